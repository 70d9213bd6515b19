"""Rows of a matrix picked by index, as the MoE dispatch moves tokens to their experts' rows.

`moe_block` copies each token's row once per chosen expert (8 copies for Qwen3-30B-A3B: ~570 MB of e4m3 rows or
~1.1 GB of bf16 rows per 32K-token pass and layer), so the copy runs at memory speed or costs as much as a GEMM.
XLA's gather moves one element per thread: for one-byte e4m3 values that was ~0.8 TB/s on an H200 (2026-11-28).
Two ways to move more bytes per thread:

- `gather_rows_words`: XLA's gather on the rows bitcast to 4-byte words (same bytes, a quarter or half the
  elements), exact for any dtype;
- `gather_rows_pallas`: a Pallas (Triton) kernel, a program per few output rows, each row copied in wide
  contiguous slices: the GPU's default (`gather_rows`), 2.4x XLA's gather of e4m3 rows and 1.45x of bf16 rows.

Rows whose index is out of range (>= the row count: the tiled layout's padding rows) come back as zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

GATHER_IMPLS = ("elements", "words", "pallas")


def _as_words(values: jax.Array) -> jax.Array | None:
    """values [N, W] bitcast to uint32 [N, W * itemsize / 4], or None when its rows are not whole words."""
    n, width = values.shape
    per_word = 4 // values.dtype.itemsize if values.dtype.itemsize < 4 else 1
    if values.dtype.itemsize > 4 or width % per_word:
        return None
    if per_word == 1:
        return lax.bitcast_convert_type(values, jnp.uint32)
    return lax.bitcast_convert_type(values.reshape(n, width // per_word, per_word), jnp.uint32)


def _from_words(words: jax.Array, dtype, width: int) -> jax.Array:
    return lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], width)


def gather_rows_words(values: jax.Array, source: jax.Array) -> jax.Array:
    """values [N, W] -> [len(source), W]: row source[i] of values, zeros where source[i] >= N; XLA's gather on
    4-byte words (falls back to elements for rows that are not whole words)."""
    words = _as_words(values)
    if words is None:
        return jnp.take(values, source, axis=0, mode="fill", fill_value=0)
    moved = jnp.take(words, source, axis=0, mode="fill", fill_value=0)
    return _from_words(moved, values.dtype, values.shape[1])


def _gather_rows_kernel(source_ref, values_ref, out_ref, *, num_rows: int, slices: tuple[tuple[int, int], ...]):
    for r in range(out_ref.shape[0]):
        row = source_ref[r]
        valid = row < num_rows
        row = jnp.minimum(row, num_rows - 1)
        for start, size in slices:
            v = pltriton.load(values_ref.at[pl.ds(row, 1), pl.ds(start, size)])  # [1, size]
            pltriton.store(out_ref.at[pl.ds(r, 1), pl.ds(start, size)], jnp.where(valid, v, jnp.zeros_like(v)))


@functools.partial(jax.jit, static_argnames=("interpret", "rows", "num_warps", "chunk"))
def gather_rows_pallas(values: jax.Array, source: jax.Array, interpret: bool = False, rows: int = 4,
                       num_warps: int = 4, chunk: int = 1024) -> jax.Array:
    """`gather_rows_words`' result from a Pallas (Triton) kernel on the rows' 4-byte words: each program copies
    `rows` output rows in slices of up to `chunk` words (Triton's shapes are powers of two: a width that is not
    is copied as its binary parts). `interpret`: Pallas's interpreter (CPU tests)."""
    words = _as_words(values)
    if words is None:
        raise ValueError(f"gather_rows_pallas: rows of {values.shape[1]} {values.dtype} values are not whole "
                         f"4-byte words; use gather_rows_words")
    n, width = words.shape
    m = source.shape[0]
    rows = min(rows, pl.next_power_of_2(m))
    padded = -(-m // rows) * rows
    source = jnp.pad(source.astype(jnp.int32), (0, padded - m), constant_values=n)
    slices, start = [], 0
    while start < width:
        size = min(chunk, 1 << ((width - start).bit_length() - 1))
        slices.append((start, size))
        start += size
    out = pl.pallas_call(
        functools.partial(_gather_rows_kernel, num_rows=n, slices=tuple(slices)),
        out_shape=jax.ShapeDtypeStruct((padded, width), jnp.uint32),
        grid=(padded // rows,),
        in_specs=[pl.BlockSpec((rows,), lambda i: (i,)), pl.BlockSpec((n, width), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, width), lambda i: (i, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gather_rows",
    )(source, words)
    return _from_words(out[:m], values.dtype, values.shape[1])


def pallas_gather_tuning(row_bytes: int) -> dict[str, int]:
    """`gather_rows_pallas`' rows per program and warps for rows of this many bytes: the best of
    `scripts/bench_moe.py --movement` on an H200 (2026-11-28) at 278,400 rows of Qwen3-30B-A3B's 2,048 values:
    e4m3 rows (2 KiB) 0.40 ms at 4 rows x 4 warps (XLA's gather: 0.95 ms on elements, 0.46 on words); bf16 rows
    (4 KiB) 0.66 ms at 8 rows x 8 warps (0.96 / 0.87 ms)."""
    return {"rows": 8, "num_warps": 8} if row_bytes >= 4096 else {"rows": 4, "num_warps": 4}


def gather_rows(values: jax.Array, source: jax.Array, impl: str | None = None) -> jax.Array:
    """values [N, W] -> [len(source), W]: row source[i] of values, zeros where source[i] >= N. impl: one of
    `GATHER_IMPLS`, None = "pallas" on a GPU (falling back to "words" for rows that are not whole words), "words"
    elsewhere; "elements" is XLA's gather as is."""
    on_gpu = jax.devices()[0].platform == "gpu"
    impl = impl or ("pallas" if on_gpu else "words")
    if impl not in GATHER_IMPLS:
        raise ValueError(f"gather impl must be one of {GATHER_IMPLS}, got {impl!r}")
    if impl == "pallas" and on_gpu and _as_words(values) is not None:
        return gather_rows_pallas(values, source, **pallas_gather_tuning(values.shape[1] * values.dtype.itemsize))
    if impl == "elements":
        return jnp.take(values, source, axis=0, mode="fill", fill_value=0)
    return gather_rows_words(values, source)
