"""How rl compiles an outermost program: through `jaxllm.compile.jit`, never a plain `jax.jit` where the LLM (or
the offline update) runs (tests/test_compile_rule.py). Below every tool and the LLM path (`rl.llm`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
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


class CompileAhead:
    """Programs compiling in background threads while the caller does other work (XLA releases the GIL while it
    compiles): `start(name, jitted, *args)` begins compiling `jitted` (from `compile_program`) for those arguments'
    shapes, `submit(name, fn)` runs any compiling function; `get(name)` returns the executable, saying first what
    it waits for if the compile has not finished. The threads are daemons: a process that stops (an error, Ctrl-C)
    does not wait for a compile nobody will use."""

    def __init__(self, say: Callable[[str], None] = lambda text: None):
        self._jobs: dict[str, tuple[Future, float]] = {}
        self._say = say

    def start(self, name: str, jitted: Callable, *args, after: tuple[str, ...] = ()) -> None:
        from jaxllm.compile import compile_ahead

        self.submit(name, lambda: compile_ahead(jitted, *args), after=after)

    def submit(self, name: str, compile_fn: Callable[[], Callable], after: tuple[str, ...] = ()) -> None:
        """Run `compile_fn` (which compiles and returns an executable) in a background thread under `name`, once the
        jobs named in `after` ended (finished or failed: their errors are for whoever asks for them). `seconds`
        counts from then."""
        future: Future = Future()
        before = [self._jobs[a][0] for a in after]

        def job():
            for f in before:
                f.exception()  # waits; a failure there is not this job's
            t0 = time.perf_counter()
            try:
                result = compile_fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever asks for it
                future.set_exception(e)
            else:
                future.set_result((result, time.perf_counter() - t0))

        threading.Thread(target=job, name=f"compile-{name}", daemon=True).start()
        self._jobs[name] = (future, time.perf_counter())

    def started(self, name: str) -> bool:
        """Whether `name` was submitted."""
        return name in self._jobs

    def done(self, name: str) -> bool:
        """Whether `name` finished compiling (or failed)."""
        return self._jobs[name][0].done()

    def get(self, name: str) -> Callable:
        """The executable of `name` (waiting for its compile; re-raises what the compile raised)."""
        future, started = self._jobs[name]
        if not future.done():
            self._say(f"waiting for the {name} program to compile (started {time.perf_counter() - started:.0f} s "
                      f"ago) ...")
        executable, _seconds = future.result()
        return executable

    def wait_all(self) -> None:
        """Wait for every job (saying what it waits for, as `get` does); errors stay for `get`."""
        for name, (future, _) in self._jobs.items():
            if not future.done():
                self._say(f"waiting for the {name} program to compile (started "
                          f"{time.perf_counter() - self._jobs[name][1]:.0f} s ago) ...")
            future.exception()

    def summary(self) -> str:
        """'name N.N s, ...': each finished job's compile seconds (failed or unfinished ones left out)."""
        done = [(n, f.result()[1]) for n, (f, _) in self._jobs.items() if f.done() and f.exception() is None]
        return ", ".join(f"{n} {s:.1f} s" for n, s in done)

    def seconds(self, name: str) -> float:
        """How long `name` took to compile (waits for it)."""
        return self._jobs[name][0].result()[1]
