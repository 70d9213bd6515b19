"""The pure `encode`/`prefill` functions inside jit, vmap and lax.scan; layer truncation; deterministic init."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import PrefixCache, Qwen3Config, encode, init_params, load_model, prefill

CONFIG = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0)


@pytest.fixture(scope="module")
def setup():
    params = init_params(CONFIG, jnp.float32, 0)
    rng = np.random.default_rng(0)
    head = jnp.asarray(rng.integers(0, 256, size=5), jnp.int32)
    ids = jnp.asarray(rng.integers(0, 256, size=(2, 3, 6)), jnp.int32)  # [steps, B, T]
    lengths = jnp.asarray(rng.integers(1, 7, size=(2, 3)), jnp.int32)
    cache = jax.jit(prefill, static_argnums=1)(params, CONFIG, head)
    return params, cache, ids, lengths


def direct(params, cache, ids, lengths, pooling="mean"):
    return jax.jit(encode, static_argnames=("config", "layer", "pooling"))(
        params, CONFIG, ids, lengths, layer=-2, pooling=pooling, prefix=cache)


def test_encode_inside_scan_with_traced_params_and_cache(setup):
    params, cache, ids, lengths = setup

    @jax.jit
    def rollout(params, cache, ids, lengths):
        def step(carry, xs):
            vec = encode(params, CONFIG, xs[0], xs[1], layer=-2, pooling="mean", prefix=cache)
            return carry + vec.sum(), vec
        return jax.lax.scan(step, jnp.float32(0), (ids, lengths))

    total, vecs = rollout(params, cache, ids, lengths)
    for s in range(ids.shape[0]):
        np.testing.assert_allclose(vecs[s], direct(params, cache, ids[s], lengths[s]), rtol=1e-5, atol=1e-6)
    assert "callback" not in str(jax.make_jaxpr(rollout)(params, cache, ids, lengths))


def test_encode_under_vmap(setup):
    params, cache, ids, lengths = setup
    batched = jax.jit(jax.vmap(lambda i, n: encode(params, CONFIG, i, n, layer=-2, pooling="mean", prefix=cache)))
    out = batched(ids, lengths)
    for s in range(ids.shape[0]):
        np.testing.assert_allclose(out[s], direct(params, cache, ids[s], lengths[s]), rtol=1e-5, atol=1e-6)


def test_prefix_cache_is_a_pytree_with_static_length(setup):
    _, cache, _, _ = setup
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 4 and cache.length == 5
    assert cache.keys.shape == (3, 5, 2, 8) and cache.hidden_sums.shape == (4, 32)
    assert cache.hidden_sums.dtype == jnp.float32
    assert isinstance(jax.tree_util.tree_unflatten(treedef, leaves), PrefixCache)


@pytest.mark.parametrize("layer", [0, 1])
def test_hidden_state_k_runs_only_the_first_k_layers(setup, layer):
    params, _, ids, lengths = setup
    poisoned = jax.tree.map(lambda a: a.at[layer:].set(jnp.nan), params["layers"])
    poisoned = {**params, "layers": poisoned, "norm": jnp.full_like(params["norm"], jnp.nan)}
    got = encode(poisoned, CONFIG, ids[0], lengths[0], layer=layer)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(got, encode(params, CONFIG, ids[0], lengths[0], layer=layer))


def test_final_state_uses_the_final_norm(setup):
    params, _, ids, lengths = setup
    scaled = {**params, "norm": params["norm"] * 2}
    np.testing.assert_allclose(encode(scaled, CONFIG, ids[0], lengths[0]),
                               2 * encode(params, CONFIG, ids[0], lengths[0]), rtol=1e-6)
    np.testing.assert_array_equal(encode(scaled, CONFIG, ids[0], lengths[0], layer=-2),
                                  encode(params, CONFIG, ids[0], lengths[0], layer=-2))


_FINGERPRINT = ("import jax.numpy as jnp, numpy as np; from jaxllm import load_model; m = load_model('tiny'); "
                "print(repr([float(np.asarray(x, np.float64).sum()) for x in "
                "(m.params['embed_tokens'], m.params['layers']['down_proj'], m.params['norm'])]))")


def test_tiny_preset_is_the_same_model_in_every_process():
    model = load_model("tiny")
    assert model.dtype == jnp.float32 and model.config.vocab_size == 151936
    here = [float(np.asarray(x, np.float64).sum()) for x in
            (model.params["embed_tokens"], model.params["layers"]["down_proj"], model.params["norm"])]
    out = subprocess.run([sys.executable, "-c", _FINGERPRINT], capture_output=True, text=True, check=True)
    assert eval(out.stdout.strip().splitlines()[-1]) == here
    std = float(np.asarray(model.params["layers"]["q_proj"]).std())
    assert abs(std - 0.02) < 0.001 and float(here[2]) == 64.0
    other_seed = load_model("tiny", seed=1)
    assert not np.array_equal(other_seed.params["embed_tokens"], model.params["embed_tokens"])
    bf16 = load_model("tiny", dtype="bfloat16")
    np.testing.assert_array_equal(bf16.params["norm"], model.params["norm"])
    np.testing.assert_allclose(np.asarray(bf16.params["embed_tokens"], np.float32),
                               model.params["embed_tokens"], rtol=2 ** -8)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_split_prefix_attention_matches_masked_attention(setup, pooling):
    """The log-sum-exp merge used by the "cudnn_split" GPU path, run with XLA attention on the CPU."""
    params, cache, ids, lengths = setup
    run = jax.jit(encode, static_argnames=("config", "layer", "pooling", "attention_impl"))
    masked = run(params, CONFIG, ids[0], lengths[0], pooling=pooling, prefix=cache, attention_impl="xla")
    split = run(params, CONFIG, ids[0], lengths[0], pooling=pooling, prefix=cache, attention_impl="xla_split")
    np.testing.assert_allclose(split, masked, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attention implementation must be one of"):
        run(params, CONFIG, ids[0], lengths[0], prefix=cache, attention_impl="flash")


def test_cudnn_split_falls_back_to_public_attention_with_one_warning(monkeypatch):
    """A JAX whose private cuDNN attention changed (here: its signature) makes the GPU default the public masked
    path ('cudnn'), with one warning; a working one keeps 'cudnn_split'. That the public masked path's vectors
    equal the split path's: `test_split_prefix_attention_matches_masked_attention`."""
    import warnings

    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from jaxllm import model

    monkeypatch.setattr(model.jax, "default_backend", lambda: "gpu")

    def changed(q, k, v, *, scale, mask_type):  # e.g. a JAX without `return_residual`
        raise AssertionError("not reached: the call has an unexpected keyword")

    def working(q, k, v, *, scale, mask_type, return_residual):
        b, t, h, _ = q.shape
        return q, jnp.zeros((b, h, t), jnp.float32)

    for fake, expect, warned in ((changed, "cudnn", 1), (working, "cudnn_split", 0)):
        monkeypatch.setattr(cudnn, "dot_product_attention", fake)
        model._cudnn_lse_available.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [model.default_attention_impl(jnp.bfloat16) for _ in range(3)] == [expect] * 3
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == warned, messages
        assert all("TypeError" in m and "'cudnn'" in m for m in messages)
    model._cudnn_lse_available.cache_clear()


