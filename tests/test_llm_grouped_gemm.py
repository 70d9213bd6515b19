"""jaxllm.grouped_gemm: the tile-aligned row layout, and the tiled Hopper kernel against lax.ragged_dot (on a CPU
through Mosaic GPU's interpreter; on a Hopper GPU compiled, at the Qwen3-30B-A3B config)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import grouped_gemm, moe, moe_rows
from jaxllm.grouped_gemm import TileConfig, tile_plan, tiled_grouped_matmul

SMALL = TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=64, band=1)
ON_GPU = jax.default_backend() == "gpu"


def interpreter():
    if ON_GPU:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _routing_with_an_empty_and_a_one_row_expert(seed: int) -> np.ndarray:
    """Rows per group of the GPU tests' routing at the 30B's scale: 3,001 rows drawn over 16 experts, expert 2
    empty and expert 5 a single row."""
    sizes = np.bincount(np.random.default_rng(seed).integers(0, 16, 3001), minlength=16)
    sizes[2], sizes[5] = 0, 1
    return sizes


@pytest.mark.parametrize("sizes", [[5, 0, 130, 64, 1], [200, 0, 0, 0, 0], [0, 0, 0, 0, 7], [64, 64, 64, 64, 64]])
def test_tile_plan_puts_each_group_on_whole_tiles(sizes):
    tm = 64
    sizes_np = np.asarray(sizes)
    plan = tile_plan(jnp.asarray(sizes_np, jnp.int32), int(sizes_np.sum()), tm)
    padded_row, groups = np.asarray(plan.padded_row), np.asarray(plan.tile_groups)
    assert plan.num_rows == grouped_gemm.padded_row_count(int(sizes_np.sum()), len(sizes), tm)
    assert plan.num_rows % tm == 0 and groups.shape == (plan.num_rows // tm,)
    assert np.all(np.diff(padded_row) > 0) and padded_row.max() < plan.num_rows  # order kept, no collisions
    group_of_row = np.repeat(np.arange(len(sizes)), sizes_np)
    np.testing.assert_array_equal(groups[padded_row // tm], group_of_row)  # each row sits in its group's tiles
    used = np.ceil(sizes_np / tm).astype(int)
    np.testing.assert_array_equal(groups[groups >= 0], np.repeat(np.arange(len(sizes)), used))
    assert np.all(groups[used.sum():] == -1)
    starts = padded_row[np.concatenate([[0], np.cumsum(sizes_np)[:-1]])[sizes_np > 0]]
    assert np.all(starts % tm == 0)  # every non-empty group starts on a tile boundary
    # given each row's group (as the dispatch's sort has it), the same layout
    given = tile_plan(jnp.asarray(sizes_np, jnp.int32), int(sizes_np.sum()), tm,
                      row_group=jnp.asarray(group_of_row, jnp.int32))
    np.testing.assert_array_equal(np.asarray(given.padded_row), padded_row)


def test_tiled_kernel_equals_ragged_dot_interpreted():
    rng = np.random.default_rng(0)
    sizes = np.array([70, 0, 80])
    x = jnp.asarray(rng.normal(size=(int(sizes.sum()), 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, 128, 128)) * 0.1, jnp.bfloat16)  # [G, N, K]
    plan = tile_plan(jnp.asarray(sizes, jnp.int32), x.shape[0], SMALL.tile_m)
    rows = jnp.zeros((plan.num_rows, 128), x.dtype).at[plan.padded_row].set(x)
    out = tiled_grouped_matmul(rows, w, plan.tile_groups, SMALL, interpret=interpreter())
    got = np.asarray(out[plan.padded_row], np.float32)
    want = np.asarray(moe.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), "ragged_dot"), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_tiled_kernel_fuses_swiglu_interpreted():
    """With swiglu, the kernel's output is silu(gate) * up of the float32 products (gate over up in the weights)."""
    rng = np.random.default_rng(1)
    sizes, f = np.array([0, 90, 40]), 128
    x = jnp.asarray(rng.normal(size=(int(sizes.sum()), 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(3, 2 * f, 128)) * 0.1, jnp.bfloat16)
    plan = tile_plan(jnp.asarray(sizes, jnp.int32), x.shape[0], SMALL.tile_m)
    rows = jnp.zeros((plan.num_rows, 128), x.dtype).at[plan.padded_row].set(x)
    out = tiled_grouped_matmul(rows, w, plan.tile_groups, SMALL, swiglu=True, interpret=interpreter())
    assert out.shape == (plan.num_rows, f)
    gu = np.asarray(moe.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), jnp.asarray(sizes, jnp.int32),
                                       "ragged_dot"))
    want = gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]
    np.testing.assert_allclose(np.asarray(out[plan.padded_row], np.float32), want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())


def test_moe_block_tiled_reads_the_layer_stack_in_place():
    """moe_block on the tiled kernel, given the whole [L, E, ...] stacks and a layer index, equals the ragged_dot
    block on that layer's slice; no op slices the stacks (the kernel reads them in place)."""
    e, d, f, n, layers = 4, 128, 128, 40, 3
    ks = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(ks[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    stack = {"router": (jax.random.normal(ks[1], (layers, d, e)) * 0.3).astype(jnp.bfloat16),
             "gate_up": (jax.random.normal(ks[2], (layers, e, 2 * f, d)) * 0.1).astype(jnp.bfloat16),
             "down": (jax.random.normal(ks[3], (layers, e, d, f)) * 0.1).astype(jnp.bfloat16)}
    params = dict(stack, router=stack["router"][1])
    block = lambda p, j: moe.moe_block(x, p, 2, True, impl="tiled", layer=j)  # noqa: E731
    jaxpr = jax.make_jaxpr(block)(params, jnp.int32(1))
    sliced = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("dynamic_slice", "gather", "slice")
              and eqn.invars[0].aval.ndim == 4]
    assert not sliced, f"the expert stack was sliced: {sliced}"
    got = np.asarray(block(params, jnp.int32(1)), np.float32)
    want = np.asarray(moe.moe_block(x, jax.tree.map(lambda a: a[1], stack), 2, True, impl="ragged_dot"), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def _w8a8_block_reference(x, router, gate_up, down, layer, top_k, norm_topk_prob):
    """The W8A8 sparse block in float64 numpy from the e4m3 values and their scales: tokens quantised per row,
    SwiGLU of the scaled gate+up products, its output quantised per row, down scaled, routing weights summed."""
    from jaxllm.fp8 import quantize_rows

    weights, experts = (np.asarray(a) for a in moe.route(x, router, top_k, norm_topk_prob))
    xq, xs = (np.asarray(a, np.float64) for a in quantize_rows(x))
    gu_w = np.asarray(gate_up.weight[layer], np.float64) * np.asarray(gate_up.scale[layer])[..., None]
    down_w = np.asarray(down.weight[layer], np.float64) * np.asarray(down.scale[layer])[..., None]
    f = down_w.shape[-1]
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].astype(np.float64), experts[t]):
            gu = (xq[t] * xs[t]) @ gu_w[e].T
            hidden = gu[:f] / (1 + np.exp(-gu[:f])) * gu[f:]
            hq, hs = (np.asarray(a, np.float64) for a in quantize_rows(jnp.asarray(hidden[None], jnp.float32)))
            out[t] += w * ((hq[0] * hs[0]) @ down_w[e].T)
    return out


