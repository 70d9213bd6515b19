"""Prompts -> one vector per prompt, optionally behind a cached constant prefix. Pure functions of arrays.

`encode` and `prefill` take `config` (and `layer`, `pooling`) as static arguments and everything else as arrays,
so they jit, vmap and run inside `lax.scan` with no host callback.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from .config import Qwen3Config
from .model import Params, embed, forward, normalize_layer_index
from .packed_attention import Segments, default_packed_attention_impl

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
    layer: HF `hidden_states` index (negatives allowed; -1 = final post-norm state; only the layers it needs run),
        or a tuple of indices: then [B, K, D], every index from one pass to the deepest.
    pooling: "last" = state of the last real token; "mean" = mean over all real tokens (prefix included).
    prefix: a PrefixCache; then ids/lengths are the rest of each prompt and positions continue at prefix.length.
    Rows with length 0 give the prefix's last / mean state with a prefix, and zeros without one.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if ids.ndim != 2:
        raise ValueError(f"ids must be int [B, T] (right-padded token ids), got shape {ids.shape}")
    lengths = jnp.asarray(lengths, jnp.int32)
    offset = 0 if prefix is None else prefix.length
    pk, pv = (None, None) if prefix is None else (prefix.keys, prefix.values)
    if isinstance(layer, tuple):  # several layers from one pass: [B, K, D]
        idx = tuple(normalize_layer_index(k, config) for k in layer)
        states = _states_at(params, config, ids.astype(jnp.int32), idx, prefix_k=pk, prefix_v=pv,
                            position_offset=offset, attention_impl=attention_impl)
        return jnp.stack([_pool(h, lengths, pooling, prefix, k) for h, k in zip(states, idx)], axis=1)
    k_idx = normalize_layer_index(layer, config)
    h, _ = forward(params, config, ids.astype(jnp.int32), layer=k_idx, prefix_k=pk, prefix_v=pv,
                   position_offset=offset, attention_impl=attention_impl)
    return _pool(h, lengths, pooling, prefix, k_idx)


def _states_at(params: Params, config: Qwen3Config, ids: jax.Array, idx: tuple[int, ...], **kw) -> list:
    """The hidden states [B, T, D] at each HF index in `idx` (0..L) from ONE forward pass to the deepest."""
    top = max(idx)
    h, (per_layer, _) = forward(params, config, ids, layer=top, collect=top > 0, **kw)
    return [h if i == top else embed(params, ids) if i == 0 else per_layer[i - 1] for i in idx]


def _pool(h: jax.Array, lengths: jax.Array, pooling: Pooling, prefix: PrefixCache | None, k_idx: int) -> jax.Array:
    """One vector [B, D] per prompt of the hidden states h [B, T, D] at HF index k_idx (see `encode`)."""
    t = h.shape[1]
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


def length_buckets(max_len: int, num_buckets: int = 6, min_len: int = 64) -> tuple[int, ...]:
    """Static padded lengths for `encode_bucketed`: max_len and up to num_buckets-1 shorter ones, each about 2/3
    of the next, rounded up to a multiple of 64 (e.g. 1138 -> (192, 256, 384, 512, 768, 1138))."""
    buckets = {int(max_len)}
    length = float(max_len)
    while len(buckets) < num_buckets:
        length *= 2 / 3
        rounded = int(-(-length // 64) * 64)
        if rounded < min_len or rounded >= min(buckets):
            break
        buckets.add(rounded)
    return tuple(sorted(buckets))


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def encode_bucketed(params: Params, config: Qwen3Config, ids: jax.Array, lengths: jax.Array, *,
                    layer: int = -1, pooling: Pooling = "last", prefix: PrefixCache | None = None,
                    chunk: int = 64, buckets: tuple[int, ...] | None = None,
                    attention_impl: str | None = None) -> jax.Array:
    """`encode` for batches of prompts of very different lengths, without paying for the padding.

    Prompts are sorted by length and encoded `chunk` at a time (`lax.map`); each chunk is cut to the shortest
    static bucket length that holds its longest prompt (`lax.switch` over one compiled branch per bucket).
    Causal attention means the cut padding never influenced real tokens, so the vectors equal `encode`'s up to
    float rounding; the cost follows the actual lengths instead of ids.shape[1]. chunk also bounds activation
    memory (chunk x bucket tokens at a time), e.g. for 1,024 prompts of ~1,000 tokens through Qwen3-4B.
    """
    batch, t = ids.shape
    buckets = tuple(sorted({min(b, t) for b in (buckets or length_buckets(t))} | {t}))
    chunk = _largest_divisor_at_most(batch, chunk)
    lengths = jnp.asarray(lengths, jnp.int32)
    order = jnp.argsort(lengths)
    sorted_ids = ids[order].reshape(batch // chunk, chunk, t)
    sorted_lengths = lengths[order].reshape(batch // chunk, chunk)

    def encode_chunk(args):
        chunk_ids, chunk_lengths = args
        branches = [
            (lambda i, n, b=b: encode(params, config, i[:, :b], n, layer=layer, pooling=pooling, prefix=prefix,
                                      attention_impl=attention_impl))
            for b in buckets
        ]
        which = jnp.searchsorted(jnp.asarray(buckets), jnp.max(chunk_lengths))
        return lax.switch(jnp.minimum(which, len(buckets) - 1), branches, chunk_ids, chunk_lengths)

    vectors = lax.map(encode_chunk, (sorted_ids, sorted_lengths))
    vectors = vectors.reshape((batch,) + vectors.shape[2:])
    return vectors[jnp.argsort(order)]


# tokens of the largest packed pass: 9 x 4,096, so that 128 Craftax-Symbolic prompts (~36,100 real tokens behind
# the cached head) are one pass. Each pass reads every weight once (an MoE: every expert), and its last pass is
# small and padded: at 32,768 the same tokens as 32,768 + 4,096 cost Qwen3-30B-A3B's fp8 encoder 20.5 ms and the
# 4B's 11.8 ms more than one pass (an H200, 2026-11-28: docs/BENCHMARKS.md). A trainer window at 128 envs (136
# prompts, 35-39K tokens) is one pass until it spills into 36,864 + 4,608: measured as fast as 32,768 there.
DEFAULT_CAPACITY = 36864


def default_capacity(batch: int, max_len: int) -> int:
    """`encode_packed`'s capacity when none is given.

    A packed pass never needs more than the padded batch (`batch * max_len` tokens), so that is the capacity up to
    DEFAULT_CAPACITY tokens; above it, DEFAULT_CAPACITY (but at least one longest prompt). Rounded up to a multiple
    of 128 rows, the GEMM tile size on the GPU, except for tiny batches (<= 128 tokens, as in tests), which get
    exactly their padded size.
    """
    padded = batch * max_len
    if padded <= 128:
        return padded
    return _round_up(max(max_len, min(padded, DEFAULT_CAPACITY)), 128)


def pass_capacities(capacity: int, max_len: int) -> tuple[int, ...]:
    """The static pass sizes of a packed encode, ascending: `capacity`, a quarter and an eighth of it (rounded up to
    64 tokens, at least one longest prompt), each smaller size kept only when at most half the next one kept.

    Each size is one more compiled forward pass (a `lax.switch` branch) in every program that encodes, and a cold
    compile pays for each: the 30B fp8 trainer's update compiled in 73 s with these three and 105 s with the six used
    before (halvings and 1.5x steps between them; one H200), so its first update came at 1:28 instead of 1:59
    (docs/BENCHMARKS.md).
    `encode_packed` runs full passes while over capacity / 1.5 tokens are left, and below that the smaller sizes
    (`pass_size_index`). At DEFAULT_CAPACITY that is 4,608, 9,216 and 36,864: a trainer window at 128 envs (136
    prompts, 35-39K tokens) runs the same passes as with the six sizes, and of 20 planned windows of 128-300
    Craftax prompts (docs/BENCHMARKS.md) 17 compute the same tokens, one 5% more and two 19% fewer.
    """
    capacity = int(capacity)

    def part(d):
        return max(_round_up(-(-capacity // d), 64) if capacity >= 64 * d else -(-capacity // d), int(max_len))

    sizes = [capacity]
    for size in (part(4), part(8)):
        if 2 * size <= sizes[0]:
            sizes.insert(0, size)
    return tuple(sizes)


def pass_size_index(sizes: Sequence[int], left: int | jax.Array) -> jax.Array:
    """Which of the ascending pass `sizes` a packed pass takes when `left` real tokens remain (a traced or concrete
    int): the smallest size that holds them when it pads at most a third of its row, is the smallest size, or is at
    most twice the size below it (two passes of that would compute as much); else the largest size below them,
    filled, the rest left for more passes. So with sizes (4,608, 9,216, 36,864) a rest of 15,000 tokens runs two
    passes of 9,216 rather than one of 36,864."""
    sizes = jnp.asarray(sizes)
    last = sizes.shape[0] - 1
    up = jnp.minimum(jnp.searchsorted(sizes, left), last)  # the smallest size >= left (the largest when none is)
    down = jnp.maximum(jnp.searchsorted(sizes, left, side="right") - 1, 0)  # the largest size <= left
    take_up = (up == 0) | (2 * sizes[up] <= 3 * left) | (sizes[up] <= 2 * sizes[down])
    return jnp.where(take_up, up, down)


def packed_plan(batch: int, max_len: int, capacity: int | None, dtype) -> tuple:
    """The static plan of `encode_packed` on ids [batch, max_len] of a model with embedding `dtype`: the attention
    implementation, the capacity, the pass sizes and what each pass's shape depends on (cuDNN's grid per size; the
    windowed XLA form's key window depends on `max_len` itself). Two ids widths of equal plans give the same
    vectors bit for bit: nothing past a prompt's length is read, so only the plan sees the width."""
    capacity = default_capacity(batch, max_len) if capacity is None else int(capacity)
    impl = default_packed_attention_impl(dtype).removesuffix("_split")
    sizes = pass_capacities(capacity, max_len)
    per_pass = tuple(segment_grid(s, max_len, batch) for s in sizes) if impl == "cudnn" else max_len
    return impl, capacity, sizes, per_pass


