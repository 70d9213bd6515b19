"""FP8 (W8A8 e4m3) matmuls: the quantisation against a NumPy reference, and the model's fidelity to float32."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm import Qwen3Config, encode, encode_packed, fp8, fp8_kernels, load_model
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
    # on a GPU the two paths attend with different cuDNN calls (packed vs split); their last-bit differences flip
    # e4m3 roundings in later layers (H100, 2026-11-27: min cosine 0.9987 at this 6-layer shape)
    assert cosine(packed, got).min() >= 0.998


def test_fp8_is_refused_as_a_dtype_name_typo():
    with pytest.raises(ValueError, match="'fp8'"):
        load_model("tiny", dtype="fp16x")


def numpy_fp8_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """The W8A8 SwiGLU MLP computed independently (float64, e4m3 rounding by ml_dtypes): x and down's input
    quantised per row, the weights per output channel, gate/up/product unrounded between the GEMMs."""
    e4m3 = ml_dtypes.float8_e4m3fn
    top = float(ml_dtypes.finfo(e4m3).max)

    def rows(a):
        s = np.maximum(np.abs(a).max(axis=-1, keepdims=True) / top, 1e-12)
        return (a / s).astype(np.float32).astype(e4m3).astype(np.float64), s

    def columns(w):
        s = np.maximum(np.abs(w).max(axis=0, keepdims=True) / top, 1e-12)
        return (w / s).astype(np.float32).astype(e4m3).astype(np.float64), s

    (xq, sx), (gq, sg), (uq, su), (dq, sd) = rows(x), columns(gate), columns(up), columns(down)
    g, u = (xq @ gq) * sx * sg, (xq @ uq) * sx * su
    hq, sh = rows(g / (1 + np.exp(-g)) * u)
    return (hq @ dq) * sh * sd


def test_fp8_mlp_matches_numpy_reference():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 7, 32)) * rng.uniform(0.05, 20, size=(2, 7, 1))).astype(np.float32)
    gate, up, down = (rng.standard_normal(shape).astype(np.float32) * 0.3 for shape in ((32, 48), (32, 48), (48, 32)))
    got = np.asarray(fp8.mlp(jnp.asarray(x), *(quantize_matrix(jnp.asarray(w)) for w in (gate, up, down))))
    want = numpy_fp8_mlp(x, gate, up, down)
    # float32 vs float64 arithmetic can move a value across an e4m3 rounding boundary: one step there is 2^-3
    # relative for that element, diluted over the 48-term down product
    np.testing.assert_allclose(got, want, rtol=0.02, atol=0.02 * np.abs(want).max())
    plain = np.asarray(fp8.mlp(jnp.asarray(x), *(jnp.asarray(w) for w in (gate, up, down))))
    silu = lambda a: a / (1 + np.exp(-a))
    np.testing.assert_allclose(plain, (silu(x @ gate) * (x @ up)) @ down, rtol=1e-4, atol=1e-4 * np.abs(plain).max())


@pytest.mark.parametrize("rows, width, block_rows, chunk", [(5, 96, 1, 512), (7, 200, 2, 64), (3, 48, 4, 16)])
def test_pallas_quantisation_kernels_equal_their_xla_forms(rows, width, block_rows, chunk):
    """The one-pass GPU kernels, run by Pallas's interpreter: bit-equal to the XLA forms the CPU path uses, for
    widths that are not powers of two (slices of `chunk`, then the remainder's binary parts) and row counts that
    are not multiples of the rows per program."""
    keys = jax.random.split(jax.random.key(rows * width), 5)
    gate = jax.random.normal(keys[0], (rows, width), jnp.bfloat16) * 4
    up = jax.random.normal(keys[1], (rows, width), jnp.bfloat16)
    x_scale = jax.random.uniform(keys[2], (rows,), minval=0.01, maxval=2.0)
    gate_scale, up_scale = (jax.random.uniform(k, (width,), minval=0.1, maxval=1.0) for k in keys[3:])
    tuning = dict(interpret=True, rows=block_rows, chunk=chunk)
    got = fp8_kernels.swiglu_quantize_pallas(gate, up, x_scale, gate_scale, up_scale, **tuning)
    want = fp8.swiglu_quantize_reference(gate, up, x_scale, gate_scale, up_scale)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    got = fp8_kernels.quantize_rows_pallas(gate, **tuning)
    want = fp8.quantize_rows(gate)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def _expert_rows(tiles: list[int], tile_m: int, two_f: int, groups: int, seed: int = 0):
    """gate+up products of rows in the tiled layout: tile t's rows belong to expert tiles[t] (-1: an unused tile,
    zero rows), with per-row scales and per-expert column scales."""
    keys = jax.random.split(jax.random.key(seed), 3)
    n = len(tiles) * tile_m
    tile_groups = jnp.asarray(tiles, jnp.int32)
    expert = jnp.repeat(tile_groups, tile_m)
    product = (jax.random.normal(keys[0], (n, two_f), jnp.float32) * 30).astype(jnp.bfloat16)
    product = jnp.where((expert >= 0)[:, None], product, 0)
    row_scale = jnp.where(expert >= 0, jax.random.uniform(keys[1], (n,), minval=0.001, maxval=0.05), 0)
    col_scale = jax.random.uniform(keys[2], (groups, two_f), minval=0.1, maxval=1.0)
    return product, row_scale, tile_groups, expert, col_scale


@pytest.mark.parametrize("two_f, tile_m, block_rows, chunk", [(192, 8, 1, 512), (192, 8, 2, 32), (64, 4, 4, 16)])
def test_pallas_expert_swiglu_kernel_equals_its_xla_form(two_f, tile_m, block_rows, chunk):
    """The fp8 experts' scale + SwiGLU + requantisation kernel (Pallas's interpreter): bit-equal to
    `moe.expert_swiglu_quantize_reference`, each row tile reading its own expert's column scales (an unused tile's
    zero rows included), for widths that are not powers of two."""
    from jaxllm.moe import expert_swiglu_quantize_reference

    product, row_scale, tile_groups, expert, col_scale = _expert_rows([2, 0, 0, 3, -1], tile_m, two_f, 4)
    got = fp8_kernels.expert_swiglu_quantize_pallas(product, row_scale, tile_groups, col_scale, tile_m=tile_m,
                                                    interpret=True, rows=block_rows, chunk=chunk)
    want = expert_swiglu_quantize_reference(product, row_scale, expert, col_scale)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    # a wrong expert's column scales would change the values
    shuffled = expert_swiglu_quantize_reference(product, row_scale, jnp.where(expert == 2, 3, expert), col_scale)
    assert not np.array_equal(np.asarray(shuffled[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
    with pytest.raises(ValueError, match="rows dividing tile_m"):
        fp8_kernels.expert_swiglu_quantize_pallas(product, row_scale, tile_groups, col_scale, tile_m=tile_m,
                                                  interpret=True, rows=2 * tile_m)


@pytest.mark.skipif(not native_fp8_available(), reason="the compiled Pallas kernels need a GPU with FP8 tensor cores")
def test_compiled_expert_swiglu_kernel_matches_its_xla_form_at_the_30b_width():
    """On the GPU: the compiled kernel against its XLA form at Qwen3-30B-A3B's expert width (F 768: a 512 and a
    256 slice) in 128-row tiles, up to the last bit of `exp` (a value may round to the neighbouring e4m3 step)."""
    from jaxllm.moe import expert_swiglu_quantize_reference

    tiles = [5, 0, 7, 7, 1, -1, -1]
    product, row_scale, tile_groups, expert, col_scale = _expert_rows(tiles, 128, 1536, 8, seed=3)
    got = fp8_kernels.expert_swiglu_quantize_pallas(product, row_scale, tile_groups, col_scale, tile_m=128)
    want = jax.jit(expert_swiglu_quantize_reference)(product, row_scale, expert, col_scale)
    assert_quantized_close(got, want)


def assert_quantized_close(got, want, max_changed=0.01):
    """Two per-row e4m3 quantisations (values, scales) of the same rows computed with sums of squares in a
    different order: a row's RMS may move by a float32 ulp, which can move a bf16 value (and so its e4m3
    rounding) by one step. Allow that: scales within 1e-2 relative (one bf16 ulp of the abs-max element),
    dequantised values within one e4m3 step (2^-3 relative) or 2^-9 of the row's scale, rarely."""
    (gq, gs), (wq, ws) = got, want
    gq, wq = np.asarray(gq.astype(jnp.float32)), np.asarray(wq.astype(jnp.float32))
    gs, ws = np.asarray(gs), np.asarray(ws)
    np.testing.assert_allclose(gs, ws, rtol=1e-2)
    assert (gq != wq).mean() <= max_changed
    np.testing.assert_allclose(gq * gs[..., None], wq * ws[..., None], rtol=2.0 ** -3,
                               atol=2.0 ** -9 * float(ws.max()))