def test_moe_block_fp8_experts_are_w8a8_on_both_kernels(monkeypatch):
    """fp8 experts (e4m3 stacks with per-column scales): the tokens quantised per row, e4m3 GEMMs, scales after
    them, SwiGLU in float32 and requantised for down. The ragged_dot path (a CPU's) equals a float64 reference of
    that arithmetic; the tiled kernel (interpreted here) equals the ragged_dot path up to its bfloat16 products;
    and both stay near the bfloat16 block of the dequantised weights. With the GPU's one-pass scale + SwiGLU +
    requantisation kernel forced on (interpreted), the tiled block is unchanged to the bit."""
    import functools

    from jaxllm import fp8_kernels
    from jaxllm.fp8 import out_in_weights, quantize_out_in

    e, d, f, n, layers = 4, 128, 128, 24, 2
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    router = (jax.random.normal(ks[1], (d, e)) * 0.3).astype(jnp.bfloat16)
    gate_up = quantize_out_in((jax.random.normal(ks[2], (layers, e, 2 * f, d)) * 0.1).astype(jnp.bfloat16))
    down = quantize_out_in((jax.random.normal(ks[3], (layers, e, d, f)) * 0.1).astype(jnp.bfloat16))
    params = {"router": router, "gate_up": gate_up, "down": down}
    block = lambda impl: np.asarray(moe.moe_block(x, params, 2, False, impl=impl, layer=jnp.int32(1)),  # noqa: E731
                                    np.float32)
    ragged, tiled = block("ragged_dot"), block("tiled")
    want = _w8a8_block_reference(x, router, gate_up, down, 1, 2, False)
    scale = np.abs(want).max()
    np.testing.assert_allclose(ragged, want, rtol=1e-2, atol=1e-2 * scale)  # bf16 output: 2^-8 relative
    np.testing.assert_allclose(tiled, ragged, rtol=2e-2, atol=2e-2 * scale)
    traced = []
    kernel = functools.partial(fp8_kernels.expert_swiglu_quantize_pallas, interpret=True)
    monkeypatch.setattr(moe, "native_fp8_available", lambda: True)
    monkeypatch.setattr(fp8_kernels, "expert_swiglu_quantize_pallas",
                        lambda *a, **kw: traced.append(kw["tile_m"]) or kernel(*a, **kw))
    np.testing.assert_array_equal(block("tiled"), tiled)
    assert traced == [64]  # the kernel ran, on the layout's 64-row tiles
    dense = {"router": router, **{name: out_in_weights(jax.tree.map(lambda a: a[1], w), jnp.bfloat16)
                                  for name, w in (("gate_up", gate_up), ("down", down))}}
    bf16 = np.asarray(moe.moe_block(x, dense, 2, False, impl="ragged_dot"), np.float32)
    cosine = np.sum(ragged * bf16, -1) / np.linalg.norm(ragged, axis=-1) / np.linalg.norm(bf16, axis=-1)
    assert cosine.min() > 0.98, cosine.min()  # activations in e4m3 (3 mantissa bits): near, not equal


