"""The k largest entries of each row of a small matrix: the MoE router's choice of experts (`jaxllm.moe.route`).

XLA lowers `lax.top_k` over Qwen3-30B-A3B's router probabilities ([32,768, 128], k = 8) to a sort of every row on a
GPU: ~6 ms of a ~370 ms fp8 encode of 128 prompts on one H200 (48 layers, 2026-11-28); `top_k_pallas` took 1.1 ms
there. It keeps a block of rows in registers and takes the maximum k times, reading the matrix once. For values
like a softmax's (finite or +inf, no -0.0, no NaN) its result equals `lax.top_k`'s bit for bit: the same values
in descending order, ties broken towards the lower column. It marks a taken column with -inf and compares with
`==`, so rows holding -inf, -0.0 or NaN can differ from `lax.top_k` (which orders all floats totally).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import devices
from .fp8_kernels import row_blocks

TOP_K_IMPLS = ("pallas", "xla")


def _take_top_k(values: jax.Array, slots: int, k: int, width: int) -> tuple[jax.Array, jax.Array]:
    """The k largest of each row of values [rows, columns] (columns past `width` are padding, -inf) by taking the
    maximum k times: ([rows, slots] float32 in descending order, their columns int32; slots past k are zeros)."""
    columns = lax.broadcasted_iota(jnp.int32, values.shape, 1)
    slot_ids = lax.broadcasted_iota(jnp.int32, (values.shape[0], slots), 1)
    top = jnp.zeros((values.shape[0], slots), jnp.float32)
    index = jnp.zeros((values.shape[0], slots), jnp.int32)
    for slot in range(k):
        best = jnp.max(values, axis=1)[:, None]
        # the lowest column holding the maximum; a NaN row matches nowhere and takes the last real column
        pick = jnp.minimum(jnp.min(jnp.where(values == best, columns, width), axis=1), width - 1)[:, None]
        top = jnp.where(slot_ids == slot, best, top)
        index = jnp.where(slot_ids == slot, pick, index)
        values = jnp.where(columns == pick, -jnp.inf, values)
    return top, index


def _top_k_kernel(values_ref, top_ref, index_ref, *, k: int, width: int):
    top_ref[...], index_ref[...] = _take_top_k(values_ref[...], top_ref.shape[1], k, width)


def _router_top_k_kernel(logits_ref, weight_ref, index_ref, *, k: int, width: int, normalize: bool):
    logits = logits_ref[...].astype(jnp.float32)  # padding columns: -inf, so exp gives 0
    shifted = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    probs = shifted / jnp.sum(shifted, axis=1, keepdims=True)  # jax.nn.softmax's arithmetic
    top, index = _take_top_k(probs, weight_ref.shape[1], k, width)
    if normalize:  # slots past k hold zeros: the sum is the k weights'
        top = top / jnp.sum(top, axis=1, keepdims=True)
    weight_ref[...] = top.astype(weight_ref.dtype)
    index_ref[...] = index


def _row_call(kernel: Any, values: jax.Array, k: int, out_dtype: Any, interpret: bool, rows: int, num_warps: int,
              name: str) -> tuple[jax.Array, jax.Array]:
    """`kernel` over blocks of `rows` rows of values [N, E] (E padded to a power of two with -inf): (its [N, k]
    values in out_dtype, int32 [N, k] columns)."""
    n, width = values.shape
    if not 1 <= k <= width:
        raise ValueError(f"{name}: k must be between 1 and the row width {width}, got {k}")
    columns, slots = pl.next_power_of_2(width), pl.next_power_of_2(k)
    if columns != width:
        values = jnp.pad(values, ((0, 0), (0, columns - width)), constant_values=-jnp.inf)
    per, padded, (values,) = row_blocks([values], rows)
    block = lambda cols: pl.BlockSpec((per, cols), lambda i: (i, 0))  # noqa: E731
    top, index = pl.pallas_call(
        functools.partial(kernel, k=k, width=width),
        out_shape=(jax.ShapeDtypeStruct((padded, slots), out_dtype),
                   jax.ShapeDtypeStruct((padded, slots), jnp.int32)),
        grid=(padded // per,),
        in_specs=[block(columns)],
        out_specs=(block(slots), block(slots)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(values)
    return top[:n, :k], index[:n, :k]


@functools.partial(jax.jit, static_argnames=("k", "interpret", "rows", "num_warps"))
def top_k_pallas(values: jax.Array, k: int, interpret: bool = False, rows: int = 64,
                 num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(values, k)` for float32 values [N, E] like a softmax's (module doc) from one Pallas (Triton)
    kernel: (the k largest of each row [N, k] in descending order, their columns int32 [N, k]; ties: the lower
    column first). A program holds `rows` rows; E and k are padded to powers of two inside. `interpret`: Pallas's
    interpreter (CPU tests)."""
    return _row_call(_top_k_kernel, values.astype(jnp.float32), k, jnp.float32, interpret, rows, num_warps,
                     "top_k_rows")


@functools.partial(jax.jit, static_argnames=("k", "normalize", "out_dtype", "interpret", "rows", "num_warps"))
def router_top_k_pallas(logits: jax.Array, k: int, normalize: bool, out_dtype: Any, interpret: bool = False,
                        rows: int = 64, num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """The MoE router's step after its logits [N, E] (`jaxllm.moe.route`'s arithmetic) from one Pallas kernel: a
    softmax over each row in float32, its k largest (`top_k_pallas`' order and ties), divided by their sum when
    `normalize`, cast to out_dtype. Returns (weights [N, k], experts int32 [N, k]). XLA runs the softmax, the
    top-k and the division as three kernels; this reads the 16-bit logits once."""
    return _row_call(functools.partial(_router_top_k_kernel, normalize=normalize), logits, k, out_dtype, interpret,
                     rows, num_warps, "router_top_k")


def top_k_rows(values: jax.Array, k: int, impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(values, k)` of float32 values [N, E] (the MoE router's probabilities). impl: "pallas"
    (`top_k_pallas`, the GPU's default; off a GPU, or for values that are not float32 [N, E], `lax.top_k` runs
    instead) or "xla" (`lax.top_k`, the default elsewhere)."""
    on_gpu = devices.on_gpu()
    impl = impl or ("pallas" if on_gpu else "xla")
    if impl not in TOP_K_IMPLS:
        raise ValueError(f"top-k impl must be one of {TOP_K_IMPLS}, got {impl!r}")
    if impl == "pallas" and on_gpu and values.ndim == 2 and values.dtype == jnp.float32:
        return top_k_pallas(values, k)
    return lax.top_k(values, k)
