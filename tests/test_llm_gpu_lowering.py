"""The GPU paths' Pallas kernels (Mosaic GPU and Triton) lower for a CUDA GPU, checked on a CPU: JAX lowers every
kernel when it lowers the program around it, so a kernel that a GPU backend cannot lower (a primitive Pallas Triton
has no rule for, such as `jnp.any`'s reduce_or) fails here, in CI, instead of after minutes on a GPU. While tracing,
`jax.devices()` answers one Hopper GPU, so the choices made from it (the tiled grouped GEMM, the Pallas row, norm,
top-k and fp8 kernels) take their GPU forms; attention, chosen from `jax.default_backend()`, keeps its CPU form
(cuDNN is left to the GPU tests). Nothing is compiled or run; Mosaic GPU's lowering checks a kernel's shared memory
against a Hopper's 227 KiB, so a tiled config that cannot fit fails here too. What only the GPU's compilers check
(registers, spills) is left to the GPU tests."""
from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from jaxllm import Qwen3Config, encode_packed, fp8, init_params, moe
from jaxllm.fp8 import quantize_out_in, quantize_params


class _Hopper:
    platform = "gpu"
    compute_capability = "9.0"
    core_count = 132
    device_kind = "NVIDIA H200"


def _clear_device_caches() -> None:
    """The cached answers about the devices (taken by earlier tests on the real ones)."""
    fp8.native_fp8_available.cache_clear()
    moe._hopper.cache_clear()


@contextlib.contextmanager
def as_if_on_a_hopper_gpu():
    _clear_device_caches()
    try:
        with mock.patch.object(jax, "devices", lambda *args, **kwargs: [_Hopper()]):
            yield
    finally:
        _clear_device_caches()


def lowered_for_cuda(fn, *args) -> str:
    with as_if_on_a_hopper_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("hidden, swiglu, down_scales, row_copy", [("blocks", "epilogue", "epilogue", "scatter"),
                                                                   ("rows", "epilogue", "epilogue", "scatter"),
                                                                   ("rows", "kernel", "combine", "gather")])
def test_fp8_moe_block_lowers_for_a_hopper_gpu(monkeypatch, hidden, swiglu, down_scales, row_copy):
    """Qwen3-30B-A3B's block shapes (fewer experts): the tiled e4m3 kernels with the hidden rows quantised in
    blocks inside gate+up's epilogue (the default) or per row with each epilogue form, the row copy each way, the
    quantisation, top-k and combine kernels."""
    monkeypatch.setattr(moe, "FP8_HIDDEN", hidden)
    monkeypatch.setattr(moe, "FP8_SWIGLU", swiglu)
    monkeypatch.setattr(moe, "FP8_DOWN_SCALES", down_scales)
    monkeypatch.setattr(moe, "ROW_COPY", row_copy)
    e, d, f = 8, 2048, 768
    params = {"router": jax.ShapeDtypeStruct((d, e), jnp.bfloat16),
              "gate_up": jax.eval_shape(lambda: quantize_out_in(jnp.zeros((2, e, 2 * f, d)))),
              "down": jax.eval_shape(lambda: quantize_out_in(jnp.zeros((2, e, d, f))))}
    text = lowered_for_cuda(lambda x, p: moe.moe_block(x, p, 8, True, impl="tiled", layer=jnp.int32(1)),
                            jax.ShapeDtypeStruct((1024, d), jnp.bfloat16), params)
    assert text.count("mosaic_gpu") >= 2  # gate+up and down on the tiled kernel
    # the hidden rows' requantisation: inside gate+up's epilogue (blocks), its own kernel after the epilogue, or
    # inside the scale + SwiGLU kernel
    requantisation = {"blocks": None, "epilogue": "quantize_rows", "kernel": "expert_swiglu_quantize"}[
        swiglu if hidden == "rows" else hidden]
    for kernel in (f"{row_copy}_rows", "router_top_k", "combine_rows", requantisation):
        assert kernel is None or kernel in text, kernel
    if hidden == "blocks":
        assert "quantize_rows" not in text and "expert_swiglu_quantize" not in text


def test_fused_router_kernel_lowers_for_a_hopper_gpu():
    """`moe.FUSED_ROUTER` (the default): the router's softmax, top-k and renormalisation as one Triton kernel at
    Qwen3-30B-A3B's router shape (128 experts, 8 per token) in place of the top-k kernel."""
    assert moe.FUSED_ROUTER
    d, e = 2048, 128
    text = lowered_for_cuda(lambda x, r: moe.route(x, r, 8, True), jax.ShapeDtypeStruct((1024, d), jnp.bfloat16),
                            jax.ShapeDtypeStruct((d, e), jnp.bfloat16))
    assert "router_top_k" in text and "top_k_rows" not in text


