"""jaxllm.top_k: the router's top-k kernel (Pallas's interpreter on a CPU, compiled on a GPU) against lax.top_k,
bit for bit, ties included; the MoE router through it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.top_k import top_k_pallas, top_k_rows

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
    want = run()
    calls = []
    monkeypatch.setattr(moe, "top_k_rows",
                        lambda v, k: calls.append(v.shape) or top_k_pallas(v, k, interpret=True, rows=8))
    got = run()
    assert calls and all(shape[-1] == model.config.num_experts for shape in calls)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
