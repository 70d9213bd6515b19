"""Several hidden-state layers from one pass (issue 36): `encode`, `encode_bucketed` and `encode_packed` with a
tuple of layers give, per layer, exactly what a single-layer call gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import Qwen3Config, encode, encode_bucketed, encode_packed, init_params, prefill
from jaxllm.compile import jit

CONFIG = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0)
T = 12
LAYERS = (1, 0, 3, -2)  # out of order, the embeddings, the final post-norm state, a negative index
FUNCS = {"padded": (encode, {}), "bucketed": (encode_bucketed, {"chunk": 2}), "packed": (encode_packed, {"capacity": 3 * T})}


@pytest.fixture(scope="module")
def model():
    params = init_params(CONFIG, jnp.float32, 0)
    head = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=5), jnp.int32)
    return params, jit(prefill, static_argnums=1)(params, CONFIG, head)


@pytest.mark.parametrize("method", list(FUNCS))
@pytest.mark.parametrize("pooling, with_prefix", [("last", True), ("mean", False)])
def test_several_layers_equal_single_layer_calls(model, method, pooling, with_prefix):
    params, cache = model
    prefix = cache if with_prefix else None
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 256, size=(6, T)), jnp.int32)
    lengths = jnp.asarray([5, 0, T, 3, 7, 1], jnp.int32)
    fn, kw = FUNCS[method]
    call = jax.jit(lambda p, i, n, c, layer: fn(p, CONFIG, i, n, layer=layer, pooling=pooling, prefix=c, **kw),
                   static_argnames="layer")
    many = np.asarray(call(params, ids, lengths, prefix, LAYERS))
    assert many.shape == (6, len(LAYERS), CONFIG.hidden_size)
    for j, layer in enumerate(LAYERS):
        one = np.asarray(call(params, ids, lengths, prefix, layer))
        np.testing.assert_array_equal(many[:, j], one, err_msg=f"layer {layer}")


def test_a_layer_past_the_depth_is_refused(model):
    params, _ = model
    with pytest.raises(ValueError, match="layer=9 is out of range"):
        encode(params, CONFIG, jnp.zeros((1, 4), jnp.int32), jnp.ones(1, jnp.int32), layer=(1, 9))
