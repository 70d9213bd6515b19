"""How rl compiles an outermost program: through `jaxllm.compile.jit`, never a plain `jax.jit` where the LLM (or
the offline update) runs (tests/test_compile_rule.py). Below every tool and the LLM path (`rl.llm`).
"""
from __future__ import annotations

from typing import Callable


def compile_program(fn: Callable, *, runs_llm: bool = True, **jit_kwargs) -> Callable:
    """`fn` jitted through `jaxllm.compile.jit` with `jaxllm.compile.compiler_options(runs_llm=...)`: the one way
    rl compiles an outermost program (tests/test_compile_rule.py). A program that runs the LLM gets the LLM's XLA
    options (on a GPU: Triton GEMMs off; issue 23); one that does not gets XLA's defaults (= `jax.jit`)."""
    from jaxllm.compile import compiler_options, jit

    return jit(fn, compiler_options=compiler_options(runs_llm=runs_llm), **jit_kwargs)


def compile_llm(fn: Callable, **jit_kwargs) -> Callable:
    """`compile_program(fn, runs_llm=True)`: how every program that runs the LLM is compiled. Outermost jits only."""
    return compile_program(fn, runs_llm=True, **jit_kwargs)
