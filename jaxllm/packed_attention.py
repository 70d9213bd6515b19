"""Attention over packed prompts: many prompts laid end to end in one token row, each attending causally to its
own tokens (and to a shared cached prefix), never to its neighbours'.

`Segments` describes the packing. Two implementations of the same function:
- "xla": queries in blocks of `block` tokens, each block against the window of keys that can hold its prompts
  (a prompt is at most `max_len` tokens, so keys further back than that are never in a block's prompts), masked
  by segment and causality; the prefix joins the same softmax. Any backend; the reference.
- "cudnn": cuDNN's flash attention on the packed (ragged) layout, one segment per prompt (Hopper and later), plus
  one unmasked call against the prefix; the two halves merge by their float32 log-sum-exps. It uses JAX's private
  cuDNN module, as `model.py`'s split attention does.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from .fp8 import QuantizedRows, native_fp8_available, quantize
from .private_jax import cudnn_attention_module, probe

PACKED_ATTENTION_IMPLS = ("xla", "cudnn")

# whether an fp8 model's packed attention with cuDNN and a prefix merges its two halves inside o_proj's input
# quantisation (one Pallas kernel, `fp8_kernels.merge_quantize_pallas`: the merged 16-bit rows never go to memory)
# instead of XLA's merge fusion followed by the one-pass quantisation kernel. Same values. Read at trace time.
FUSED_MERGE_QUANTIZE = True


@flax.struct.dataclass
class Segments:
    """How prompts sit in a packed row of C token slots.

    segment:  int32 [C] the prompt each slot belongs to (empty slots: one id shared by all of them).
    valid:    bool [C] whether the slot holds a prompt's token.
    position: int32 [C] the slot's position inside its prompt (0 at the prompt's first token).
    rank:     int32 [C] the index of the slot's segment among the packed (non-empty) segments, in slot order.
    seqlens:  int32 [R, M] cuDNN's grid: the row is seen as R rows of C/R slots with M segment cells each; cell
              r (row-major) holds the r-th packed segment's token count, -1 for unused cells. A segment's
              cell row never starts after the segment does (it may run past that row's end).
    offsets:  int32 [R, M+1] the segment's first slot relative to its cell row's first slot, -1 for unused cells
              (`jaxllm.encoder.segment_grid` chooses R and M so the statistics cuDNN pads to [R*M, Hq, C/R]
              stay small).
    max_len:  static bound on any prompt's length (the "xla" key window).
    """

    segment: jax.Array
    valid: jax.Array
    position: jax.Array
    rank: jax.Array
    seqlens: jax.Array
    offsets: jax.Array
    max_len: int = flax.struct.field(pytree_node=False)


def _block_size(capacity: int, max_block: int = 128) -> int:
    return max(b for b in range(1, min(capacity, max_block) + 1) if capacity % b == 0)


def _windowed_attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array | None,
                        prefix_v: jax.Array | None, seg: Segments) -> jax.Array:
    """The "xla" implementation. q [1, C, Hq, hd]; k, v [1, C, Hkv, hd]; prefix_k/v [P, Hkv, hd] or None."""
    _, c, hq, hd = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bq = _block_size(c)
    nb = c // bq
    back = -(-max(seg.max_len - 1, 0) // bq) * bq  # keys before a block that its prompts can reach
    width = back + bq
    pad = lambda x, fill: jnp.concatenate([jnp.full((back,) + x.shape[1:], fill, x.dtype), x], axis=0)
    window = jnp.arange(nb)[:, None] * bq + jnp.arange(width)[None, :]  # [nb, W] indices into the padded arrays
    kw, vw = pad(k[0], 0)[window], pad(v[0], 0)[window]  # [nb, W, Hkv, hd]
    seg_k, slot_k = pad(seg.segment, -1)[window], window - back  # key slot index (negative = padding)
    qb = q[0].reshape(nb, bq, hkv, g, hd)
    seg_q = seg.segment.reshape(nb, bq)
    slot_q = jnp.arange(c).reshape(nb, bq)
    scale = hd ** -0.5
    logits = jnp.einsum("nqkgd,nwkd->nkgqw", qb, kw, preferred_element_type=jnp.float32) * scale
    allowed = (seg_k[:, None, :] == seg_q[:, :, None]) & (slot_k[:, None, :] <= slot_q[:, :, None])
    logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)  # [nb, Hkv, g, bq, W]
    if prefix_k is not None:
        logits_p = jnp.einsum("nqkgd,pkd->nkgqp", qb, prefix_k, preferred_element_type=jnp.float32) * scale
        logits = jnp.concatenate([logits_p, logits], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    if prefix_k is not None:
        p = prefix_k.shape[0]
        out = jnp.einsum("nkgqp,pkd->nqkgd", probs[..., :p].astype(v.dtype), prefix_v,
                         preferred_element_type=jnp.float32)
        out = out + jnp.einsum("nkgqw,nwkd->nqkgd", probs[..., p:].astype(v.dtype), vw,
                               preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("nkgqw,nwkd->nqkgd", probs.astype(v.dtype), vw, preferred_element_type=jnp.float32)
    return out.reshape(1, c, hq, hd).astype(q.dtype)


def _cudnn_halves(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array,
                  seg: Segments) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """cuDNN's two halves of the "cudnn" implementation with a prefix: (out_p, out_r [1, C, Hq, hd] in q's dtype:
    the prefix half and the packed half, w_p, w_r [1, C, Hq] float32: their softmax weights, from the float32
    log-sum-exps). Empty slots belong to no cuDNN segment: their packed half is undefined (any bits) and its
    weight 0, so they take the prefix half alone."""
    cudnn = cudnn_attention_module()
    scale = q.shape[-1] ** -0.5
    out_r, lse_r = _cudnn_packed_half(q, k, v, seg)
    out_p, lse_p = cudnn.dot_product_attention(q, prefix_k[None], prefix_v[None], scale=scale,
                                               mask_type=cudnn.MaskType.NO_MASK, return_residual=True)
    # The packed call's statistics come per segment, padded: [grid cells, Hq, C / rows]; slot s's is
    # [rank, :, position] (the cells hold the segments in slot order, see `Segments`).
    lse_r = lse_r[seg.rank, :, seg.position][None].astype(jnp.float32)  # [1, C, Hq]
    lse_p = jnp.swapaxes(lse_p, 1, 2).astype(jnp.float32)
    lse_r = jnp.where(~seg.valid[None, :, None] | ~jnp.isfinite(lse_r), -jnp.inf, lse_r)
    lse = jnp.logaddexp(lse_p, lse_r)
    return out_p, out_r, jnp.exp(lse_p - lse), jnp.exp(lse_r - lse)


def _cudnn_packed_half(q: jax.Array, k: jax.Array, v: jax.Array, seg: Segments) -> tuple[jax.Array, jax.Array]:
    """cuDNN's flash attention of each packed prompt over its own earlier slots: (out [1, C, Hq, hd], its
    statistics per grid cell [cells, Hq, C / rows])."""
    cudnn = cudnn_attention_module()
    rows = seg.seqlens.shape[0]
    grid = lambda x: x.reshape(rows, x.shape[1] // rows, *x.shape[2:])  # [1, C, ...] -> [rows, C / rows, ...]
    out_r, lse_r = cudnn.dot_product_attention(
        grid(q), grid(k), grid(v), q_seqlen=seg.seqlens, kv_seqlen=seg.seqlens, q_offsets=seg.offsets,
        kv_offsets=seg.offsets, scale=q.shape[-1] ** -0.5, mask_type=cudnn.MaskType.CAUSAL, return_residual=True)
    return out_r.reshape(q.shape), lse_r


def merge_halves(out_p: jax.Array, out_r: jax.Array, w_p: jax.Array, w_r: jax.Array, dtype: Any) -> jax.Array:
    """The attention output from its prefix and rest halves (`_cudnn_halves`; `model._split_prefix_attention`'s
    too), in float32, rounded once to `dtype`: out_p * w_p + out_r * w_r per head (w [..., Hq]), where a rest half
    of weight 0 counts 0 whatever its bits (empty slots)."""
    rest = jnp.where(w_r[..., None] > 0, out_r.astype(jnp.float32) * w_r[..., None], 0.0)
    return (out_p.astype(jnp.float32) * w_p[..., None] + rest).astype(dtype)


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array | None,
                     prefix_v: jax.Array | None, seg: Segments) -> jax.Array:
    """The "cudnn" implementation (same arguments as `_windowed_attention`)."""
    if prefix_k is None:
        return _cudnn_packed_half(q, k, v, seg)[0]
    return merge_halves(*_cudnn_halves(q, k, v, prefix_k, prefix_v, seg), q.dtype)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array | None,
                     prefix_v: jax.Array | None, segments: Segments, implementation: str = "xla") -> jax.Array:
    """Attention of packed prompts: q [1, C, Hq, hd], k/v [1, C, Hkv, hd] (post-RoPE), prefix_k/v [P, Hkv, hd] or
    None. A slot attends to the prefix and to the earlier slots of its own segment (and itself)."""
    if implementation == "cudnn":
        return _cudnn_attention(q, k, v, prefix_k, prefix_v, segments)
    if implementation == "xla":
        return _windowed_attention(q, k, v, prefix_k, prefix_v, segments)
    raise ValueError(f"packed attention implementation must be one of {PACKED_ATTENTION_IMPLS}, got "
                     f"{implementation!r}")


def packed_attention_quantized(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array | None,
                               prefix_v: jax.Array | None, segments: Segments,
                               implementation: str = "xla") -> QuantizedRows:
    """`packed_attention`'s output as o_proj's fp8 input: rows [1, C, Hq * hd] quantised (`fp8.quantize` in one
    pass). With cuDNN, a prefix, FP8 tensor cores and `FUSED_MERGE_QUANTIZE`, the two halves merge inside the
    quantisation kernel (whose blocks need a power-of-two head count and head_dim; other shapes take XLA's merge)."""
    from .fp8_kernels import merge_quantize_fits, merge_quantize_pallas

    _, c, hq, hd = q.shape
    if (implementation == "cudnn" and prefix_k is not None and FUSED_MERGE_QUANTIZE and merge_quantize_fits(hq, hd)
            and native_fp8_available()):
        out_p, out_r, w_p, w_r = _cudnn_halves(q, k, v, prefix_k, prefix_v, segments)
        values, scale = merge_quantize_pallas(out_p[0], out_r[0], w_p[0], w_r[0])
        return QuantizedRows(values.reshape(1, c, hq * hd), scale.reshape(1, c), q.dtype)
    out = packed_attention(q, k, v, prefix_k, prefix_v, segments, implementation)
    return quantize(out.reshape(1, c, hq * hd), one_pass=True)


@functools.cache
def _cudnn_packed_available() -> bool:
    """Whether JAX's private cuDNN attention takes the packed layout as `_cudnn_attention` calls it: imported and
    traced once (`jax.eval_shape`, tiny bf16 shapes, GQA, with a prefix). A JAX upgrade that moves, renames or
    changes it then falls back to the windowed XLA form with one warning instead of failing."""
    c, rows, m, hd = 16, 2, 4, 64
    arr = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    i32 = lambda shape: arr(shape, jnp.int32)
    segments = Segments(segment=i32((c,)), valid=arr((c,), jnp.bool_), position=i32((c,)), rank=i32((c,)),
                        seqlens=i32((rows, m)), offsets=i32((rows, m + 1)), max_len=8)

    def trace():
        out = jax.eval_shape(_cudnn_attention, arr((1, c, 2, hd)), arr((1, c, 1, hd)), arr((1, c, 1, hd)),
                             arr((5, 1, hd)), arr((5, 1, hd)), segments)
        return out.shape, (1, c, 2, hd)

    return probe(trace, "packed layout", "packed prompts use the windowed XLA attention, which is slower than "
                                         "--llm-encode bucketed")


def default_packed_attention_impl(dtype: Any) -> str:
    """cuDNN's packed layout on a Hopper (or later) GPU for 16-bit dtypes, the windowed XLA form otherwise."""
    if jax.default_backend() != "gpu" or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "xla"
    try:
        major = int(str(jax.devices()[0].compute_capability).split(".")[0])
    except (AttributeError, ValueError):
        return "xla"
    return "cudnn" if major >= 9 and _cudnn_packed_available() else "xla"
