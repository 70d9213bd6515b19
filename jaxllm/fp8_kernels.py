"""One-pass GPU kernels (Pallas, Triton backend) for the fp8 path's elementwise steps XLA splits in two or three.

An fp8 GEMM's input is quantised per token row: abs-max over the row, divide, cast to e4m3. XLA fuses that with
the op producing the row when it can (RMSNorm); where it cannot, it reads the row twice, once for the abs-max and
once to scale and cast: the MLP's SwiGLU product (9,728 wide for Qwen3-4B, the widest tensor of a layer) and the
attention output (produced by a cuDNN call). These kernels give each program a few token rows, held on chip
between the abs-max and the cast: every input element is read once. Packed attention's output comes in two
halves (against the cached prefix, within each prompt) that XLA would merge into rows it writes and the
quantisation reads back: `merge_quantize_pallas` merges them inside the quantisation instead.

Two more steps hold a row on chip between dependent reductions: the residual add with the next RMSNorm and its
quantisation (`residual_norm_quantize_pallas`: sum of squares, then abs-max; XLA made three kernels of it) and
the per-head q/k RMSNorm with RoPE (`head_norm_rope_pallas`; XLA made two).

Same arithmetic as their XLA forms (`jaxllm.fp8.quantize_rows` / `swiglu_quantize_reference`, and
`jaxllm.layer_ops`' references), roundings included, so the emulated path on a CPU and these kernels on a GPU give
the same numbers up to the last bit of `exp` / `rsqrt` and the order of a row's sum of squares.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .fp8_format import E4M3, E4M3_MAX, TINY


def column_slices(width: int, chunk: int) -> list[pl.Slice]:
    """[0, width) as slices of `chunk` columns, then the remainder's binary parts, largest first (Triton's
    shapes are powers of two)."""
    slices, start = [], 0
    while start < width:
        size = min(chunk, 1 << ((width - start).bit_length() - 1))
        slices.append(pl.ds(start, size))
        start += size
    return slices


def _quantize_block(values_of: Callable[[pl.Slice], jax.Array], q_ref, scale_ref, width: int, chunk: int) -> None:
    """Quantise the program's [rows, width] block: `values_of(cols)` gives the float32 values of a column slice;
    they stay in registers (the loop is unrolled) until the rows' abs-max is known."""
    values = [(cols, values_of(cols)) for cols in column_slices(width, chunk)]
    absmax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v), axis=1, keepdims=True) for _, v in values])
    scale = jnp.maximum(absmax / E4M3_MAX, TINY)  # [rows, 1]
    for cols, v in values:
        pltriton.store(q_ref.at[:, cols], (v / scale).astype(E4M3))
    scale_ref[...] = scale


def _quantize_rows_kernel(x_ref, q_ref, scale_ref, *, width: int, chunk: int):
    _quantize_block(lambda cols: pltriton.load(x_ref.at[:, cols]).astype(jnp.float32), q_ref, scale_ref, width,
                    chunk)


def _swiglu_quantize_kernel(gate_ref, up_ref, x_scale_ref, gate_scale_ref, up_scale_ref, q_ref, scale_ref, *,
                            width: int, chunk: int):
    x_scale = pltriton.load(x_scale_ref).astype(jnp.float32)  # [rows, 1]

    def values_of(cols):
        gate = pltriton.load(gate_ref.at[:, cols]).astype(jnp.float32)
        gate = gate * (x_scale * pltriton.load(gate_scale_ref.at[cols])[None, :])
        up = pltriton.load(up_ref.at[:, cols]).astype(jnp.float32)
        up = up * (x_scale * pltriton.load(up_scale_ref.at[cols])[None, :])
        return gate * jax.nn.sigmoid(gate) * up

    _quantize_block(values_of, q_ref, scale_ref, width, chunk)