def assert_normed_rows_close(got, want):
    """Two 16-bit RMSNorm outputs of the same rows with sums of squares in a different order: a row's RMS may move
    by a float32 ulp, which moves a value by one bf16 step, rarely."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert (got != want).mean() <= 0.01
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7)


@pytest.fixture
def on_cpu():
    """Run on the CPU backend even where a GPU is the default: a GPU's XLA may drop the bf16 roundings between
    the interpreted kernel's elementwise ops (excess precision), which the kernel compiled by Triton keeps."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("rows, width, block_rows, chunk", [(5, 96, 1, 512), (7, 200, 2, 64), (3, 48, 4, 16)])
def test_pallas_residual_norm_kernel_matches_its_xla_form(rows, width, block_rows, chunk, on_cpu):
    """The one-pass residual add + RMSNorm + e4m3 quantisation (Pallas's interpreter) against
    `layer_ops.residual_norm_reference`: the new residual stream bit-equal (no reduction in it), the quantised
    norm up to the order of the sum of squares."""
    from jaxllm.layer_ops import residual_norm_reference

    keys = jax.random.split(jax.random.key(rows + width), 5)
    h = jax.random.normal(keys[0], (rows, width), jnp.bfloat16) * 3
    y = jax.random.normal(keys[1], (rows, width), jnp.bfloat16) * 100
    row_scale = jax.random.uniform(keys[2], (rows,), minval=0.001, maxval=0.05)
    col_scale = jax.random.uniform(keys[3], (width,), minval=0.1, maxval=1.0)
    weight = (1 + 0.3 * jax.random.normal(keys[4], (width,))).astype(jnp.bfloat16)
    h_new, q, scale = fp8_kernels.residual_norm_quantize_pallas(h, y, row_scale, col_scale, weight, eps=1e-6,
                                                                interpret=True, rows=block_rows, chunk=chunk)
    delta = fp8.Fp8Product(y, row_scale, col_scale, jnp.bfloat16)
    want_h, want_x = residual_norm_reference(h, delta, weight, 1e-6, quantized=True)
    assert h_new.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(h_new, np.float32), np.asarray(want_h, np.float32))
    assert_quantized_close((q, scale), (want_x.values, want_x.scale))