def test_tiled_kernel_names_the_shape_it_cannot_take():
    rows = jnp.zeros((128, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="contraction 96 must be a multiple of tile_k 64"):
        tiled_grouped_matmul(rows, jnp.zeros((2, 128, 96), jnp.bfloat16), jnp.zeros((2,), jnp.int32), SMALL)


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_tiled_kernel_equals_ragged_dot_on_gpu():
    rng = np.random.default_rng(5)
    config = moe.TILED_CONFIGS[0][1]
    for k, n, draw in ((2048, 1536, "random"), (768, 2048, "random"), (768, 2048, "one")):
        sizes = np.bincount(rng.integers(0, 16, 3001), minlength=16) if draw == "random" else np.eye(16, dtype=int)[3] * 3001
        sizes[2] = 0
        if draw == "one":
            sizes[3] = 3001
        x = jnp.asarray(rng.normal(size=(int(sizes.sum()), k)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(16, n, k)) * 0.05, jnp.bfloat16)
        s = jnp.asarray(sizes, jnp.int32)
        plan = tile_plan(s, x.shape[0], config.tile_m)
        rows = jnp.zeros((plan.num_rows, k), x.dtype).at[plan.padded_row].set(x)
        out = jax.jit(lambda a, b, g: tiled_grouped_matmul(a, b, g, config))(rows, w, plan.tile_groups)
        got = np.asarray(out[plan.padded_row], np.float32)
        want = np.asarray(moe.grouped_matmul(x, w, s, "ragged_dot"), np.float32)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-2, (k, n, draw)
        if n == 1536:  # gate+up with SwiGLU fused, at its own config
            fused = jax.jit(lambda a, b, g: tiled_grouped_matmul(a, b, g, moe.TILED_CONFIGS[0][0], swiglu=True))
            got = np.asarray(fused(rows, w, plan.tile_groups)[plan.padded_row], np.float32)
            want = np.asarray(jax.nn.silu(jnp.asarray(want[:, :768])) * want[:, 768:])
            assert np.abs(got - want).max() / np.abs(want).max() < 2e-2, "swiglu"


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_fp8_tiled_kernel_and_block_on_gpu():
    """At Qwen3-30B-A3B's expert shapes: the e4m3 kernel's unscaled products equal the exact products of the e4m3
    values, for both GEMMs at their fp8 configs; the fp8 block on the kernel equals the block on ragged_dot."""
    from jaxllm.fp8 import quantize_out_in

    rng = np.random.default_rng(6)
    gate_up_config, down_config = moe.TILED_FP8_CONFIGS[0]
    for k, n, config in ((2048, 1536, gate_up_config), (768, 2048, down_config)):
        sizes = np.bincount(rng.integers(0, 16, 3001), minlength=16)
        sizes[2] = 0
        x = jnp.asarray(rng.normal(size=(int(sizes.sum()), k)), jnp.float8_e4m3fn)
        w = jnp.asarray(rng.normal(size=(16, n, k)), jnp.float8_e4m3fn)
        s = jnp.asarray(sizes, jnp.int32)
        plan = tile_plan(s, x.shape[0], config.tile_m)
        rows = jnp.zeros((plan.num_rows, k), x.dtype).at[plan.padded_row].set(x)
        out = jax.jit(lambda a, b, g, c=config: tiled_grouped_matmul(a, b, g, c))(rows, w, plan.tile_groups)
        got = np.asarray(out[plan.padded_row], np.float32)
        want = np.asarray(moe.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), s, "ragged_dot"))
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-2, (k, n)
    e, d, f, n, layers = 16, 2048, 768, 2048, 2
    ks = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ks[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    params = {"router": (jax.random.normal(ks[1], (d, e)) * 0.05).astype(jnp.bfloat16),
              "gate_up": quantize_out_in(jax.random.normal(ks[2], (layers, e, 2 * f, d)) * 0.05),
              "down": quantize_out_in(jax.random.normal(ks[3], (layers, e, d, f)) * 0.05)}
    block = jax.jit(lambda p, impl: moe.moe_block(x, p, 8, True, impl=impl, layer=jnp.int32(1)),
                    static_argnums=1)
    got, want = (np.asarray(block(params, impl), np.float32) for impl in ("tiled", "ragged_dot"))
    # the kernel's products are rounded to bf16 before their scales, ragged_dot's are float32: SwiGLU's e4m3
    # requantisation then rounds some hidden values the other way (a step of 1/8 to 1/16), so the two paths
    # differ by ~2% of an element in places (measured on an H200: max 0.59 of 23.3); a misplaced row or a wrong
    # scale would be off by its whole size
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2
    cosine = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosine.min() > 0.995, cosine.min()


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_fp8_swiglu_epilogue_on_gpu(monkeypatch):
    """At Qwen3-30B-A3B's gate+up shape (K 2048, 2F 1536): the e4m3 kernel with its row and column scales and
    SwiGLU in the epilogue equals silu(gate) * up of the scaled exact products (within its bf16 output rounding),
    and down (K 768, N 2048) with its scales in the epilogue the scaled exact products; the fp8 block on the tiled
    kernel with `moe.FP8_HIDDEN` "blocks" (the default) or "rows", there `moe.FP8_SWIGLU` "epilogue" or "kernel",
    `moe.FP8_DOWN_SCALES` "epilogue" or "combine", and the token rows scattered (the default) or gathered equals
    the block on ragged_dot in the same mode."""
    from jaxllm.fp8 import quantize_out_in

    rng = np.random.default_rng(7)
    config, f = moe.TILED_FP8_SWIGLU_CONFIG, 768
    sizes = np.bincount(rng.integers(0, 16, 3001), minlength=16)
    sizes[2] = 0
    x = jnp.asarray(rng.normal(size=(int(sizes.sum()), 2048)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.normal(size=(16, 2 * f, 2048)), jnp.float8_e4m3fn)
    s = jnp.asarray(sizes, jnp.int32)
    plan = tile_plan(s, x.shape[0], config.tile_m)
    rows = jnp.zeros((plan.num_rows, 2048), x.dtype).at[plan.padded_row].set(x)
    row_scale = jnp.asarray(rng.uniform(0.001, 0.01, plan.num_rows), jnp.float32)
    col_scale = jnp.asarray(rng.uniform(0.001, 0.01, (16, 2 * f)), jnp.float32)
    kernel = jax.jit(lambda a, b, g, r, c: tiled_grouped_matmul(a, b, g, config, swiglu=True, row_scale=r,
                                                                  col_scale=c))
    got = np.asarray(kernel(rows, w, plan.tile_groups, row_scale, col_scale)[plan.padded_row], np.float32)
    gu = np.asarray(moe.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), s, "ragged_dot"), np.float64)
    expert = np.repeat(np.arange(16), sizes)
    gu = gu * np.asarray(row_scale)[np.asarray(plan.padded_row)][:, None] * np.asarray(col_scale)[expert]
    want = gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2
    # down (K 768, N 2048) with its scales in the epilogue, at the model's config
    hidden = jnp.asarray(rng.normal(size=(int(sizes.sum()), f)), jnp.float8_e4m3fn)
    wd = jnp.asarray(rng.normal(size=(16, 2048, f)), jnp.float8_e4m3fn)
    down_config = moe._down_config(moe.TILED_FP8_DOWN_SCALED_CONFIG, f)  # as the model runs it (unpipelined, its
    # 4 stages and 128-row epilogue pieces exceed shared memory)
    plan = tile_plan(s, hidden.shape[0], down_config.tile_m)
    rows = jnp.zeros((plan.num_rows, f), hidden.dtype).at[plan.padded_row].set(hidden)
    row_scale = jnp.asarray(rng.uniform(0.001, 0.01, plan.num_rows), jnp.float32)
    col_scale = jnp.asarray(rng.uniform(0.001, 0.01, (16, 2048)), jnp.float32)
    kernel = jax.jit(lambda a, b, g, r, c: tiled_grouped_matmul(a, b, g, down_config, row_scale=r, col_scale=c))
    got = np.asarray(kernel(rows, wd, plan.tile_groups, row_scale, col_scale)[plan.padded_row], np.float32)
    want = np.asarray(moe.grouped_matmul(hidden.astype(jnp.float32), wd.astype(jnp.float32), s, "ragged_dot"),
                      np.float64)
    want = want * np.asarray(row_scale)[np.asarray(plan.padded_row)][:, None] * np.asarray(col_scale)[expert]
    # Hopper's fp8 wgmma accumulates with fewer bits than float32 (measured 0.3% of the largest value here; a
    # wrong scale would be off by its whole size)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2
    e, d, n, layers = 16, 2048, 2048, 2
    ks = jax.random.split(jax.random.key(3), 4)
    xb = jax.random.normal(ks[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    params = {"router": (jax.random.normal(ks[1], (d, e)) * 0.05).astype(jnp.bfloat16),
              "gate_up": quantize_out_in(jax.random.normal(ks[2], (layers, e, 2 * f, d)) * 0.05),
              "down": quantize_out_in(jax.random.normal(ks[3], (layers, e, d, f)) * 0.05)}
    block = lambda impl: np.asarray(jax.jit(lambda p: moe.moe_block(xb, p, 8, True, impl=impl,  # noqa: E731
                                                                    layer=jnp.int32(1)))(params), np.float32)
    want = block("ragged_dot")  # moe.FP8_HIDDEN "blocks" (the default), as the first form below
    modes = (("blocks", "epilogue", "epilogue", "scatter"), ("rows", "epilogue", "epilogue", "scatter"),
             ("rows", "kernel", "epilogue", "gather"), ("rows", "epilogue", "combine", "gather"))
    for mode in modes:
        if mode[0] == "rows":
            monkeypatch.setattr(moe, "FP8_HIDDEN", "rows")
            want = block("ragged_dot")
        mode = mode[1:]
        monkeypatch.setattr(moe, "FP8_SWIGLU", mode[0])
        monkeypatch.setattr(moe, "FP8_DOWN_SCALES", mode[1])
        monkeypatch.setattr(moe, "ROW_COPY", mode[2])
        got = block("tiled")
        # as in test_fp8_tiled_kernel_and_block_on_gpu (the kernels' bf16 and e4m3 roundings differ from
        # ragged_dot's float32 products by up to an e4m3 step in places)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2, mode
        cosine = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        assert cosine.min() > 0.995, (mode, cosine.min())


def _outputs_of_configs(configs, k, n, swiglu, dtype, sizes, seed, interpret=None):
    """The kernel's output rows at each of `configs` (sharing one tile_m), on the same operands (scaled when fp8):
    what a config option that should change nothing is checked with."""
    config = configs[0]
    rng = np.random.default_rng(seed)
    s = jnp.asarray(sizes, jnp.int32)
    fp8 = dtype == jnp.float8_e4m3fn
    x = jnp.asarray(rng.normal(size=(int(sizes.sum()), k)), dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), n, k)) * (1 if fp8 else 0.05), dtype)
    plan = tile_plan(s, x.shape[0], config.tile_m)
    rows = jnp.zeros((plan.num_rows, k), x.dtype).at[plan.padded_row].set(x)
    scales = ((jnp.asarray(rng.uniform(0.001, 0.01, plan.num_rows), jnp.float32),
               jnp.asarray(rng.uniform(0.001, 0.01, (len(sizes), n)), jnp.float32)) if fp8 else (None, None))
    outs = []
    for c in configs:
        kernel = lambda a, b, g, r, cs, c=c: tiled_grouped_matmul(  # noqa: E731
            a, b, g, c, swiglu=swiglu, row_scale=r, col_scale=cs, interpret=interpret)
        kernel = kernel if interpret is not None else jax.jit(kernel)
        outs.append(np.asarray(kernel(rows, w, plan.tile_groups, *scales)[plan.padded_row], np.float32))
    return outs