def _expert_swiglu_quantize_kernel(gate_up_ref, row_scale_ref, group_ref, col_scale_ref, q_ref, scale_ref, *,
                                   width: int, chunk: int):
    # the program's rows lie in one row tile, so they share one expert: its row of the [groups, 2 * width] scales
    group = jnp.maximum(group_ref[0], 0)  # unused tiles (-1) hold zero rows: any expert's scales give zeros
    row_scale = pltriton.load(row_scale_ref).astype(jnp.float32)  # [rows, 1]

    def values_of(cols):
        up_cols = pl.ds(cols.start + width, cols.size)
        gate = pltriton.load(gate_up_ref.at[:, cols]).astype(jnp.float32) * row_scale
        gate = gate * pltriton.load(col_scale_ref.at[group, cols])[None, :]
        up = pltriton.load(gate_up_ref.at[:, up_cols]).astype(jnp.float32) * row_scale
        up = up * pltriton.load(col_scale_ref.at[group, up_cols])[None, :]
        return gate * jax.nn.sigmoid(gate) * up

    _quantize_block(values_of, q_ref, scale_ref, width, chunk)


def _merge_quantize_kernel(prefix_ref, rest_ref, prefix_weight_ref, rest_weight_ref, q_ref, scale_ref, *,
                           heads_per: int):
    # a program's token: its heads are the rows of its blocks ([heads, head_dim], weights [heads, 1]), so a head's
    # two weights broadcast along its row; each load is `heads_per` whole heads
    dtype = prefix_ref.dtype
    merged = []
    for start in range(0, prefix_ref.shape[0], heads_per):
        heads = pl.ds(start, heads_per)
        w_p, w_r = (pltriton.load(ref.at[heads, :]) for ref in (prefix_weight_ref, rest_weight_ref))
        rest = jnp.where(w_r > 0, pltriton.load(rest_ref.at[heads, :]).astype(jnp.float32) * w_r, 0.0)
        value = pltriton.load(prefix_ref.at[heads, :]).astype(jnp.float32) * w_p + rest
        merged.append((heads, value.astype(dtype).astype(jnp.float32)))  # the merged rows' rounding, as XLA's
    absmax = functools.reduce(jnp.maximum, [jnp.max(jnp.max(jnp.abs(v), axis=1), axis=0, keepdims=True)
                                            for _, v in merged])  # [1]
    scale = jnp.maximum(absmax / E4M3_MAX, TINY)
    for heads, v in merged:
        pltriton.store(q_ref.at[heads, :], (v / scale[:, None]).astype(E4M3))
    scale_ref[...] = scale.reshape(1, 1)


def residual_norm_quantize_block(h_of: Callable[[pl.Slice], jax.Array], delta_of: Callable[[pl.Slice], jax.Array],
                                 weight_ref, h_out_ref, *refs, width: int, chunk: int, eps: float) -> None:
    """A program's rows of `residual_norm_quantize_pallas`: h_of(cols) / delta_of(cols) give a column slice of the
    residual stream and of the delta (in its dtype); writes h + delta to h_out_ref, then (the normalised rows to
    a `normed_ref` when three refs follow, ) the e4m3 rows and their scales."""
    normed_ref, q_ref, scale_ref = refs if len(refs) == 3 else (None, *refs)  # the normed rows only when asked for
    dtype = h_out_ref.dtype
    slices = column_slices(width, chunk)
    new_rows, sum_sq = [], None
    for cols in slices:
        h = (h_of(cols).astype(jnp.float32) + delta_of(cols).astype(jnp.float32)).astype(dtype)
        pltriton.store(h_out_ref.at[:, cols], h)
        h = h.astype(jnp.float32)
        part = jnp.sum(h * h, axis=1, keepdims=True)
        sum_sq = part if sum_sq is None else sum_sq + part
        new_rows.append(h)
    inv_rms = lax.rsqrt(sum_sq / width + eps)
    normed = {}
    for cols, h in zip(slices, new_rows):
        weight = pltriton.load(weight_ref.at[cols]).astype(jnp.float32)[None, :]
        normed[cols.start] = (weight * (h * inv_rms).astype(dtype).astype(jnp.float32)).astype(dtype)
        if normed_ref is not None:
            pltriton.store(normed_ref.at[:, cols], normed[cols.start])
    _quantize_block(lambda cols: normed[cols.start].astype(jnp.float32), q_ref, scale_ref, width, chunk)