@pytest.mark.parametrize("rows, width, block_rows, chunk", [(5, 96, 1, 512), (7, 200, 2, 64)])
def test_pallas_residual_norm_kernel_adds_a_plain_delta_and_keeps_the_normed_rows(rows, width, block_rows, chunk,
                                                                                   on_cpu):
    """An fp8 MoE layer's two residual steps on the kernel (Pallas's interpreter): a plain 16-bit delta (the MoE
    block's output) passed as a unit-scaled product is added bit for bit, and `keep_normed` also writes the
    16-bit normalised rows (the router's input) beside the e4m3 ones, which it leaves unchanged."""
    from jaxllm.layer_ops import _unit_scaled, residual_norm_reference

    keys = jax.random.split(jax.random.key(rows * width), 3)
    h = jax.random.normal(keys[0], (rows, width), jnp.bfloat16) * 3
    delta = jax.random.normal(keys[1], (rows, width), jnp.bfloat16) * 2
    weight = (1 + 0.3 * jax.random.normal(keys[2], (width,))).astype(jnp.bfloat16)
    product = _unit_scaled(delta)
    np.testing.assert_array_equal(np.asarray(product.value(), np.float32), np.asarray(delta, np.float32))
    run = lambda keep: fp8_kernels.residual_norm_quantize_pallas(  # noqa: E731
        h, product.product, product.row_scale, product.col_scale, weight, eps=1e-6, keep_normed=keep,
        interpret=True, rows=block_rows, chunk=chunk)
    h_new, normed, q, scale = run(True)
    want_h, want_x = residual_norm_reference(h, delta, weight, 1e-6, quantized=True, keep_value=True)
    np.testing.assert_array_equal(np.asarray(h_new, np.float32), np.asarray(want_h, np.float32))
    assert normed.dtype == jnp.bfloat16
    assert_normed_rows_close(normed, want_x.value)
    assert_quantized_close((q, scale), (want_x.rows.values, want_x.rows.scale))
    _, q_alone, scale_alone = run(False)
    np.testing.assert_array_equal(np.asarray(q_alone, np.float32), np.asarray(q, np.float32))
    np.testing.assert_array_equal(np.asarray(scale_alone), np.asarray(scale))


