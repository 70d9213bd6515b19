"""A grouped GEMM for Hopper GPUs over tile-aligned groups (Mosaic GPU Pallas): the MoE experts' matmul.

JAX's stock `ragged_dot_mgpu` takes groups that start anywhere: each row tile first searches which group it is in
(an unrolled select per group: 128 per tile for Qwen3-30B-A3B), a tile that straddles two groups is computed once
per group, and its stores are a ladder of partially masked TMA copies. It pipelines one tile at a time, so the
loads of the next tile wait for the previous tile's epilogue.

Here the caller lays the rows out so that every group starts on a row tile boundary (`TilePlan`: each group is
padded with zero rows to a multiple of `tile_m`; at most `tile_m - 1` rows per group, ~6% at one 32K-token pass of
Qwen3-30B-A3B). Then every tile belongs to exactly one group, named in a table computed once per call
(`tile_groups`, -1 for the unused tiles at the end), and the kernel is a plain persistent Hopper GEMM: a memory
warpgroup streams A and B tiles by TMA through a `stages`-deep ring while two compute warpgroups run wgmma, each on
half of the tile's columns, and the epilogue's TMA stores are double-buffered so they overlap the next tile. With
`TileConfig.pipeline_tiles` (down's GEMM in `jaxllm.moe`) the ring runs on across a CTA's tiles, so the next tile's
loads are not held back until the compute warpgroups have consumed the last one's.

Weights may carry more groups than the rows use: the MoE layer scan passes the whole [L * E, N, K] expert stack and
offsets its tile table by layer * E, so the layer's weights are read in place (slicing them out first would copy
~1.2 GiB per layer at Qwen3-30B-A3B's shape).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .fp8_format import E4M3, E4M3_MAX, TINY


class TileConfig(NamedTuple):
    """Block sizes. A CTA computes tile_m rows x (2 * tile_n) columns (one tile_n slice per compute warpgroup),
    stepping tile_k deep through `stages` shared-memory buffers; its epilogue stores epi_m x epi_n pieces.
    Consecutive CTAs walk the (row tile, column tile) grid in bands `band` column tiles wide (L2 reuse of A).
    pipeline_tiles: the memory warpgroup streams a CTA's tiles as one pipeline (JAX's pipeline of pipelines) and
    loads a tile's first k-steps while the compute warpgroups still work on the previous tile, instead of waiting
    for them to finish it; the CTAs then walk only the used row tiles, row by row (`band` unused), which must come
    before the unused ones (tile group -1), as `tile_plan` lays them out, and the k-steps must be a multiple of
    the buffers (min(stages, k-steps)). split_rows: the compute warpgroups split the tile's rows instead (each
    tile_m / 2 rows x 2 * tile_n columns, as CUTLASS's cooperative Hopper kernels split a tile): a row's 2 * tile_n
    outputs stay in one warpgroup, so `quantize_out`'s blocks need no exchange, and each k-step's wgmma is one
    64 x 2 * tile_n instruction per 32 (fp8; 16 for bf16) deep slice instead of two 64 x tile_n ones, reading the
    row tile's halves once each from shared memory instead of the whole of it twice."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    epi_m: int = 64
    epi_n: int = 64
    band: int = 4
    pipeline_tiles: bool = False
    split_rows: bool = False


class TilePlan(NamedTuple):
    """Where each sorted row goes in the tile-aligned layout: `padded_row` [M] (sorted row r -> row padded_row[r]
    of the [num_rows, ...] operand), `tile_groups` int32 [num_rows // tile_m] (the group of each row tile, -1 when
    the tile is past the last group), `num_rows` (static: the layout's row count for any routing)."""

    padded_row: jax.Array
    tile_groups: jax.Array
    num_rows: int


# How the SwiGLU epilogue computes silu(x) = x / (1 + e^-x) in float32, on each of a tile's gate values (64 a
# thread a tile):
#   "exp": e^-x by jnp.exp (on a GPU CUDA's expf: an ex2.approx inside ~8 instructions of range reduction) and a
#     full-range division, as before 2026-11-29's fourteenth session;
#   "exp2" (the default): e^-x as exp2(-x log2 e), one ex2.approx with the kernel's approx_math (relative error
#     ~2^-22, far below the bf16 output's 2^-9 rounding). On an H200 the fp8 gate+up kernel ran 3.7% faster
#     (1.514 vs 1.573 ms at 262,144 rows) and the 30B's fp8 encoder 0.8% (bf16: the same; 2026-11-29). Its
#     division as rsqrt(1 + e^-x)^2 (rsqrt.approx) measured within noise of this, so it is not a form.
SILU = "exp2"
SILU_FORMS = ("exp", "exp2")
LOG2_E = 1.4426950408889634