def _pipelined_outputs(config, k, n, swiglu, dtype, sizes, seed, interpret=None):
    """The kernel's output rows with `pipeline_tiles` off and on (`grouped_gemm.pipelined`)."""
    return _outputs_of_configs((config, grouped_gemm.pipelined(config, k)), k, n, swiglu, dtype, sizes, seed,
                               interpret)


@pytest.mark.parametrize("sizes", [[70, 0, 130, 1], [5, 0, 0, 0]])
def test_pipelined_tiles_change_nothing_interpreted(sizes):
    """`TileConfig.pipeline_tiles` (a CTA's tiles streamed as one pipeline, the used row tiles only) gives the
    same output bit for bit, interpreted on 2 CTAs: bf16 with SwiGLU at 4 k-steps through 2 buffers, fp8 down
    scaled at 6 k-steps through 3 (64-wide tiles: what the interpreter runs); with many tiles per CTA, and with
    one used tile (one CTA runs one tile, the other none)."""
    sizes = np.asarray(sizes)
    cases = ((SMALL, 256, 256, True, jnp.bfloat16),
             (moe.TILED_FP8_DOWN_SCALED_CONFIG._replace(tile_n=64), 768, 128, False, jnp.float8_e4m3fn))
    for seed, case in enumerate(cases):
        off, on = _pipelined_outputs(*case, sizes, seed, interpret=interpreter())
        assert np.abs(off).max() > 0
        np.testing.assert_array_equal(on, off, err_msg=str(case))


def test_pipelined_config_divides_the_steps():
    config = TileConfig(tile_k=128, stages=4)
    assert grouped_gemm.pipelined(config, 768) == config._replace(stages=3, pipeline_tiles=True)  # 6 steps
    assert grouped_gemm.pipelined(config, 2048).stages == 4  # 16 steps
    assert grouped_gemm.pipelined(config, 256).stages == 2  # 2 steps
    rows = jnp.zeros((128, 768), jnp.bfloat16)
    with pytest.raises(ValueError, match="k-steps 6 must be a multiple of stages 4"):
        tiled_grouped_matmul(rows, jnp.zeros((2, 256, 768), jnp.bfloat16), jnp.zeros((1,), jnp.int32),
                             config._replace(pipeline_tiles=True))


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_pipelined_tiles_change_nothing_on_gpu():
    """Compiled at the model's configs (fp8 gate+up scaled with SwiGLU, fp8 down scaled, bf16 both) with
    `grouped_gemm.pipelined`: the output equals the unpipelined kernel's bit for bit, on a routing with an empty
    expert, an expert of one row and unused tiles at the end, and on one of a single used row tile."""
    sizes = _routing_with_an_empty_and_a_one_row_expert(8)
    cases = ((moe.TILED_FP8_SWIGLU_CONFIG, 2048, 1536, True, jnp.float8_e4m3fn),
             (moe.TILED_FP8_DOWN_SCALED_CONFIG, 768, 2048, False, jnp.float8_e4m3fn),
             (moe.TILED_CONFIGS[0][0], 2048, 1536, True, jnp.bfloat16),
             (moe.TILED_CONFIGS[0][1], 768, 2048, False, jnp.bfloat16))
    for routing in (sizes, np.eye(16, dtype=int)[3] * 7):
        for seed, case in enumerate(cases):
            off, on = _pipelined_outputs(*case, routing, seed)
            assert np.abs(off).max() > 0
            np.testing.assert_array_equal(on, off, err_msg=str(case))