@pytest.mark.parametrize("plain_delta", [False, True])
def test_residual_norm_keeps_the_16bit_rows_for_an_moe_block(plain_delta, monkeypatch, on_cpu):
    """`layer_ops.residual_norm(..., keep_value=True)`, an fp8 MoE layer's step after attention (delta an fp8
    product) and the one after its block (a plain delta), on the kernel (forced on, interpreted) against the XLA
    form: the stream bit-equal, the 16-bit normalised rows to one bf16 step, their e4m3 rows as close as two
    quantisations of them; the value is the normalised rows, not the stream."""
    from jaxllm import layer_ops

    keys = jax.random.split(jax.random.key(11), 5)
    h = jax.random.normal(keys[0], (2, 6, 80), jnp.bfloat16) * 3
    if plain_delta:
        delta = jax.random.normal(keys[1], (2, 6, 80), jnp.bfloat16) * 2
    else:
        delta = fp8.Fp8Product(jax.random.normal(keys[1], (2, 6, 80), jnp.bfloat16) * 100,
                               jax.random.uniform(keys[2], (2, 6), minval=0.001, maxval=0.05),
                               jax.random.uniform(keys[3], (80,), minval=0.1, maxval=1.0), jnp.bfloat16)
    weight = (1 + 0.3 * jax.random.normal(keys[4], (80,))).astype(jnp.bfloat16)
    want_h, want_x = layer_ops.residual_norm(h, delta, weight, 1e-6, True, keep_value=True)
    assert isinstance(want_x, fp8.ValueAndRows)
    np.testing.assert_array_equal(np.asarray(want_x.value, np.float32),
                                  np.asarray(layer_ops.rms_norm(want_h, weight, 1e-6), np.float32))
    monkeypatch.setattr(layer_ops, "native_fp8_available", lambda: True)
    kernel = functools.partial(fp8_kernels.residual_norm_quantize_pallas, interpret=True)
    calls = []
    monkeypatch.setattr(fp8_kernels, "residual_norm_quantize_pallas",
                        lambda *a, **kw: calls.append(kw["keep_normed"]) or kernel(*a, **kw))
    got_h, got_x = layer_ops.residual_norm(h, delta, weight, 1e-6, True, keep_value=True)
    assert calls == [True]
    np.testing.assert_array_equal(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32))
    assert got_x.value.shape == h.shape and got_x.rows.scale.shape == h.shape[:-1]
    assert_normed_rows_close(got_x.value, want_x.value)
    assert_quantized_close((got_x.rows.values, got_x.rows.scale), (want_x.rows.values, want_x.rows.scale))


@pytest.mark.parametrize("tokens, heads, head_dim, block_rows", [(5, 4, 16, 16), (33, 2, 32, 8), (8, 8, 16, 4)])
def test_pallas_head_norm_rope_kernel_matches_its_xla_form(tokens, heads, head_dim, block_rows, on_cpu):
    """The one-pass q/k scale + per-head RMSNorm + RoPE (Pallas's interpreter) against
    `layer_ops.head_norm_rope_reference` (HF's rms_norm and rotate_half): equal up to one bf16 step where the
    order of a head's sum of squares moves its RMS by a float32 ulp."""
    from jaxllm.layer_ops import head_norm_rope_reference, rope_cos_sin

    keys = jax.random.split(jax.random.key(tokens * heads), 4)
    y = jax.random.normal(keys[0], (1, tokens, heads * head_dim), jnp.bfloat16) * 50
    row_scale = jax.random.uniform(keys[1], (1, tokens), minval=0.001, maxval=0.05)
    col_scale = jax.random.uniform(keys[2], (heads * head_dim,), minval=0.1, maxval=1.0)
    weight = (1 + 0.3 * jax.random.normal(keys[3], (head_dim,))).astype(jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.arange(tokens) + 7, head_dim, 10_000.0, jnp.bfloat16)
    got = fp8_kernels.head_norm_rope_pallas(y[0], row_scale[0], col_scale, weight, cos, sin, head_dim=head_dim,
                                            eps=1e-6, dtype=jnp.bfloat16, interpret=True, rows=block_rows)
    want = head_norm_rope_reference(fp8.Fp8Product(y, row_scale, col_scale, jnp.bfloat16), weight, cos, sin, 1e-6,
                                    heads)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32).reshape(tokens, heads * head_dim)
    assert (got != want).mean() <= 0.01
    # one bf16 step (2^-8 relative) of either RoPE term, both at most |x| (normalised: a few units)
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * np.abs(want).max())


