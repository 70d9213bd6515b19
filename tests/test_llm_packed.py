"""`encode_packed` (prompts laid end to end, only real tokens computed) equals `encode` (right-padded rows)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import Qwen3Config, encode, encode_packed, init_params, pass_capacities, prefill
from jaxllm.encoder import _pack, _plan_pass, pass_size_index, segment_grid

CONFIG = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0)
T = 12  # max_len of the test prompts
_STATIC = ("config", "layer", "pooling", "capacity")
_encode = jax.jit(encode, static_argnames=_STATIC[:3])
_encode_packed = jax.jit(encode_packed, static_argnames=_STATIC)


@pytest.fixture(scope="module")
def model():
    params = init_params(CONFIG, jnp.float32, 0)
    head = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=7), jnp.int32)
    return params, jax.jit(prefill, static_argnums=1)(params, CONFIG, head)


def ragged_batch(seed: int, batch: int = 6):
    """Right-padded ids with lengths including 0 and the maximum T; the pads are random ids (never read)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, size=(batch, T)).astype(np.int32)
    lengths = rng.integers(1, T, size=batch).astype(np.int32)
    lengths[1], lengths[3] = 0, T
    return jnp.asarray(ids), jnp.asarray(lengths)


# Each pooling with and without a prefix; capacity T overflows into several passes (one prompt each), 6T holds the
# batch in one pass (pass_capacities).
@pytest.mark.parametrize("pooling, with_prefix, capacity", [("last", True, T), ("mean", True, 6 * T),
                                                            ("last", False, 6 * T), ("mean", False, T)])
def test_packed_equals_padded(model, pooling, with_prefix, capacity):
    params, cache = model
    prefix = cache if with_prefix else None
    ids, lengths = ragged_batch(0)
    layer = -1 if capacity == T else 1  # the final post-norm state and an inner one
    want = _encode(params, CONFIG, ids, lengths, layer=layer, pooling=pooling, prefix=prefix)
    got = _encode_packed(params, CONFIG, ids, lengths, layer=layer, pooling=pooling, prefix=prefix,
                         capacity=capacity)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_packed_reads_only_real_tokens(model):
    params, cache = model
    ids, lengths = ragged_batch(2)
    pads = jnp.arange(T)[None, :] >= lengths[:, None]
    other = jnp.where(pads, (ids + 97) % 256, ids)
    a = _encode_packed(params, CONFIG, ids, lengths, layer=-1, pooling="mean", prefix=cache, capacity=24)
    b = _encode_packed(params, CONFIG, other, lengths, layer=-1, pooling="mean", prefix=cache, capacity=24)
    np.testing.assert_array_equal(a, b)


def test_packing_lays_prompts_end_to_end():
    ids, lengths = ragged_batch(3)
    remaining = lengths > 0
    grid = segment_grid(24, T, len(lengths))
    taken, start, end = _plan_pass(lengths, remaining, 24, grid)
    row, seg = _pack(ids, lengths, taken, start, end, 24, grid)
    n = np.asarray(lengths)
    expect_taken = np.asarray(remaining) & (np.cumsum(np.where(remaining, n, 0)) <= 24)
    np.testing.assert_array_equal(taken, expect_taken)
    expected_row = np.concatenate([np.asarray(ids)[i, :n[i]] for i in range(len(n)) if expect_taken[i]])
    used = len(expected_row)
    np.testing.assert_array_equal(np.asarray(row)[0, :used], expected_row)
    assert np.asarray(seg.valid).sum() == used and not np.asarray(seg.valid)[used:].any()
    owners = np.concatenate([np.full(n[i], i) for i in range(len(n)) if expect_taken[i]])
    np.testing.assert_array_equal(np.asarray(seg.segment)[:used], owners)
    ranks = np.cumsum(expect_taken & (n > 0)) - 1  # cuDNN's index of each packed segment
    np.testing.assert_array_equal(np.asarray(seg.rank)[:used], ranks[owners])
    np.testing.assert_array_equal(np.asarray(seg.position)[:used],
                                  np.concatenate([np.arange(n[i]) for i in range(len(n)) if expect_taken[i]]))