def test_fp8_swiglu_epilogue_interpreted():
    """The fp8 gate+up kernel with its row and column scales and SwiGLU in the epilogue, at the config the model
    uses (`moe.TILED_FP8_SWIGLU_CONFIG`, Mosaic GPU's interpreter), against silu(gate) * up of the scaled exact
    products of the e4m3 values: groups of several tiles, an empty one, part-filled ones (within the kernel's
    bf16 output rounding); a row scale without its column scales is refused."""
    rng = np.random.default_rng(1)
    config, groups, k, f = moe.TILED_FP8_SWIGLU_CONFIG, 5, 256, 256
    sizes = np.array([300, 0, 129, 5, 200])
    m = int(sizes.sum())
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.normal(size=(groups, 2 * f, k)), jnp.float8_e4m3fn)
    plan = tile_plan(jnp.asarray(sizes, jnp.int32), m, config.tile_m)
    rows = jnp.zeros((plan.num_rows, k), x.dtype).at[plan.padded_row].set(x)
    row_scale = jnp.asarray(rng.uniform(0.001, 0.01, plan.num_rows), jnp.float32)
    col_scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, 2 * f)), jnp.float32)
    out = tiled_grouped_matmul(rows, w, plan.tile_groups, config, swiglu=True, row_scale=row_scale,
                               col_scale=col_scale, interpret=interpreter())
    got = np.asarray(out[plan.padded_row], np.float32)
    gu = np.asarray(moe.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), jnp.asarray(sizes, jnp.int32),
                                       "ragged_dot"), np.float64)
    gu = gu * np.asarray(row_scale)[np.asarray(plan.padded_row)][:, None] * np.asarray(col_scale)[
        np.repeat(np.arange(groups), sizes)]
    want = gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2
    with pytest.raises(ValueError, match="and col_scale come together"):
        tiled_grouped_matmul(rows, w, plan.tile_groups, config, swiglu=True, row_scale=row_scale)


def test_fp8_scaled_epilogue_without_swiglu_interpreted():
    """The fp8 down kernel with its row and column scales in the epilogue (`moe.FP8_DOWN_SCALES` "epilogue"),
    interpreted at 64-wide column tiles: the scaled exact products of the e4m3 values, within the bf16 output
    rounding, on groups of several tiles, an empty one and part-filled ones."""
    rng = np.random.default_rng(2)
    config = moe.TILED_FP8_DOWN_SCALED_CONFIG._replace(tile_n=64, epi_n=64)
    groups, k, n = 4, 256, 256
    sizes = np.array([200, 0, 3, 140])
    m = int(sizes.sum())
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.normal(size=(groups, n, k)), jnp.float8_e4m3fn)
    plan = tile_plan(jnp.asarray(sizes, jnp.int32), m, config.tile_m)
    rows = jnp.zeros((plan.num_rows, k), x.dtype).at[plan.padded_row].set(x)
    row_scale = jnp.asarray(rng.uniform(0.001, 0.01, plan.num_rows), jnp.float32)
    col_scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, n)), jnp.float32)
    out = tiled_grouped_matmul(rows, w, plan.tile_groups, config, row_scale=row_scale, col_scale=col_scale,
                               interpret=interpreter())
    got = np.asarray(out[plan.padded_row], np.float32)
    want = np.asarray(moe.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32),
                                         jnp.asarray(sizes, jnp.int32), "ragged_dot"), np.float64)
    want = want * np.asarray(row_scale)[np.asarray(plan.padded_row)][:, None] * np.asarray(col_scale)[
        np.repeat(np.arange(groups), sizes)]
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-9)  # one bf16 rounding


def test_fp8_block_takes_the_modes_it_names_interpreted(monkeypatch):
    """The fp8 block on the tiled kernel (interpreted) at shapes that take the 128-row tile configs: with
    `moe.FP8_HIDDEN` "blocks" (the default) gate+up is one scaled GEMM with SwiGLU and the block quantisation and
    down one block-scaled GEMM, equal to the ragged_dot block's arithmetic of the same mode; with "rows", and
    `moe.FP8_SWIGLU` "epilogue" gate+up is one scaled GEMM with SwiGLU, with "kernel" an unscaled GEMM; with
    `moe.FP8_DOWN_SCALES` "epilogue" down is a scaled GEMM and the combine gets no scales, with "combine" it is
    unscaled; every rows form stays as near the ragged_dot block as the GPU test at Qwen3-30B-A3B's shapes
    allows."""
    from jaxllm.fp8 import quantize_out_in

    assert moe.FP8_HIDDEN == "blocks" and moe.FP8_SWIGLU == "epilogue" and moe.FP8_DOWN_SCALES == "epilogue"
    e, d, f, n = 2, 256, 128, 16
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (n, d)).astype(jnp.bfloat16)
    params = {"router": (jax.random.normal(ks[1], (d, e)) * 0.3).astype(jnp.bfloat16),
              "gate_up": quantize_out_in(jax.random.normal(ks[2], (1, e, 2 * f, d)) * 0.1),
              "down": quantize_out_in(jax.random.normal(ks[3], (1, e, d, f)) * 0.1)}
    block = lambda impl: np.asarray(moe.moe_block(x, params, 2, False, impl=impl, layer=jnp.int32(0)),  # noqa: E731
                                    np.float32)
    calls, kernel = [], moe.tiled_grouped_matmul
    monkeypatch.setattr(moe, "tiled_grouped_matmul", lambda *a, **kw: calls.append(
        (kw.get("swiglu", False), kw.get("row_scale") is not None, kw.get("quantize_out", False),
         kw.get("row_block_scales") is not None)) or kernel(*a, **kw))
    # the interpreter hangs on the scaled epilogue at 128-wide column tiles (the model's down config, tested
    # compiled on a GPU): 64-wide here
    monkeypatch.setattr(moe, "TILED_FP8_DOWN_SCALED_CONFIG", moe.TILED_FP8_DOWN_SCALED_CONFIG._replace(tile_n=64))
    combined_scales, combine = [], moe_rows.combine_rows
    monkeypatch.setattr(moe_rows, "combine_rows", lambda *a, **kw: combined_scales.append(a[3] is not None)
                        or combine(*a, **kw))

    got, want = block("tiled"), block("ragged_dot")
    assert calls == [(True, True, True, False), (False, False, False, True)], calls
    assert combined_scales == [False, False]
    # the same arithmetic: e4m3 values of the hidden rows may round the other way where the kernel's SwiGLU
    # (float32, its own exponential) and XLA's differ by ulps
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=np.abs(want).max() * 2e-2)

    monkeypatch.setattr(moe, "FP8_HIDDEN", "rows")
    want = block("ragged_dot")
    for swiglu_mode, down_mode in (("epilogue", "epilogue"), ("kernel", "epilogue"), ("epilogue", "combine")):
        monkeypatch.setattr(moe, "FP8_SWIGLU", swiglu_mode)
        monkeypatch.setattr(moe, "FP8_DOWN_SCALES", down_mode)
        calls.clear()
        combined_scales.clear()
        got = block("tiled")
        mode = (swiglu_mode, down_mode)
        gate_up_call = (True, True, False, False) if swiglu_mode == "epilogue" else (False, False, False, False)
        down_call = (False, down_mode == "epilogue", False, False)
        assert calls == [gate_up_call, down_call], (mode, calls)  # gate+up, then down
        assert combined_scales == [down_mode == "combine"], (mode, combined_scales)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2, mode
        cosine = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        assert cosine.min() > 0.995, (mode, cosine.min())