def test_model_with_one_pass_kernels_matches_the_xla_forms(monkeypatch):
    """The fp8 model's wiring of the one-pass kernels (reshapes, the rotary tables per row, the layer input
    carried between layers) on the CPU: the kernels forced on and run by Pallas's interpreter give the hidden
    states of the XLA forms, for a padded batch and for packed prompts."""
    import functools

    from jaxllm import layer_ops

    with pytest.warns(UserWarning, match="emulated") if not native_fp8_available() else contextlib.nullcontext():
        model = load_model("tiny", dtype="fp8")
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, model.config.vocab_size, size=(3, 20)), jnp.int32)
    lengths = jnp.asarray([20, 13, 5], jnp.int32)
    prefix = model.prefill(jnp.asarray(rng.integers(0, model.config.vocab_size, size=9), jnp.int32))
    # fresh functions each run: jit caches traces by function, and the kernels are chosen at trace time
    run = lambda: (jax.jit(lambda p, i, n, c: encode(p, model.config, i, n, prefix=c))(model.params, ids, lengths,
                                                                                         prefix),
                   jax.jit(lambda p, i, n, c: encode_packed(p, model.config, i, n, prefix=c, capacity=32))(
                       model.params, ids, lengths, prefix))
    want = run()
    monkeypatch.setattr(layer_ops, "native_fp8_available", lambda: True)
    traced = []
    for name in ("residual_norm_quantize_pallas", "head_norm_rope_pallas"):
        kernel = functools.partial(getattr(fp8_kernels, name), interpret=True)
        monkeypatch.setattr(fp8_kernels, name, lambda *a, _k=kernel, _n=name, **kw: traced.append(_n) or _k(*a, **kw))
    got = run()
    # per run: 2 residual kernels and 2 head kernels in the layer scan's body, traced once per call
    assert sorted(set(traced)) == ["head_norm_rope_pallas", "residual_norm_quantize_pallas"]
    # a sum of squares in another order moves an RMS by a float32 ulp, now and then an e4m3 rounding by one step
    # (2^-3 of that value), and later layers carry it on: the tolerance of the packed-vs-padded fp8 comparison
    for g, w in zip(got, want):
        assert cosine(g, w).min() >= 0.999
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=0.05,
                                   atol=0.05 * float(jnp.abs(w).max()))


def _expert_outputs_case(tokens: int, k: int, rows: int, width: int, groups: int, scaled: bool, seed: int = 0):
    """An MoE block's uncombined output (bf16 expert rows, each token's k rows and routing weights, fp8 scales or
    none), a residual stream and a norm weight."""
    from jaxllm.moe_rows import ExpertOutputs, ExpertRowScales

    keys = jax.random.split(jax.random.key(seed), 9)
    expert_rows = (jax.random.normal(keys[0], (rows, width), jnp.float32) * 20).astype(jnp.bfloat16)
    slot_row = jax.random.permutation(keys[1], rows)[: tokens * k].reshape(tokens, k).astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[2], (tokens, k)), axis=-1).astype(jnp.bfloat16)
    scales = ExpertRowScales(jax.random.uniform(keys[3], (rows,), minval=0.001, maxval=0.05),
                             jax.random.randint(keys[4], (rows,), -1, groups),
                             jax.random.uniform(keys[5], (groups, width), minval=0.1, maxval=1.0)) if scaled else None
    h = jax.random.normal(keys[6], (tokens, width), jnp.bfloat16) * 3
    weight = (1 + 0.3 * jax.random.normal(keys[7], (width,))).astype(jnp.bfloat16)
    return h, ExpertOutputs(expert_rows, slot_row, weights, scales, (tokens,), jnp.bfloat16), weight


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("width, chunk", [(96, 1024), (200, 64)])
def test_pallas_combine_residual_kernel_matches_its_xla_form(scaled, width, chunk, on_cpu):
    """An fp8 MoE layer's last step in one kernel (Pallas's interpreter): its expert rows combined (fp8 scales or
    none), added to the residual stream, normalised and quantised, against the combine's and the residual step's
    XLA forms one after the other: the new residual stream bit-equal (the combine sums in slot order, as XLA's
    form does, and rounds once), the normed rows and their e4m3 values up to the order of the sum of squares."""
    from jaxllm.layer_ops import residual_norm_reference
    from jaxllm.moe_rows import combine_residual_norm_quantize_pallas

    h, delta, weight = _expert_outputs_case(13, 3, 50, width, 4, scaled)
    want_h, want_x = residual_norm_reference(h, delta, weight, 1e-6, quantized=True, keep_value=True)
    run = lambda keep: combine_residual_norm_quantize_pallas(  # noqa: E731
        h, delta.rows, delta.slot_row, delta.weights, delta.scales, weight, eps=1e-6, keep_normed=keep,
        interpret=True, chunk=chunk)
    h_new, normed, q, scale = run(True)
    assert h_new.dtype == normed.dtype == jnp.bfloat16 and q.shape == h.shape and scale.shape == (13,)
    np.testing.assert_array_equal(np.asarray(h_new, np.float32), np.asarray(want_h, np.float32))
    assert_normed_rows_close(normed, want_x.value)
    assert_quantized_close((q, scale), (want_x.rows.values, want_x.rows.scale))
    _, q_alone, scale_alone = run(False)
    np.testing.assert_array_equal(np.asarray(q_alone, np.float32), np.asarray(q, np.float32))
    np.testing.assert_array_equal(np.asarray(scale_alone), np.asarray(scale))