def test_segment_grid_holds_every_segment_from_its_row_on():
    """cuDNN's grid (`segment_grid`): each taken segment's cell row starts at or before the segment, the plan cuts
    at the first segment that would not fit, and the cells hold the segments in slot order (what the statistics'
    gather relies on). Checked against a plain loop over many random plans, short prompts included."""
    rng = np.random.default_rng(11)
    for trial in range(40):
        batch, max_len = 16, 12
        capacity = int(rng.choice([12, 24, 48, 96, 192]))
        lengths = rng.integers(0, max_len + 1, size=batch) if trial % 2 else rng.integers(0, 3, size=batch)
        remaining = rng.random(batch) < 0.8
        rows, per_row = segment_grid(capacity, max_len, batch)
        width = capacity // rows
        assert capacity % rows == 0 and width >= max_len
        grid = segment_grid(capacity, max_len, batch)
        taken, start, end = _plan_pass(jnp.asarray(lengths, jnp.int32), jnp.asarray(remaining), capacity, grid)
        # the reference: greedy in index order, stop at the first prompt that overflows or misses the grid
        want, slot, rank = np.zeros(batch, bool), 0, 0
        for i in range(batch):
            if not remaining[i]:
                continue
            if slot + lengths[i] > capacity or (lengths[i] > 0 and (rank // per_row) * width > slot):
                break
            want[i], slot, rank = True, slot + lengths[i], rank + (lengths[i] > 0)
        np.testing.assert_array_equal(taken, want)
        ids = jnp.asarray(rng.integers(0, 256, size=(batch, max_len)), jnp.int32)
        _, seg = _pack(ids, jnp.asarray(lengths, jnp.int32), taken, start, end, capacity, grid)
        real = want & (lengths > 0)
        cells = np.asarray(seg.seqlens).reshape(-1)
        np.testing.assert_array_equal(cells[:real.sum()], lengths[real])
        assert (cells[real.sum():] == -1).all()
        offsets = np.asarray(seg.offsets)
        assert (offsets[:, -1] == -1).all()
        flat = (offsets[:, :-1] + np.arange(rows)[:, None] * width).reshape(-1)[:real.sum()]
        np.testing.assert_array_equal(flat, np.asarray(start)[real])  # row start + offset = the segment's slot
        assert (offsets[:, :-1].reshape(-1)[:real.sum()] >= 0).all()
    assert segment_grid(32768, 1138, 128) == (16, 16)  # the 4B trainer's pass: 16 rows of 2,048 slots


def _emulated_cudnn_attention(q, k, v, q_seqlen=None, kv_seqlen=None, q_offsets=None, kv_offsets=None, *, scale,
                              mask_type, return_residual):
    """What JAX's private cuDNN call computes, written with dense jnp ops for tiny shapes: without offsets plain
    unmasked attention and statistics [B, N, T]; with them JAX's compaction of the [B, M] grid (cells with
    seqlen -1 dropped, offsets made absolute by adding b * T) and causal attention inside each segment, statistics
    [B * M, N, T] at [compacted segment, head, position]. Output slots cuDNN does not write hold 1e4, statistics
    NaN."""
    assert return_residual
    b, t, n, h = q.shape
    rep = lambda x: jnp.repeat(x.astype(jnp.float32), n // x.shape[2], axis=2)
    kf, vf = rep(k), rep(v)
    if q_offsets is None:
        logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kf) * scale
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, -1), vf)
        return out.astype(q.dtype), jax.nn.logsumexp(logits, -1)
    assert q_seqlen is kv_seqlen and q_offsets is kv_offsets  # self-attention of each segment
    m = q_seqlen.shape[1]
    absolute = jnp.where(q_offsets >= 0, q_offsets + jnp.arange(b)[:, None] * t, -1).reshape(-1)
    seqlen, offset = q_seqlen.reshape(-1), absolute
    compact = lambda x: x[jnp.argsort(x < 0, stable=True)]  # non-negative entries first, in order
    seqlen, offset = compact(seqlen)[:b * m], compact(offset)[:b * m]
    slots = jnp.arange(b * t)
    inside = (seqlen[None] >= 0) & (slots[:, None] >= offset[None]) & (slots[:, None] < offset[None] + seqlen[None])
    segment = jnp.where(inside.any(1), jnp.argmax(inside, 1), -1)  # [B*T] compacted segment of each slot
    position = slots - offset[jnp.maximum(segment, 0)]
    qf, kf, vf = q.reshape(b * t, n, h).astype(jnp.float32), kf.reshape(b * t, n, h), vf.reshape(b * t, n, h)
    allowed = (segment[:, None] == segment[None]) & (segment[:, None] >= 0) & (slots[None] <= slots[:, None])
    logits = jnp.where(allowed[None], jnp.einsum("tnh,snh->nts", qf, kf) * scale, -jnp.inf)
    lse = jax.nn.logsumexp(logits, -1)  # [N, B*T]
    out = jnp.einsum("nts,snh->tnh", jnp.exp(logits - lse[..., None]), vf)
    out = jnp.where((segment >= 0)[:, None, None], out, 1e4).reshape(b, t, n, h)  # finite: the dense einsums here
    # multiply every slot's values, even masked ones, by their probability 0
    stats = jnp.full((b * m, n, t), jnp.nan, jnp.float32)
    stats = stats.at[jnp.where(segment >= 0, segment, b * m), :, position].set(lse.T, mode="drop")
    return out.astype(q.dtype), stats


