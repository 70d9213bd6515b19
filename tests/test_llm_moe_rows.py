"""jaxllm.moe_rows: the MoE dispatch's row copies (XLA's gather on 4-byte words, and the Pallas kernel run by its
interpreter on a CPU, compiled on a GPU) against jnp.take, padding rows included; the combine's Pallas kernel
against its XLA form and a NumPy sum."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import moe
from jaxllm.moe_rows import (ExpertRowScales, combine_rows, combine_rows_pallas, combine_rows_reference,
                             gather_rows, gather_rows_pallas, gather_rows_words, layout_rows, scatter_rows_pallas)

ON_GPU = jax.default_backend() == "gpu"


def _case(dtype, n: int, width: int, m: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 2)
    values = (jax.random.normal(keys[0], (n, width), jnp.float32) * 3).astype(dtype)
    # every row index, repeats, and out-of-range indices (the tiled layout's padding rows: zeros)
    source = jax.random.randint(keys[1], (m,), 0, n + 3)
    source = source.at[:3].set(jnp.array([n, 0, n - 1]))
    want = jnp.take(values, source, axis=0, mode="fill", fill_value=0)
    return values, source, want


def _bits(a: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8 if a.dtype.itemsize == 1 else jnp.uint16)) \
        if a.dtype.itemsize < 4 else np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("dtype, width", [(jnp.float8_e4m3fn, 96), (jnp.bfloat16, 40), (jnp.float32, 24),
                                          (jnp.float8_e4m3fn, 6), (jnp.bfloat16, 3)])
def test_word_gather_moves_the_same_bits(dtype, width):
    values, source, want = _case(dtype, 37, width, 50)
    got = gather_rows_words(values, source)
    assert got.dtype == values.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.asarray(got[0].astype(jnp.float32)).any()  # index n: a zero row
    np.testing.assert_array_equal(_bits(gather_rows(values, source, "elements")), _bits(want))


@pytest.mark.parametrize("dtype, width, rows, chunk, block", [(jnp.float8_e4m3fn, 96, 4, 1024, False),
                                                              (jnp.bfloat16, 40, 2, 8, False),
                                                              (jnp.float32, 24, 1, 16, False),
                                                              (jnp.float8_e4m3fn, 96, 8, 1024, True),
                                                              (jnp.bfloat16, 40, 4, 8, True)])
def test_pallas_gather_equals_take_interpreted(dtype, width, rows, chunk, block):
    """Widths whose word count is not a power of two (copied as binary parts), row counts that are no multiple of
    the rows per program; row by row and as one gathered block load."""
    values, source, want = _case(dtype, 29, width, 23, seed=1)
    got = gather_rows_pallas(values, source, interpret=True, rows=rows, chunk=chunk, block=block)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_gather_names_what_it_cannot_take():
    with pytest.raises(ValueError, match="gather impl must be one of"):
        gather_rows(jnp.zeros((2, 4)), jnp.zeros((1,), jnp.int32), "scatter")
    with pytest.raises(ValueError, match="not whole 4-byte words"):
        gather_rows_pallas(jnp.zeros((2, 3), jnp.bfloat16), jnp.zeros((1,), jnp.int32), interpret=True)


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
def test_pallas_gather_equals_take_on_gpu():
    """At Qwen3-30B-A3B's hidden width (2,048: 512 words of e4m3, 1,024 of bf16)."""
    for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
        values, source, want = _case(dtype, 4096, 2048, 20000, seed=2)
        np.testing.assert_array_equal(_bits(gather_rows_pallas(values, source)), _bits(want))
        for rows, warps in ((16, 4), (32, 8)):
            got = gather_rows_pallas(values, source, rows=rows, num_warps=warps, block=True)
            np.testing.assert_array_equal(_bits(got), _bits(want))
        np.testing.assert_array_equal(_bits(jax.jit(gather_rows_words)(values, source)), _bits(want))
        np.testing.assert_array_equal(_bits(jax.jit(gather_rows)(values, source)), _bits(want))  # GPU default


def _layout_case(dtype, n: int, k: int, experts: int, width: int, tile_m: int, seed: int = 0):
    """Token rows and a real tiled layout of a random routing (`moe._tile_layout`): (values, source, slot_row)."""
    keys = jax.random.split(jax.random.key(seed), 2)
    values = (jax.random.normal(keys[0], (n, width), jnp.float32) * 3).astype(dtype)
    plan = moe.dispatch(jax.random.randint(keys[1], (n, k), 0, experts), experts)
    _, source, row_of_slot = moe._tile_layout(plan, n, k, tile_m, 0)
    return values, source, row_of_slot.reshape(n, k)


@pytest.mark.parametrize("dtype, n, k, width, per", [(jnp.float8_e4m3fn, 37, 2, 96, 4), (jnp.bfloat16, 16, 8, 40, 8),
                                                     (jnp.float32, 5, 1, 24, 4), (jnp.float8_e4m3fn, 3, 3, 8, 8)])