@pytest.mark.skipif(not native_fp8_available(), reason="the compiled Pallas kernels need a GPU with FP8 tensor cores")
def test_compiled_combine_residual_kernel_matches_its_xla_form_at_the_30b_shape():
    """On the GPU, Qwen3-30B-A3B's shapes (2,048 wide, 8 experts a token, fp8 scales): `layer_ops.residual_norm`
    of an MoE block's uncombined output (the fused kernel) against `residual_norm_reference` (the combine's own
    kernel, then the residual step in XLA form): within one bf16 rounding (the GPU's XLA may keep excess
    precision between the residual step's ops)."""
    from jaxllm import layer_ops

    h, delta, weight = _expert_outputs_case(3000, 8, 30000, 2048, 128, scaled=True, seed=5)
    fused = jax.jit(lambda a, d, w: layer_ops.residual_norm(a, d, w, 1e-6, True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_ops, "FUSED_MOE_COMBINE", True)
        got_h, got_x = fused(h, delta, weight)
    want_h, want_x = jax.jit(lambda a, d, w: layer_ops.residual_norm_reference(a, d, w, 1e-6, True))(h, delta, weight)
    np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32), rtol=2.0 ** -7,
                               atol=2.0 ** -7 * 3)
    assert_quantized_close((got_x.values, got_x.scale), (want_x.values, want_x.scale), max_changed=0.05)


@pytest.mark.skipif(not native_fp8_available(), reason="the compiled Pallas kernels need a GPU with FP8 tensor cores")
def test_compiled_residual_kernel_keeps_the_normed_rows_at_the_30b_width():
    """On the GPU, Qwen3-30B-A3B's hidden width (2,048): the compiled residual kernel with a plain delta (the MoE
    block's output, unit scales) and the 16-bit normalised rows kept, against its XLA form op by op."""
    from jaxllm.layer_ops import _unit_scaled, residual_norm_reference

    n, width = 1000, 2048
    keys = jax.random.split(jax.random.key(9), 3)
    h = jax.random.normal(keys[0], (n, width), jnp.bfloat16) * 3
    delta = jax.random.normal(keys[1], (n, width), jnp.bfloat16) * 2
    weight = (1 + 0.3 * jax.random.normal(keys[2], (width,))).astype(jnp.bfloat16)
    p = _unit_scaled(delta)
    got = jax.jit(fp8_kernels.residual_norm_quantize_pallas, static_argnames=("eps", "keep_normed"))(
        h, p.product, p.row_scale, p.col_scale, weight, eps=1e-6, keep_normed=True)
    want_h, want_x = residual_norm_reference(h, delta, weight, 1e-6, True, keep_value=True)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want_h, np.float32))
    assert_normed_rows_close(got[1], want_x.value)
    assert_quantized_close(got[2:], (want_x.rows.values, want_x.rows.scale))


