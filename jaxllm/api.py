"""`load_model` and the `Model` convenience wrapper (host-side checks + jitted pure functions)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import compile as compile_lib
from . import fp8
from . import model as model_lib
from .config import PRESETS, Qwen3Config
from .encoder import PrefixCache, encode, prefill
from .memory import check_fits
from .resolve import resolve_checkpoint_dir
from .weights import init_params, load_params

_STATIC = ("config", "attention_impl")
_FUNCTIONS = {"encode": (encode, _STATIC + ("layer", "pooling")), "prefill": (prefill, _STATIC),
              "hidden_states": (model_lib.hidden_states, _STATIC), "logits": (model_lib.logits, _STATIC)}


@functools.cache
def _jitted(name: str):
    """The jitted pure function `name`, compiled with the project's XLA options (`jaxllm.compile`)."""
    fn, static = _FUNCTIONS[name]
    return compile_lib.jit(fn, compiler_options=compile_lib.compiler_options(), static_argnames=static)


def default_dtype() -> Any:
    """float32 on a CPU backend, bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


FP8 = "fp8"  # load_model's dtype for W8A8 fp8 matmuls over bfloat16 activations (jaxllm.fp8)


def _as_dtype(dtype: Any) -> Any:
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str) and dtype == FP8:
        return jnp.bfloat16
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype; use 'float32', 'bfloat16', 'float16' or 'fp8'") from None
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype {dt} is not supported; use float32, bfloat16, float16 or 'fp8'")
    return dt.type


def _check_ids(ids: Any, config: Qwen3Config, ndim: int, what: str) -> Any:
    if isinstance(ids, jax.core.Tracer):
        return ids
    arr = np.asarray(ids)
    if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.integer):
        shape = "[B, T]" if ndim == 2 else "[P]"
        raise ValueError(f"{what} must be integer token ids of shape {shape}, got {arr.dtype} {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
        raise ValueError(f"{what} has token ids outside [0, {config.vocab_size}) (min {arr.min()}, max "
                         f"{arr.max()}); was it tokenized for another model?")
    return jnp.asarray(arr, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Model:
    """A Qwen3 model ready to use: config (static), params (device pytree), dtype (of the activations; with
    `quantization="fp8"` the projection and MLP matrices in params are `fp8.Fp8Matrix`)."""

    config: Qwen3Config
    params: dict[str, Any]
    dtype: Any
    quantization: str | None = None

    def hidden_states(self, ids: Any) -> tuple[jax.Array, ...]:
        """ids int [B, T] -> L+1 arrays [B, T, D] (HF output_hidden_states; the last is post-norm)."""
        return _jitted("hidden_states")(self.params, self.config, _check_ids(ids, self.config, 2, "ids"))

    def prefill(self, prefix_ids: Any) -> PrefixCache:
        """1-D prefix token ids -> PrefixCache for `encode(..., prefix=cache)`."""
        ids = _check_ids(prefix_ids, self.config, 1, "prefix_ids")
        return _jitted("prefill")(self.params, self.config, ids)

    def encode(self, ids: Any, lengths: Any, layer: int = -1, pooling: str = "last",
               prefix: PrefixCache | None = None) -> jax.Array:
        """Right-padded ids [B, T] + lengths [B] -> float32 [B, D]. See `jaxllm.encoder.encode`."""
        ids = _check_ids(ids, self.config, 2, "ids")
        model_lib.normalize_layer_index(layer, self.config)
        if not isinstance(lengths, jax.core.Tracer):
            lens = np.asarray(lengths)
            if lens.shape != (ids.shape[0],) or not np.issubdtype(lens.dtype, np.integer):
                raise ValueError(f"lengths must be integers of shape [{ids.shape[0]}] (one per row of ids), "
                                 f"got {lens.dtype} {lens.shape}")
            if lens.size and (lens.min() < 0 or lens.max() > ids.shape[1]):
                raise ValueError(f"lengths must lie in [0, T={ids.shape[1]}], got min {lens.min()} "
                                 f"max {lens.max()}")
        return _jitted("encode")(self.params, self.config, ids, jnp.asarray(lengths, jnp.int32), layer=layer,
                           pooling=pooling, prefix=prefix)

    def logits(self, ids: Any) -> jax.Array:
        """ids int [B, T] -> float32 logits [B, T, V] (the only path that uses the LM head)."""
        model_lib.lm_head_weight(self.params, self.config)  # clear error early when there is no head
        return _jitted("logits")(self.params, self.config, _check_ids(ids, self.config, 2, "ids"))


def _config_of(name: str | Path | Qwen3Config) -> tuple[Qwen3Config, Path | None]:
    """(config, checkpoint directory) of what `load_model` takes: the directory is None for a preset or a config
    (random init)."""
    if isinstance(name, Qwen3Config):
        return name, None
    if str(name) in PRESETS:
        return PRESETS[str(name)], None
    ckpt_dir = resolve_checkpoint_dir(name, tuple(PRESETS))
    return Qwen3Config.from_json(ckpt_dir / "config.json"), ckpt_dir


def load_model(name: str | Path | Qwen3Config, dtype: Any = None, seed: int = 0) -> Model:
    """A Model from a preset name ("tiny", "qwen3-4b": random init with `seed`), a Qwen3Config (random init),
    a local checkpoint directory, or a hub id (local HF cache, else downloaded once: jaxllm.resolve). dtype None: float32 on a CPU
    backend, bfloat16 on a GPU; "fp8": bfloat16 weights converted once to W8A8 fp8 matrices (`jaxllm.fp8`;
    emulated, with a one-line warning, where the backend has no FP8 tensor cores).
    """
    dt = _as_dtype(dtype)
    is_fp8 = isinstance(dtype, str) and dtype == FP8
    config, ckpt_dir = _config_of(name)
    check_fits(config, FP8 if is_fp8 else dt)
    if ckpt_dir is None:
        params = init_params(config, dt, seed, fp8_experts=is_fp8 and config.is_moe)
    else:
        params = load_params(ckpt_dir, config, dt, fp8_experts=is_fp8 and config.is_moe)
    if is_fp8:
        fp8.warn_if_emulated()
        return Model(config, fp8.quantize_params(params), dt, quantization=FP8)
    return Model(config, params, dt)


def model_shapes(name: str | Path | Qwen3Config, dtype: Any = None) -> Model:
    """The `Model` that `load_model(name, dtype)` returns, with `jax.ShapeDtypeStruct` params: the config is read
    (a preset, or a checkpoint's config.json) but no weight is read, drawn or allocated. What compiling a program
    ahead, while the weights load, needs. A checkpoint's params are assumed to have the LM head its config implies
    (untied: a head); a bare Qwen3Model checkpoint has none, and a program compiled for these shapes then compiles
    again at its first call (same results, only the time is lost). Raises `ModelTooLargeError` where `load_model`
    would, so a model that cannot fit is refused before anything compiles for it."""
    dt = _as_dtype(dtype)
    is_fp8 = isinstance(dtype, str) and dtype == FP8
    config, _ = _config_of(name)
    check_fits(config, FP8 if is_fp8 else dt)

    def params():
        drawn = init_params(config, dt, 0, fp8_experts=is_fp8 and config.is_moe)
        return fp8.quantize_params(drawn) if is_fp8 else drawn

    return Model(config, jax.eval_shape(params), dt, quantization=FP8 if is_fp8 else None)


def prefill_shapes(model: Model, prefix_length: int) -> PrefixCache:
    """The `PrefixCache` that `model.prefill(ids)` returns for `prefix_length` ids, as `jax.ShapeDtypeStruct`s
    (`model` may be `model_shapes`'s: nothing runs)."""
    ids = jax.ShapeDtypeStruct((int(prefix_length),), jnp.int32)
    return jax.eval_shape(lambda params, ids: prefill(params, model.config, ids), model.params, ids)
