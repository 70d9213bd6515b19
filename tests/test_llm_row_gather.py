"""jaxllm.row_gather: the MoE dispatch's row copies (XLA's gather on 4-byte words, and the Pallas kernel run by its
interpreter on a CPU, compiled on a GPU) against jnp.take, padding rows included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.row_gather import gather_rows, gather_rows_pallas, gather_rows_words

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


@pytest.mark.parametrize("dtype, width, rows, chunk", [(jnp.float8_e4m3fn, 96, 4, 1024), (jnp.bfloat16, 40, 2, 8),
                                                       (jnp.float32, 24, 1, 16)])
def test_pallas_gather_equals_take_interpreted(dtype, width, rows, chunk):
    """Widths whose word count is not a power of two (copied as binary parts), row counts that are no multiple of
    the rows per program."""
    values, source, want = _case(dtype, 29, width, 23, seed=1)
    got = gather_rows_pallas(values, source, interpret=True, rows=rows, chunk=chunk)
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
        np.testing.assert_array_equal(_bits(jax.jit(gather_rows_words)(values, source)), _bits(want))
        np.testing.assert_array_equal(_bits(jax.jit(gather_rows)(values, source)), _bits(want))  # GPU default
