"""How the project's programs are compiled: XLA options on a GPU, and the persistent compilation cache.

On a GPU every program that runs the LLM compiles with Triton GEMMs off (`GPU_COMPILER_OPTIONS`). With Triton
GEMMs on, XLA's autotuner tries Triton kernels for every fp8 dot and ran for over 9 minutes on an H100 at the
Qwen3-4B shape (issue 23); with them off, each fp8 dot becomes one cuBLASLt fp8 GEMM and the program compiles in
seconds, and the bfloat16 in-scan trainer measured no slower (docs/BENCHMARKS.md: 1,731 vs 1,682 SPS). Programs
without the LLM (plain PPO, the offline update) keep XLA's defaults: plain PPO at 128 envs measured 5% faster
with Triton GEMMs on, alone on an H100 (25,293 / 25,283 vs 24,540 / 23,529 SPS, alternating). The options go on
the outermost `jax.jit` of a program only (XLA refuses them on a nested jit), through `jit`, which never touches
the user's `XLA_FLAGS` and falls back to compiling without an option that the installed XLA rejects (one warning
naming it).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import jax

# xla_gpu_autotune_level (XLA's flag: 0 = off; 1 = on; 2 = on+init; 3 = on+init+reinit; 4 = on+init+reinit+check,
# the default): 2 still times every candidate GEMM algorithm on initialised inputs and keeps the fastest (the
# steady-state speed), but skips re-initialising the outputs between candidates and checking each candidate's
# result against a reference (issue 35: the cold start of the 4B trainer spent its first encode in the autotuner).
# scripts/gpu_issue35.sh autotune measures it against level 4 (XLA_FLAGS wins over these options).
GPU_COMPILER_OPTIONS: Mapping[str, Any] = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 2}


def compiler_options(backend: str | None = None, *, runs_llm: bool = True,
                     xla_flags: str | None = None) -> dict[str, Any]:
    """XLA options for an outermost jit on `backend` (default: JAX's default backend): `GPU_COMPILER_OPTIONS` on
    a GPU for a program that `runs_llm`, none elsewhere (XLA's defaults). An option that `xla_flags` (default: the
    XLA_FLAGS environment variable) sets is left to it: the user's flag wins."""
    backend = backend or jax.default_backend()
    options = dict(GPU_COMPILER_OPTIONS) if backend == "gpu" and runs_llm else {}
    user = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in options.items() if f"--{k}=" not in user and f"--{k} " not in f"{user} "}


def _outermost() -> bool:
    """Whether a call now starts an outermost program (nothing is being traced)."""
    from jax._src import core  # trace_state_clean has no public name; without it, tracer arguments still tell

    check = getattr(core, "trace_state_clean", None)
    return check() if check is not None else True


class _JitWithOptions:
    """`jax.jit(fn, compiler_options=options)`; an option XLA rejects is dropped (one warning) and the rest kept."""

    def __init__(self, fn: Callable, options: Mapping[str, Any], jit_kwargs: dict[str, Any]):
        self._fn, self._jit_kwargs = fn, jit_kwargs
        self.options = dict(options)
        self._jitted = jax.jit(fn, compiler_options=self.options, **jit_kwargs)
        self.fell_back = False  # an option was dropped

    def _rejected(self, error: Exception) -> str | None:
        """The option `error` names when XLA refused it, else None."""
        text = str(error)
        if "compile option" not in text and "While setting option" not in text:
            return None
        return next((name for name in self.options if name in text), None)

    def _drop_rejected(self, error: Exception) -> bool:
        """Drop the option `error` says XLA refused (warning once, naming it); False when it names none."""
        name = self._rejected(error)
        if name is None:
            return False
        warnings.warn(f"this JAX/XLA does not accept the compiler option {name}={self.options[name]!r} "
                      f"({str(error).splitlines()[0]}); compiling without it", stacklevel=3)
        del self.options[name]
        self.fell_back = True
        self._jitted = jax.jit(self._fn, compiler_options=self.options or None, **self._jit_kwargs)
        return True

    def __call__(self, *args, **kwargs):
        if not _outermost() or any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            # traced inside another program (e.g. jax.eval_shape of a setup that calls this one): XLA options
            # belong to the outermost program only, so here it is a plain nested jit
            return jax.jit(self._fn, **self._jit_kwargs)(*args, **kwargs)
        while True:
            try:
                return self._jitted(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - XLA reports a refused option as a runtime error
                if not self._drop_rejected(e):
                    raise

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs)

    def compile_ahead(self, *args, on_lowered: Callable[[], None] = lambda: None, **kwargs):
        """The executable for these arguments' shapes, compiled now (`compile_ahead`), dropping a refused option as a
        call does."""
        while True:
            try:
                lowered = self._jitted.lower(*args, **kwargs)
                on_lowered()
                return lowered.compile()
            except Exception as e:  # noqa: BLE001 - as in __call__
                if not self._drop_rejected(e):
                    raise