def _residual_norm_quantize_kernel(h_ref, y_ref, row_scale_ref, col_scale_ref, weight_ref, *out_refs,
                                   width: int, chunk: int, eps: float):
    dtype = out_refs[0].dtype
    row_scale = pltriton.load(row_scale_ref).astype(jnp.float32)  # [rows, 1]

    def delta_of(cols):
        y = pltriton.load(y_ref.at[:, cols]).astype(jnp.float32)
        return (y * (row_scale * pltriton.load(col_scale_ref.at[cols])[None, :])).astype(dtype)

    residual_norm_quantize_block(lambda cols: pltriton.load(h_ref.at[:, cols]), delta_of, weight_ref, *out_refs,
                                 width=width, chunk=chunk, eps=eps)


def _head_norm_rope_kernel(y_ref, row_scale_ref, col_scale_ref, weight_ref, cos_ref, sin_ref, out_ref, *,
                           eps: float):
    dtype = out_ref.dtype
    half = out_ref.shape[1] // 2
    halves = (pl.ds(0, half), pl.ds(half, half))
    row_scale = pltriton.load(row_scale_ref).astype(jnp.float32)  # [rows, 1]
    f32 = lambda a: a.astype(jnp.float32)

    def scaled(cols):
        y = f32(pltriton.load(y_ref.at[:, cols]))
        return f32((y * (row_scale * pltriton.load(col_scale_ref.at[cols])[None, :])).astype(dtype))

    lo, hi = (scaled(cols) for cols in halves)
    inv_rms = lax.rsqrt((jnp.sum(lo * lo, axis=1, keepdims=True) + jnp.sum(hi * hi, axis=1, keepdims=True))
                        / (2 * half) + eps)
    lo, hi = (f32((f32(pltriton.load(weight_ref.at[cols]))[None, :] * f32((v * inv_rms).astype(dtype)))
                  .astype(dtype)) for v, cols in zip((lo, hi), halves))
    # rotate_half: the low half pairs with minus the high half, the high half with the low half
    for v, partner, cols in ((lo, -hi, halves[0]), (hi, lo, halves[1])):
        cos, sin = f32(pltriton.load(cos_ref.at[:, cols])), f32(pltriton.load(sin_ref.at[:, cols]))
        out = f32((v * cos).astype(dtype)) + f32((partner * sin).astype(dtype))
        pltriton.store(out_ref.at[:, cols], out.astype(dtype))