def test_every_silu_form_is_silu():
    """Each way the epilogue may compute its SiLU (`grouped_gemm.SILU_FORMS`; "exp2" the default) equals
    x * sigmoid(x) in float64 within float32 rounding, out to where e^-x overflows (large -x); an unknown form is
    refused by name."""
    x = np.concatenate([np.linspace(-120, 120, 4001), [-1e-30, 0.0, 1e-30, -88.8, 88.8]]).astype(np.float32)
    want = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    assert grouped_gemm.SILU == "exp2"
    for form in grouped_gemm.SILU_FORMS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(grouped_gemm, "SILU", form)
            got = np.asarray(grouped_gemm.silu(jnp.asarray(x)), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30, err_msg=form)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouped_gemm, "SILU", "tanh")
        with pytest.raises(ValueError, match="SILU is 'tanh'"):
            grouped_gemm.silu(jnp.asarray(x))


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_silu_forms_on_gpu(monkeypatch):
    """At Qwen3-30B-A3B's gate+up shape and the model's configs (fp8 scaled, bf16): the SwiGLU epilogue with its
    SiLU's exponential as one ex2.approx (the default) gives the outputs it gave with CUDA's expf, within one bf16
    rounding of each (the float32 SiLUs differ by ~1e-6 relative)."""
    sizes = np.bincount(np.random.default_rng(12).integers(0, 16, 3001), minlength=16)
    for seed, (dtype, config) in enumerate(((jnp.float8_e4m3fn, moe.TILED_FP8_SWIGLU_CONFIG),
                                            (jnp.bfloat16, moe.TILED_CONFIGS[0][0]))):
        outs = {}
        for form in grouped_gemm.SILU_FORMS:
            monkeypatch.setattr(grouped_gemm, "SILU", form)
            [outs[form]] = _outputs_of_configs((config,), 2048, 1536, True, dtype, sizes, seed)
        want = outs.pop("exp")
        assert np.abs(want).max() > 0
        for form, got in outs.items():
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6 * np.abs(want).max(),
                                       err_msg=f"{dtype} {form}")


def test_epilogue_pieces_of_128_rows_change_nothing_interpreted():
    """The fp8 epilogues stored in 128-row pieces (the model's configs: `TileConfig.epi_m` 128, half the pieces
    of 64) give the same output bit for bit as in 64-row pieces, interpreted at the model's fp8 gate+up config
    (scales + SwiGLU) and fp8 down at 64-wide tiles."""
    sizes = np.array([200, 0, 129, 5])
    cases = ((moe.TILED_FP8_SWIGLU_CONFIG, 256, 256, True),
             (moe.TILED_FP8_DOWN_SCALED_CONFIG._replace(tile_n=64), 256, 128, False))
    for seed, (config, k, n, swiglu) in enumerate(cases):
        assert config.epi_m == 128
        off, on = _outputs_of_configs((config._replace(epi_m=64), config), k, n, swiglu, jnp.float8_e4m3fn,
                                      sizes, seed, interpreter())
        assert np.abs(off).max() > 0
        np.testing.assert_array_equal(on, off, err_msg=str(config))


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_epilogue_pieces_of_128_rows_change_nothing_on_gpu():
    """At Qwen3-30B-A3B's shapes and the model's fp8 configs (gate+up scaled with SwiGLU, down scaled and
    pipelined): their 128-row epilogue pieces give the same output bit for bit as 64-row pieces."""
    sizes = np.bincount(np.random.default_rng(10).integers(0, 16, 3001), minlength=16)
    cases = ((moe.TILED_FP8_SWIGLU_CONFIG, 2048, 1536, True),
             (moe._down_config(moe.TILED_FP8_DOWN_SCALED_CONFIG, 768), 768, 2048, False))
    for seed, (config, k, n, swiglu) in enumerate(cases):
        assert config.epi_m == 128
        off, on = _outputs_of_configs((config._replace(epi_m=64), config), k, n, swiglu, jnp.float8_e4m3fn,
                                      sizes, seed)
        np.testing.assert_array_equal(on, off, err_msg=str(config))


