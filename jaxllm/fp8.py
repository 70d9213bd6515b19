"""FP8 (e4m3) weights and matmuls, W8A8 with dynamic activation scales (as vLLM's FP8 W8A8 / FP8_DYNAMIC).

Projection and MLP weights are stored as float8_e4m3fn with one float32 scale per output channel, converted once
at load (`quantize_params`). At run time each token's activation row is scaled by its own absolute maximum and cast
to e4m3, the two fp8 operands meet in one GEMM with float32 accumulation, and the product is rescaled by
(token scale x channel scale). Everything else (embeddings, norms, attention and its softmax, the residual stream)
stays in the activation dtype (bfloat16).

The MLP (`mlp_product` / `mlp`) keeps the gate and up products in float32 until down_proj's input is
quantised, and that quantisation (like the attention output's) runs as one Pallas kernel on the GPU
(`jaxllm.fp8_kernels`): XLA would read those tensors twice. `project` returns a GEMM's product with its scales
still apart (`Fp8Product`), so the step that consumes it (`jaxllm.layer_ops`: the residual add with the next norm,
the q/k norms with RoPE) applies them in its own pass.

On a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper) the GEMM runs on them (cuBLASLt); elsewhere
the same fp8 values are multiplied in float32 (`emulated`): identical rounding of the operands, only slower.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from .fp8_format import E4M3, E4M3_MAX, TINY
from .params import LAYER_LEAVES

# Leaves of params["layers"] stored in fp8: the layer's matrices (the leaves HF stores [out, in]: q/k/v/o, gate/up/down)
QUANTIZED_LEAVES = tuple(name for name, leaf in LAYER_LEAVES.items() if leaf.transpose)
# An MoE's experts, stored in e4m3 (W8A8 in `jaxllm.moe`: half the memory of Qwen3-30B-A3B's 58 GB of experts)
EXPERT_QUANTIZED_LEAVES = ("gate_up", "down")


@flax.struct.dataclass
class Fp8Matrix:
    """An fp8 weight: `weight` float8_e4m3fn [..., out, in] (contraction on the minor axis, the layout cuBLASLt's
    fp8 GEMM wants for both operands) and `scale` float32 [..., out]; the matrix it stands for is
    (weight * scale[..., :, None]).T."""

    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The [..., in, out] shape of the matrix it stands for (as the unquantised leaf)."""
        return self.weight.shape[:-2] + (self.weight.shape[-1], self.weight.shape[-2])


@flax.struct.dataclass
class QuantizedRows:
    """Activations quantised per row for an fp8 GEMM: `values` e4m3 [..., in], `scale` float32 [...]; `dtype`:
    the activations' own dtype (the GEMM's product is written in it when 16-bit)."""

    values: jax.Array
    scale: jax.Array
    dtype: Any = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class ValueAndRows:
    """Activations for a consumer that reads them both ways (an MoE block in fp8: its router takes the 16-bit
    `value` [..., in], its experts the e4m3 `rows` of the same values)."""

    value: jax.Array
    rows: QuantizedRows


@flax.struct.dataclass
class Fp8Product:
    """An fp8 GEMM's product before its scales: `product` [..., out] (the unscaled float32 accumulator rounded to
    `product`'s dtype), `row_scale` float32 [...] (the activations'), `col_scale` float32 [out] (the weight's).
    It stands for `value()`; kept apart so the scales can be applied by the kernel that consumes it."""

    product: jax.Array
    row_scale: jax.Array
    col_scale: jax.Array
    dtype: Any = flax.struct.field(pytree_node=False)

    def value(self) -> jax.Array:
        """The scaled product in `dtype`: scales multiplied in float32, one rounding."""
        return (self.product.astype(jnp.float32) * (self.row_scale[..., None] * self.col_scale)).astype(self.dtype)


def quantize_matrix(w: jax.Array) -> Fp8Matrix:
    """[..., in, out] matrix -> Fp8Matrix with one scale per output channel (absolute max over `in` / 448)."""
    return quantize_out_in(jnp.swapaxes(w, -1, -2))


def quantize_out_in(w: jax.Array) -> Fp8Matrix:
    """A matrix stored [..., out, in] (an MoE's experts) -> Fp8Matrix of its transpose, one scale per output row."""
    wt = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(wt), axis=-1) / E4M3_MAX, TINY)
    return Fp8Matrix((wt / scale[..., None]).astype(E4M3), scale)


def out_in_weights(w: jax.Array | Fp8Matrix, dtype: Any) -> jax.Array:
    """An [..., out, in] weight in `dtype`: as is, or an Fp8Matrix dequantised (weight x its row scales; weight-only
    fp8, as the MoE experts use it: stored in e4m3, multiplied in `dtype`)."""
    if not isinstance(w, Fp8Matrix):
        return w
    return (w.weight.astype(jnp.float32) * w.scale[..., None]).astype(dtype)


def dequantize_matrix(m: Fp8Matrix, dtype: Any = jnp.float32) -> jax.Array:
    """The [..., in, out] matrix an Fp8Matrix stands for (for tests and inspection)."""
    return jnp.swapaxes(out_in_weights(m, dtype), -1, -2)


