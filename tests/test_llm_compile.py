"""jaxllm.compile: XLA options per dtype, the fallback when XLA rejects an option, the persistent cache switch."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import compile as jcompile


def test_a_gpu_turns_triton_gemms_off_and_a_cpu_gets_no_options():
    assert jcompile.compiler_options(backend="gpu", xla_flags="") == {"xla_gpu_enable_triton_gemm": False,
                                                                      "xla_gpu_autotune_level": 2}
    # a flag the user sets in XLA_FLAGS wins over the option (issue 35: the autotune stage compares levels)
    assert jcompile.compiler_options(backend="gpu", xla_flags="--xla_gpu_autotune_level=4") == {
        "xla_gpu_enable_triton_gemm": False}
    assert jcompile.compiler_options(backend="cpu") == {}
    assert jcompile.compiler_options(backend="gpu", runs_llm=False) == {}  # plain PPO: XLA's defaults


def test_jit_with_an_accepted_option_computes_the_same():
    f = jcompile.jit(lambda x: x @ x, compiler_options={"xla_gpu_enable_triton_gemm": False})
    x = jnp.arange(16.0).reshape(4, 4)
    np.testing.assert_array_equal(f(x), x @ x)


def test_an_option_xla_rejects_falls_back_with_one_warning_naming_it():
    f = jcompile.jit(lambda x: x * 2, compiler_options={"xla_no_such_option_for_the_test": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_array_equal(f(jnp.ones(3)), 2 * np.ones(3))
        np.testing.assert_array_equal(f(jnp.ones(3)), 2 * np.ones(3))  # no second warning
    lines = [str(w.message) for w in caught]
    assert len(lines) == 1 and "xla_no_such_option_for_the_test" in lines[0] and "compiling without it" in lines[0]


def test_other_errors_are_not_swallowed_by_the_fallback():
    f = jcompile.jit(lambda x: x @ jnp.ones((5, 2)), compiler_options={"xla_gpu_enable_triton_gemm": False})
    with pytest.raises(TypeError):
        f(jnp.ones((3, 4)))


def test_persistent_cache_keeps_a_configured_directory_and_can_be_turned_off(tmp_path, monkeypatch):
    assert jcompile.enable_persistent_cache("off") is None
    configured = jax.config.jax_compilation_cache_dir
    if configured:  # the tests' own cache (tests/conftest.py) is the user's choice here: kept
        assert jcompile.enable_persistent_cache(tmp_path / "elsewhere") == jcompile.Path(configured)
        assert jax.config.jax_compilation_cache_dir == configured
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jcompile.default_cache_dir() == tmp_path / "craftax-llm" / "jax"


def test_persistent_cache_gets_a_size_limit_unless_one_is_set():
    """JAX locks its cache directory only when the cache has a size limit; without a lock a process can load an entry
    another is still writing (this suite's workers aborted on one)."""
    before = jax.config.jax_compilation_cache_max_size
    try:
        jax.config.update("jax_compilation_cache_max_size", -1)  # JAX's default: no limit, no lock
        jcompile.enable_persistent_cache()
        assert jax.config.jax_compilation_cache_max_size == jcompile.CACHE_MAX_BYTES
        jax.config.update("jax_compilation_cache_max_size", 123 << 20)  # the user's limit is kept
        jcompile.enable_persistent_cache()
        assert jax.config.jax_compilation_cache_max_size == 123 << 20
    finally:
        jax.config.update("jax_compilation_cache_max_size", before)


def test_a_rejected_option_is_dropped_and_the_others_kept():
    """issue 35: the LLM programs carry two options; XLA refusing one must not drop the other (Triton GEMMs off)."""
    f = jcompile.jit(lambda x: x * 2, compiler_options={"xla_no_such_option_for_the_test": True,
                                                        "xla_gpu_enable_triton_gemm": False})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        np.testing.assert_array_equal(f(jnp.ones(3)), 2 * np.ones(3))
    assert f.options == {"xla_gpu_enable_triton_gemm": False} and f.fell_back
    g = jcompile.jit(lambda x: x + 1, compiler_options={"xla_no_such_option_for_the_test": True})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        np.testing.assert_array_equal(jcompile.compile_ahead(g, jnp.ones(2))(jnp.ones(2)), 2 * np.ones(2))


def test_a_program_with_options_traced_inside_another_runs_as_a_plain_nested_jit():
    """XLA options belong to the outermost program: jax.eval_shape (or an outer jit) of code that calls a `jit`
    with options must trace it as a plain nested jit instead of failing."""
    from jaxllm.compile import jit

    inner = jit(lambda x: x * 2.0, compiler_options={"xla_cpu_enable_fast_math": False})
    assert float(inner(jnp.float32(3.0))) == 6.0
    shape = jax.eval_shape(lambda x: inner(x) + 1.0, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert shape.shape == (3,)
    assert float(jax.jit(lambda: inner(jnp.float32(2.0)))()) == 4.0  # called with no tracer argument