def jit(fn: Callable, *, compiler_options: Mapping[str, Any] | None = None, **jit_kwargs) -> Callable:
    """`jax.jit(fn, **jit_kwargs)` compiled with XLA `compiler_options` (e.g. `compiler_options(dtype)`); an option
    the installed XLA rejects is dropped with one warning instead of failing. Use it for outermost jits only."""
    if not compiler_options:
        return jax.jit(fn, **jit_kwargs)
    return _JitWithOptions(fn, compiler_options, jit_kwargs)


def compile_ahead(jitted: Callable, *args, on_lowered: Callable[[], None] = lambda: None, **kwargs) -> Callable:
    """The executable of `jitted` (a function from `jit`) for these arguments (arrays, or `jax.ShapeDtypeStruct`s
    for their shapes), compiled now: `jitted.lower(*args).compile()`, an option the installed XLA rejects dropped
    as a call drops it. XLA releases the GIL while it compiles, so threads calling this compile several programs at
    once (tracing and lowering hold it). `on_lowered()` is called once traced and lowered, before XLA compiles:
    e.g. to let another thread trace a program that calls this one, which then finds its trace in jax's cache.
    Call the executable with arguments of exactly those shapes and dtypes."""
    if isinstance(jitted, _JitWithOptions):
        return jitted.compile_ahead(*args, on_lowered=on_lowered, **kwargs)
    lowered = jitted.lower(*args, **kwargs)
    on_lowered()
    return lowered.compile()


def default_cache_dir() -> Path:
    """Where compiled programs are kept between runs: $XDG_CACHE_HOME (or ~/.cache)/craftax-llm/jax."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "craftax-llm" / "jax"


# the persistent cache's size limit when none is set. JAX locks the cache directory around each read and write only
# when the cache has a limit; without one, a process can read an entry that another is still writing and abort
# while loading it (this suite's two workers did, 2026-11-29), so concurrent runs (sweeps, bench workers) need one.
# Past it, the least recently used programs go.
CACHE_MAX_BYTES = 16 << 30


def limit_persistent_cache() -> None:
    """Give JAX's persistent cache a size limit (CACHE_MAX_BYTES) unless one is set, so it locks its directory."""
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)


def enable_persistent_cache(directory: str | Path | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache so a second start skips recompiling the same programs.

    `directory`: where (default `default_cache_dir()`); "off" (or "none", "") disables it. A directory already
    configured (JAX_COMPILATION_CACHE_DIR, or `jax.config` set by the caller) is kept: the user's choice wins.
    Either way the cache gets a size limit (`limit_persistent_cache`) unless one is set. Returns the directory in
    use, None when off."""
    if directory is not None and str(directory).lower() in ("off", "none", ""):
        return None
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        limit_persistent_cache()
        return Path(configured)
    path = Path(directory) if directory is not None else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation cache {path} cannot be created ({e.strerror or e}); compiling without it",
                      stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    limit_persistent_cache()
    # every program, however small: on a GPU even a one-operation program takes 0.05-0.7 s to compile, and a start
    # compiles dozens of them (craftax's constants at import, eager setup); each is a small file read next time
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