# How the GEMM on block-scaled rows (`tiled_grouped_matmul`'s row_block_scales) applies a k-step's scales: one
# float32 sum per tile, kept in units of the last k-step's row scales. Before each step's wgmma accumulates onto it,
# the sum is multiplied by last / this step's scales (a division per row, a multiply per value); the epilogue
# multiplies it by the last step's scales. (Interpreted, the product is added to the rescaled sum instead: Mosaic
# GPU's interpreter has no run_state.) The sum of each block's exact products times its scale.
# Other forms, measured and removed on H200s (2026-11-29/30; docs/BENCHMARKS.md, nineteenth, twenty-second and
# twenty-fourth sessions), none faster:
#   "promote": each step's product in its own zeroed accumulator, scaled and added (DeepSeek-V3's promotion; two
#     accumulators, so 64-wide column tiles): down 0.997-1.114 ms against 0.888-0.921;
#   "halves": the tile's rows in two accumulators, one half rescaled while the other's wgmma runs: 0.875-0.955;
#   (`git show 1c53d63:jaxllm/grouped_gemm.py` has both);
#   the two compute warpgroups issuing each k-step's products in turn (an order barrier each way): 0.942-0.959
#     (`git show ca951a0`); a ping-pong over the tile's column halves: 1.110-1.196 (`git show 303aeb8`).
#   "factors": each step's factor s[b - 1] / s[b] computed by XLA before the kernel, the first step's rescale
#     skipped, the last scales applied in the epilogue (no division in the kernel): 0.889-0.903 against
#     0.855-0.903, and not bit-equal to the kernel's division on a GPU (`git show dc9602b`).
#   "stagger": compute warpgroup 1 starting each tile only once warpgroup 0 had finished its first 1 or 3 k-steps,
#     so that their waits and rescales fall at different moments: bit-equal, and no faster for any form the model
#     runs (3 rounds, 2026-11-30: down on block scales 0.727 of dense, 0.722 staggered by 1, 0.690 by 3;
#     `git show e7e72c8`). Nor was the model's config beaten by 34 others for this form (`bench_moe.py
#     --tune-blocks`), and cuBLAS's own dense GEMM on the same 1 x 128 row blocks runs at the speed of this one
#     (`scripts/bench_scale_forms.py`; docs/BENCHMARKS.md, twenty-fifth session).


# Whether the expert GEMMs warm L2 with each expert's weights one wave of tiles ahead: "leader" (the CTA whose next
# tile is its expert's first row tile TMA-prefetches that tile's weight columns into L2 as its current tile starts,
# so the next wave's tiles of that expert start from L2 instead of HBM; one prefetch per expert and column tile),
# "fp8" (the default: "leader" on e4m3 operands, "none" on 16-bit ones) or "none". A trained router spreads its
# rows over all 128 experts, so nearly every wave meets experts whose weights are not in L2 yet (the random model's
# routing reuses the same 8). H200s, 2026-11-30, the 30B's encoders: fp8 with the rows spread evenly 327.8 vs 328.9
# ms (faster in each of 3 alternating rounds), fp8 on the random routing 319.8 vs 320.1 (3 of 3 rounds); bf16 with
# the rows spread 470.9 vs 466.6 ms, slower in each of 3 rounds, so 16-bit kernels do not prefetch. Prefetching
# every CTA's next tile instead (its weights, or its rows too) made the encoders 10-53 ms slower (`git show
# c7e1bec`). Prefetches change no value. Read at trace time.
PREFETCH = "fp8"
PREFETCH_FORMS = ("none", "leader", "fp8")
PREFETCH_BOX = 256  # elements per dimension of one TMA prefetch (the hardware's limit)


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x) in float32, as the kernel's epilogue computes it (`SILU`)."""
    if SILU not in SILU_FORMS:
        raise ValueError(f"grouped_gemm.SILU is {SILU!r}; use one of {SILU_FORMS}")
    if SILU == "exp":
        return x / (1.0 + jnp.exp(-x))
    return x / (1.0 + jnp.exp2(x * -LOG2_E))