@pytest.mark.parametrize("row_copy", ["scatter", "gather"])
def test_bf16_moe_block_lowers_for_a_hopper_gpu(monkeypatch, row_copy):
    """The bf16 block: the tiled kernel with SwiGLU in its epilogue, the row copy each way and the combine."""
    monkeypatch.setattr(moe, "ROW_COPY", row_copy)
    e, d, f = 8, 2048, 768
    params = {"router": jax.ShapeDtypeStruct((d, e), jnp.bfloat16),
              "gate_up": jax.ShapeDtypeStruct((2, e, 2 * f, d), jnp.bfloat16),
              "down": jax.ShapeDtypeStruct((2, e, d, f), jnp.bfloat16)}
    text = lowered_for_cuda(lambda x, p: moe.moe_block(x, p, 8, True, impl="tiled", layer=jnp.int32(1)),
                            jax.ShapeDtypeStruct((1024, d), jnp.bfloat16), params)
    assert text.count("mosaic_gpu") >= 2
    for kernel in (f"{row_copy}_rows", "router_top_k", "combine_rows"):
        assert kernel in text, kernel


def _small(**moe_fields) -> Qwen3Config:
    return Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                       rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=4096, **moe_fields)


@pytest.mark.parametrize("sparse", [True, False])
def test_fp8_encoder_lowers_for_a_hopper_gpu(sparse):
    """A small Qwen3-MoE at shapes the tiled fp8 kernels take, and a dense Qwen3, packed in fp8: every layer's
    kernels (residual norms, q/k norm and RoPE, the MLP's or the sparse block's) in the layer scan."""
    config = _small(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True) \
        if sparse else _small()
    with as_if_on_a_hopper_gpu():
        params = jax.eval_shape(lambda: quantize_params(init_params(config, jnp.bfloat16, 0, fp8_experts=sparse)))
    text = lowered_for_cuda(lambda p, i, n: encode_packed(p, config, i, n, capacity=256), params,
                            jax.ShapeDtypeStruct((4, 64), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    layer_kernels = ("mosaic_gpu", f"{moe.ROW_COPY}_rows", "combine_rows") if sparse else ("swiglu_quantize",)
    for kernel in ("residual_norm_quantize", "head_norm_rope") + layer_kernels:
        assert kernel in text, kernel


@pytest.mark.parametrize("form", ["gate_up", "down"])
def test_pipelined_fp8_expert_kernel_lowers_for_a_hopper_gpu(form):
    """The tiled e4m3 kernels with `TileConfig.pipeline_tiles` (one pipeline over a CTA's tiles, a dynamic tile
    count), at the model's configs and epilogues."""
    from jaxllm.grouped_gemm import pipelined, tiled_grouped_matmul

    config, k, n = ((moe.TILED_FP8_SWIGLU_CONFIG, 2048, 1536) if form == "gate_up"
                    else (moe.TILED_FP8_DOWN_SCALED_CONFIG, 768, 2048))
    config, rows = pipelined(config, k), 128 * 24
    text = lowered_for_cuda(
        lambda a, b, g, r, c: tiled_grouped_matmul(a, b, g, config, swiglu=form == "gate_up", row_scale=r,
                                                   col_scale=c),
        jax.ShapeDtypeStruct((rows, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((16, n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((24,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32),
        jax.ShapeDtypeStruct((16, n), jnp.float32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("form, variant", [("gate_up", "silu-exp"), ("gate_up", "epi64"), ("down", "epi64")])
def test_fp8_expert_kernel_variants_lower_for_a_hopper_gpu(form, variant, monkeypatch):
    """The e4m3 kernels in the forms bench_encoder's variants time: gate+up's SiLU by expf and a division
    (`grouped_gemm.SILU` "exp", as before the default's ex2.approx) and 64-row epilogue pieces (down pipelined, as
    the model runs it)."""
    from jaxllm import grouped_gemm

    config, k, n = ((moe.TILED_FP8_SWIGLU_CONFIG, 2048, 1536) if form == "gate_up"
                    else (moe._down_config(moe.TILED_FP8_DOWN_SCALED_CONFIG, 768), 768, 2048))
    if variant.startswith("silu-"):
        monkeypatch.setattr(grouped_gemm, "SILU", variant.removeprefix("silu-"))
    else:
        config = config._replace(epi_m=64)
    rows = 128 * 24
    text = lowered_for_cuda(
        lambda a, b, g, r, c: grouped_gemm.tiled_grouped_matmul(a, b, g, config, swiglu=form == "gate_up",
                                                                row_scale=r, col_scale=c),
        jax.ShapeDtypeStruct((rows, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((16, n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((24,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32),
        jax.ShapeDtypeStruct((16, n), jnp.float32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("form", ["gate_up", "down_blocks", "bf16_gate_up"])
def test_expert_kernels_with_l2_prefetch_lower_for_a_hopper_gpu(form, monkeypatch):
    """The tiled kernels with `grouped_gemm.PREFETCH` "leader" (TMA prefetches of an expert's weight columns into L2 a
    wave of tiles ahead): fp8 gate+up unpipelined with SwiGLU and blocks out, fp8 down pipelined on block scales,
    bf16 gate+up with SwiGLU. The prefetches carry the tile's dynamic expert index, and show in the kernel as L2
    prefetches of the 3-d weights; with "fp8" (the default) in the e4m3 kernels only, with "none" in none."""
    from jaxllm import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "PREFETCH", "leader")
    rows, e = 128 * 24, 16
    if form == "down_blocks":
        config, k, n, dtype = moe.down_blocks_config(768), 768, 2048, jnp.float8_e4m3fn
        scales = (jax.ShapeDtypeStruct((6, rows), jnp.float32), jax.ShapeDtypeStruct((e, n), jnp.float32))
        fn = lambda a, b, g, r, c: grouped_gemm.tiled_grouped_matmul(a, b, g, config, row_block_scales=r,  # noqa
                                                                     col_scale=c)
    elif form == "gate_up":
        config, k, n, dtype = moe.TILED_FP8_SWIGLU_BLOCKS_CONFIG, 2048, 1536, jnp.float8_e4m3fn
        scales = (jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((e, n), jnp.float32))
        fn = lambda a, b, g, r, c: grouped_gemm.tiled_grouped_matmul(  # noqa: E731
            a, b, g, config, swiglu=True, row_scale=r, col_scale=c, quantize_out=True,
            quantize_block=moe.FP8_HIDDEN_BLOCK)
    else:
        config, k, n, dtype = moe.tiled_configs(2048, 768)[0], 2048, 1536, jnp.bfloat16
        scales = ()
        fn = lambda a, b, g: grouped_gemm.tiled_grouped_matmul(a, b, g, config, swiglu=True)  # noqa: E731
    shapes = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((e, n, k), dtype),
              jax.ShapeDtypeStruct((24,), jnp.int32), *scales)
    text = lowered_for_cuda(fn, *shapes)
    assert "cp.async.bulk.prefetch.tensor.3d.L2" in text  # the weights [G, N, K], the expert's index dynamic
    monkeypatch.setattr(grouped_gemm, "PREFETCH", "fp8")  # the default: e4m3 kernels only
    assert ("cp.async.bulk.prefetch" in lowered_for_cuda(lambda *a: fn(*a), *shapes)) == (dtype != jnp.bfloat16)
    monkeypatch.setattr(grouped_gemm, "PREFETCH", "none")
    assert "cp.async.bulk.prefetch" not in lowered_for_cuda(lambda *a: fn(*a), *shapes)


def _tiled_kernel_forms() -> dict[str, tuple]:
    """Every tiled config the model or a benchmark variant runs at Qwen3-30B-A3B's expert shapes (D 2048, F 768),
    as name -> (config, contraction, outputs, dtype, scales, swiglu): scales "none", "rows" (W8A8 row and column
    scales), "blocks_out" (row and column scales in, gate+up's e4m3 blocks out, of 2 * tile_n columns or, named
    "_64", tile_n) or "blocks_in" (down on block-scaled rows); swiglu: the gate+up kernels' SwiGLU epilogue."""
    from jaxllm.grouped_gemm import pipelined, split_rows

    bf16_gate_up, bf16_down = moe.TILED_CONFIGS[0]
    fp8_gate_up, fp8_down = moe.TILED_FP8_CONFIGS[0]
    bf16, e4m3 = jnp.bfloat16, jnp.float8_e4m3fn
    forms = {"bf16 gate+up": (bf16_gate_up, 2048, 1536, bf16, "none", True),
             "bf16 down": (bf16_down, 768, 2048, bf16, "none", False),
             "fp8 gate+up unscaled": (fp8_gate_up, 2048, 1536, e4m3, "none", False),
             "fp8 down unscaled": (fp8_down, 768, 2048, e4m3, "none", False),
             "fp8 gate+up scaled": (moe.TILED_FP8_SWIGLU_CONFIG, 2048, 1536, e4m3, "rows", True),
             "fp8 down scaled": (moe.TILED_FP8_DOWN_SCALED_CONFIG, 768, 2048, e4m3, "rows", False),
             "fp8 gate+up blocks": (moe.TILED_FP8_SWIGLU_BLOCKS_CONFIG, 2048, 1536, e4m3, "blocks_out", True),
             "fp8 gate+up blocks_64": (moe.TILED_FP8_SWIGLU_BLOCKS_CONFIG, 2048, 1536, e4m3, "blocks_out", True),
             "fp8 gate+up blocks split rows": (moe.TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG, 2048, 1536, e4m3, "blocks_out",
                                               True),
             "fp8 down blocks": (moe.down_blocks_config(768), 768, 2048, e4m3, "blocks_in", False),
             "fp8 down blocks_64": (moe.down_blocks_config(768)._replace(tile_k=64), 768, 2048, e4m3, "blocks_in",
                                    False),
             "fp8 down blocks split rows": (split_rows(moe.down_blocks_config(768)), 768, 2048, e4m3, "blocks_in",
                                            False),
             "fp8 down scaled split rows": (split_rows(moe.TILED_FP8_DOWN_SCALED_CONFIG), 768, 2048, e4m3, "rows",
                                            False),
             "bf16 down split rows": (split_rows(bf16_down), 768, 2048, bf16, "none", False)}
    # each unpipelined one also pipelined (the model pipelines down; bench_moe --pipeline-tiles 1 times both)
    for name, (config, k, *rest) in list(forms.items()):
        if not config.pipeline_tiles:
            forms[name + " pipelined"] = (pipelined(config, k), k, *rest)
    return forms


@pytest.mark.parametrize("name", sorted(_tiled_kernel_forms()))
def test_every_tiled_config_fits_a_hopper_gpu(name):
    """Each tiled config in each form it runs lowers for a Hopper GPU, its shared memory within 227 KiB (until
    2026-11-30, fp8 down's config unpipelined asked for 258 KiB, which only its GPU test found). For down on
    block-scaled rows this is the CPU's only check of its GPU form: its products accumulate onto the rescaled sum
    through accumulator state, which Mosaic GPU's interpreter cannot run."""
    from jaxllm import grouped_gemm

    config, k, n, dtype, scales, swiglu = _tiled_kernel_forms()[name]
    rows, e = 128 * 24, 16
    kwargs = {"swiglu": swiglu}
    if scales == "blocks_out":
        kwargs |= {"quantize_out": True, "quantize_block": config.tile_n if name.endswith("_64") else None}
    row_scales = (k // config.tile_k, rows) if scales == "blocks_in" else (rows,)
    scale_shapes = () if scales == "none" else (jax.ShapeDtypeStruct(row_scales, jnp.float32),
                                                jax.ShapeDtypeStruct((e, n), jnp.float32))

    def fn(a, b, g, *s):
        if s:
            kwargs.update(col_scale=s[1], **{"row_block_scales" if scales == "blocks_in" else "row_scale": s[0]})
        return grouped_gemm.tiled_grouped_matmul(a, b, g, config, **kwargs)

    text = lowered_for_cuda(fn, jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((e, n, k), dtype),
                            jax.ShapeDtypeStruct((rows // config.tile_m,), jnp.int32), *scale_shapes)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("heads_per", [32, 8])
def test_attention_merge_quantize_kernel_lowers_for_a_hopper_gpu(heads_per):
    """Packed attention's halves merged inside o_proj's quantisation (`fp8_kernels.merge_quantize_pallas`, the fp8
    encoders' default with cuDNN) at the 4B's and the 30B's attention width."""
    from jaxllm import fp8_kernels

    halves = jax.ShapeDtypeStruct((4099, 32, 128), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((4099, 32), jnp.float32)
    text = lowered_for_cuda(lambda *a: fp8_kernels.merge_quantize_pallas(*a, heads_per=heads_per),
                            halves, halves, weights, weights)
    assert "merge_quantize" in text
