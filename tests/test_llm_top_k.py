"""jaxllm.top_k: the router's top-k kernel (Pallas's interpreter on a CPU, compiled on a GPU) against lax.top_k,
bit for bit, ties included; the MoE router through it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.top_k import router_top_k_pallas, top_k_pallas, top_k_rows

ON_GPU = jax.default_backend() == "gpu"


def _probs(n: int, width: int, seed: int, levels: int | None = None) -> jax.Array:
    """Router-like rows: a softmax of random logits; with `levels`, the logits take only that many values, so most
    rows hold ties (also at the k-th place)."""
    logits = jax.random.normal(jax.random.key(seed), (n, width), jnp.float32) * 2
    if levels is not None:
        logits = jnp.round(logits * levels / 4) * 4 / levels
    return jax.nn.softmax(logits, axis=-1)


def _assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32), np.asarray(want[0]).view(np.uint32))


@pytest.mark.parametrize("n, width, k, rows, levels", [
    (37, 16, 4, 8, None),   # rows no multiple of the block
    (29, 16, 4, 8, 2),      # ties everywhere: the lower column first
    (20, 6, 2, 4, 3),       # a width that is no power of two (padded with -inf)
    (9, 8, 1, 16, None),    # top-1, fewer rows than a block
    (12, 8, 3, 4, 1),       # k no power of two
    (5, 4, 4, 2, None),     # k = the whole row: a descending sort
])
def test_pallas_top_k_equals_lax_interpreted(n, width, k, rows, levels):
    values = _probs(n, width, seed=n, levels=levels)
    _assert_same(top_k_pallas(values, k, interpret=True, rows=rows), jax.lax.top_k(values, k))


def test_top_k_names_what_it_cannot_take():
    with pytest.raises(ValueError, match="top-k impl must be one of"):
        top_k_rows(jnp.zeros((2, 4)), 1, "sort")
    with pytest.raises(ValueError, match="k must be between 1 and the row width 4"):
        top_k_pallas(jnp.zeros((2, 4)), 5, interpret=True)


def test_top_k_rows_is_lax_top_k_off_a_gpu():
    values = _probs(11, 16, seed=3, levels=2)
    _assert_same(top_k_rows(values, 4), jax.lax.top_k(values, 4))
    _assert_same(top_k_rows(values, 4, "xla"), jax.lax.top_k(values, 4))


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
@pytest.mark.parametrize("levels", [None, 3])
def test_compiled_top_k_equals_lax_at_the_30b_router_shape(levels):
    """Qwen3-30B-A3B's router: 128 experts, 8 per token, a 32,768-token pass (and a pass that is no block
    multiple)."""
    for n in (32768, 4099):
        values = _probs(n, 128, seed=n, levels=levels)
        _assert_same(top_k_rows(values, 8), jax.lax.top_k(values, 8))


def test_tiny_moe_routes_through_the_kernel_unchanged(monkeypatch):
    """tiny-moe's packed encode with the router's top-k on the kernel (forced on, interpreted) equals the encode
    with lax.top_k bit for bit; the router called the kernel on its [tokens, experts] probabilities."""
    from jaxllm import encode_packed, load_model, moe

    model = load_model("tiny-moe", dtype="float32")
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, 150000, size=(3, 16)), jnp.int32)
    lengths = jnp.asarray([16, 9, 3], jnp.int32)
    run = lambda: np.asarray(jax.jit(  # noqa: E731  (a fresh function: the top-k is chosen at trace time)
        lambda p, i, n: encode_packed(p, model.config, i, n, capacity=32))(model.params, ids, lengths))
    monkeypatch.setattr(moe, "FUSED_ROUTER", False)  # the route through top_k_rows (a GPU's default fuses it)
    want = run()
    calls = []
    monkeypatch.setattr(moe, "top_k_rows",
                        lambda v, k: calls.append(v.shape) or top_k_pallas(v, k, interpret=True, rows=8))
    got = run()
    assert calls and all(shape[-1] == model.config.num_experts for shape in calls)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _route_after_logits(logits: jax.Array, k: int, normalize: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """`jaxllm.moe.route` after its logits, as XLA runs it: softmax in float32, lax.top_k, the renormalisation."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(dtype), experts