@pytest.mark.parametrize("with_prefix", [True, False])
def test_cudnn_bookkeeping_equals_windowed_with_an_emulated_cudnn(model, monkeypatch, with_prefix):
    """The "cudnn" path's grid, offsets, statistics gather and merge, run against `_emulated_cudnn_attention` on the
    CPU: equal to the windowed form, with segments that run past their grid row and plans the grid cuts short."""
    from types import SimpleNamespace

    from jaxllm import packed_attention

    fake = SimpleNamespace(dot_product_attention=_emulated_cudnn_attention,
                           MaskType=SimpleNamespace(CAUSAL="causal", NO_MASK="none"))
    monkeypatch.setattr(packed_attention, "cudnn_attention_module", lambda: fake)
    params, cache = model
    prefix = cache if with_prefix else None
    ids, lengths = ragged_batch(5, batch=12)
    lengths = lengths.at[2:10].set(1)  # eight one-token prompts: more segments than the grid's first rows hold
    assert segment_grid(6 * T, T, 12)[0] > 1  # several grid rows
    # so the grid cuts the first pass short of all prompts
    assert not _plan_pass(lengths, lengths > 0, 6 * T, segment_grid(6 * T, T, 12))[0][10]
    run = jax.jit(encode_packed, static_argnames=("config", "pooling", "capacity", "attention_impl"))
    with jax.default_matmul_precision("highest"):  # float32 on a GPU too (not TF32)
        for pooling in ("last", "mean"):
            want = run(params, CONFIG, ids, lengths, pooling=pooling, prefix=prefix, capacity=6 * T,
                       attention_impl="xla")
            got = run(params, CONFIG, ids, lengths, pooling=pooling, prefix=prefix, capacity=6 * T,
                      attention_impl="cudnn")
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_pass_sizes_are_the_capacity_a_quarter_and_an_eighth():
    # the trainer's setting (Craftax compact, max_len 1,138): rounded up to 64 tokens
    assert pass_capacities(36864, 1138) == (4608, 9216, 36864)
    assert pass_capacities(32768, 1138) == (4096, 8192, 32768)
    assert pass_capacities(8192, T) == (1024, 2048, 8192)
    assert pass_capacities(6 * T, T) == (18, 6 * T)  # at least one longest prompt, at most half the next size
    assert pass_capacities(2 * T, T) == (T, 2 * T)
    assert pass_capacities(T, T) == (T,)  # no smaller size over half the capacity