def test_pallas_scatter_equals_gather_interpreted(dtype, n, k, width, per, monkeypatch):
    """Each token row stored to its k layout rows, padding rows zero: the gather's bits, with token counts that are
    no multiple of the tokens per program (masked lanes) and a single program. The interpreter's outputs start as
    all-ones words here (its default is zeros), so a row the kernel leaves unwritten shows."""
    from jax._src.pallas import primitives

    uninitialized = primitives.uninitialized_value
    monkeypatch.setattr(primitives, "uninitialized_value", lambda shape, dtype: (
        jnp.full(shape, 0xFFFFFFFF, dtype) if jnp.dtype(dtype) == jnp.uint32 else uninitialized(shape, dtype)))
    values, source, slot_row = _layout_case(dtype, n, k, 4, width, 16, seed=n)
    got = scatter_rows_pallas(values, slot_row, source, interpret=True, tokens_per_program=per)
    np.testing.assert_array_equal(_bits(got), _bits(gather_rows_words(values, source)))
    assert not np.asarray(got[np.asarray(source) >= n].astype(jnp.float32)).any()  # padding rows: zeros
    np.testing.assert_array_equal(_bits(layout_rows(values, source, slot_row)), _bits(got))  # CPU: the gather
    with pytest.raises(ValueError, match="row copy impl must be one of"):
        layout_rows(values, source, slot_row, "scan")


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
def test_pallas_scatter_equals_gather_on_gpu():
    """At Qwen3-30B-A3B's hidden width, 8 experts a token of 128, the model's 128-row tiles; also as
    `layout_rows(..., "scatter")` (`moe.ROW_COPY`)."""
    for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
        values, source, slot_row = _layout_case(dtype, 4096, 8, 128, 2048, 128, seed=3)
        want = _bits(gather_rows_words(values, source))
        np.testing.assert_array_equal(_bits(scatter_rows_pallas(values, slot_row, source)), want)
        scattered = jax.jit(layout_rows, static_argnums=3)(values, source, slot_row, "scatter")
        np.testing.assert_array_equal(_bits(scattered), want)


def _combine_case(n: int, k: int, rows: int, width: int, groups: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    expert_rows = (jax.random.normal(keys[0], (rows, width), jnp.float32) * 20).astype(jnp.bfloat16)
    slot_row = jax.random.permutation(keys[1], rows)[: n * k].reshape(n, k).astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[2], (n, k)), axis=-1).astype(jnp.bfloat16)
    group = jax.random.randint(keys[3], (rows,), -1, groups)  # -1: an unused tile's row, read as expert 0
    scales = ExpertRowScales(jax.random.uniform(keys[4], (rows,), minval=0.001, maxval=0.05), group,
                             jax.random.uniform(keys[5], (groups, width), minval=0.1, maxval=1.0))
    return expert_rows, slot_row, weights, scales


def _numpy_combine(expert_rows, slot_row, weights, scales):
    r = np.asarray(expert_rows, np.float64)[np.asarray(slot_row)]  # [N, k, D]
    if scales is not None:
        group = np.maximum(np.asarray(scales.group), 0)[np.asarray(slot_row)]
        r = r * np.asarray(scales.row, np.float64)[np.asarray(slot_row)][..., None] * np.asarray(scales.col)[group]
    return np.sum(r * np.asarray(weights, np.float64)[..., None], axis=1)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("width, per, chunk", [(96, 1, 1024), (40, 4, 16)])
def test_pallas_combine_equals_its_xla_form_interpreted(scaled, width, per, chunk):
    """The weighted sum of each token's k expert rows (with fp8 scales or without), for widths that are not
    powers of two and token counts that are no multiple of the tokens per program: the interpreted kernel equals
    the XLA form (both float32 sums in slot order, one rounding to bf16), and both equal a float64 NumPy sum up to
    that rounding."""
    expert_rows, slot_row, weights, scales = _combine_case(13, 3, 50, width, 4)
    scales = scales if scaled else None
    want = combine_rows_reference(expert_rows, slot_row, weights, scales, jnp.bfloat16)
    got = combine_rows_pallas(expert_rows, slot_row, weights, scales, jnp.bfloat16, interpret=True,
                              rows_per_program=per, chunk=chunk)
    assert got.dtype == jnp.bfloat16 and got.shape == (13, width)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    exact = _numpy_combine(expert_rows, slot_row, weights, scales)
    np.testing.assert_allclose(np.asarray(want, np.float64), exact, rtol=2.0 ** -8, atol=1e-6 * np.abs(exact).max())
    np.testing.assert_array_equal(np.asarray(combine_rows(expert_rows, slot_row, weights, scales, jnp.bfloat16,
                                                          "xla"), np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="combine impl must be"):
        combine_rows(expert_rows, slot_row, weights, scales, jnp.bfloat16, "scatter")


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU")
def test_pallas_combine_matches_its_xla_form_on_gpu():
    """At Qwen3-30B-A3B's shapes (2,048 wide, 8 experts a token), with and without fp8 scales: the float32 sums
    may differ in order from XLA's, so within one bf16 rounding."""
    expert_rows, slot_row, weights, scales = _combine_case(3000, 8, 30000, 2048, 128, seed=4)
    for s in (None, scales):
        got = np.asarray(combine_rows(expert_rows, slot_row, weights, s, jnp.bfloat16), np.float32)
        want = _numpy_combine(expert_rows, slot_row, weights, s)
        np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-6 * np.abs(want).max())