def test_length_buckets_are_static_increasing_and_end_at_max_len():
    from jaxllm import length_buckets

    assert length_buckets(1138) == (192, 256, 384, 512, 768, 1138)
    assert length_buckets(40) == (40,)
    for t in (100, 454, 2588):
        b = length_buckets(t)
        assert b[-1] == t and list(b) == sorted(set(b)) and all(x % 64 == 0 for x in b[:-1])


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_encode_bucketed_equals_encode(pooling):
    """Sorting, chunking and cutting the padding to a bucket must not change any vector (rows come back in order)."""
    from jaxllm import encode_bucketed

    params = init_params(CONFIG, jnp.float32, 0)
    rng = np.random.default_rng(1)
    cache = jax.jit(prefill, static_argnums=1)(params, CONFIG, jnp.asarray(rng.integers(0, 256, size=7), jnp.int32))
    batch, t = 12, 40
    ids = jnp.asarray(rng.integers(0, 256, size=(batch, t)), jnp.int32)
    # Mixed lengths so that chunks land in different buckets (including the empty rest and the full length).
    lengths = jnp.asarray([3, 40, 0, 17, 9, 25, 1, 31, 12, 5, 38, 20], jnp.int32)
    want = jax.jit(encode, static_argnames=("config", "layer", "pooling"))(
        params, CONFIG, ids, lengths, layer=-1, pooling=pooling, prefix=cache)
    got = jax.jit(encode_bucketed, static_argnames=("config", "layer", "pooling", "chunk", "buckets"))(
        params, CONFIG, ids, lengths, layer=-1, pooling=pooling, prefix=cache, chunk=4, buckets=(8, 16, 24))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
