"""Prompts -> one vector per prompt, optionally behind a cached constant prefix. Pure functions of arrays.

`encode` and `prefill` take `config` (and `layer`, `pooling`) as static arguments and everything else as arrays,
so they jit, vmap and run inside `lax.scan` with no host callback.
"""
from __future__ import annotations

from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from .config import Qwen3Config
from .model import Params, forward, normalize_layer_index

Pooling = Literal["last", "mean"]
POOLINGS = ("last", "mean")


@flax.struct.dataclass
class PrefixCache:
    """A constant prompt head run once through the model.

    keys / values: [L, P, Hkv, hd] per-layer attention keys (after q/k-norm and RoPE) and values, model dtype.
    hidden_sums:   [L+1, D] float32 sums over the P prefix tokens of every HF hidden-state index (mean pooling).
    last_hidden:   [L+1, D] float32 hidden states of the last prefix token (last pooling of an empty rest).
    length:        P, static.
    """

    keys: jax.Array
    values: jax.Array
    hidden_sums: jax.Array
    last_hidden: jax.Array
    length: int = flax.struct.field(pytree_node=False)


def prefill(params: Params, config: Qwen3Config, prefix_ids: jax.Array,
            attention_impl: str | None = None) -> PrefixCache:
    """Runs the prefix (1-D token ids, length P >= 1) through all layers into a PrefixCache."""
    prefix_ids = jnp.asarray(prefix_ids)
    if prefix_ids.ndim != 1 or prefix_ids.shape[0] == 0:
        raise ValueError(f"prefix_ids must be a non-empty 1-D array of token ids, got shape {prefix_ids.shape}")
    ids = prefix_ids[None].astype(jnp.int32)
    final, (per_layer, (k, v)) = forward(params, config, ids, layer=-1, collect=True, collect_kv=True,
                                               attention_impl=attention_impl)
    emb = jnp.take(params["embed_tokens"], ids, axis=0)
    # Hidden-state index i: 0 = embeddings, 1..L-1 = layer outputs, L = final norm of the last layer.
    states = jnp.concatenate([emb[None], per_layer[:-1], final[None]], axis=0)[:, 0].astype(jnp.float32)
    return PrefixCache(keys=k[:, 0], values=v[:, 0], hidden_sums=states.sum(axis=1),
                       last_hidden=states[:, -1], length=int(prefix_ids.shape[0]))


def encode(params: Params, config: Qwen3Config, ids: jax.Array, lengths: jax.Array, *, layer: int = -1,
           pooling: Pooling = "last", prefix: PrefixCache | None = None,
           attention_impl: str | None = None) -> jax.Array:
    """One float32 vector [B, D] per right-padded prompt.

    ids: int [B, T] (right-padded; pads never influence real tokens), lengths: int [B] real tokens per row.
    layer: HF `hidden_states` index (negatives allowed; -1 = final post-norm state; only the layers it needs run).
    pooling: "last" = state of the last real token; "mean" = mean over all real tokens (prefix included).
    prefix: a PrefixCache; then ids/lengths are the rest of each prompt and positions continue at prefix.length.
    Rows with length 0 give the prefix's last / mean state with a prefix, and zeros without one.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if ids.ndim != 2:
        raise ValueError(f"ids must be int [B, T] (right-padded token ids), got shape {ids.shape}")
    k_idx = normalize_layer_index(layer, config)
    lengths = jnp.asarray(lengths, jnp.int32)
    offset = 0 if prefix is None else prefix.length
    pk, pv = (None, None) if prefix is None else (prefix.keys, prefix.values)
    h, _ = forward(params, config, ids.astype(jnp.int32), layer=k_idx, prefix_k=pk, prefix_v=pv,
                   position_offset=offset, attention_impl=attention_impl)
    t = ids.shape[1]
    if pooling == "last":
        last = jnp.clip(lengths - 1, 0, t - 1)
        vec = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)
        fallback = jnp.zeros_like(vec) if prefix is None else prefix.last_hidden[k_idx][None]
        return jnp.where((lengths > 0)[:, None], vec, fallback)
    real = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
    total = jnp.sum(h.astype(jnp.float32) * real[:, :, None], axis=1)
    count = lengths.astype(jnp.float32)
    if prefix is not None:
        total = total + prefix.hidden_sums[k_idx][None]
        count = count + prefix.length
    return total / jnp.maximum(count, 1.0)[:, None]
