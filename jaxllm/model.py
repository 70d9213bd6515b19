"""Pure-JAX Qwen3 decoder over a params pytree, numerically following HF transformers' `modeling_qwen3`.

Params layout (a dict; decoder layers stacked on a leading axis of size L for `lax.scan`):

    embed_tokens [V, D]
    layers: input_layernorm [L, D], q_proj [L, D, Hq*hd], k_proj [L, D, Hkv*hd], v_proj [L, D, Hkv*hd],
            o_proj [L, Hq*hd, D], q_norm [L, hd], k_norm [L, hd], post_attention_layernorm [L, D],
            gate_proj [L, D, I], up_proj [L, D, I], down_proj [L, I, D]
            (an MoE model: the attention and norm leaves only)
    experts (MoE, the Ls sparse layers): router [Ls, D, E], gate_up [Ls, E, 2F, D], down [Ls, E, D, F]
    dense_mlp (MoE, the Ld dense layers among them, if any): gate_proj [Ld, D, I], up_proj, down_proj
    norm [D]
    lm_head [D, V]        (only for untied checkpoints)

Projection matrices are stored [in, out] (HF stores [out, in]; weights.py transposes at load time). The leaves'
HF names, shapes and init are tabled once in jaxllm/params.py.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .config import Qwen3Config
from .fp8 import Fp8Matrix, QuantizedRows, mlp_product, project, quantize
from .moe import moe_expert_outputs
from .params import layer_stacks
from .layer_ops import head_norm_rope, norm_input, residual_norm, rms_norm, rope_cos_sin, value
from .packed_attention import (Segments, default_packed_attention_impl, merge_halves, packed_attention,
                               packed_attention_quantized)
from .private_jax import cudnn_attention_module, probe

Params = dict[str, Any]


ATTENTION_IMPLS = ("xla", "cudnn", "xla_split", "cudnn_split")


@functools.cache
def _cudnn_lse_available() -> bool:
    """Whether JAX's private cuDNN attention primitive (which returns float32 softmax statistics) works as
    `_attention_with_lse` calls it: imported and traced once (`jax.eval_shape`, tiny bf16 shapes), so a JAX
    upgrade that moves, renames or changes it falls back to the public path with one warning instead of
    failing the default GPU path."""
    q = jax.ShapeDtypeStruct((1, 16, 2, 64), jnp.bfloat16)

    def trace():
        out, lse = jax.eval_shape(lambda q, k, v: _attention_with_lse(q, k, v, True, "cudnn"), q, q, q)
        return (out.shape, lse.shape), (q.shape, q.shape[:3])

    return probe(trace, "attention with float32 statistics",
                 "attention uses the public masked jax.nn.dot_product_attention path ('cudnn') instead of "
                 "'cudnn_split'")


def default_attention_impl(dtype: Any) -> str:
    """cuDNN flash attention on a GPU for 16-bit dtypes, XLA otherwise (CPU, float32).

    On a GPU the split form (prefix and rest attended separately, merged by log-sum-exp) is the default: it
    measured 7-8% faster than the masked single call at the Qwen3-4B shape (docs/BENCHMARKS.md). It needs a
    private JAX module; where that is missing or fails its probe (`_cudnn_lse_available`), the public masked
    `jax.nn.dot_product_attention` path is used (with one warning).
    """
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "cudnn_split" if _cudnn_lse_available() else "cudnn"
    return "xla"


def _attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool,
                        backend: str) -> tuple[jax.Array, jax.Array]:
    """Attention output [B, T, Hq, hd] and float32 log-sum-exp of the scaled logits [B, T, Hq]."""
    scale = q.shape[-1] ** -0.5
    if backend == "cudnn":
        # jax.nn.dot_product_attention rounds the residual to the output dtype (bf16), too coarse for merging;
        # the cuDNN primitive itself returns float32 softmax statistics [B, Hq, T].
        cudnn = cudnn_attention_module()
        mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
        out, lse = cudnn.dot_product_attention(q, k, v, scale=scale, mask_type=mask, return_residual=True)
        return out, jnp.swapaxes(lse, 1, 2).astype(jnp.float32)
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, hq, hd)
    return out, lse.reshape(b, hq, t).swapaxes(1, 2)


def _split_prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array,
                            backend: str) -> jax.Array:
    """Prefix attention without materialising the prefix per row: all B*T queries attend to the shared prefix
    in one unmasked call, each row attends causally to its own rest, and the two are merged by log-sum-exp."""
    b, t, hq, hd = q.shape
    out_p, lse_p = _attention_with_lse(q.reshape(1, b * t, hq, hd), prefix_k[None], prefix_v[None], False, backend)
    out_r, lse_r = _attention_with_lse(q, k, v, True, backend)
    out_p, lse_p = out_p.reshape(b, t, hq, hd), lse_p.reshape(b, t, hq)
    lse = jnp.logaddexp(lse_p, lse_r)
    return merge_halves(out_p, out_r, jnp.exp(lse_p - lse), jnp.exp(lse_r - lse), q.dtype)


def _packed_impl(implementation: str | None, dtype: Any) -> str:
    """The packed attention implementation for an `attention` implementation name (its "_split" suffix dropped)."""
    return (implementation or default_packed_attention_impl(dtype)).removesuffix("_split")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_k: jax.Array | None = None,
              prefix_v: jax.Array | None = None, implementation: str | None = None,
              segments: Segments | None = None) -> jax.Array:
    """Causal GQA attention, scale head_dim**-0.5, softmax in float32.

    q: [B, T, Hq, hd]; k, v: [B, T, Hkv, hd]. With a prefix (prefix_k/prefix_v: [P, Hkv, hd], shared by the
    batch), query i sits at position P+i and sees the P prefix keys and rest keys 0..i.
    implementation: "xla" or "cudnn" (jax.nn.dot_product_attention; with a prefix, prefix keys are prepended
    and the causal structure is a [1, 1, T, P+T] mask shared by batch and heads, keeping the fused kernel usable),
    "cudnn_split" / "xla_split" (prefix handled by `_split_prefix_attention`), None = `default_attention_impl`.
    With `segments` (packed prompts, B = 1): `packed_attention`; implementation "xla" or "cudnn" (the "_split"
    suffix is ignored: the packed forms always handle the prefix apart), None = `default_packed_attention_impl`.
    """
    if segments is not None:
        return packed_attention(q, k, v, prefix_k, prefix_v, segments, _packed_impl(implementation, q.dtype))
    impl = implementation or default_attention_impl(q.dtype)
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLS} or None, got {impl!r}")
    backend = impl.removesuffix("_split")
    if prefix_k is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=backend)
    if impl.endswith("_split"):
        return _split_prefix_attention(q, k, v, prefix_k, prefix_v, backend)
    batch, t = q.shape[0], q.shape[1]
    p = prefix_k.shape[0]
    k = jnp.concatenate([jnp.broadcast_to(prefix_k[None], (batch,) + prefix_k.shape), k], axis=1)
    v = jnp.concatenate([jnp.broadcast_to(prefix_v[None], (batch,) + prefix_v.shape), v], axis=1)
    mask = jnp.arange(p + t)[None, :] <= (p + jnp.arange(t))[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation=impl)


def decoder_layer(h: jax.Array, x: jax.Array | QuantizedRows, lp: Params, mp: Params, next_norm: jax.Array,
                  cos: jax.Array, sin: jax.Array, config: Qwen3Config, prefix_k: jax.Array | None = None,
                  prefix_v: jax.Array | None = None, attention_impl: str | None = None,
                  segments: Segments | None = None, expert_layer: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array | QuantizedRows, tuple[jax.Array, jax.Array]]:
    """One Qwen3 decoder layer on the residual stream h [B, T, D], given its input x = RMSNorm(h) with the
    layer's input_layernorm (`layer_input`: e4m3 rows for fp8 weights). lp: the layer's attention and norm
    leaves; mp: its feed-forward block (gate_proj/up_proj/down_proj for a dense MLP, router/gate_up/down for a
    sparse MoE block, `jaxllm.moe`; with `expert_layer`, its gate_up/down are the whole expert stacks and this is
    the layer's index in them, so a kernel can read them in place). Returns the new h, the next layer's input (the new h normalised with
    `next_norm`: computed here so the residual add and the norm after it are one step) and this layer's
    post-RoPE (k, v). Matrices are plain [in, out] arrays or `fp8.Fp8Matrix` (W8A8); `segments`: packed prompts
    (B = 1)."""
    batch, t, _ = h.shape
    eps, hd = config.rms_norm_eps, config.head_dim
    q = head_norm_rope(project(x, lp["q_proj"]), lp["q_norm"], cos, sin, eps, config.num_attention_heads)
    k = head_norm_rope(project(x, lp["k_proj"]), lp["k_norm"], cos, sin, eps, config.num_key_value_heads)
    v = value(project(x, lp["v_proj"])).reshape(batch, t, config.num_key_value_heads, hd)
    if isinstance(lp["o_proj"], Fp8Matrix) and segments is not None:
        attn = packed_attention_quantized(q, k, v, prefix_k, prefix_v, segments,
                                          _packed_impl(attention_impl, q.dtype))
    else:
        attn = attention(q, k, v, prefix_k, prefix_v, attention_impl, segments).reshape(batch, t, config.q_size)
        if isinstance(lp["o_proj"], Fp8Matrix):
            # attention is a custom call (cuDNN) on a GPU: XLA cannot fuse o_proj's fp8 input quantisation into it
            attn = quantize(attn, one_pass=True)
    sparse = "router" in mp
    # fp8 experts take e4m3 rows and their router the 16-bit ones: both from the one step after the residual add
    mlp_quantized = isinstance(mp["gate_up" if sparse else "gate_proj"], Fp8Matrix)
    h, x = residual_norm(h, project(attn, lp["o_proj"]), lp["post_attention_layernorm"], eps, mlp_quantized,
                         keep_value=sparse)
    if sparse:
        delta = moe_expert_outputs(x, mp, config.num_experts_per_tok, config.norm_topk_prob, layer=expert_layer)
    else:
        delta = mlp_product(x, mp["gate_proj"], mp["up_proj"], mp["down_proj"])
    h, x = residual_norm(h, delta, next_norm, eps, isinstance(lp["q_proj"], Fp8Matrix))
    return h, x, (k, v)


def layer_runs(config: Qwen3Config, num_layers: int) -> list[tuple[str, int, int, int]]:
    """Layers 0..num_layers-1 as runs of consecutive layers whose feed-forward block lives in the same stack:
    (stack name, first layer, end layer, the first layer's index in that stack). A dense model is one run over
    `layers` (its MLP leaves are stacked with the attention's); an MoE model alternates `experts` and
    `dense_mlp` as its sparse and dense layers do (Qwen3-30B-A3B: one run of 48 sparse layers)."""
    # where each layer's feed-forward leaves sit: (stack, position in it), from the params table's stacks
    home = {i: (name, pos) for name, (_, indices) in layer_stacks(config).items() if name != "layers"
            for pos, i in enumerate(indices)}
    runs: list[tuple[str, int, int, int]] = []
    for i in range(num_layers):
        stack, pos = home.get(i, ("layers", i))
        if runs and runs[-1][0] == stack:
            runs[-1] = (stack, runs[-1][1], i + 1, runs[-1][3])
        else:
            runs.append((stack, i, i + 1, pos))
    return runs


def layer_input(h: jax.Array, layers: Params, index: int | jax.Array, config: Qwen3Config
                ) -> jax.Array | QuantizedRows:
    """Decoder layer `index`'s input: h normalised with its input_layernorm, as its projections take it."""
    return norm_input(h, layers["input_layernorm"][index], config.rms_norm_eps,
                      isinstance(layers["q_proj"], Fp8Matrix))


def normalize_layer_index(layer: int, config: Qwen3Config) -> int:
    """Maps an HF `hidden_states` index (negatives allowed) to 0..L, with a clear error when out of range."""
    n = config.num_hidden_layers
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TypeError(f"layer must be a Python int (a static hidden-state index), got {type(layer).__name__}")
    if not -(n + 1) <= layer <= n:
        raise ValueError(f"layer={layer} is out of range: this model has {n + 1} hidden states "
                         f"(valid indices {-(n + 1)}..{n}; 0 = embeddings, {n} or -1 = final post-norm)")
    return layer % (n + 1)


def embed(params: Params, ids: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] in the params' dtype."""
    return jnp.take(params["embed_tokens"], ids, axis=0)


def forward(params: Params, config: Qwen3Config, ids: jax.Array, *, layer: int = -1, collect: bool = False,
            collect_kv: bool = False, prefix_k: jax.Array | None = None, prefix_v: jax.Array | None = None,
            position_offset: int = 0, attention_impl: str | None = None,
            segments: Segments | None = None) -> tuple[jax.Array, Any]:
    """Runs the model up to HF hidden-state index `layer` (only the layers that index needs).

    Returns (hidden state at `layer` [B, T, D], per-layer scan outputs (h after each layer [n, B, T, D] if
    `collect`, else None; (k, v) each [n, B, T, Hkv, hd] if `collect_kv`, else None)). prefix_k/prefix_v:
    [L, P, Hkv, hd] of a cached prefix; positions then start at `position_offset` (= P).
    `segments`: ids [1, C] are packed prompts (`packed_attention.Segments`); each slot's position is
    position_offset + its position inside its prompt.
    """
    k_idx = normalize_layer_index(layer, config)
    h = embed(params, ids)
    t = ids.shape[1]
    positions = jnp.arange(t) if segments is None else segments.position
    cos, sin = rope_cos_sin(position_offset + positions, config.head_dim, config.rope_theta, h.dtype)
    layers = params["layers"]

    def body(stack, carry, index):
        h, x = carry
        i, j = index
        # Index the full layer stacks inside the loop (a dynamic slice per layer) rather than slicing the first
        # k_idx layers up front, which would copy the weights of the layers used (gigabytes for Qwen3-4B).
        lp = jax.tree.map(lambda a: a[i], layers)
        mp, expert_layer = lp, None
        if stack == "experts":  # the expert weights go whole to the sparse block, which indexes them itself
            mp, expert_layer = dict(params[stack], router=params[stack]["router"][j]), j
        elif stack != "layers":
            mp = jax.tree.map(lambda a: a[j], params[stack])
        pk, pv = (None, None) if prefix_k is None else (prefix_k[i], prefix_v[i])
        # the last layer also normalises its output for a next one (with its own norm): one unused RMSNorm
        next_norm = layers["input_layernorm"][jnp.minimum(i + 1, k_idx - 1)]
        h, x, kv = decoder_layer(h, x, lp, mp, next_norm, cos, sin, config, pk, pv, attention_impl, segments,
                                 expert_layer)
        return (h, x), (h if collect else None, kv if collect_kv else None)

    outputs = (None, None)
    if k_idx > 0:
        carry = (h, layer_input(h, layers, 0, config))
        per_run = []
        for stack, first, end, offset in layer_runs(config, k_idx):
            index = (jnp.arange(first, end), jnp.arange(offset, offset + end - first))
            carry, out = lax.scan(functools.partial(body, stack), carry, index)
            per_run.append(out)
        h = carry[0]
        outputs = per_run[0] if len(per_run) == 1 else jax.tree.map(
            lambda *parts: jnp.concatenate(parts, axis=0), *per_run)
    if k_idx == config.num_hidden_layers:
        h = rms_norm(h, params["norm"], config.rms_norm_eps)
    return h, outputs


def hidden_states(params: Params, config: Qwen3Config, ids: jax.Array,
                  attention_impl: str | None = None) -> tuple[jax.Array, ...]:
    """All L+1 hidden states [B, T, D] with HF `output_hidden_states` semantics (last one post-norm)."""
    emb = embed(params, ids)
    final, (per_layer, _) = forward(params, config, ids, layer=-1, collect=True, attention_impl=attention_impl)
    n = config.num_hidden_layers
    return (emb,) + tuple(per_layer[i] for i in range(n - 1)) + (final,)


def lm_head_weight(params: Params, config: Qwen3Config) -> jax.Array:
    """The [D, V] output projection: the transposed embedding when tied, else `lm_head`."""
    if config.tie_word_embeddings:
        return params["embed_tokens"].T
    if "lm_head" not in params:
        raise ValueError("this model has untied embeddings but no 'lm_head' weight (it was loaded from a bare "
                         "Qwen3Model checkpoint); load a Qwen3ForCausalLM checkpoint to compute logits")
    return params["lm_head"]


def logits(params: Params, config: Qwen3Config, ids: jax.Array, attention_impl: str | None = None) -> jax.Array:
    """Next-token logits [B, T, V] in float32 (matmul in the model dtype with float32 accumulation)."""
    w = lm_head_weight(params, config)
    h, _ = forward(params, config, ids, layer=-1, attention_impl=attention_impl)
    return jnp.matmul(h, w, preferred_element_type=jnp.float32)