@jax.jit
def _quantize_layers(layers: dict[str, Any]) -> dict[str, Any]:
    return {k: quantize_matrix(v) if k in QUANTIZED_LEAVES else v for k, v in layers.items()}


def quantize_params(params: dict[str, Any]) -> dict[str, Any]:
    """The params pytree with every decoder projection and dense MLP matrix replaced by an Fp8Matrix (one jitted
    pass on the device; the unquantised copies can be freed afterwards). An MoE model's experts
    (`EXPERT_QUANTIZED_LEAVES`) are quantised here when they come 16-bit, which needs room for both copies: a big
    MoE's should come quantised from `init_params` / `load_params` (`fp8_experts`, layer by layer), as
    `load_model` does. The router stays in its dtype, as in the official FP8 checkpoints."""
    stacks = {name: _quantize_layers(params[name]) for name in ("layers", "dense_mlp") if name in params}
    if "experts" in params and not isinstance(params["experts"]["gate_up"], Fp8Matrix):
        stacks["experts"] = {k: quantize_out_in(v) if k in EXPERT_QUANTIZED_LEAVES else v
                             for k, v in params["experts"].items()}
    return {**params, **stacks}


@functools.lru_cache(maxsize=None)
def native_fp8_available(backend: str | None = None) -> bool:
    """Whether the default devices multiply fp8 on tensor cores (NVIDIA compute capability >= 8.9)."""
    devices = jax.devices(backend)
    if devices[0].platform != "gpu":
        return False
    try:
        major, minor = (int(x) for x in str(devices[0].compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return False
    return (major, minor) >= (8, 9)


def warn_if_emulated() -> None:
    """Says once, in one line, that fp8 is emulated (correct, not faster) on this backend."""
    if not native_fp8_available():
        warnings.warn(f"fp8 matmuls are emulated on this {jax.default_backend()} backend (no FP8 tensor cores): "
                      f"same numerics as on a Hopper GPU, but not faster than bfloat16", stacklevel=3)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations [..., in] -> (e4m3 [..., in], float32 scale [...]): each row scaled by its own absolute max."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1) / E4M3_MAX, TINY)
    return (xf / scale[..., None]).astype(E4M3), scale


def quantize_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Activations [R, K] -> (e4m3 [R, K], float32 scales [K // block, R]): each row's block-wide slices of K
    scaled by their own absolute max (Qwen3's FP8 checkpoints quantise activations in such 1 x 128 groups). The
    scales are stored block-major, as the tiled grouped GEMM reads and writes them
    (`grouped_gemm.tiled_grouped_matmul`'s row_block_scales and quantize_out)."""
    r, k = x.shape
    xf = x.astype(jnp.float32).reshape(r, k // block, block)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1) / E4M3_MAX, TINY)
    return (xf / scale[..., None]).astype(E4M3).reshape(r, k), scale.T


def dequantize_blocks(values: jax.Array, scales: jax.Array) -> jax.Array:
    """`quantize_blocks`' inverse in float32: values [R, K] times their block's scale (scales [K // block, R])."""
    r, k = values.shape
    blocks = scales.shape[0]
    return (values.astype(jnp.float32).reshape(r, blocks, k // blocks) * scales.T[..., None]).reshape(r, k)


def _fp8_dot(xq: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """The unscaled product of e4m3 rows [..., in] and an e4m3 weight [out, in], float32 accumulation, written in
    `out_dtype`: one cuBLASLt fp8 GEMM on FP8 tensor cores, else the same values multiplied in float32."""
    dims = (((xq.ndim - 1,), (1,)), ((), ()))
    if native_fp8_available():
        return lax.dot_general(xq, w, dims, preferred_element_type=out_dtype)
    return lax.dot_general(xq.astype(jnp.float32), w.astype(jnp.float32), dims,
                           precision=lax.Precision.HIGHEST).astype(out_dtype)


def _product_dtype(x: jax.Array | QuantizedRows) -> Any:
    """The dtype a GEMM writes for activations `x`: theirs when 16-bit, else float32."""
    return x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.float32


def quantize_rows_one_pass(x: jax.Array, rows: int = 1) -> tuple[jax.Array, jax.Array]:
    """`quantize_rows`; on a GPU with FP8 tensor cores from one Pallas kernel that reads x once
    (`jaxllm.fp8_kernels`), `rows` rows per program. For an x that XLA cannot fuse the quantisation into (a custom
    call's output, such as attention's): XLA would read it twice, for the abs-max and for the cast."""
    if not native_fp8_available():
        return quantize_rows(x)
    from .fp8_kernels import quantize_rows_pallas

    q, scale = quantize_rows_pallas(x.reshape(-1, x.shape[-1]), rows=rows)
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


def quantize(x: jax.Array, one_pass: bool = False) -> QuantizedRows:
    """x's rows quantised for an fp8 GEMM (`quantize_rows`); `one_pass`: by `quantize_rows_one_pass`, for an x
    whose producer XLA cannot fuse the quantisation into."""
    values, scale = quantize_rows_one_pass(x) if one_pass else quantize_rows(x)
    return QuantizedRows(values, scale, x.dtype)


def project(x: jax.Array | QuantizedRows, w: jax.Array | Fp8Matrix) -> jax.Array | Fp8Product:
    """x @ w: for a plain [in, out] matrix the product in x's dtype; for an Fp8Matrix the W8A8 GEMM's
    `Fp8Product` (x quantised here unless it already is), whose scales its consumer applies."""
    if not isinstance(w, Fp8Matrix):
        return x @ w
    xq = x if isinstance(x, QuantizedRows) else quantize(x)
    return Fp8Product(_fp8_dot(xq.values, w.weight, _product_dtype(xq)), xq.scale, w.scale, xq.dtype)


def fp8_matmul(x: jax.Array, m: Fp8Matrix) -> jax.Array:
    """x [..., in] @ the matrix of `m`, W8A8: per-token e4m3 activations, per-channel e4m3 weights, float32
    accumulation, result in x's dtype.

    For 16-bit activations the GEMM writes its product in that dtype (cuBLASLt rounds its float32 accumulator
    once, on the way out), half the bytes of a float32 product; the two scales are then applied in float32 by
    the elementwise fusion that reads it (the consumer: SwiGLU, the residual add, the q/k norms). Emulated
    backends round the same float32 product to the same dtype, so both give the same numbers."""
    return project(x, m).value()


def swiglu_quantize_reference(gate: jax.Array, up: jax.Array, x_scale: jax.Array, gate_scale: jax.Array,
                              up_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """silu(gate * x_scale * gate_scale) * (up * x_scale * up_scale) in float32, quantised per row to e4m3:
    gate, up [..., I] unscaled GEMM products, x_scale [...], gate_scale / up_scale [I]. Returns (e4m3 [..., I],
    float32 scale [...]). XLA's form of `jaxllm.fp8_kernels.swiglu_quantize_pallas` (same arithmetic)."""
    g = gate.astype(jnp.float32) * (x_scale[..., None] * gate_scale)
    u = up.astype(jnp.float32) * (x_scale[..., None] * up_scale)
    return quantize_rows(g * jax.nn.sigmoid(g) * u)


def swiglu_quantize(gate: jax.Array, up: jax.Array, x_scale: jax.Array, gate_scale: jax.Array,
                    up_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`swiglu_quantize_reference`'s result; on a GPU with FP8 tensor cores from one Pallas kernel that reads each
    gate/up row once (`jaxllm.fp8_kernels`), where XLA would read the widest tensor of the layer twice."""
    if not native_fp8_available():
        return swiglu_quantize_reference(gate, up, x_scale, gate_scale, up_scale)
    from .fp8_kernels import swiglu_quantize_pallas

    lead, width = gate.shape[:-1], gate.shape[-1]
    q, scale = swiglu_quantize_pallas(gate.reshape(-1, width), up.reshape(-1, width), x_scale.reshape(-1),
                                      gate_scale, up_scale)
    return q.reshape(*lead, width), scale.reshape(lead)


def mlp_product(x: jax.Array | QuantizedRows, gate: jax.Array | Fp8Matrix, up: jax.Array | Fp8Matrix,
                down: jax.Array | Fp8Matrix) -> jax.Array | Fp8Product:
    """Qwen3's SwiGLU MLP, down(silu(gate(x)) * up(x)): for plain matrices the result in x's dtype; for Fp8Matrix
    ones W8A8 GEMMs (x quantised once for gate and up unless it already is, their unscaled products turned into
    down's e4m3 input by `swiglu_quantize`, float32 in between) and down's `Fp8Product`."""
    if not isinstance(gate, Fp8Matrix):
        return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)
    xq = x if isinstance(x, QuantizedRows) else quantize(x)
    product = _product_dtype(xq)
    hq, h_scale = swiglu_quantize(_fp8_dot(xq.values, gate.weight, product), _fp8_dot(xq.values, up.weight, product),
                                  xq.scale, gate.scale, up.scale)
    return Fp8Product(_fp8_dot(hq, down.weight, product), h_scale, down.scale, xq.dtype)


def linear(x: jax.Array, w: jax.Array | Fp8Matrix) -> jax.Array:
    """x @ w for a plain [in, out] matrix (in x's dtype) or an Fp8Matrix (W8A8, `fp8_matmul`)."""
    if isinstance(w, Fp8Matrix):
        return fp8_matmul(x, w)
    return x @ w


def mlp(x: jax.Array, gate: jax.Array | Fp8Matrix, up: jax.Array | Fp8Matrix,
        down: jax.Array | Fp8Matrix) -> jax.Array:
    """Qwen3's SwiGLU MLP, down(silu(gate(x)) * up(x)), for plain matrices (in x's dtype) or Fp8Matrix ones."""
    out = mlp_product(x, gate, up, down)
    return out.value() if isinstance(out, Fp8Product) else out
