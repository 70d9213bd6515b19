"""The e4m3 format the fp8 path quantises to: its dtype, its largest finite value and the floor of a scale.

Shared by `jaxllm.fp8` (quantisation and GEMMs) and `jaxllm.fp8_kernels` (its one-pass GPU kernels), which must
agree on them bit for bit; `fp8` imports the kernels, so the constants live here rather than in either.
"""
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
TINY = 1e-12  # floor of a scale, so an all-zero row or column quantises to zeros instead of NaN