def row_blocks(per_row: list[jax.Array], rows: int) -> tuple[int, int, list[jax.Array]]:
    """Blocks of `rows` token rows over arrays [N, W] or [N] (made [N, 1]): (rows, padded N, the arrays padded
    to whole blocks). `rows` shrinks to the smallest power of two that holds N; padding rows are cut off after."""
    n = per_row[0].shape[0]
    rows = min(rows, pl.next_power_of_2(n))
    padded = -(-n // rows) * rows
    per_row = [a.reshape(n, 1) if a.ndim == 1 else a for a in per_row]
    if padded != n:
        per_row = [jnp.pad(a, ((0, padded - n), (0, 0))) for a in per_row]
    return rows, padded, per_row


def _row_kernel_call(kernel: Callable, per_row: list[jax.Array], per_column: list[jax.Array], *, name: str,
                     interpret: bool, rows: int, num_warps: int, chunk: int,
                     row_outputs: tuple = ()) -> tuple[jax.Array, ...]:
    """Run `kernel` over blocks of `rows` token rows: `per_row` arrays [N, W] or [N] (one value per row),
    `per_column` arrays [W] (whole, to every program). Returns (one [N, W] array per dtype of `row_outputs`, which
    the kernel writes first, then e4m3 [N, W], float32 scale [N])."""
    n, width = per_row[0].shape
    rows, padded, per_row = row_blocks(per_row, rows)
    spec = lambda columns: pl.BlockSpec((rows, columns), lambda i: (i, 0))
    widths_dtypes = [(width, dtype) for dtype in row_outputs] + [(width, E4M3), (1, jnp.float32)]
    *extra, q, scale = pl.pallas_call(
        functools.partial(kernel, width=width, chunk=chunk),
        out_shape=tuple(jax.ShapeDtypeStruct((padded, w), dtype) for w, dtype in widths_dtypes),
        grid=(padded // rows,),
        in_specs=[spec(a.shape[1]) for a in per_row] + [pl.BlockSpec((width,), lambda i: (0,)) for _ in per_column],
        out_specs=tuple(spec(w) for w, _ in widths_dtypes),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*per_row, *per_column)
    return (*(e[:n] for e in extra), q[:n], scale[:n, 0])


_TUNING = ("interpret", "rows", "num_warps", "chunk")


@functools.partial(jax.jit, static_argnames=_TUNING)
def quantize_rows_pallas(x: jax.Array, interpret: bool = False, rows: int = 1, num_warps: int = 4,
                         chunk: int = 512) -> tuple[jax.Array, jax.Array]:
    """x [N, W] -> (e4m3 [N, W], float32 scale [N]): each row scaled by its own abs-max (`jaxllm.fp8.quantize_rows`).
    `interpret`: run Pallas's interpreter (CPU tests) instead of compiling for the GPU. Tuning (powers of two):
    `rows` per program, Triton `num_warps`, `chunk` columns per slice."""
    return _row_kernel_call(_quantize_rows_kernel, [x], [], name="quantize_rows", interpret=interpret, rows=rows,
                            num_warps=num_warps, chunk=chunk)


@functools.partial(jax.jit, static_argnames=_TUNING)
def swiglu_quantize_pallas(gate: jax.Array, up: jax.Array, x_scale: jax.Array, gate_scale: jax.Array,
                           up_scale: jax.Array, interpret: bool = False, rows: int = 1, num_warps: int = 4,
                           chunk: int = 512) -> tuple[jax.Array, jax.Array]:
    """silu(gate * x_scale * gate_scale) * (up * x_scale * up_scale), quantised per row to e4m3.

    gate, up: unscaled GEMM products [N, I] (16-bit or float32); x_scale [N] float32 (the rows' activation scales);
    gate_scale, up_scale [I] float32 (the weights' channel scales). Returns (e4m3 [N, I], float32 scale [N]).
    `interpret` and the tuning as `quantize_rows_pallas`; the defaults measured best on an H100 at Qwen3-4B's
    width (scripts/bench_fp8_mlp.py: 1 row x 4 warps, 512-column slices)."""
    return _row_kernel_call(_swiglu_quantize_kernel, [gate, up, x_scale.astype(jnp.float32)],
                            [gate_scale.astype(jnp.float32), up_scale.astype(jnp.float32)], name="swiglu_quantize",
                            interpret=interpret, rows=rows, num_warps=num_warps, chunk=chunk)


@functools.partial(jax.jit, static_argnames=("tile_m",) + _TUNING)
def expert_swiglu_quantize_pallas(gate_up: jax.Array, row_scale: jax.Array, tile_groups: jax.Array,
                                  col_scale: jax.Array, tile_m: int, interpret: bool = False, rows: int = 1,
                                  num_warps: int = 4, chunk: int = 512) -> tuple[jax.Array, jax.Array]:
    """The fp8 experts' step between their two GEMMs: silu(gate) * up of the scaled gate+up product, quantised
    per row to e4m3 (`jaxllm.moe.expert_swiglu_quantize_reference`'s arithmetic, from one kernel that reads each
    product row once; XLA reads it twice, for the abs-max and for the cast).

    gate_up [R, 2F] the unscaled product of rows in the tiled kernel's layout (each run of `tile_m` rows belongs to
    one expert), row_scale [R] float32, tile_groups int32 [R // tile_m] (each row tile's expert: a row of
    col_scale [G, 2F], -1 for unused tiles, whose rows are zero). Returns (e4m3 [R, F], float32 scale [R]).
    `rows` per program must divide `tile_m`; `interpret` and the tuning as `quantize_rows_pallas`."""
    n, two_f = gate_up.shape
    if tile_m % rows or n % tile_m or tile_groups.shape != (n // tile_m,):
        raise ValueError(f"expert_swiglu_quantize_pallas: {n} rows in tiles of {tile_m} with {rows} rows per "
                         f"program need {n // tile_m} tile groups and rows dividing tile_m; got "
                         f"{tile_groups.shape[0]} groups")
    width = two_f // 2
    spec = lambda columns: pl.BlockSpec((rows, columns), lambda i: (i, 0))  # noqa: E731
    q, scale = pl.pallas_call(
        functools.partial(_expert_swiglu_quantize_kernel, width=width, chunk=chunk),
        out_shape=(jax.ShapeDtypeStruct((n, width), E4M3), jax.ShapeDtypeStruct((n, 1), jnp.float32)),
        grid=(n // rows,),
        in_specs=[spec(two_f), spec(1), pl.BlockSpec((1,), lambda i: (i * rows // tile_m,)),
                  pl.BlockSpec(col_scale.shape, lambda i: (0, 0))],
        out_specs=(spec(width), spec(1)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="expert_swiglu_quantize",
    )(gate_up, row_scale.astype(jnp.float32).reshape(n, 1), tile_groups.astype(jnp.int32),
      col_scale.astype(jnp.float32))
    return q, scale[:, 0]


def merge_quantize_fits(heads: int, head_dim: int) -> bool:
    """Whether `merge_quantize_pallas` takes attention halves of `heads` heads of `head_dim` (its blocks need
    powers of two)."""
    return not (heads & (heads - 1) or head_dim & (head_dim - 1))


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "heads_per"))
def merge_quantize_pallas(prefix_half: jax.Array, rest_half: jax.Array, prefix_weight: jax.Array,
                          rest_weight: jax.Array, interpret: bool = False, num_warps: int = 4,
                          heads_per: int = 32) -> tuple[jax.Array, jax.Array]:
    """Attention's two halves merged and quantised per row for an fp8 GEMM (o_proj), each half read once.

    prefix_half, rest_half [N, H, head_dim] (16-bit: cuDNN's outputs against the cached prefix and within each
    packed prompt), prefix_weight, rest_weight [N, H] float32 (each head's softmax weights; a rest half of weight
    0 counts 0 whatever its bits). Returns (e4m3 [N, H * head_dim], float32 scale [N]): `jaxllm.fp8.quantize_rows`
    of `jaxllm.packed_attention.merge_halves`'s rows, rounded to the halves' dtype as XLA's merge writes them.
    One program a token, its H heads the rows of a [H, head_dim] block. `interpret`: Pallas's interpreter (CPU
    tests). Tuning: Triton `num_warps`, `heads_per` heads per load (powers of two; H and head_dim too). On H200s
    (36,864 tokens x 32 heads of 128, 2026-11-29) it saved 0.10-0.12 ms a layer in the fp8 encoders against XLA's
    merge and the quantisation kernel; other settings were within the encoders' rounds' spread
    (docs/BENCHMARKS.md)."""
    n, heads, head_dim = prefix_half.shape
    heads_per = min(heads_per, heads)
    if not merge_quantize_fits(heads, head_dim) or heads_per & (heads_per - 1) or rest_half.shape != prefix_half.shape:
        raise ValueError(f"merge_quantize_pallas: halves {prefix_half.shape} and {rest_half.shape} must match, "
                         f"with a power-of-two number of heads and head_dim; heads_per {heads_per} a power of two")
    # [N * H, head_dim]: a token's heads are H consecutive rows, its weights H consecutive [1]-rows
    halves = [a.reshape(n * heads, head_dim) for a in (prefix_half, rest_half)]
    weights = [w.astype(jnp.float32).reshape(n * heads, 1) for w in (prefix_weight, rest_weight)]
    half_spec = pl.BlockSpec((heads, head_dim), lambda i: (i, 0))
    weight_spec = pl.BlockSpec((heads, 1), lambda i: (i, 0))
    q, scale = pl.pallas_call(
        functools.partial(_merge_quantize_kernel, heads_per=heads_per),
        out_shape=(jax.ShapeDtypeStruct(halves[0].shape, E4M3), jax.ShapeDtypeStruct((n, 1), jnp.float32)),
        grid=(n,),
        in_specs=[half_spec, half_spec, weight_spec, weight_spec],
        out_specs=(half_spec, pl.BlockSpec((1, 1), lambda i: (i, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="merge_quantize",
    )(*halves, *weights)
    return q.reshape(n, heads * head_dim), scale[:, 0]


@functools.partial(jax.jit, static_argnames=("eps", "keep_normed") + _TUNING)
def residual_norm_quantize_pallas(h: jax.Array, y: jax.Array, row_scale: jax.Array, col_scale: jax.Array,
                                  weight: jax.Array, eps: float, keep_normed: bool = False, interpret: bool = False,
                                  rows: int = 1, num_warps: int = 4, chunk: int = 512) -> tuple[jax.Array, ...]:
    """The residual add of an fp8 GEMM's product, then RMSNorm and per-row e4m3 quantisation of the sum.

    h [N, D] the residual stream (16-bit); y [N, D] the GEMM's unscaled product, row_scale [N] / col_scale [D]
    its activation / weight scales (a 16-bit y with unit scales is a plain residual add); weight [D] the RMSNorm
    weight. Returns (h + the scaled product [N, D] in h's dtype, e4m3 [N, D], float32 scale [N]):
    `jaxllm.layer_ops.residual_norm_reference`'s values, from one kernel that reads each row once. `keep_normed`:
    also the normalised rows themselves [N, D] in h's dtype, second (for a consumer that needs both, such as an
    MoE block: its router reads the 16-bit rows, its experts the e4m3 ones). `interpret` and the tuning as
    `quantize_rows_pallas`."""
    kernel = functools.partial(_residual_norm_quantize_kernel, eps=eps)
    return _row_kernel_call(kernel, [h, y, row_scale.astype(jnp.float32)],
                            [col_scale.astype(jnp.float32), weight], name="residual_norm_quantize",
                            interpret=interpret, rows=rows, num_warps=num_warps, chunk=chunk,
                            row_outputs=(h.dtype,) * (2 if keep_normed else 1))


@functools.partial(jax.jit, static_argnames=("head_dim", "eps", "dtype", "interpret", "rows", "num_warps"))
def head_norm_rope_pallas(y: jax.Array, row_scale: jax.Array, col_scale: jax.Array, weight: jax.Array,
                          cos: jax.Array, sin: jax.Array, head_dim: int, eps: float, dtype: Any,
                          interpret: bool = False, rows: int = 32, num_warps: int = 4) -> jax.Array:
    """An fp8 GEMM's q or k product, scaled into `dtype`, then each head's RMSNorm and RoPE (rotate_half).

    y [N, H*head_dim] the unscaled product, row_scale [N] / col_scale [H*head_dim] its scales, weight [head_dim]
    the q/k norm weight, cos / sin [N, head_dim] each row's rotary tables. Returns [N, H*head_dim] in `dtype`:
    `jaxllm.layer_ops.head_norm_rope_reference`'s values from one kernel (a program holds `rows` tokens x one
    head; 32 x 4 warps measured best on an H100 at Qwen3-4B's q and k, scripts/bench_layer_kernels.py)."""
    n, width = y.shape
    rows, padded, (y, row_scale, cos, sin) = row_blocks([y, row_scale.astype(jnp.float32), cos, sin], rows)
    out = pl.pallas_call(
        functools.partial(_head_norm_rope_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct((padded, width), dtype),
        grid=(padded // rows, width // head_dim),
        in_specs=[pl.BlockSpec((rows, head_dim), lambda i, j: (i, j)),
                  pl.BlockSpec((rows, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((head_dim,), lambda i, j: (j,)),
                  pl.BlockSpec((head_dim,), lambda i, j: (0,)),
                  pl.BlockSpec((rows, head_dim), lambda i, j: (i, 0)),
                  pl.BlockSpec((rows, head_dim), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((rows, head_dim), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="head_norm_rope",
    )(y, row_scale, col_scale.astype(jnp.float32), weight, cos, sin)
    return out[:n]