@pytest.mark.skipif(not native_fp8_available(), reason="the compiled Pallas kernels need a GPU with FP8 tensor cores")
def test_compiled_one_pass_kernels_match_xla_forms_at_the_4b_widths():
    """On the GPU: the compiled residual and q/k kernels against their XLA forms at Qwen3-4B's widths (hidden
    2,560, not a power of two; 32 heads of 128), for a token count that is no multiple of the block rows."""
    from jaxllm.layer_ops import head_norm_rope_reference, residual_norm_reference, rope_cos_sin

    n, width, heads, head_dim = 1000, 2560, 32, 128
    keys = jax.random.split(jax.random.key(5), 6)
    h = jax.random.normal(keys[0], (1, n, width), jnp.bfloat16) * 3
    y = jax.random.normal(keys[1], (1, n, width), jnp.bfloat16) * 100
    row_scale = jax.random.uniform(keys[2], (1, n), minval=0.001, maxval=0.05)
    col_scale = jax.random.uniform(keys[3], (width,), minval=0.1, maxval=1.0)
    weight = (1 + 0.3 * jax.random.normal(keys[4], (width,))).astype(jnp.bfloat16)
    got = jax.jit(fp8_kernels.residual_norm_quantize_pallas, static_argnames="eps")(
        h[0], y[0], row_scale[0], col_scale, weight, eps=1e-6)
    # the XLA forms op by op (not jitted): under jit XLA may drop the bf16 roundings between elementwise ops
    # (excess precision), which HF's numerics and the kernels keep
    want_h, want_x = residual_norm_reference(h, fp8.Fp8Product(y, row_scale, col_scale, jnp.bfloat16), weight,
                                             1e-6, True)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want_h[0], np.float32))
    assert_quantized_close(got[1:], (want_x.values[0], want_x.scale[0]))

    yq = y[..., : heads * head_dim // 2].repeat(2, axis=-1)  # [1, n, 4096]
    col_scale = jnp.tile(col_scale, 2)[: heads * head_dim]
    cos, sin = rope_cos_sin(jnp.arange(n) + 877, head_dim, 1e6, jnp.bfloat16)
    got = fp8_kernels.head_norm_rope_pallas(yq[0], row_scale[0], col_scale, weight[:head_dim], cos, sin,
                                            head_dim=head_dim, eps=1e-6, dtype=jnp.bfloat16)
    want = head_norm_rope_reference(fp8.Fp8Product(yq, row_scale, col_scale, jnp.bfloat16), weight[:head_dim], cos,
                                    sin, 1e-6, heads)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32).reshape(n, heads * head_dim)
    assert (got != want).mean() <= 0.01
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * np.abs(want).max())


def _attention_halves(tokens: int, heads: int, head_dim: int, seed: int = 0):
    """Two halves of packed attention as cuDNN gives them ([N, H, hd] bf16) and their softmax weights ([N, H]
    float32, summing to 1 per head); every fifth row an empty slot: weight 0 on a packed half of NaN bits."""
    keys = jax.random.split(jax.random.key(seed), 3)
    prefix = jax.random.normal(keys[0], (tokens, heads, head_dim), jnp.bfloat16)
    rest = jax.random.normal(keys[1], (tokens, heads, head_dim), jnp.bfloat16) * 3
    w_p = jax.random.uniform(keys[2], (tokens, heads), minval=0.0, maxval=1.0)
    empty = (jnp.arange(tokens) % 5 == 4)[:, None]
    w_p = jnp.where(empty, 1.0, w_p)
    rest = jnp.where(empty[..., None], jnp.nan, rest)
    return prefix, rest, w_p, 1.0 - w_p


def _merged_then_quantized(prefix, rest, w_p, w_r):
    """XLA's form, as the model runs it without the fused kernel: the merged bf16 rows written (their own jit, so
    the bf16 rounding is not elided as excess precision), then quantised."""
    from jaxllm.packed_attention import merge_halves

    merged = jax.jit(lambda *a: merge_halves(*a, jnp.bfloat16))(prefix, rest, w_p, w_r)
    return jax.jit(fp8.quantize_rows)(merged.reshape(merged.shape[0], -1))