@pytest.mark.parametrize("n, width, k, rows, levels, normalize, dtype", [
    (37, 16, 4, 8, None, True, jnp.bfloat16),   # rows no multiple of the block, bf16 logits and weights
    (29, 16, 4, 8, 2, False, jnp.bfloat16),     # ties everywhere, no renormalisation
    (20, 6, 2, 4, 3, True, jnp.float32),        # a width that is no power of two (padded with -inf)
    (9, 8, 1, 16, None, True, jnp.float32),     # top-1: a weight of 1 after the renormalisation
])
def test_router_kernel_equals_softmax_top_k_and_renormalisation_interpreted(n, width, k, rows, levels, normalize,
                                                                            dtype):
    """`router_top_k_pallas` (Pallas's interpreter) against XLA's softmax, lax.top_k and division, bit for bit."""
    logits = (jnp.log(_probs(n, width, seed=n + 1, levels=levels)) * 3).astype(dtype)
    got = router_top_k_pallas(logits, k, normalize, dtype, interpret=True, rows=rows)
    want = _route_after_logits(logits, k, normalize, dtype)
    assert got[0].dtype == dtype
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
def test_compiled_router_kernel_matches_xla_at_the_30b_router_shape():
    """Qwen3-30B-A3B's router after its logits (128 experts, 8 per token, bf16): Triton's exp and XLA's may differ
    in the last bit, so an expert may swap with its neighbour where two probabilities are that close (rare), and a
    weight may move by one bf16 step."""
    logits = (jax.random.normal(jax.random.key(2), (4099, 128)) * 2).astype(jnp.bfloat16)
    got = router_top_k_pallas(logits, 8, True, jnp.bfloat16)
    want = _route_after_logits(logits, 8, True, jnp.bfloat16)
    assert (np.asarray(got[1]) != np.asarray(want[1])).any(axis=1).mean() <= 1e-3
    same = (np.asarray(got[1]) == np.asarray(want[1])).all(axis=1)
    np.testing.assert_allclose(np.asarray(got[0], np.float32)[same], np.asarray(want[0], np.float32)[same],
                               rtol=2.0 ** -7)


def test_moe_block_routes_through_the_fused_router_kernel(monkeypatch):
    """`moe.FUSED_ROUTER` (the default; the kernel interpreted, as if on a GPU): tiny-moe's packed encode equals
    the XLA route's bit for bit; the router called the kernel on its [tokens, experts] logits."""
    from jaxllm import encode_packed, load_model, moe, top_k

    model = load_model("tiny-moe", dtype="float32")
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(0, 150000, size=(3, 16)), jnp.int32)
    lengths = jnp.asarray([16, 9, 3], jnp.int32)
    run = lambda: np.asarray(jax.jit(  # noqa: E731  (a fresh function: the route is chosen at trace time)
        lambda p, i, n: encode_packed(p, model.config, i, n, capacity=32))(model.params, ids, lengths))
    monkeypatch.setattr(moe, "FUSED_ROUTER", False)  # the XLA route, wherever this runs
    want = run()
    calls = []
    kernel = top_k.router_top_k_pallas
    monkeypatch.setattr(moe, "FUSED_ROUTER", True)
    monkeypatch.setattr(moe, "router_top_k_pallas",
                        lambda v, *a: calls.append(v.shape) or kernel(v, *a, interpret=True, rows=8))
    monkeypatch.setattr(moe, "_on_gpu", lambda: True)  # the route only: the rest keeps its CPU forms
    got = run()
    assert calls and all(shape[-1] == model.config.num_experts for shape in calls)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
