"""FP8 (W8A8 e4m3) matmuls: the quantisation against a NumPy reference, and the model's fidelity to float32."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm import Qwen3Config, encode_packed, load_model
from jaxllm.fp8 import Fp8Matrix, dequantize_matrix, fp8_matmul, linear, native_fp8_available, quantize_matrix

MID = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, rope_theta=10_000.0)


def numpy_w8a8(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The W8A8 product computed independently: per-row / per-column absmax scales, e4m3 rounding by ml_dtypes,
    float64 products."""
    e4m3 = ml_dtypes.float8_e4m3fn
    top = float(ml_dtypes.finfo(e4m3).max)
    sx = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / top, 1e-12)
    sw = np.maximum(np.abs(w).max(axis=0, keepdims=True) / top, 1e-12)
    xq = (x / sx).astype(np.float32).astype(e4m3).astype(np.float64)
    wq = (w / sw).astype(np.float32).astype(e4m3).astype(np.float64)
    return (xq @ wq) * sx * sw


def test_fp8_matmul_matches_numpy_reference():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 48)) * rng.uniform(0.01, 30, size=(3, 5, 1))).astype(np.float32)
    w = (rng.standard_normal((48, 40)) * rng.uniform(0.001, 2, size=(1, 40))).astype(np.float32)
    got = np.asarray(fp8_matmul(jnp.asarray(x), quantize_matrix(jnp.asarray(w))))
    np.testing.assert_allclose(got, numpy_w8a8(x, w), rtol=1e-5, atol=1e-6 * np.abs(got).max())


def test_fp8_matmul_of_bf16_activations_rounds_the_unscaled_product_to_bf16():
    """16-bit activations: the GEMM writes the unscaled float32 product rounded to bfloat16 (as cuBLASLt does with
    a bf16 output), then both scales apply in float32 and the result is rounded to bfloat16 again."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 64)) * rng.uniform(0.05, 20, size=(4, 1))).astype(np.float32)
    w = (rng.standard_normal((64, 24)) * rng.uniform(0.01, 2, size=(1, 24))).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    got = fp8_matmul(xb, quantize_matrix(jnp.asarray(w)))
    assert got.dtype == jnp.bfloat16
    e4m3, bf16 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16
    xr = np.asarray(xb, np.float32)
    sx = np.maximum(np.abs(xr).max(-1, keepdims=True) / 448.0, 1e-12).astype(np.float32)
    sw = np.maximum(np.abs(w).max(0, keepdims=True) / 448.0, 1e-12).astype(np.float32)
    xq = (xr / sx).astype(e4m3).astype(np.float64)
    wq = (w / sw).astype(e4m3).astype(np.float64)
    unscaled = (xq @ wq).astype(np.float32).astype(bf16).astype(np.float32)
    want = (unscaled * (sx * sw)).astype(bf16).astype(np.float32)
    # float32 accumulation order may move the unscaled product by an ulp of float32 before its bf16 rounding:
    # allow one bf16 ulp (2^-8 relative) on top of the output rounding
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2.0 ** -7, atol=1e-6 * np.abs(want).max())


def test_quantized_matrix_layout_and_rounding():
    w = jax.random.normal(jax.random.key(1), (2, 24, 16)) * jnp.linspace(0.1, 3, 16)
    m = quantize_matrix(w)
    assert m.weight.dtype == jnp.float8_e4m3fn and m.weight.shape == (2, 16, 24) and m.shape == (2, 24, 16)
    assert m.scale.shape == (2, 16)
    back = dequantize_matrix(m)
    # e4m3 keeps 3 mantissa bits: relative rounding <= 2^-4 for normal values, absolute <= scale * 2^-9 below
    bound = 2.0 ** -4 * jnp.abs(w) + m.scale[:, None, :] * 2.0 ** -9
    assert bool(jnp.all(jnp.abs(back - w) <= bound))
    zeros = quantize_matrix(jnp.zeros((4, 3)))  # an all-zero column quantises to zeros, not NaN
    assert np.isfinite(np.asarray(dequantize_matrix(zeros))).all()


def test_linear_dispatches_on_the_weight_type():
    x = jax.random.normal(jax.random.key(2), (4, 8))
    w = jax.random.normal(jax.random.key(3), (8, 6))
    np.testing.assert_array_equal(linear(x, w), x @ w)
    assert isinstance(quantize_matrix(w), Fp8Matrix)
    np.testing.assert_allclose(linear(x, quantize_matrix(w)), x @ w, rtol=0.1, atol=0.15)


def cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("name", ["tiny", "mid"])
def test_fp8_model_stays_close_to_float32(name):
    config = MID if name == "mid" else "tiny"
    if native_fp8_available():
        fp8 = load_model(config, dtype="fp8")
    else:
        with pytest.warns(UserWarning, match="emulated"):
            fp8 = load_model(config, dtype="fp8")
    ref = load_model(config, dtype="float32")
    assert fp8.quantization == "fp8" and fp8.dtype == jnp.bfloat16
    assert isinstance(fp8.params["layers"]["down_proj"], Fp8Matrix)
    vocab = (MID if name == "mid" else ref.config).vocab_size
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, vocab, size=(4, 24)), jnp.int32)
    lengths = jnp.asarray([24, 17, 9, 1], jnp.int32)
    prefix = jnp.asarray(rng.integers(0, vocab, size=10), jnp.int32)
    got = fp8.encode(ids, lengths, prefix=fp8.prefill(prefix))
    want = ref.encode(ids, lengths, prefix=ref.prefill(prefix))
    assert cosine(got, want).min() >= 0.99
    # the packed path runs the same fp8 matmuls
    packed = jax.jit(encode_packed, static_argnames=("config", "capacity"))(
        fp8.params, fp8.config, ids, lengths, prefix=fp8.prefill(prefix), capacity=64)
    np.testing.assert_allclose(packed, got, rtol=0.05, atol=0.05 * float(jnp.abs(got).max()))
    assert cosine(packed, got).min() >= 0.999


def test_fp8_is_refused_as_a_dtype_name_typo():
    with pytest.raises(ValueError, match="'fp8'"):
        load_model("tiny", dtype="fp16x")