def _block_scaled_kernels(k, f, n, sizes, seed, interpret=None, down_config=None, split_rows=False):
    """`moe.FP8_HIDDEN` "blocks"' two kernels at the model's configs on one random routing: gate+up [K -> 2F] with
    its scales, SwiGLU and the block quantisation in the epilogue, then down [F -> N] on those block-scaled rows.
    Returns, for the real rows: (gate+up's e4m3 values and scales, `fp8.quantize_blocks` of the float64 SwiGLU of
    the scaled exact products; down's output and its float64 reference on the kernel's own e4m3 rows). down_config:
    default the model's (`moe.down_blocks_config`); split_rows: gate+up with its warpgroups splitting the tile's
    rows (`moe.TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG`) instead of its columns (exchanging their rows' abs-max at
    128-wide blocks), as the model runs it."""
    from jaxllm.fp8 import dequantize_blocks, quantize_blocks

    rng = np.random.default_rng(seed)
    gate_up_config = moe.TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG if split_rows else moe.TILED_FP8_SWIGLU_BLOCKS_CONFIG
    down_config = down_config or moe.down_blocks_config(f)
    groups, m = len(sizes), int(sizes.sum())
    s = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float8_e4m3fn)
    w_gate_up = jnp.asarray(rng.normal(size=(groups, 2 * f, k)), jnp.float8_e4m3fn)
    w_down = jnp.asarray(rng.normal(size=(groups, n, f)), jnp.float8_e4m3fn)
    plan = tile_plan(s, m, gate_up_config.tile_m)
    real = np.asarray(plan.padded_row)
    rows = jnp.zeros((plan.num_rows, k), x.dtype).at[plan.padded_row].set(x)
    row_scale = jnp.asarray(rng.uniform(0.001, 0.01, plan.num_rows), jnp.float32)
    gate_up_scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, 2 * f)), jnp.float32)
    down_scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, n)), jnp.float32)

    def kernels(rows, row_scale, gate_up_scale, down_scale, tile_groups):
        hidden, scales = tiled_grouped_matmul(rows, w_gate_up, tile_groups, gate_up_config, swiglu=True,
                                              row_scale=row_scale, col_scale=gate_up_scale, quantize_out=True,
                                              quantize_block=moe.FP8_HIDDEN_BLOCK, interpret=interpret)
        out = tiled_grouped_matmul(hidden, w_down, tile_groups, down_config, row_block_scales=scales,
                                   col_scale=down_scale, interpret=interpret)
        return hidden, scales, out

    kernels = kernels if interpret is not None else jax.jit(kernels)
    hidden, scales, out = kernels(rows, row_scale, gate_up_scale, down_scale, plan.tile_groups)
    expert = np.repeat(np.arange(groups), sizes)
    gu = np.asarray(moe.grouped_matmul(x.astype(jnp.float32), w_gate_up.astype(jnp.float32), s, "ragged_dot"),
                    np.float64) * np.asarray(row_scale)[real][:, None] * np.asarray(gate_up_scale)[expert]
    swiglu = gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]
    want_hidden, want_scales = quantize_blocks(jnp.asarray(swiglu, jnp.float32), moe.FP8_HIDDEN_BLOCK)
    hidden, scales = hidden[plan.padded_row], scales[:, plan.padded_row]
    want_out = np.asarray(moe.grouped_matmul(dequantize_blocks(hidden, scales), w_down.astype(jnp.float32), s,
                                             "ragged_dot"), np.float64) * np.asarray(down_scale)[expert]
    return ((np.asarray(hidden, np.float32), np.asarray(scales), np.asarray(want_hidden, np.float32),
             np.asarray(want_scales)), (np.asarray(out[plan.padded_row], np.float32), want_out))


def _check_block_scaled(case, changed_values, scale_rtol, out_atol):
    """Interpreted, the products are exact: the scales agree to float32 ulps (SiLU's exponential), the e4m3 values
    exactly, down to one bf16 rounding. Compiled, Hopper's fp8 wgmma accumulates with fewer bits than float32
    (~0.3% of the largest product, as the other fp8 GPU tests measure): scale_rtol, changed_values (the share of
    e4m3 values rounded the other way) and out_atol (relative to the largest output) allow that; a wrong block,
    row or scale would be off by its whole size."""
    (hidden, scales, want_hidden, want_scales), (out, want_out) = case
    np.testing.assert_allclose(scales, want_scales, rtol=scale_rtol)
    assert np.mean(hidden != want_hidden) <= changed_values
    assert np.abs(hidden - want_hidden).max() <= np.abs(want_hidden).max() / 8  # at most one e4m3 step
    np.testing.assert_allclose(out, want_out, rtol=2 ** -7, atol=np.abs(want_out).max() * out_atol)


BLOCK_CASES = [(128, False), (64, False), (128, True)]


@pytest.mark.parametrize("block, split_rows", BLOCK_CASES)
def test_block_scaled_hidden_kernels_interpreted(monkeypatch, block, split_rows):
    """`moe.FP8_HIDDEN` "blocks" at the configs the model uses (Mosaic GPU's interpreter; down's column tiles 64
    wide, which is what it runs): gate+up's epilogue writes e4m3 values and one scale per row and 128-wide block
    (the two compute warpgroups' abs-max exchanged), equal to `fp8.quantize_blocks` of the scaled SwiGLU; down
    applies each 128-deep k-step's block scales (its running sum rescaled at each): the block-scaled sum of the
    exact products. Groups of several tiles, an empty one, part-filled ones, down pipelined over 3 k-steps
    (6 with `moe.FP8_HIDDEN_BLOCK` 64: a warpgroup's columns, no exchange). gate+up's warpgroups split the
    columns (the model's `TILED_FP8_SWIGLU_BLOCKS_CONFIG`) or, with `split_rows`, the rows."""
    monkeypatch.setattr(moe, "FP8_HIDDEN_BLOCK", block)
    down_config = moe.down_blocks_config(384)._replace(tile_n=64)
    _check_block_scaled(_block_scaled_kernels(256, 384, 128, np.array([200, 0, 60]), 11, interpreter(),
                                              down_config, split_rows), 0.0, 1e-5, 2 ** -12)


def test_block_scaled_hidden_refuses_what_it_cannot_take():
    rows = jnp.zeros((128, 256), jnp.float8_e4m3fn)
    weights = jnp.zeros((2, 128, 256), jnp.float8_e4m3fn)
    groups, col = jnp.zeros((1,), jnp.int32), jnp.ones((2, 128), jnp.float32)
    config = moe.down_blocks_config(256)
    with pytest.raises(ValueError, match=r"row_block_scales \[2, 128\]"):
        tiled_grouped_matmul(rows, weights, groups, config, row_block_scales=jnp.ones((128,)), col_scale=col)
    with pytest.raises(ValueError, match="not both"):
        tiled_grouped_matmul(rows, weights, groups, config, row_block_scales=jnp.ones((2, 128)),
                             row_scale=jnp.ones((128,)), col_scale=col)
    with pytest.raises(ValueError, match="quantize_block must be tile_n 64 .not with split_rows. or 2 . tile_n, got 32"):
        tiled_grouped_matmul(rows, jnp.zeros((2, 256, 256), jnp.float8_e4m3fn), groups, moe.TILED_FP8_SWIGLU_CONFIG,
                             swiglu=True, quantize_out=True, quantize_block=32)
    with pytest.raises(ValueError, match="take e4m3 rows"):
        tiled_grouped_matmul(rows.astype(jnp.bfloat16), weights.astype(jnp.bfloat16), groups, config,
                             quantize_out=True)


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
@pytest.mark.parametrize("block, split_rows", BLOCK_CASES)
def test_block_scaled_hidden_kernels_on_gpu(monkeypatch, block, split_rows):
    """Compiled at Qwen3-30B-A3B's expert shapes (K 2048, F 768, N 2048): as the interpreted test, on a routing
    with an empty expert and one of a single row (a few e4m3 values may round the other way: the kernel's SiLU
    is ex2.approx and its division approximate), with 128- and 64-wide blocks."""
    monkeypatch.setattr(moe, "FP8_HIDDEN_BLOCK", block)
    sizes = _routing_with_an_empty_and_a_one_row_expert(12)
    _check_block_scaled(_block_scaled_kernels(2048, 768, 2048, sizes, 13, split_rows=split_rows), 0.1, 2e-2,
                        1e-2)