def padded_row_count(num_rows: int, num_groups: int, tile_m: int) -> int:
    """Rows of the tile-aligned layout of num_rows rows in num_groups groups: enough for any group sizes (each
    group rounds up to a multiple of tile_m, so at most tile_m - 1 padding rows per group)."""
    return -(-(num_rows + num_groups * (tile_m - 1)) // tile_m) * tile_m


def tile_plan(group_sizes: jax.Array, num_rows: int, tile_m: int, row_group: jax.Array | None = None) -> TilePlan:
    """The tile-aligned layout for rows sorted by group with sizes group_sizes [G] (summing to num_rows).
    row_group int32 [num_rows], the group of each sorted row, where the caller has it already (a sort by group
    does): otherwise it is found from the sizes (a comparison of every row with every group's end)."""
    sizes = group_sizes.astype(jnp.int32)
    padded_sizes = (sizes + tile_m - 1) // tile_m * tile_m
    ends = jnp.cumsum(sizes)
    padded_ends = jnp.cumsum(padded_sizes)
    shift = (padded_ends - padded_sizes) - (ends - sizes)  # each group's start moves by this many rows
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    if row_group is None:
        # method="compare_all": one fused comparison per query (G is small) instead of a binary search's while
        # loop, which on a GPU costs a host round trip per step
        row_group = jnp.searchsorted(ends, rows, side="right", method="compare_all")
    padded_row = rows + shift[row_group]
    total = padded_row_count(num_rows, sizes.shape[0], tile_m)
    tile_starts = jnp.arange(total // tile_m, dtype=jnp.int32) * tile_m
    tile_groups = jnp.searchsorted(padded_ends, tile_starts, side="right", method="compare_all").astype(jnp.int32)
    tile_groups = jnp.where(tile_starts < padded_ends[-1], tile_groups, -1)
    return TilePlan(padded_row.astype(jnp.int32), tile_groups, total)


def check_shapes(rows: jax.Array, weights: jax.Array, tile_groups: jax.Array, config: TileConfig,
                 transposed: bool, swiglu: bool = False, row_scale: jax.Array | None = None,
                 col_scale: jax.Array | None = None, row_block_scales: jax.Array | None = None,
                 quantize_out: bool = False, quantize_block: int | None = None) -> None:
    """Raises ValueError naming the dimension that `tiled_grouped_matmul` cannot take with this config."""
    m, k = rows.shape
    n = weights.shape[1] if transposed else weights.shape[2]
    k_w = weights.shape[2] if transposed else weights.shape[1]
    out_n = n // 2 if swiglu else n
    problems = []
    if k != k_w:
        problems.append(f"contraction: rows have {k}, weights {k_w}")
    if m % config.tile_m or tile_groups.shape != (m // config.tile_m,):
        problems.append(f"rows {m} must be tile_groups {tile_groups.shape[0]} tiles of tile_m {config.tile_m}")
    if out_n % (2 * config.tile_n) or (swiglu and n % 2):
        problems.append(f"output columns {out_n} must be a multiple of 2 * tile_n = {2 * config.tile_n}")
    if k % config.tile_k:
        problems.append(f"contraction {k} must be a multiple of tile_k {config.tile_k}")
    elif config.pipeline_tiles and (k // config.tile_k) % min(config.stages, k // config.tile_k):
        problems.append(f"pipeline_tiles: the k-steps {k // config.tile_k} must be a multiple of stages "
                        f"{config.stages} (see `pipelined`)")
    if config.tile_m % config.epi_m or config.tile_n % config.epi_n:
        problems.append("the epilogue piece (epi_m, epi_n) must divide (tile_m, tile_n)")
    if config.split_rows and (config.tile_m % 128 or (config.tile_m // 2) % config.epi_m):
        problems.append(f"split_rows takes tile_m a multiple of 128 (each warpgroup's wgmma rows a multiple of 64) "
                        f"and epi_m dividing tile_m / 2, got tile_m {config.tile_m}, epi_m {config.epi_m}")
    if rows.dtype != weights.dtype:
        problems.append(f"rows are {rows.dtype} but weights {weights.dtype}")
    if row_scale is not None and row_block_scales is not None:
        problems.append("give row_scale or row_block_scales, not both")
    elif (row_scale is None and row_block_scales is None) != (col_scale is None):
        problems.append("row_scale (or row_block_scales) and col_scale come together")
    elif row_scale is not None and (row_scale.shape != (m,) or col_scale.shape != (weights.shape[0], n)):
        problems.append(f"scales must be row_scale [{m}] and col_scale [{weights.shape[0]}, {n}], got "
                        f"{list(row_scale.shape)} and {list(col_scale.shape)}")
    elif row_block_scales is not None and (row_block_scales.shape != (k // config.tile_k, m)
                                           or col_scale.shape != (weights.shape[0], n)):
        problems.append(f"scales must be row_block_scales [{k // config.tile_k}, {m}] (one per tile_k-deep block "
                        f"of each row) and col_scale [{weights.shape[0]}, {n}], got {list(row_block_scales.shape)} "
                        f"and {list(col_scale.shape)}")
    if (row_block_scales is not None or quantize_out) and jnp.dtype(rows.dtype).itemsize != 1:
        problems.append("row_block_scales and quantize_out take e4m3 rows")
    if quantize_block not in (None, config.tile_n, 2 * config.tile_n) or (config.split_rows
                                                                         and quantize_block == config.tile_n):
        problems.append(f"quantize_block must be tile_n {config.tile_n} (not with split_rows) or 2 * tile_n, got "
                        f"{quantize_block}")
    if problems:
        raise ValueError("tiled_grouped_matmul: " + "; ".join(problems))


def pipelined(config: TileConfig, k: int) -> TileConfig:
    """config with `pipeline_tiles` on at contraction k: stages cut to the largest count that divides its
    k-steps."""
    steps = k // config.tile_k
    stages = max(s for s in range(1, min(config.stages, steps) + 1) if steps % s == 0)
    return config._replace(pipeline_tiles=True, stages=stages)


def split_rows(config: TileConfig) -> TileConfig:
    """config with its compute warpgroups splitting each tile's rows (`TileConfig.split_rows`), its epilogue pieces
    cut to a warpgroup's tile_m / 2 rows where they were taller."""
    return config._replace(split_rows=True, epi_m=min(config.epi_m, config.tile_m // 2))


def tiled_grouped_matmul(rows: jax.Array, weights: jax.Array, tile_groups: jax.Array,
                         config: TileConfig = TileConfig(), *, transposed: bool = True, swiglu: bool = False,
                         row_scale: jax.Array | None = None, col_scale: jax.Array | None = None,
                         row_block_scales: jax.Array | None = None, quantize_out: bool = False,
                         quantize_block: int | None = None, out_dtype: Any = None, num_sms: int | None = None,
                         interpret: Any = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """rows [R, K] in `TilePlan` layout, weights [G, N, K] (`transposed`, contraction innermost) or [G, K, N],
    tile_groups int32 [R // tile_m]: row tile t of the result is rows' tile t times weights[tile_groups[t]]
    (float32 accumulation, `out_dtype` out: default rows' dtype, bfloat16 for fp8 rows). With `swiglu`, the
    weights' N outputs are gate over up (N = 2F) and the result is silu(gate) * up [R, F], computed from the
    float32 accumulators in the epilogue (one rounding, and the [R, 2F] product never goes to memory). Tiles whose
    group is negative (all after the used ones with `pipeline_tiles`) are skipped: their rows of the result are
    left unwritten (garbage), so callers read only rows of real tiles. num_sms: the persistent grid's size
    (default: the device's core count; 2 when interpreted); interpret: Mosaic GPU interpret params (runs on a CPU,
    for tests).

    fp8: rows and weights float8_e4m3fn (weights [G, N, K]: fp8 wgmma takes both operands K-major) give the
    unscaled products of the e4m3 values (float32 accumulation, bfloat16 out by default). With row_scale float32
    [R] and col_scale float32 [G, N] (W8A8: `jaxllm.moe`'s experts, gate+up with `swiglu` and down without), the
    accumulators are multiplied by row_scale[r] * col_scale[group, n] in the epilogue (before SwiGLU: gate and up
    each by their own columns): the scales are TMA-copied to shared memory when a tile starts, behind its main
    loop, and waited on barriers.

    Block-scaled fp8 (`jaxllm.moe`'s experts with `FP8_HIDDEN` "blocks"): with row_block_scales float32
    [K // tile_k, R] (and col_scale, without row_scale) the rows' e4m3 values carry one scale per row and tile_k-deep
    block of K, applied a k-step at a time by rescaling the running sum (col_scale in the epilogue). With `quantize_out`
    the float32 result (scaled, SwiGLU'd) is quantised to e4m3 in the epilogue with one scale per row and block of
    `quantize_block` columns: the CTA's 2 * tile_n (the default: the two compute warpgroups exchange their rows'
    abs-max through shared memory) or a warpgroup's tile_n (no exchange). Returns (e4m3 [R, out_n], float32 scales
    [out_n // quantize_block, R]), scale = max(abs-max / 448, 1e-12) as `jaxllm.fp8.quantize_blocks`.

    Mosaic GPU's interpreter (jax 0.10.2) runs the fp8 kernel at 64-wide column
    tiles but hangs at 128-wide ones and at 64-row tiles of bf16 (the model's configs are tested compiled on an
    H200)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    check_shapes(rows, weights, tile_groups, config, transposed, swiglu, row_scale, col_scale, row_block_scales,
                 quantize_out, quantize_block)
    scaled = col_scale is not None  # the epilogue multiplies by the column scales (and row_scale, where given)
    row_scaled = row_scale is not None
    block_scaled = row_block_scales is not None
    if PREFETCH not in PREFETCH_FORMS:
        raise ValueError(f"grouped_gemm.PREFETCH is {PREFETCH!r}; use one of {PREFETCH_FORMS}")
    # (no value changes: the interpreter skips them)
    prefetch = interpret is None and (PREFETCH == "leader" or (PREFETCH == "fp8" and rows.dtype == E4M3))
    if interpret is not None and transposed:  # the interpreter cannot transpose a shared-memory operand yet
        weights, transposed = jnp.swapaxes(weights, 1, 2), False
    m, k = rows.shape
    n = weights.shape[1] if transposed else weights.shape[2]
    out_n = n // 2 if swiglu else n
    itemsize = jnp.dtype(rows.dtype).itemsize
    # blocks that span both compute warpgroups' columns
    exchange = quantize_block in (None, 2 * config.tile_n) and not config.split_rows
    if quantize_out:
        out_dtype = E4M3
    elif out_dtype is None:
        out_dtype = jnp.bfloat16 if itemsize == 1 else rows.dtype
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    cta_n = 2 * tn  # output columns per tile: one tile_n slice per compute warpgroup (or all, `split_rows`)
    wm, wn = (tm // 2, cta_n) if config.split_rows else (tm, tn)  # each compute warpgroup's part of a tile
    m_tiles, n_tiles, k_steps = m // tm, out_n // cta_n, k // tk
    parts = 2 if swiglu else 1  # weight tiles per step: (gate, up) or the one matrix

    def smem_layout(minor: int, size: int) -> tuple[Any, ...]:
        swizzle = plgpu.find_swizzle(minor * size * 8)
        return plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle)

    operand_layout = smem_layout(tk, itemsize)
    out_layout = smem_layout(config.epi_n, jnp.dtype(out_dtype).itemsize)
    b_block, b_index = ((cta_n, tk), lambda s: (0, s)) if transposed else ((tk, cta_n), lambda s: (s, 0))
    b_spec = plgpu.BlockSpec(b_block, b_index, transforms=operand_layout, memory_space=plgpu.SMEM)

    slots = min(config.stages, k_steps)  # the pipeline's buffers per operand

    # block-scaled rows: each k-step's row scales [1, tm] ride the pipeline with the step's tiles
    block_scale_specs = [plgpu.BlockSpec((1, tm), lambda s: (s, 0), memory_space=plgpu.SMEM)] if block_scaled else []

    def pipeline(step, context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=config.stages, compute_context=context, pipeline_state=state,
            in_specs=[plgpu.BlockSpec((tm, tk), lambda s: (0, s), transforms=operand_layout,
                                      memory_space=plgpu.SMEM)] + [b_spec] * parts + block_scale_specs)

    def weight_tile(b_gmem, group, ni, part):
        cols = pl.ds(part * out_n + ni * cta_n, cta_n)
        return b_gmem.at[group].at[cols, :] if transposed else b_gmem.at[group].at[:, cols]

    # scales: (row scales [tm] unless block-scaled, column scales [parts, tn]) per compute warpgroup, each copy with
    # its own barrier
    copies = int(row_scaled) + parts  # scale copies per warpgroup and tile
    scale_buffers = dict(col_smem=plgpu.SMEM((2, parts, wn), jnp.float32),
                         scale_barriers=plgpu.Barrier(num_barriers=2 * copies)) if scaled else {}
    if row_scaled:
        scale_buffers["row_smem"] = plgpu.SMEM((2, wm), jnp.float32)
    if quantize_out:
        # amax_smem[slot, wg]: each warpgroup's row abs-max, in two slots by tile parity (the other warpgroup may
        # still read the last tile's), exchanged on a barrier of both compute warpgroups; amax_smem[2, 0]: the rows'
        # scales on their way out. (One buffer, and the barrier's name sorting after the others': Mosaic GPU's
        # interpreter, jax 0.10.2, hung with a second scale buffer, or with the barrier named "amax_barrier".)
        scale_buffers["amax_smem"] = plgpu.SMEM((3, 2, tm), jnp.float32)
        if exchange:
            scale_buffers["wg_exchange_barrier"] = plgpu.Barrier(num_arrivals=2)

    def body(groups_gmem, used_gmem, a_gmem, b_gmem, *rest):
        if quantize_out:
            *rest, out_gmem, out_scale_gmem = rest
        else:
            *rest, out_gmem = rest
        block_scales_gmem = rest.pop(0) if block_scaled else None
        row_scale_gmem = rest.pop(0) if row_scaled else None
        col_scale_gmem = rest.pop(0) if scaled else None
        unused = lambda *_, **__: None
        block_scale_tile = (lambda rs: [block_scales_gmem.at[:, rs]]) if block_scaled else (lambda rs: [])

        @functools.partial(pl.run_scoped,
                           buffers=pipeline(unused, unused).get_allocations(
                               a_gmem, *(weight_tile(b_gmem, 0, 0, p) for p in range(parts)),
                               *block_scale_tile(pl.ds(0, tm))),
                           out_smem=plgpu.SMEM((2, 2, config.epi_m, config.epi_n), out_dtype,
                                               transforms=out_layout),
                           **scale_buffers, collective_axes="wg")
        def scope(buffers, out_smem, row_smem=None, col_smem=None, scale_barriers=None, amax_smem=None,
                  wg_exchange_barrier=None):
            wg = lax.axis_index("wg")
            wg_rows = pl.ds(wg * wm if config.split_rows else 0, wm)
            wg_cols = pl.ds(0 if config.split_rows else wg * tn, wn)

            if config.pipeline_tiles:  # the used row tiles only (they come first), row by row
                used_tiles = used_gmem[0]
                grid = (used_tiles, n_tiles)
            else:
                grid = (m_tiles * n_tiles,)

            def tile_at(step):
                """The (row tile, column tile) of the grid's linear step."""
                if config.pipeline_tiles:
                    return step // n_tiles, step % n_tiles
                return plgpu.planar_snake(step, (m_tiles, n_tiles), 1, config.band)

            def prefetch_next_tile(local_index):
                """`PREFETCH` "leader" ("fp8" on e4m3 operands): L2 prefetches of this CTA's next tile's weight
                columns, by the memory warpgroup, where that tile is its expert's first row tile."""
                step = (local_index + 1) * lax.axis_size("sm") + lax.axis_index("sm")
                total = grid[0] * grid[1] if config.pipeline_tiles else grid[0]
                mi, ni = tile_at(jnp.minimum(step, total - 1))
                group = groups_gmem[mi]
                first = (mi == 0) | (groups_gmem[jnp.maximum(mi - 1, 0)] != group)

                @pl.when((step < total) & (group >= 0) & first & (lax.axis_index("wg") == 2))
                def _():
                    for start in range(0, k, PREFETCH_BOX):
                        ks = pl.ds(start, min(PREFETCH_BOX, k - start))
                        for p in range(parts):
                            tile = weight_tile(b_gmem, group, ni, p)
                            plgpu.async_prefetch(tile.at[:, ks] if transposed else tile.at[ks, :])

            @plgpu.nd_loop(grid, collective_axes="sm")
            def tile_loop(info):
                if config.pipeline_tiles:
                    mi, ni = info.index
                else:
                    mi, ni = tile_at(info.index[0])
                if prefetch:
                    prefetch_next_tile(info.local_index)
                group = groups_gmem[mi]

                @pl.when(group >= 0)
                def _():
                    row_slice, col_slice = pl.ds(mi * tm, tm), pl.ds(ni * cta_n, cta_n)

                    def start_scale_copies():
                        """TMA copies of this tile's scales (this warpgroup's columns); waited in the epilogue."""
                        barrier = lambda i: scale_barriers.at[wg * copies + i]  # noqa: E731
                        if row_scaled:
                            plgpu.copy_gmem_to_smem(row_scale_gmem.at[row_slice].at[wg_rows], row_smem.at[wg],
                                                    barrier(0))
                        for p in range(parts):
                            cols = pl.ds(p * out_n + ni * cta_n + (0 if config.split_rows else wg * tn), wn)
                            plgpu.copy_gmem_to_smem(col_scale_gmem.at[group].at[cols], col_smem.at[wg, p],
                                                    barrier(int(row_scaled) + p))

                    def epilogue_values(values):
                        """The warpgroup's float32 results: the accumulators, scaled (W8A8), SwiGLU'd. The scales'
                        barriers are waited on before."""
                        if scaled:
                            shape = values[0].shape
                            row = lax.broadcast_in_dim(row_smem[wg], shape, [0]) if row_scaled else 1.0
                            values = [v * row * lax.broadcast_in_dim(col_smem[wg, p], shape, [1])
                                      for p, v in enumerate(values)]
                        if swiglu:
                            gate, up = values
                            return silu(gate) * up
                        return values[0]

                    def quantized(result):
                        """result [wm, wn] (this warpgroup's part) in e4m3 with one scale per row and block (the
                        CTA's 2 * tn columns: with the other compute warpgroup's abs-max where it holds half),
                        and the scales."""
                        amax = jnp.max(jnp.abs(result), axis=1)
                        if exchange:
                            slot = info.local_index % 2
                            amax_smem[slot, wg] = amax
                            plgpu.barrier_arrive(wg_exchange_barrier)
                            plgpu.barrier_wait(wg_exchange_barrier)
                            amax = jnp.maximum(amax, amax_smem[slot, 1 - wg])
                        scale = jnp.maximum(amax / E4M3_MAX, TINY)
                        return (result / lax.broadcast_in_dim(scale, (wm, wn), [0])).astype(out_dtype), scale

                    def context(run):
                        if scaled:
                            start_scale_copies()
                        if block_scaled:  # the running sum and the last step's scales: values the steps carry
                            total, last = run((jnp.zeros((wm, wn), jnp.float32), jnp.ones((wm,), jnp.float32)))
                            finish([total * lax.broadcast_in_dim(last, (wm, wn), [0])])
                            return

                        @functools.partial(pl.run_scoped,
                                           accs=[plgpu.ACC((wm, wn), jnp.float32) for _ in range(parts)])
                        def _(accs):
                            run(tuple(accs))
                            finish([acc[...] for acc in accs])

                    def finish(values):
                        """The epilogue from the warpgroup's float32 values (one per part): scales waited for and
                        applied, SwiGLU, (quantisation,) the stores."""
                        if scaled:
                            for i in range(copies):
                                plgpu.barrier_wait(scale_barriers.at[wg * copies + i])
                        result = epilogue_values(values)
                        if quantize_out:
                            result, out_scale = quantized(result)
                        else:
                            result = result.astype(out_dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last tile's stores left the slots
                        piece = 0
                        for pm in range(wm // config.epi_m):
                            for pn in range(wn // config.epi_n):
                                slot = piece % 2
                                piece += 1
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                rs = slice(pm * config.epi_m, (pm + 1) * config.epi_m)
                                cs = slice(pn * config.epi_n, (pn + 1) * config.epi_n)
                                out_smem[wg, slot] = result[rs, cs]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem.at[row_slice, col_slice].at[wg_rows, wg_cols].at[rs, cs])
                        if quantize_out and exchange:  # the scales (both warpgroups hold them): stored by the first
                            @pl.when(wg == 0)
                            def _():
                                amax_smem[2, 0] = out_scale
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(amax_smem.at[2, 0], out_scale_gmem.at[ni, row_slice])
                        elif quantize_out:  # each warpgroup its own block's (rows)
                            block = ni if config.split_rows else 2 * ni + wg
                            amax_smem[2, wg, pl.ds(0, wm)] = out_scale
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(amax_smem.at[2, wg, pl.ds(0, wm)],
                                                    out_scale_gmem.at[block, row_slice].at[wg_rows])

                    def weight_operand(b_smem):
                        return (b_smem.at[wg_cols, :].transpose((1, 0)) if transposed
                                else b_smem.at[:, wg_cols])

                    def step(indices, a_smem, *rest):
                        a_smem = a_smem.at[wg_rows] if config.split_rows else a_smem

                        def product(acc):
                            plgpu.wgmma(acc, a_smem, weight_operand(rest[0]))
                            return acc[...]

                        def accumulated(total, b_smem):
                            """The step's product accumulated onto the (rescaled) running sum."""
                            if interpret is None:  # the wgmma accumulates onto it
                                return pl.run_state(lambda acc: plgpu.wgmma(acc, a_smem, weight_operand(b_smem)))(
                                    plgpu.ACC.init(total))
                            # the interpreter has no run_state: the product added (same sum, rounded apart)
                            return total + pl.run_scoped(product, plgpu.ACC((wm, wn), jnp.float32))

                        if block_scaled:  # the sum rescaled to this step's scales, then the product onto it
                            b_smem, step_scales, (total, last) = rest
                            scale = step_scales[0, wg_rows]
                            total = total * lax.broadcast_in_dim(last / scale, (wm, wn), [0])
                            return accumulated(total, b_smem), scale
                        b_tiles, accs = rest[:-1], rest[-1]
                        for b_smem, acc in zip(b_tiles, accs):
                            plgpu.wgmma(acc, a_smem, weight_operand(b_smem))
                        plgpu.wgmma_wait(0)
                        return accs

                    # pipeline_tiles: a CTA's first tile fills the buffers (START); the later ones (STEADY) load
                    # each k-step as soon as the previous tile's step in its buffer is consumed
                    state = (jnp.where(info.local_index == 0, int(plgpu.PipelinePipeline.START),
                                       int(plgpu.PipelinePipeline.STEADY)) if config.pipeline_tiles else None)
                    pipeline(step, context, state)(a_gmem.at[row_slice, :],
                                                   *(weight_tile(b_gmem, group, ni, p) for p in range(parts)),
                                                   *block_scale_tile(row_slice), allocations=buffers)

            if config.pipeline_tiles:
                # a STEADY pipeline does not wait for its last steps to be consumed: the memory warpgroup waits
                # for the last tile's (one per buffer) here, as a STOP pipeline would
                @pl.when((lax.axis_index("wg") == 2) & (lax.axis_index("sm") < used_tiles * n_tiles))
                def _():
                    [consumed] = buffers["flat_consumed_barrier_refs"]
                    for slot in range(slots):
                        plgpu.barrier_wait(consumed.at[slot])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if num_sms is None:  # the interpreter simulates every SM's threads: two are enough there
        num_sms = 2 if interpret is not None else getattr(jax.devices()[0], "core_count", None) or 132
    out_type = jax.ShapeDtypeStruct((m, out_n), out_dtype)
    if quantize_out:
        out_type = (out_type, jax.ShapeDtypeStruct((out_n // (cta_n if exchange else wn), m), jnp.float32))
    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(num_sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg", interpret=interpret,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=SILU != "exp"))  # ex2.approx (`silu`)
    scales = [s.astype(jnp.float32) for s in (row_block_scales, row_scale, col_scale) if s is not None]
    # pipeline_tiles: the used row tiles, the first ones (`tile_plan`); otherwise unread
    used = (jnp.sum(tile_groups >= 0, dtype=jnp.int32)[None] if config.pipeline_tiles
            else jnp.zeros((1,), jnp.int32))
    return kernel(tile_groups.astype(jnp.int32), used, rows, weights, *scales)