def test_pass_size_index_pads_at_most_a_third_else_fills_smaller_passes():
    which = lambda sizes, left: int(pass_size_index(sizes, left))  # noqa: E731
    sizes = (4608, 36864)
    assert [which(sizes, n) for n in (0, 1, 4608)] == [0, 0, 0]  # the small pass holds the rest
    assert [which(sizes, n) for n in (4609, 12000, 24575)] == [0, 0, 0]  # a full pass would pad over a third
    assert [which(sizes, n) for n in (24576, 36864, 36865, 10**6)] == [1, 1, 1, 1]  # full passes
    sizes = (4608, 9216, 36864)
    # 9,216 pads over a third at 5,000 tokens, but two passes of 4,608 would compute as much
    assert [which(sizes, n) for n in (4609, 5000, 9216, 9217, 15000, 24576)] == [1, 1, 1, 1, 1, 2]
    # finer sizes: the smallest that holds the rest while it pads at most a third or steps at most 2x
    assert [which((4, 6, 9, 27), n) for n in (3, 5, 6, 7, 10, 17, 18, 40)] == [0, 1, 1, 2, 2, 2, 3, 3]


def test_small_passes_equal_padded(model):
    # 256 prompts of 9-11 tokens (2,560 in all) in passes of up to 8,192 slots: one of 2,048 filled, one of 1,024
    params, cache = model
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(0, 256, size=(256, T)), jnp.int32)
    lengths = jnp.asarray(np.resize([9, 10, 11], 256), jnp.int32)
    assert int(pass_size_index(pass_capacities(8192, T), 2560)) == 1  # 2,048: the rest in a 1,024 after it
    # float32 products on a GPU too: at these row counts its default precision takes TF32 GEMMs for some dots (an
    # H200 gave 2.5e-4 differences between the two layouts without this)
    with jax.default_matmul_precision("float32"):
        want = _encode(params, CONFIG, ids, lengths, layer=-1, pooling="last", prefix=cache)
        got = _encode_packed(params, CONFIG, ids, lengths, layer=-1, pooling="last", prefix=cache, capacity=8192)
        # sizes given: the same vectors, whatever passes they make (here one 3,072 pass)
        sized = jax.jit(functools.partial(encode_packed, layer=-1, pooling="last", pass_sizes=(1024, 3072, 8192)),
                        static_argnums=1)(params, CONFIG, ids, lengths, prefix=cache)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(sized, want, rtol=2e-5, atol=2e-5)


def test_pass_sizes_that_cannot_hold_a_prompt_are_refused(model):
    params, _ = model
    ids, lengths = ragged_batch(0)
    with pytest.raises(ValueError, match=f"must each hold one prompt of max_len {T}"):
        encode_packed(params, CONFIG, ids, lengths, pass_sizes=(T - 1, 6 * T))
    with pytest.raises(ValueError, match="the largest equal to capacity"):
        encode_packed(params, CONFIG, ids, lengths, capacity=6 * T, pass_sizes=(T, 4 * T))


def test_capacity_smaller_than_a_prompt_is_refused(model):
    params, _ = model
    ids, lengths = ragged_batch(0)
    with pytest.raises(ValueError, match=f"max_len {T}"):
        encode_packed(params, CONFIG, ids, lengths, capacity=T - 1)