def _block_scaled_down_of_configs(configs, k, n, sizes, seed, interpret=None):
    """Down on block-scaled e4m3 rows (one random scale per row and k-step, over 4 orders of magnitude) at each of
    `configs` (sharing tile_m and tile_k): its outputs on the real rows."""
    rng = np.random.default_rng(seed)
    groups, m, config = len(sizes), int(sizes.sum()), configs[0]
    plan = tile_plan(jnp.asarray(sizes, jnp.int32), m, config.tile_m)
    rows = jnp.asarray(rng.normal(size=(plan.num_rows, k)) * 8, jnp.float8_e4m3fn)
    weights = jnp.asarray(rng.normal(size=(groups, n, k)), jnp.float8_e4m3fn)
    block_scales = jnp.asarray(10.0 ** rng.uniform(-5, -1, (k // config.tile_k, plan.num_rows)), jnp.float32)
    col_scale = jnp.asarray(rng.uniform(0.001, 0.01, (groups, n)), jnp.float32)

    def down(c):
        fn = lambda *a: tiled_grouped_matmul(*a, c, row_block_scales=block_scales, col_scale=col_scale,  # noqa
                                             interpret=interpret)
        fn = fn if interpret is not None else jax.jit(fn)
        return np.asarray(fn(rows, weights, plan.tile_groups)[plan.padded_row], np.float32)

    return [down(c) for c in configs]


def _split_rows_pair(config):
    """config and the same with its compute warpgroups splitting the tile's rows (`grouped_gemm.split_rows`)."""
    return config, grouped_gemm.split_rows(config)


def test_split_rows_down_changes_nothing_interpreted():
    """Down with its compute warpgroups splitting the tile's rows (each 64 rows x both column halves) gives the
    same outputs bit for bit as splitting the columns: bf16, fp8 with row scales and fp8 on block-scaled rows (the
    running sum rescaled per k-step, with each warpgroup's own rows' scales), pipelined over 3 k-steps at a 64-wide
    column tile (what the interpreter runs), on groups of several tiles, an empty one and part-filled ones. A
    warpgroup that read the other's rows, scales or columns would be off by whole values."""
    sizes = np.array([200, 0, 60])
    config = moe.down_blocks_config(384)._replace(tile_n=64)
    columns, rows = _block_scaled_down_of_configs(_split_rows_pair(config), 384, 128, sizes, 21, interpreter())
    assert np.isfinite(columns).all() and np.abs(columns).max() > 0
    np.testing.assert_array_equal(rows, columns)
    for dtype, k in ((jnp.float8_e4m3fn, 384), (jnp.bfloat16, 192)):
        config = grouped_gemm.pipelined(TileConfig(tile_m=128, tile_n=64, tile_k=128 if k == 384 else 64,
                                                   stages=3, epi_m=64), k)
        columns, rows = _outputs_of_configs(_split_rows_pair(config), k, 128, False, dtype, sizes, 22,
                                            interpreter())
        np.testing.assert_array_equal(rows, columns, err_msg=str(dtype))


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_split_rows_down_on_gpu():
    """Compiled at Qwen3-30B-A3B's down shape (F 768, N 2048) with the model's configs (fp8 on block-scaled rows,
    fp8 with row scales, bf16; pipelined): splitting the tile's rows between the warpgroups gives the outputs of
    splitting its columns, on a routing with an empty expert and one of a single row. The same products in the
    same k order, so equal up to how the wgmma shape orders its float32 sums (one bf16 rounding)."""
    sizes = _routing_with_an_empty_and_a_one_row_expert(22)
    cases = [_block_scaled_down_of_configs(_split_rows_pair(moe.down_blocks_config(768)), 768, 2048, sizes, 23)]
    for config, dtype in ((moe._down_config(moe.TILED_FP8_DOWN_SCALED_CONFIG, 768), jnp.float8_e4m3fn),
                          (moe._down_config(moe.TILED_CONFIGS[0][1], 768), jnp.bfloat16)):
        cases.append(_outputs_of_configs(_split_rows_pair(config), 768, 2048, False, dtype, sizes, 24))
    for columns, rows in cases:
        assert np.isfinite(columns).all()
        np.testing.assert_allclose(rows, columns, rtol=2 ** -7, atol=np.abs(columns).max() * 1e-3)


@pytest.mark.skipif(not ON_GPU, reason="the compiled Hopper kernel needs a GPU")
def test_l2_prefetch_changes_nothing_on_gpu(monkeypatch):
    """`grouped_gemm.PREFETCH` "leader" (L2 prefetches of an expert's weights a wave of tiles ahead) changes no
    value: at Qwen3-30B-A3B's shapes, the fp8 block-scaled pair (gate+up unpipelined, down pipelined) and bf16
    gate+up with SwiGLU and down give the same outputs bit for bit, on a routing with an empty expert, one of a
    single row and unused tiles at the end."""
    sizes = _routing_with_an_empty_and_a_one_row_expert(14)
    bf16_cases = ((moe.TILED_CONFIGS[0][0], 2048, 1536, True),
                  (moe._down_config(moe.TILED_CONFIGS[0][1], 768), 768, 2048, False))

    def outputs():
        fp8_pair = _block_scaled_kernels(2048, 768, 2048, sizes, 15)
        bf16 = [_outputs_of_configs((config,), k, n, swiglu, jnp.bfloat16, sizes, 16)[0]
                for config, k, n, swiglu in bf16_cases]
        return [fp8_pair[0][0], fp8_pair[0][1], fp8_pair[1][0], *bf16]

    monkeypatch.setattr(grouped_gemm, "PREFETCH", "none")
    off = outputs()
    monkeypatch.setattr(grouped_gemm, "PREFETCH", "leader")
    names = ("gate+up e4m3", "gate+up scales", "down", "bf16 gate+up", "bf16 down")
    for name, a, b in zip(names, off, outputs(), strict=True):
        assert np.abs(a).max() > 0
        np.testing.assert_array_equal(b, a, err_msg=name)
