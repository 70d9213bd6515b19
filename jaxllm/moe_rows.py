"""Rows between token order and expert order, the MoE block's memory-bound steps (`jaxllm.moe`).

Gather: `moe_block` copies each token's row once per chosen expert (8 copies for Qwen3-30B-A3B: ~570 MB of e4m3
rows or ~1.1 GB of bf16 rows per 32K-token pass and layer), so the copy runs at memory speed or costs as much as a
GEMM. XLA's gather moves one element per thread: for one-byte e4m3 values ~1.2 TB/s on an H200 (2026-11-28). Two
ways to move more bytes per thread:

- `gather_rows_words`: XLA's gather on the rows bitcast to 4-byte words (same bytes, a quarter or half the
  elements), exact for any dtype;
- `gather_rows_pallas`: a Pallas (Triton) kernel, a program per few output rows, each row copied in wide
  contiguous slices: `gather_rows`'s form on a GPU. At 278,400 rows of 2,048 values on two H200s
  (`scripts/bench_moe.py --movement`, 2026-11-28): e4m3 rows 0.40 / 0.47 ms (XLA's gather on elements 0.95 / 1.37,
  on words 0.46 / 0.58) at 4 rows x 4 warps a program; bf16 rows 0.66 / 0.89 ms at 8 x 8 and 0.74 / 0.81 at 4 x 4
  (XLA's: 0.96 / 1.18, on words 0.87 / 1.00). With 16 rows a program as one gathered [16, slice] load (`block`:
  every row's load in flight before the stores), on a third H200 (2026-11-29): e4m3 0.43 ms at 8 warps against
  0.52 for 4 rows x 4 warps row by row, bf16 0.70 at 4 warps against 0.78 for 8 x 8 (XLA's on elements 0.99 /
  1.19). `pallas_gather_tuning` holds what the encoder and trainer run.

Rows whose index is out of range (>= the row count: the tiled layout's padding rows) come back as zeros.

Scatter: `scatter_rows_pallas` makes the same layout the other way round, each token row read once and stored to
its k rows (a gather reads each token row k times, and its copies push the token rows out of L2). `layout_rows`
picks the scatter (`moe.ROW_COPY`'s default) or the gather. In the 30B's fp8 encoder on an H200 (2026-11-29) the
scatter took 8.2 + 1.4 ms of a call where the block gather took 12.9 + 1.4 (the call 353.5 against 358.8 ms).

Combine: each token's output is the sum over its k expert rows of routing weight x row (for fp8 experts, x the
row's scale x its expert's column scales), in float32, rounded once. `combine_rows_reference` is XLA's form;
`combine_rows_pallas` computes it in one kernel that writes only the token rows, the GPU's default: alone it runs
as fast as XLA's fusion (bf16) or in 12% less time (fp8 scales), but in the bf16 model the fusion XLA built around the
combine took 77 ms of a 554 ms encode of 128 prompts, the kernel 15 ms (the encode: 490 ms; one H200, 2026-11-28).
A block's output can stay uncombined (`ExpertOutputs`) until the step after it; `combine_residual_norm_quantize_pallas`
combines inside the fp8 residual kernel, but measured slower than the two kernels (docs/BENCHMARKS.md, ninth session).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import devices
from .fp8_format import E4M3
from .fp8_kernels import column_slices, residual_norm_quantize_block, row_blocks

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


def _words_or_raise(values: jax.Array, kernel: str, instead: str) -> jax.Array:
    """`_as_words(values)`, or one error naming what `kernel` cannot take and what to use `instead`."""
    words = _as_words(values)
    if words is None:
        raise ValueError(f"{kernel}: rows of {values.shape[1]} {values.dtype} values are not whole 4-byte words; "
                         f"use {instead}")
    return words


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


def _gather_rows_kernel(source_ref, values_ref, out_ref, *, num_rows: int, slices: list[pl.Slice]):
    for r in range(out_ref.shape[0]):
        row = source_ref[r]
        valid = row < num_rows
        row = jnp.minimum(row, num_rows - 1)
        for cols in slices:
            v = pltriton.load(values_ref.at[pl.ds(row, 1), cols])  # [1, size]
            pltriton.store(out_ref.at[pl.ds(r, 1), cols], jnp.where(valid, v, jnp.zeros_like(v)))


def _gather_block_kernel(source_ref, values_ref, out_ref, *, num_rows: int, slices: list[pl.Slice]):
    source = source_ref[...]  # [rows]
    valid = (source < num_rows)[:, None]
    source = jnp.minimum(source, num_rows - 1)
    for cols in slices:
        # both indices as arrays (a row per program row, contiguous columns): Pallas's interpreter takes no mix
        # of array and slice indices
        columns = cols.start + lax.broadcasted_iota(jnp.int32, (1, cols.size), 1)
        v = pltriton.load(values_ref.at[source[:, None], columns])
        pltriton.store(out_ref.at[:, cols], jnp.where(valid, v, jnp.zeros_like(v)))


@functools.partial(jax.jit, static_argnames=("interpret", "rows", "num_warps", "chunk", "block"))
def gather_rows_pallas(values: jax.Array, source: jax.Array, interpret: bool = False, rows: int = 4,
                       num_warps: int = 4, chunk: int = 1024, block: bool = False) -> jax.Array:
    """`gather_rows_words`' result from a Pallas (Triton) kernel on the rows' 4-byte words: each program copies
    `rows` output rows in slices of up to `chunk` words (Triton's shapes are powers of two: a width that is not
    is copied as its binary parts), one row after another or, with `block`, as one [rows, slice] gathered load
    (all rows' loads in flight before the stores). `interpret`: Pallas's interpreter (CPU tests)."""
    n, width = (words := _words_or_raise(values, "gather_rows_pallas", "gather_rows_words")).shape
    m = source.shape[0]
    rows = min(rows, pl.next_power_of_2(m))
    padded = -(-m // rows) * rows
    source = jnp.pad(source.astype(jnp.int32), (0, padded - m), constant_values=n)
    out = pl.pallas_call(
        functools.partial(_gather_block_kernel if block else _gather_rows_kernel, num_rows=n,
                          slices=column_slices(width, chunk)),
        out_shape=jax.ShapeDtypeStruct((padded, width), jnp.uint32),
        grid=(padded // rows,),
        in_specs=[pl.BlockSpec((rows,), lambda i: (i,)), pl.BlockSpec((n, width), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, width), lambda i: (i, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gather_rows",
    )(source, words)
    return _from_words(out[:m], values.dtype, values.shape[1])


def _scatter_rows_kernel(slot_row_ref, source_ref, values_ref, out_ref, *, num_tokens: int, num_rows: int,
                         tokens_per: int, rows_per: int, zero_rows: int, slices: list[pl.Slice]):
    # every index is an array (Pallas's interpreter takes no mix of array and slice indices); lanes past the end
    # keep their out-of-range index and are masked (the interpreter drops such stores, as the GPU does)
    i = pl.program_id(0)
    token = i * tokens_per + lax.broadcasted_iota(jnp.int32, (tokens_per,), 0)
    live = token < num_tokens
    destinations = [jnp.where(live, pltriton.load(slot_row_ref.at[token, j], mask=live, other=0), num_rows)[:, None]
                    for j in range(slot_row_ref.shape[1])]
    for cols in slices:
        columns = cols.start + lax.broadcasted_iota(jnp.int32, (1, cols.size), 1)
        mask = jnp.broadcast_to(live[:, None], (tokens_per, cols.size))
        v = pltriton.load(values_ref.at[token[:, None], columns], mask=mask, other=0)  # token rows, read once
        for destination in destinations:
            pltriton.store(out_ref.at[destination, columns], v, mask=mask)
    # zeros into the padding rows (no token's copy) of this program's share of the output rows, in blocks of
    # `zero_rows`; few blocks hold any (the end of each expert's last tile, the unused tiles), and jnp.any has no
    # Pallas Triton lowering (reduce_or), a max does
    def zero_block(b, carry):
        row = i * rows_per + b * zero_rows + lax.broadcasted_iota(jnp.int32, (zero_rows,), 0)
        in_range = row < num_rows
        padding = (pltriton.load(source_ref.at[row], mask=in_range, other=0) >= num_tokens) & in_range

        @pl.when(jnp.max(padding.astype(jnp.int32)) > 0)
        def _():
            for cols in slices:
                columns = cols.start + lax.broadcasted_iota(jnp.int32, (1, cols.size), 1)
                zeros = jnp.zeros((zero_rows, cols.size), out_ref.dtype)
                pltriton.store(out_ref.at[row[:, None], columns], zeros,
                               mask=jnp.broadcast_to(padding[:, None], zeros.shape))

        return carry

    lax.fori_loop(0, rows_per // zero_rows, zero_block, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "tokens_per_program", "num_warps", "chunk"))
def scatter_rows_pallas(values: jax.Array, slot_row: jax.Array, source: jax.Array, interpret: bool = False,
                        tokens_per_program: int = 8, num_warps: int = 4, chunk: int = 1024) -> jax.Array:
    """`gather_rows(values, source)` written the other way round, from a Pallas (Triton) kernel on the rows'
    4-byte words: each program reads its `tokens_per_program` token rows of values [N, W] once and stores each to
    its k rows of the output, slot_row int32 [N, k] (every output row that some slot names is named exactly once,
    as `moe._tile_layout` lays them out); output rows no slot names (source[r] >= N: the tiled layout's padding)
    are zeros. A gather reads each token row k times, and the copies it writes push the token rows out of L2;
    this reads them once. source int32 [R] sizes the output. `interpret`: Pallas's interpreter (CPU tests)."""
    n, width = (words := _words_or_raise(values, "scatter_rows_pallas", 'layout_rows(..., "gather")')).shape
    num_rows = source.shape[0]
    per = min(tokens_per_program, pl.next_power_of_2(n))
    programs = -(-n // per)
    zero_rows = 16  # the padding fill's block: a [16, slice] store, as small as the token copy's
    rows_per = -(-num_rows // (programs * zero_rows)) * zero_rows  # each program's share, in whole blocks
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    operands = [slot_row.astype(jnp.int32), source.astype(jnp.int32), words]
    out = pl.pallas_call(
        functools.partial(_scatter_rows_kernel, num_tokens=n, num_rows=num_rows, tokens_per=per, rows_per=rows_per,
                          zero_rows=zero_rows, slices=column_slices(width, chunk)),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), jnp.uint32),
        grid=(programs,),
        in_specs=[whole(a) for a in operands],
        out_specs=whole(jax.ShapeDtypeStruct((num_rows, width), jnp.uint32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="scatter_rows",
    )(*operands)
    return _from_words(out, values.dtype, values.shape[1])


def pallas_gather_tuning(row_bytes: int) -> dict[str, Any]:
    """`gather_rows_pallas`' form for rows of this many bytes: 16 rows a program as one gathered block load, 8 warps
    for e4m3 rows (2 KiB at Qwen3-30B-A3B's width), 4 for bf16 (module doc)."""
    return {"rows": 16, "num_warps": 4 if row_bytes >= 4096 else 8, "block": True}


def gather_rows(values: jax.Array, source: jax.Array, impl: str | None = None) -> jax.Array:
    """values [N, W] -> [len(source), W]: row source[i] of values, zeros where source[i] >= N. impl: one of
    `GATHER_IMPLS`, None = "pallas" on a GPU (falling back to "words" for rows that are not whole words), "words"
    elsewhere; "elements" is XLA's gather as is."""
    on_gpu = devices.on_gpu()
    impl = impl or ("pallas" if on_gpu else "words")
    if impl not in GATHER_IMPLS:
        raise ValueError(f"gather impl must be one of {GATHER_IMPLS}, got {impl!r}")
    if impl == "pallas" and on_gpu and _as_words(values) is not None:
        return gather_rows_pallas(values, source, **pallas_gather_tuning(values.shape[1] * values.dtype.itemsize))
    if impl == "elements":
        return jnp.take(values, source, axis=0, mode="fill", fill_value=0)
    return gather_rows_words(values, source)


ROW_COPY_IMPLS = ("scatter", "gather")


def layout_rows(values: jax.Array, source: jax.Array, slot_row: jax.Array, impl: str | None = None) -> jax.Array:
    """The token rows values [N, W] in the experts' row layout: row r is values[source[r]], zeros where
    source[r] >= N; slot_row int32 [N, k] names the row of each (token, expert) copy (each row named at most
    once). impl: "scatter" (the default: `scatter_rows_pallas` on a GPU, for rows of whole 4-byte words, each token
    row read once; the gather elsewhere) or "gather" (`gather_rows`). Same bits either way."""
    on_gpu = devices.on_gpu()
    impl = impl or "scatter"
    if impl not in ROW_COPY_IMPLS:
        raise ValueError(f"row copy impl must be one of {ROW_COPY_IMPLS}, got {impl!r}")
    if impl == "scatter" and on_gpu and _as_words(values) is not None:
        return scatter_rows_pallas(values, slot_row, source)
    return gather_rows(values, source)


class ExpertRowScales(NamedTuple):
    """The scales of fp8 experts' down products: each expert row's `row` scale [R] float32, its expert `group`
    [R] int32 (a row of `col`; -1 read as 0) and the experts' column scales `col` [G, D] float32."""

    row: jax.Array
    group: jax.Array
    col: jax.Array


def combine_rows_reference(rows: jax.Array, slot_row: jax.Array, weights: jax.Array,
                           scales: ExpertRowScales | None, dtype: Any) -> jax.Array:
    """Token outputs [N, D] in `dtype`: sum over j of weights[n, j] x rows[slot_row[n, j]] (times, with `scales`,
    the row's scale x its expert's column scales), in float32. rows [R, D]; slot_row int32 [N, k]; weights [N, k].
    One fusion in XLA (gather, multiply, sum): no [N, k, D] float32 intermediate."""
    n, k = slot_row.shape
    flat = slot_row.reshape(-1)
    per_slot = jnp.take(rows, flat, axis=0).astype(jnp.float32)
    if scales is not None:
        col = jnp.take(scales.col, jnp.take(scales.group, flat), axis=0, mode="clip")
        per_slot = per_slot * (jnp.take(scales.row, flat)[:, None] * col)
    per_slot = per_slot.reshape(n, k, rows.shape[1])
    return jnp.sum(per_slot * weights[..., None].astype(jnp.float32), axis=1).astype(dtype)


def _combined_row(slot_row_ref, weights_ref, rows_ref, scale_refs, r: int, slices: list[pl.Slice]
                  ) -> list[jax.Array]:
    """Token r of the program's block: the float32 sum over its k expert rows (weighted, and scaled when
    `scale_refs` holds (row scale, group, column scales)), as one [1, size] array per column slice."""
    acc = [None] * len(slices)
    for j in range(slot_row_ref.shape[1]):
        row, weight = slot_row_ref[r, j], weights_ref[r, j]
        if scale_refs:
            row_scale_ref, group_ref, col_ref = scale_refs
            row_scale = pltriton.load(row_scale_ref.at[pl.ds(row, 1)])[None, :]  # [1, 1]
            group = jnp.maximum(group_ref[row], 0)
        for i, cols in enumerate(slices):
            v = pltriton.load(rows_ref.at[pl.ds(row, 1), cols]).astype(jnp.float32)
            if scale_refs:
                v = v * (row_scale * pltriton.load(col_ref.at[pl.ds(group, 1), cols]))
            v = v * weight
            acc[i] = v if acc[i] is None else acc[i] + v
    return acc


def _combine_rows_kernel(slot_row_ref, weights_ref, rows_ref, *scale_and_out_refs, slices, scaled: bool):
    *scale_refs, out_ref = scale_and_out_refs
    for r in range(out_ref.shape[0]):
        totals = _combined_row(slot_row_ref, weights_ref, rows_ref, scale_refs if scaled else (), r, slices)
        for total, cols in zip(totals, slices):
            pltriton.store(out_ref.at[pl.ds(r, 1), cols], total.astype(out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "rows_per_program", "num_warps", "chunk"))
def combine_rows_pallas(rows: jax.Array, slot_row: jax.Array, weights: jax.Array, scales: ExpertRowScales | None,
                        dtype: Any, interpret: bool = False, rows_per_program: int = 1, num_warps: int = 4,
                        chunk: int = 1024) -> jax.Array:
    """`combine_rows_reference`'s result from one Pallas (Triton) kernel: a program per `rows_per_program` tokens
    sums their k rows in float32 registers, in slices of up to `chunk` columns (a width that is not a power of two
    as its binary parts), and writes each token row once. `interpret`: Pallas's interpreter (CPU tests)."""
    n, k = slot_row.shape
    width = rows.shape[1]
    per, padded, (slot_row, weights) = row_blocks([slot_row.astype(jnp.int32), weights.astype(jnp.float32)],
                                                  rows_per_program)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    extra = [] if scales is None else [scales.row.astype(jnp.float32), scales.group.astype(jnp.int32),
                                       scales.col.astype(jnp.float32)]
    out = pl.pallas_call(
        functools.partial(_combine_rows_kernel, slices=column_slices(width, chunk), scaled=scales is not None),
        out_shape=jax.ShapeDtypeStruct((padded, width), dtype),
        grid=(padded // per,),
        in_specs=[pl.BlockSpec((per, k), lambda i: (i, 0)), pl.BlockSpec((per, k), lambda i: (i, 0)), whole(rows)]
                 + [whole(a) for a in extra],
        out_specs=pl.BlockSpec((per, width), lambda i: (i, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="combine_rows",
    )(slot_row, weights, rows, *extra)
    return out[:n]


def combine_rows(rows: jax.Array, slot_row: jax.Array, weights: jax.Array, scales: ExpertRowScales | None,
                 dtype: Any, impl: str | None = None) -> jax.Array:
    """`combine_rows_reference`'s result. impl: "pallas" (`combine_rows_pallas`, the GPU's default) or "xla"
    (the default elsewhere)."""
    on_gpu = devices.on_gpu()
    impl = impl or ("pallas" if on_gpu else "xla")
    if impl not in ("pallas", "xla"):
        raise ValueError(f"combine impl must be 'pallas' or 'xla', got {impl!r}")
    if impl == "pallas" and on_gpu:
        # 2 tokens x 8 warps: the best or equal of scripts/bench_moe.py --movement on an H200 (2026-11-28)
        return combine_rows_pallas(rows, slot_row, weights, scales, dtype, rows_per_program=2, num_warps=8)
    return combine_rows_reference(rows, slot_row, weights, scales, dtype)


def _combine_residual_norm_quantize_kernel(slot_row_ref, weights_ref, h_ref, rows_ref, *refs, slices, width: int,
                                           chunk: int, eps: float, scaled: bool):
    scale_refs, (norm_weight_ref, *out_refs) = refs[:3 * scaled], refs[3 * scaled:]
    dtype = out_refs[0].dtype
    totals = _combined_row(slot_row_ref, weights_ref, rows_ref, scale_refs, 0, slices)
    delta = {cols.start: total.astype(dtype) for cols, total in zip(slices, totals)}  # the combine's one rounding
    residual_norm_quantize_block(lambda cols: pltriton.load(h_ref.at[:, cols]), lambda cols: delta[cols.start],
                                 norm_weight_ref, *out_refs, width=width, chunk=chunk, eps=eps)


@functools.partial(jax.jit, static_argnames=("eps", "keep_normed", "interpret", "num_warps", "chunk"))
def combine_residual_norm_quantize_pallas(h: jax.Array, rows: jax.Array, slot_row: jax.Array, weights: jax.Array,
                                          scales: ExpertRowScales | None, norm_weight: jax.Array, eps: float,
                                          keep_normed: bool = False, interpret: bool = False, num_warps: int = 4,
                                          chunk: int = 1024) -> tuple[jax.Array, ...]:
    """An fp8 MoE layer's last step in one kernel: the combine (`combine_rows_reference`: each token's k expert
    rows weighted and summed in float32, rounded once to h's dtype), the residual add and the next RMSNorm with
    its e4m3 quantisation (`jaxllm.fp8_kernels.residual_norm_quantize_pallas` with that sum as a plain delta).
    The combined rows never go to memory: a program holds one token's row from its k expert rows to its e4m3
    values. h [N, D] the residual stream; rows [R, D], slot_row int32 [N, k], weights [N, k], scales as
    `combine_rows_reference`'s; norm_weight [D]. Returns (h + combined [N, D], the normed rows [N, D] with
    `keep_normed`, e4m3 [N, D], float32 scale [N]). `interpret`: Pallas's interpreter (CPU tests)."""
    n, width = h.shape
    k = slot_row.shape[1]
    per_token = lambda cols: pl.BlockSpec((1, cols), lambda i: (i, 0))  # noqa: E731
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    extra = [] if scales is None else [scales.row.astype(jnp.float32), scales.group.astype(jnp.int32),
                                       scales.col.astype(jnp.float32)]
    out_dtypes = [h.dtype] * (2 if keep_normed else 1) + [E4M3]
    outs = pl.pallas_call(
        functools.partial(_combine_residual_norm_quantize_kernel, slices=column_slices(width, chunk), width=width,
                          chunk=chunk, eps=eps, scaled=scales is not None),
        out_shape=tuple(jax.ShapeDtypeStruct((n, width), d) for d in out_dtypes)
                  + (jax.ShapeDtypeStruct((n, 1), jnp.float32),),
        grid=(n,),
        in_specs=[per_token(k), per_token(k), per_token(width), whole(rows)] + [whole(a) for a in extra]
                 + [pl.BlockSpec((width,), lambda i: (0,))],
        out_specs=tuple(per_token(width) for _ in out_dtypes) + (per_token(1),),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="combine_residual_norm_quantize",
    )(slot_row.astype(jnp.int32), weights.astype(jnp.float32), h, rows, *extra, norm_weight)
    return (*outs[:-1], outs[-1][:, 0])


@flax.struct.dataclass
class ExpertOutputs:
    """An MoE block's output before its combine: the expert rows `rows` [R, D], each token's rows `slot_row` int32
    [N, k] and routing `weights` [N, k], the fp8 `scales` (or None), and the tokens' leading shape `lead` and
    `dtype`. It stands for `value()`; kept apart so the step after the block (the residual add with the next
    norm, `jaxllm.layer_ops.residual_norm`) can combine the rows in its own kernel."""

    rows: jax.Array
    slot_row: jax.Array
    weights: jax.Array
    scales: ExpertRowScales | None
    lead: tuple[int, ...] = flax.struct.field(pytree_node=False)
    dtype: Any = flax.struct.field(pytree_node=False)

    def value(self) -> jax.Array:
        """The block's output [*lead, D] in `dtype` (`combine_rows`)."""
        combined = combine_rows(self.rows, self.slot_row, self.weights, self.scales, self.dtype)
        return combined.reshape(*self.lead, self.rows.shape[-1])