@pytest.mark.parametrize("tokens, heads, head_dim, heads_per", [(13, 4, 64, 2), (9, 2, 128, 8), (6, 8, 16, 8)])
def test_pallas_merge_quantize_kernel_equals_merge_then_quantise(tokens, heads, head_dim, heads_per, on_cpu):
    """`merge_quantize_pallas` (Pallas's interpreter) against XLA's merge of the two halves followed by the rows'
    quantisation, bit for bit; an empty slot's NaN packed half (weight 0) leaves no trace."""
    prefix, rest, w_p, w_r = _attention_halves(tokens, heads, head_dim)
    got = fp8_kernels.merge_quantize_pallas(prefix, rest, w_p, w_r, interpret=True, heads_per=heads_per)
    want = _merged_then_quantized(prefix, rest, w_p, w_r)
    assert got[0].shape == (tokens, heads * head_dim) and np.isfinite(np.asarray(got[1])).all()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    with pytest.raises(ValueError, match="power-of-two number of heads and head_dim"):
        fp8_kernels.merge_quantize_pallas(prefix[..., 4:], rest[..., 4:], w_p, w_r, interpret=True)


@pytest.mark.skipif(not native_fp8_available(), reason="the compiled Pallas kernels need a GPU with FP8 tensor cores")
def test_compiled_merge_quantize_kernel_matches_its_xla_form_at_the_attention_width():
    """On the GPU: the compiled kernel against XLA's merge then quantisation at the 4B's and the 30B's attention
    width (32 heads of 128), for a token count that is no power of two. The merge's multiply-add may be contracted
    to an FMA on one side only, which can move a merged value across a bf16 rounding boundary (about 2^-16 of
    them) and with it, rarely, its row's scale."""
    prefix, rest, w_p, w_r = _attention_halves(4099, 32, 128, seed=5)
    want = _merged_then_quantized(prefix, rest, w_p, w_r)
    for heads_per in (32, 8):
        got = fp8_kernels.merge_quantize_pallas(prefix, rest, w_p, w_r, heads_per=heads_per)
        assert_quantized_close(got, want, max_changed=1e-3)


def test_packed_attention_quantized_merges_in_the_kernel_as_xla_does(monkeypatch, on_cpu):
    """`packed_attention_quantized` with cuDNN's halves (made up here on the CPU): the fused kernel's rows
    (`FUSED_MERGE_QUANTIZE`, interpreted) equal XLA's merge then quantisation, in o_proj's [1, C, Hq * hd] layout."""
    from jaxllm import packed_attention as pa

    tokens, heads, head_dim = 11, 4, 32
    prefix, rest, w_p, w_r = _attention_halves(tokens, heads, head_dim, seed=2)
    monkeypatch.setattr(pa, "_cudnn_halves", lambda *a: (prefix[None], rest[None], w_p[None], w_r[None]))
    monkeypatch.setattr(pa, "_cudnn_attention", lambda *a: pa.merge_halves(*pa._cudnn_halves(*a), jnp.bfloat16))
    monkeypatch.setattr(pa, "native_fp8_available", lambda: True)
    monkeypatch.setattr(fp8, "native_fp8_available", lambda: False)  # the unfused form's quantisation: XLA's
    kernel, calls = fp8_kernels.merge_quantize_pallas, []
    monkeypatch.setattr(fp8_kernels, "merge_quantize_pallas",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw, interpret=True))
    q = jnp.zeros((1, tokens, heads, head_dim), jnp.bfloat16)
    kv = jnp.zeros((1, tokens, 1, head_dim), jnp.bfloat16)
    prefix_kv = jnp.zeros((3, 1, head_dim), jnp.bfloat16)
    rows = {}
    for fused in (True, False):
        monkeypatch.setattr(pa, "FUSED_MERGE_QUANTIZE", fused)
        rows[fused] = pa.packed_attention_quantized(q, kv, kv, prefix_kv, prefix_kv, None, "cudnn")
    assert calls == [1]  # the fused form ran the kernel, the other did not
    assert rows[True].values.shape == (1, tokens, heads * head_dim) and rows[True].scale.shape == (1, tokens)
    for got, want in ((rows[True].values, rows[False].values), (rows[True].scale, rows[False].scale)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # 6 heads (as a model with 40 would): no kernel blocks for them, XLA's merge instead
    six = _attention_halves(tokens, 6, head_dim, seed=3)
    monkeypatch.setattr(pa, "_cudnn_halves", lambda *a: tuple(x[None] for x in six))
    monkeypatch.setattr(pa, "FUSED_MERGE_QUANTIZE", True)
    q6 = jnp.zeros((1, tokens, 6, head_dim), jnp.bfloat16)
    got = pa.packed_attention_quantized(q6, kv, kv, prefix_kv, prefix_kv, None, "cudnn")
    assert calls == [1] and got.values.shape == (1, tokens, 6 * head_dim)