def test_packed_inside_scan_and_vmap_free_of_callbacks(model):
    params, cache = model
    ids = jnp.stack([ragged_batch(s)[0] for s in (4, 5)])
    lengths = jnp.stack([ragged_batch(s)[1] for s in (4, 5)])

    @jax.jit
    def rollout(params, cache, ids, lengths):
        step = lambda c, x: (c, encode_packed(params, CONFIG, x[0], x[1], pooling="last", prefix=cache,
                                              capacity=32))
        return jax.lax.scan(step, 0, (ids, lengths))[1]

    out = rollout(params, cache, ids, lengths)
    for s in range(2):
        want = _encode(params, CONFIG, ids[s], lengths[s], layer=-1, pooling="last", prefix=cache)
        np.testing.assert_allclose(out[s], want, rtol=2e-5, atol=2e-5)
    assert "callback" not in str(jax.make_jaxpr(rollout)(params, cache, ids, lengths))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's packed attention needs a (Hopper) GPU")
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_cudnn_packed_equals_windowed_on_gpu(pooling):
    """bf16 on the GPU: the cuDNN packed-layout attention gives the windowed XLA form's vectors (and encode's)."""
    config = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0)
    params = init_params(config, jnp.bfloat16, 0)
    rng = np.random.default_rng(7)
    cache = jax.jit(prefill, static_argnums=1)(params, config, jnp.asarray(rng.integers(0, 256, 40), jnp.int32))
    ids = jnp.asarray(rng.integers(0, 256, size=(16, 96)), jnp.int32)
    lengths = jnp.asarray(rng.integers(0, 97, size=16), jnp.int32).at[0].set(96).at[1].set(0)
    from jaxllm.packed_attention import default_packed_attention_impl

    if int(str(jax.devices()[0].compute_capability).split(".")[0]) < 9:
        pytest.skip("cuDNN's packed layout needs Hopper or later")
    assert default_packed_attention_impl(jnp.bfloat16) == "cudnn"  # the probe passes on this JAX and GPU
    run = jax.jit(encode_packed, static_argnames=("config", "pooling", "capacity", "attention_impl"))
    ref = np.asarray(run(params, config, ids, lengths, pooling=pooling, prefix=cache, capacity=512,
                         attention_impl="xla"), np.float64)
    got = np.asarray(run(params, config, ids, lengths, pooling=pooling, prefix=cache, capacity=512,
                         attention_impl="cudnn"), np.float64)
    padded = np.asarray(_encode(params, config, ids, lengths, layer=-1, pooling=pooling, prefix=cache), np.float64)
    scale = np.abs(ref).max()
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 2e-2 * scale  # bf16 activations, two attention kernels
    assert np.abs(padded - ref).max() <= 2e-2 * scale


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's packed attention and fp8 kernels need a GPU")
def test_fp8_packed_attention_merged_in_the_quantisation_on_gpu(monkeypatch):
    """fp8 on the GPU: o_proj's input from the kernel that merges cuDNN's two halves as it quantises them
    (`FUSED_MERGE_QUANTIZE`, the default) gives the vectors of XLA's merge followed by the quantisation kernel, up to
    the rare value a contracted multiply-add rounds to the neighbouring bf16 step."""
    from jaxllm import packed_attention
    from jaxllm.fp8 import native_fp8_available, quantize_params

    if not native_fp8_available() or packed_attention.default_packed_attention_impl(jnp.bfloat16) != "cudnn":
        pytest.skip("needs FP8 tensor cores and cuDNN's packed layout (Hopper)")
    config = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0)
    params = quantize_params(init_params(config, jnp.bfloat16, 0))
    rng = np.random.default_rng(9)
    cache = jax.jit(prefill, static_argnums=1)(params, config, jnp.asarray(rng.integers(0, 256, 40), jnp.int32))
    ids = jnp.asarray(rng.integers(0, 256, size=(16, 96)), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, 97, size=16), jnp.int32)
    vectors = {}
    for fused in (True, False):
        monkeypatch.setattr(packed_attention, "FUSED_MERGE_QUANTIZE", fused)
        jax.clear_caches()  # the setting is read while tracing: no trace of the other setting may be reused
        run = jax.jit(lambda p, i, n, c: encode_packed(p, config, i, n, prefix=c, capacity=512))
        text = run.lower(params, ids, lengths, cache).as_text()
        assert ("merge_quantize" in text) == fused
        vectors[fused] = np.asarray(run(params, ids, lengths, cache), np.float64)
    got, want = vectors[True], vectors[False]
    assert np.isfinite(got).all()
    cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosine.min() >= 0.9999


def test_cudnn_packed_probe_falls_back_with_one_warning(monkeypatch):
    """A JAX whose private cuDNN call changed: the probe says so once and packed attention takes the XLA form."""
    from jaxllm import packed_attention

    def changed(*args, **kwargs):
        raise TypeError("dot_product_attention() got an unexpected keyword argument 'q_offsets'")

    monkeypatch.setattr(packed_attention, "_cudnn_attention", changed)
    with pytest.warns(RuntimeWarning, match="windowed XLA attention") as record:
        assert not packed_attention._cudnn_packed_available.__wrapped__()
    assert len(record) == 1


