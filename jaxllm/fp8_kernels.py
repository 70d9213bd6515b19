"""One-pass GPU kernels (Pallas, Triton backend) for the fp8 activation quantisations XLA splits in two.

An fp8 GEMM's input is quantised per token row: abs-max over the row, divide, cast to e4m3. XLA fuses that with
the op producing the row when it can (RMSNorm); where it cannot, it reads the row twice, once for the abs-max and
once to scale and cast: the MLP's SwiGLU product (9,728 wide for Qwen3-4B, the widest tensor of a layer) and the
attention output (produced by a cuDNN call). These kernels give each program a few token rows, held on chip
between the abs-max and the cast: every input element is read once.

Same arithmetic as `jaxllm.fp8.quantize_rows` / `swiglu_quantize_reference` (float32 throughout), so the emulated
path on a CPU and these kernels on a GPU give the same numbers up to the last bit of `exp`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .fp8_format import E4M3, E4M3_MAX, TINY


def _column_slices(width: int, chunk: int) -> list[pl.Slice]:
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
    values = [(cols, values_of(cols)) for cols in _column_slices(width, chunk)]
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


def _row_kernel_call(kernel: Callable, per_row: list[jax.Array], per_column: list[jax.Array], *, name: str,
                     interpret: bool, rows: int, num_warps: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Run `kernel` over blocks of `rows` token rows: `per_row` arrays [N, W] or [N] (one value per row),
    `per_column` arrays [W] (whole, to every program). Returns (e4m3 [N, W], float32 scale [N])."""
    n, width = per_row[0].shape
    rows = min(rows, pl.next_power_of_2(n))
    padded = -(-n // rows) * rows  # the grid covers whole blocks; rows past n are padding, cut off below
    per_row = [a.reshape(n, 1) if a.ndim == 1 else a for a in per_row]
    if padded != n:
        per_row = [jnp.pad(a, ((0, padded - n), (0, 0))) for a in per_row]
    spec = lambda a: pl.BlockSpec((rows, a.shape[1]), lambda i: (i, 0))
    q, scale = pl.pallas_call(
        functools.partial(kernel, width=width, chunk=chunk),
        out_shape=(jax.ShapeDtypeStruct((padded, width), E4M3), jax.ShapeDtypeStruct((padded, 1), jnp.float32)),
        grid=(padded // rows,),
        in_specs=[spec(a) for a in per_row] + [pl.BlockSpec((width,), lambda i: (0,)) for _ in per_column],
        out_specs=(pl.BlockSpec((rows, width), lambda i: (i, 0)), pl.BlockSpec((rows, 1), lambda i: (i, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*per_row, *per_column)
    return q[:n], scale[:n, 0]


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