def _round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def segment_grid(capacity: int, max_len: int, batch: int) -> tuple[int, int]:
    """The static (rows, segments_per_row) grid of cuDNN's packed call for a pass of `capacity` slots.

    cuDNN's packed attention writes its float32 softmax statistics as [rows * segments_per_row, heads, row width]
    (`jaxllm.packed_attention`), so one row of 32,768 slots and 128 segments writes 537 MB per layer at Qwen3-4B's
    32 heads, almost all of it padding. The row is therefore viewed as `rows` rows of `capacity / rows` slots, the
    narrowest that still holds a longest prompt (a prompt may run past its row's end: the slots are contiguous),
    with room for twice the pass's possible prompts: `segments_per_row = 2 * min(batch, capacity) / rows`. Segment
    r of a pass (in slot order) sits in grid row r // segments_per_row, which must not start after it
    (`_plan_pass` defers prompts that would); that holds whenever the prompts average at least
    capacity / (2 * batch) tokens (128 at 128 prompts in 32,768 slots). Only the "cudnn" packed attention uses
    the grid."""
    rows = max(r for r in range(1, capacity + 1) if capacity % r == 0 and capacity // r >= max_len)
    prompts = min(batch, capacity)
    return rows, min(prompts, -(-2 * prompts // rows))


def _plan_pass(lengths: jax.Array, remaining: jax.Array, capacity: int,
               grid: tuple[int, int]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy in index order: of the prompts still `remaining`, those whose running token total fits `capacity`,
    up to the first whose segment would not fit the (rows, segments_per_row) `grid` (`segment_grid`; it and the
    rest wait for the next pass). Returns (taken bool [B], first slot of each prompt int [B], one past its last
    slot int [B])."""
    rows, per_row = grid
    width = capacity // rows
    tokens = jnp.where(remaining, lengths, 0)
    end = jnp.cumsum(tokens)
    taken = remaining & (end <= capacity)
    real = taken & (lengths > 0)
    rank = jnp.cumsum(real) - 1
    misfit = real & ((rank // per_row) * width > end - tokens)  # its grid row would start after the prompt does
    taken = taken & (jnp.cumsum(misfit) == 0)  # taking a prefix never moves the prompts before the cut
    tokens = jnp.where(taken, tokens, 0)
    end = jnp.cumsum(tokens)
    return taken, end - tokens, end


def _pack(ids: jax.Array, lengths: jax.Array, taken: jax.Array, start: jax.Array, end: jax.Array,
          capacity: int, grid: tuple[int, int]) -> tuple[jax.Array, Segments]:
    """The token row [1, capacity] of the taken prompts laid end to end, and its Segments on `grid`."""
    batch, t = ids.shape
    slot = jnp.arange(capacity)
    owner = jnp.minimum(jnp.searchsorted(end, slot, side="right"), batch - 1)  # first prompt ending after slot
    valid = slot < end[-1]
    position = jnp.where(valid, slot - start[owner], 0)
    tokens = jnp.where(valid, ids[owner, jnp.minimum(position, t - 1)], 0)
    real = taken & (lengths > 0)
    rank = jnp.cumsum(real) - 1  # index among the packed segments
    rows, per_row = grid
    cell = jnp.where(real, rank, rows * per_row)  # segment r in grid cell r (row-major); others dropped
    on_grid = lambda x: jnp.full((rows * per_row,), -1, jnp.int32).at[cell].set(x, mode="drop").reshape(rows, per_row)
    row_start = (jnp.arange(rows * per_row) // per_row * (capacity // rows)).reshape(rows, per_row)
    seqlens, starts = on_grid(lengths), on_grid(start)
    offsets = jnp.where(seqlens >= 0, starts - row_start, -1)  # relative to the segment's grid row
    segments = Segments(segment=jnp.where(valid, owner, batch), valid=valid, position=position,
                        rank=jnp.where(valid, rank[owner], 0), seqlens=seqlens,
                        offsets=jnp.concatenate([offsets, jnp.full((rows, 1), -1, jnp.int32)], axis=1),
                        max_len=t)
    return tokens[None], segments


def encode_packed(params: Params, config: Qwen3Config, ids: jax.Array, lengths: jax.Array, *, layer: int = -1,
                  pooling: Pooling = "last", prefix: PrefixCache | None = None, capacity: int | None = None,
                  attention_impl: str | None = None, pass_sizes: Sequence[int] | None = None) -> jax.Array:
    """`encode` that computes only real tokens: same inputs, same vectors (up to float rounding).

    The prompts' real tokens are laid end to end in a row of token slots (no per-prompt padding); each slot's
    position restarts at the prefix length for every prompt, and attention keeps each prompt to its own tokens
    plus the cached prefix (`packed_attention`). A pass takes the remaining prompts greedily in index order while
    they fit its row (and cuDNN's segment grid, `segment_grid`); passes repeat until every prompt is done
    (`lax.while_loop`). `capacity` is the largest row (tokens per pass; None: `default_capacity`); each pass's row
    is one of the static `pass_sizes` (None: `pass_capacities(capacity, ids.shape[1])`; given, each at least
    ids.shape[1] and the largest the capacity), chosen by what is left (`pass_size_index`, a `lax.switch`). Any
    capacity and sizes >= ids.shape[1] give the same vectors. Rows of length 0 give `encode`'s fallback vector.
    `layer` a tuple: [B, K, D], every index from one pass.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if ids.ndim != 2:
        raise ValueError(f"ids must be int [B, T] (right-padded token ids), got shape {ids.shape}")
    batch, t = ids.shape
    if pass_sizes is not None:
        sizes = tuple(sorted({int(s) for s in pass_sizes}))
        if not sizes or sizes[0] < t or (capacity is not None and sizes[-1] != int(capacity)):
            raise ValueError(f"pass_sizes {tuple(pass_sizes)} must each hold one prompt of max_len {t} "
                             f"(ids.shape[1]), the largest equal to capacity ({capacity}); e.g. "
                             f"pass_sizes=({t}, {max(t, int(capacity or 0))})")
        capacity = sizes[-1]
    capacity = default_capacity(batch, t) if capacity is None else int(capacity)
    if capacity < t:
        raise ValueError(f"capacity {capacity} tokens cannot hold one prompt of max_len {t} (ids.shape[1]); "
                         f"use a capacity >= {t}")
    sizes = pass_capacities(capacity, t) if pass_sizes is None else sizes
    multi = isinstance(layer, tuple)  # several layers from one pass: [B, K, D]
    idx = tuple(normalize_layer_index(k, config) for k in (layer if multi else (layer,)))
    k_idx = idx[0]
    lengths = jnp.asarray(lengths, jnp.int32)
    offset = 0 if prefix is None else prefix.length
    pk, pv = (None, None) if prefix is None else (prefix.keys, prefix.values)
    dim = config.hidden_size

    def fallback_of(k):
        if pooling == "last":
            return jnp.zeros((dim,), jnp.float32) if prefix is None else prefix.last_hidden[k]
        return jnp.zeros((dim,), jnp.float32) if prefix is None else prefix.hidden_sums[k] / prefix.length

    fallback = jnp.stack([fallback_of(k) for k in idx]) if multi else fallback_of(k_idx)
    vectors = jnp.broadcast_to(fallback, (batch,) + fallback.shape)
    impl = (attention_impl or default_packed_attention_impl(params["embed_tokens"].dtype)).removesuffix("_split")

    def pass_of(size, vectors, remaining):
        # cuDNN's statistics are padded to its grid; the windowed form needs none (one row holds any plan)
        grid = segment_grid(size, t, batch) if impl == "cudnn" else (1, min(batch, size))
        taken, start, end = _plan_pass(lengths, remaining, size, grid)
        row, segments = _pack(ids.astype(jnp.int32), lengths, taken, start, end, size, grid)

        def pool(h, k):
            h = h[0].astype(jnp.float32)  # [capacity, D]
            if pooling == "last":
                return h[jnp.clip(end - 1, 0, size - 1)]
            real = jnp.where(segments.valid[:, None], h, 0.0)  # empty slots may hold anything: select, not multiply
            # a one-hot product rather than segment_sum: a GPU scatter-add sums in no fixed order
            owner = (segments.segment[None, :] == jnp.arange(batch)[:, None]).astype(jnp.float32)
            total = jnp.matmul(owner, real, precision=lax.Precision.HIGHEST)
            count = lengths.astype(jnp.float32)
            if prefix is not None:
                total, count = total + prefix.hidden_sums[k][None], count + prefix.length
            return total / jnp.maximum(count, 1.0)[:, None]

        kw = dict(prefix_k=pk, prefix_v=pv, position_offset=offset, attention_impl=impl, segments=segments)
        if multi:
            vec = jnp.stack([pool(h, k) for h, k in zip(_states_at(params, config, row, idx, **kw), idx)], axis=1)
        else:
            vec = pool(forward(params, config, row, layer=k_idx, **kw)[0], k_idx)
        keep = taken.reshape((batch,) + (1,) * (vec.ndim - 1))
        return jnp.where(keep, vec, vectors), remaining & ~taken

    def one_pass(state):
        which = pass_size_index(sizes, jnp.sum(jnp.where(state[1], lengths, 0)))
        return lax.switch(which, [functools.partial(pass_of, size) for size in sizes], *state)

    vectors, _ = lax.while_loop(lambda state: jnp.any(state[1]), one_pass, (vectors, lengths > 0))
    return vectors