def test_trainer_refuses_a_capacity_below_the_templates_max_len(templates):
    from rl.llm import make_inscan_encoder

    tpl = templates[("Craftax-Classic-Symbolic-v1", "compact")]
    with pytest.raises(ValueError, match=rf"--llm-capacity 100 .*max_len {tpl.max_len}"):
        make_inscan_encoder(tpl, CONFIG, layer=-1, pooling="last", method="packed", capacity=100)
    make_inscan_encoder(tpl, CONFIG, layer=-1, pooling="last", method="packed", capacity=tpl.max_len)  # fine


def test_cudnn_halves_merge_by_their_log_sum_exps(monkeypatch):
    """The "cudnn" implementation's merge of its two calls (cuDNN itself replaced by made-up outputs and
    statistics, so it runs on a CPU), against numpy: each head's prefix and packed halves weighted by
    exp(log-sum-exp); an empty slot (not valid, or its statistic -inf) takes the prefix half alone, whatever bits
    its packed half holds."""
    import enum
    import types

    from jaxllm import packed_attention as pa

    c, rows, cells, heads, hd = 32, 2, 8, 4, 16
    rng = np.random.default_rng(0)
    out_r = rng.standard_normal((1, c, heads, hd)).astype(np.float32)
    out_p = rng.standard_normal((1, c, heads, hd)).astype(np.float32)
    lse_r = rng.standard_normal((cells, heads, c // rows)).astype(np.float32) * 2  # cuDNN's per-cell layout
    lse_p = rng.standard_normal((1, heads, c)).astype(np.float32) * 2
    rank, position = rng.integers(0, cells, c), rng.integers(0, c // rows, c)
    valid = np.ones(c, bool)
    valid[[3, 20]] = False
    out_r[0, 3] = np.nan  # an empty slot's packed half is undefined
    lse_r[rank[11], :, position[11]] = -np.inf  # and a slot cuDNN left without a statistic
    out_r[0, 11] = np.nan

    class MaskType(enum.Enum):
        CAUSAL = 1
        NO_MASK = 2

    def dot_product_attention(q, k, v, *, mask_type, **kwargs):
        if mask_type is MaskType.CAUSAL:
            assert q.shape == (rows, c // rows, heads, hd)  # the packed call sees the grid's rows
            return jnp.asarray(out_r, q.dtype).reshape(q.shape), jnp.asarray(lse_r)
        return jnp.asarray(out_p, q.dtype), jnp.asarray(lse_p)

    fake = types.SimpleNamespace(dot_product_attention=dot_product_attention, MaskType=MaskType)
    monkeypatch.setattr(pa, "cudnn_attention_module", lambda: fake)
    seg = pa.Segments(segment=jnp.zeros(c, jnp.int32), valid=jnp.asarray(valid), position=jnp.asarray(position),
                      rank=jnp.asarray(rank), seqlens=jnp.zeros((rows, cells // rows), jnp.int32),
                      offsets=jnp.zeros((rows, cells // rows + 1), jnp.int32), max_len=8)
    q = jnp.zeros((1, c, heads, hd), jnp.float32)
    kv, prefix_kv = jnp.zeros((1, c, 2, hd), jnp.float32), jnp.zeros((5, 2, hd), jnp.float32)
    got = np.asarray(pa.packed_attention(q, kv, kv, prefix_kv, prefix_kv, seg, "cudnn"))

    slot_lse_r = lse_r[rank, :, position]  # [C, heads]
    slot_lse_p = lse_p[0].T
    empty = ~valid[:, None] | ~np.isfinite(slot_lse_r)
    e_p = np.exp(slot_lse_p)
    e_r = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, slot_lse_r)))
    rest = np.where(empty[..., None], 0.0, np.nan_to_num(out_r[0]))
    want = (out_p[0] * e_p[..., None] + rest * e_r[..., None]) / (e_p + e_r)[..., None]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    without_prefix = np.asarray(pa.packed_attention(q, kv, kv, None, None, seg, "cudnn"))
    np.testing.assert_array_equal(without_prefix, out_r)
