"""A decoder layer's elementwise steps: RMSNorm, RoPE, and the residual add with the norm after it.

Each step is written once in XLA form (any backend, any dtype; HF's numerics). For fp8 weights on a GPU with
FP8 tensor cores, the two steps XLA splits into several passes over a tensor run as one Pallas kernel each
(`jaxllm.fp8_kernels`), with the same roundings:
- `residual_norm`: h + an fp8 GEMM's scaled product (or an MoE block's output), then RMSNorm and the next GEMM's
  e4m3 quantisation (two reductions in a row; XLA made three kernels of it), with the 16-bit normalised rows too
  where an fp8 MoE block's router reads them (an MoE block's output comes uncombined, `moe_rows.ExpertOutputs`:
  with `FUSED_MOE_COMBINE` its combine runs in the same kernel, `moe_rows.combine_residual_norm_quantize_pallas`);
- `head_norm_rope`: an fp8 q/k product, scaled, then each head's RMSNorm and RoPE (XLA made two).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .fp8 import Fp8Product, QuantizedRows, ValueAndRows, native_fp8_available, quantize
from .moe_rows import ExpertOutputs

# an fp8 MoE block's combine inside the residual kernel after it (one kernel instead of two, the combined rows never
# in memory). Off: on an H200 the fused kernel took 25.7 ms per 128-prompt encode of Qwen3-30B-A3B against 23.9 for
# the combine's and the residual step's own kernels (1 token a program, 4 or 8 warps; docs/BENCHMARKS.md, ninth
# 2026-11-28 session). Read at trace time.
FUSED_MOE_COMBINE = False


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as in HF: normalise in float32, cast back to x's dtype, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., T, head_dim] for integer positions, computed in float32 and cast to `dtype`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split (`rotate_half`) rotary embedding. x: [B, T, H, hd]; cos/sin: [T, hd] (shared by the batch)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def value(y: jax.Array | Fp8Product | ExpertOutputs) -> jax.Array:
    """A projection's or an MoE block's result as an array (an `Fp8Product` scaled into its dtype, an
    `ExpertOutputs` combined)."""
    return y.value() if isinstance(y, (Fp8Product, ExpertOutputs)) else y


def norm_input(h: jax.Array, weight: jax.Array, eps: float, quantized: bool, keep_value: bool = False
               ) -> jax.Array | QuantizedRows | ValueAndRows:
    """RMSNorm of the residual stream h, as the next projection takes it: e4m3 rows when `quantized` (its
    weights are fp8), else h's dtype; with `keep_value` too, both (`ValueAndRows`: an fp8 MoE block's input)."""
    x = rms_norm(h, weight, eps)
    if not quantized:
        return x
    return ValueAndRows(x, quantize(x)) if keep_value else quantize(x)


def residual_norm_reference(h: jax.Array, delta: jax.Array | Fp8Product | ExpertOutputs, weight: jax.Array, eps: float,
                            quantized: bool, keep_value: bool = False
                            ) -> tuple[jax.Array, jax.Array | QuantizedRows | ValueAndRows]:
    """(h + delta, `norm_input` of that sum) in XLA form."""
    h = h + value(delta)
    return h, norm_input(h, weight, eps, quantized, keep_value)


def _one_pass_kernels(y: Any) -> bool:
    """Whether `y` (an fp8 product) goes to a one-pass kernel on this backend."""
    return isinstance(y, Fp8Product) and native_fp8_available()


def _unit_scaled(delta: jax.Array) -> Fp8Product:
    """A plain 16-bit delta as an `Fp8Product` with unit scales: `value()` gives it back bit for bit, so the
    residual kernel adds it as it is."""
    ones = lambda n: jnp.ones((n,), jnp.float32)  # noqa: E731
    rows = ones(delta.size // delta.shape[-1]).reshape(delta.shape[:-1])
    return Fp8Product(delta, rows, ones(delta.shape[-1]), delta.dtype)


def residual_norm(h: jax.Array, delta: jax.Array | Fp8Product | ExpertOutputs, weight: jax.Array, eps: float,
                  quantized: bool, keep_value: bool = False
                  ) -> tuple[jax.Array, jax.Array | QuantizedRows | ValueAndRows]:
    """The residual add h + delta, then the next projection's input (`norm_input` of the sum).

    h [..., D]; delta: a plain array, an fp8 GEMM's `Fp8Product` or an MoE block's uncombined `ExpertOutputs`.
    When the sum is quantised again on a GPU with FP8 tensor cores, one kernel reads each row once
    (`residual_norm_quantize_pallas`, which also writes the 16-bit normalised rows for `keep_value`; for
    `ExpertOutputs` with `FUSED_MOE_COMBINE`, `combine_residual_norm_quantize_pallas`, which also combines the
    expert rows; else the combine's own kernel first); elsewhere `residual_norm_reference`, with the same values."""
    if isinstance(delta, ExpertOutputs):
        if FUSED_MOE_COMBINE and quantized and native_fp8_available() and delta.dtype == h.dtype:
            return _combine_residual_norm(h, delta, weight, eps, keep_value)
        delta = delta.value()
    plain = quantized and isinstance(delta, jax.Array) and native_fp8_available()  # added with unit scales
    product = _unit_scaled(delta) if plain else delta
    if not (quantized and _one_pass_kernels(product) and product.dtype == h.dtype):
        return residual_norm_reference(h, delta, weight, eps, quantized, keep_value)
    from .fp8_kernels import residual_norm_quantize_pallas

    width = h.shape[-1]
    h_new, *normed, values, scale = residual_norm_quantize_pallas(
        h.reshape(-1, width), product.product.reshape(-1, width), product.row_scale.reshape(-1), product.col_scale,
        weight, eps=eps, keep_normed=keep_value)
    return _unflatten(h, h_new, normed, values, scale, keep_value)


def _combine_residual_norm(h: jax.Array, delta: ExpertOutputs, weight: jax.Array, eps: float, keep_value: bool
                           ) -> tuple[jax.Array, QuantizedRows | ValueAndRows]:
    """`residual_norm` of an MoE block's uncombined output on a GPU: combine, add, norm and quantise in one kernel."""
    from .moe_rows import combine_residual_norm_quantize_pallas

    width = h.shape[-1]
    h_new, *normed, values, scale = combine_residual_norm_quantize_pallas(
        h.reshape(-1, width), delta.rows, delta.slot_row, delta.weights, delta.scales, weight, eps=eps,
        keep_normed=keep_value, num_warps=8)
    return _unflatten(h, h_new, normed, values, scale, keep_value)


def _unflatten(h: jax.Array, h_new: jax.Array, normed: list[jax.Array], values: jax.Array, scale: jax.Array,
               keep_value: bool) -> tuple[jax.Array, QuantizedRows | ValueAndRows]:
    """A residual kernel's [N, D] outputs in h's shape, as `residual_norm` returns them."""
    rows = QuantizedRows(values.reshape(h.shape), scale.reshape(h.shape[:-1]), h.dtype)
    return h_new.reshape(h.shape), ValueAndRows(normed[0].reshape(h.shape), rows) if keep_value else rows


def head_norm_rope_reference(y: jax.Array | Fp8Product, weight: jax.Array, cos: jax.Array, sin: jax.Array,
                             eps: float, heads: int) -> jax.Array:
    """q or k: the projection y [B, T, H*hd] as heads [B, T, H, hd], each RMS-normalised (weight [hd]), then
    RoPE with cos/sin [T, hd]. XLA form."""
    y = value(y)
    return apply_rope(rms_norm(y.reshape(*y.shape[:2], heads, -1), weight, eps), cos, sin)


def head_norm_rope(y: jax.Array | Fp8Product, weight: jax.Array, cos: jax.Array, sin: jax.Array, eps: float,
                   heads: int) -> jax.Array:
    """`head_norm_rope_reference`'s result; for an fp8 product on a GPU with FP8 tensor cores from one kernel
    (`head_norm_rope_pallas`) that also applies the product's scales."""
    head_dim = y.product.shape[-1] // heads if isinstance(y, Fp8Product) else 0
    if not (_one_pass_kernels(y) and head_dim & (head_dim - 1) == 0 and head_dim >= 16):
        return head_norm_rope_reference(y, weight, cos, sin, eps, heads)
    from .fp8_kernels import head_norm_rope_pallas

    batch, tokens, width = y.product.shape
    rows = lambda table: jnp.broadcast_to(table, (batch, tokens, head_dim)).reshape(-1, head_dim)
    out = head_norm_rope_pallas(y.product.reshape(-1, width), y.row_scale.reshape(-1), y.col_scale, weight,
                                rows(cos), rows(sin), head_dim=head_dim, eps=eps, dtype=y.dtype)
    return out.reshape(batch, tokens, heads, head_dim)
