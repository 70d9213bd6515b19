"""Qwen3-MoE's sparse block: routing as transformers computes it, a dropless dispatch, and grouped GEMMs.

For N tokens and k experts per token, the N*k (token, expert) rows are sorted by expert, so each expert's rows are
one contiguous group; one grouped GEMM computes gate and up for every group at once (weights [E, 2F, D],
contraction innermost), one more computes down ([E, D, F]), and the k weighted outputs of each token are gathered
back through the inverse permutation and summed in float32 (a gather, never a scatter-add of floats: the result
does not depend on thread timing). No token is ever dropped: group sizes are whatever the router chose. The rows
move both ways in `jaxllm.moe_rows` (Pallas kernels on a GPU).

The grouped GEMM's implementation is chosen per backend in one place, `default_grouped_matmul_impl`:
- "ragged_dot": `jax.lax.ragged_dot_general` (XLA). On a CPU it is a plain loop over groups; on a GPU XLA lowers
  it to a dense dot over a group-masked copy of the input (E times the work, tens of GiB at Qwen3-30B-A3B's
  shapes), so it is the GPU's choice only for the small shapes the kernel cannot take.
- "mgpu": JAX's Hopper grouped GEMM (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, Mosaic GPU: TMA loads
  and wgmma, a persistent grid), on GPUs with compute capability 9.x.
- "tiled": our Hopper kernel (`jaxllm.grouped_gemm`): the rows are laid out so that each expert's group starts on a
  row-tile boundary, the tile -> expert table is computed once, and the weights are read in place from the layer
  stack (no per-layer copy). Off a GPU it runs in Mosaic GPU's interpreter (tests only: slow).
docs/BENCHMARKS.md has the candidates measured side by side ("Qwen3-30B-A3B").
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .devices import on_gpu as _on_gpu  # moe._on_gpu: a name tests can replace
from .fp8 import (Fp8Matrix, QuantizedRows, ValueAndRows, dequantize_blocks, native_fp8_available, quantize_blocks,
                  quantize_rows, quantize_rows_one_pass)
from .grouped_gemm import TileConfig, pipelined, silu, tile_plan, tiled_grouped_matmul
from .moe_rows import ExpertOutputs, ExpertRowScales, layout_rows
from .top_k import router_top_k_pallas, top_k_rows

GROUPED_MATMUL_IMPLS = ("ragged_dot", "mgpu", "tiled")

# ragged_dot_mgpu's tilings, by contraction size: the best of a sweep on an H100 at Qwen3-30B-A3B's expert shapes
# (scripts/bench_moe.py --tune, docs/BENCHMARKS.md): gate+up (K 2048, N 1536) 466 TFLOP/s with 192-wide column
# blocks, down (K 768, N 2048) 294 with 128-deep k steps. A shape neither divides falls back to "ragged_dot".
MGPU_TILINGS = (
    {"block_m": 128, "block_n": 192, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 4},
    {"block_m": 128, "block_n": 128, "block_k": 128, "max_concurrent_steps": 3, "grid_block_n": 4},
    {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2},
)


MGPU_ROW_MULTIPLE = 8  # ragged_dot_mgpu's row count must be a multiple of its 8-row TMA tiling


def mgpu_tiling(n: int, k: int) -> dict[str, int] | None:
    """The tiling for a grouped GEMM with N output columns and contraction K: the measured best for large K
    (gate+up) first, for small K (down) second, else the first that divides the shape; None if none does."""
    order = MGPU_TILINGS if k >= 1024 else (MGPU_TILINGS[1], MGPU_TILINGS[0], MGPU_TILINGS[2])
    for tiling in order:
        if k % tiling["block_k"] == 0 and n % (tiling["block_n"] * tiling["grid_block_n"]) == 0:
            return tiling
    return None


@functools.cache
def _hopper() -> bool:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    try:
        return int(str(device.compute_capability).split(".")[0]) == 9
    except (AttributeError, ValueError):
        return False


def default_grouped_matmul_impl() -> str:
    """The grouped GEMM for the default backend: "tiled" on a Hopper GPU, "ragged_dot" elsewhere."""
    return "tiled" if _hopper() else "ragged_dot"


# the tiled kernel's block sizes, as (gate+up with SwiGLU fused, down) pairs sharing one row tiling: the first pair
# whose shapes divide both expert GEMMs is used. The first is the best of a sweep on an H100 at Qwen3-30B-A3B's
# shapes (D 2048, F 768; scripts/bench_moe.py --tune-tiled, docs/BENCHMARKS.md); the last takes small test models.
TILED_CONFIGS = (
    (TileConfig(tile_m=128, tile_n=64, tile_k=64, stages=4, band=16),
     TileConfig(tile_m=128, tile_n=128, tile_k=64, stages=4, band=8)),
    (TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, band=1),) * 2,
)


# fp8 (W8A8) experts on the tiled kernel: e4m3 operands, 128-deep k steps (a 128-byte swizzle of one-byte values),
# gate+up without the SwiGLU epilogue (`FP8_SWIGLU` "kernel": the scales and SwiGLU after it, in their own kernel;
# the default "epilogue" uses `TILED_FP8_SWIGLU_CONFIG` for gate+up instead). The best of a sweep on an H200
# (scripts/bench_moe.py --fp8 --tune-tiled, 2026-11-28): gate+up 1,108 TFLOP/s, down 884 (dense fp8: 1,271 / 1,063)
TILED_FP8_CONFIGS = (
    (TileConfig(tile_m=128, tile_n=128, tile_k=128, stages=3, band=16),
     TileConfig(tile_m=128, tile_n=128, tile_k=128, stages=4, band=16)),
    (TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, band=1),) * 2,
)


# fp8 gate+up with its scales and SwiGLU in the kernel's epilogue (`FP8_SWIGLU`="epilogue"): two [tile_m, tile_n]
# float32 accumulators per compute warpgroup (gate and up), so tile_n 64 as the bf16 SwiGLU config; 128-deep k
# steps of e4m3; 3 stages of 48 KiB. Kept after a sweep of the 14 configs that fit on an H200 (bench_moe.py --fp8
# --tune-tiled, 2026-11-29, 262,144 rows): this one 1.56 ms in the run's candidate row and 1.77 in its sweep row,
# the sweep's best 1.60 (band 8): within that noise. Both fp8 epilogue configs store 128-row pieces (epi_m 128:
# half the pieces of 64, so half the epilogue's barrier rounds, for 32 KiB more shared memory): the 30B's fp8
# encoder 0.2% faster in each of 4 alternating rounds on an H200 (scripts/bench_ratio.py, 2026-11-29)
TILED_FP8_SWIGLU_CONFIG = TileConfig(tile_m=128, tile_n=64, tile_k=128, stages=3, epi_m=128, band=16)

# fp8 down with its scales in the kernel's epilogue (`FP8_DOWN_SCALES`="epilogue"): the best of a sweep on an H200
# (scripts/bench_moe.py --fp8 --tune-tiled, 2026-11-29): 1.09 ms at 262,144 rows, the unscaled kernel 1.02-1.08.
# 3 stages: pipelined over F 768's six k-steps it runs 3 anyway (`grouped_gemm.pipelined`), and unpipelined
# (`PIPELINED_DOWN` off) 4 stages with 128-row epilogue pieces ask for 258 KiB of shared memory (227 fit)
TILED_FP8_DOWN_SCALED_CONFIG = TileConfig(tile_m=128, tile_n=128, tile_k=128, stages=3, epi_m=128, band=16)

# how the fp8 experts quantise the hidden rows (silu(gate) * up) for down: "blocks" (one scale per row and
# `FP8_HIDDEN_BLOCK`-wide block of F, as Qwen3's FP8 checkpoints quantise activations: on the tiled kernel gate+up's
# epilogue writes e4m3 and the scales directly, from float32, and down multiplies each k-step's product by its
# block's scales; no pass over the hidden rows in between) or "rows" (one scale per row, as the dense fp8 MLP: the
# epilogue writes bfloat16 rows that their own pass quantises, `FP8_SWIGLU`; `FP8_DOWN_SCALES`). The same on every
# backend (the ragged_dot path computes the same arithmetic); "rows" where F is not a multiple of the block. Read at
# trace time.
FP8_HIDDEN = "blocks"
# the block width: 2 * TILED_FP8_SWIGLU_CONFIG.tile_n (a CTA's columns: the two compute warpgroups exchange their
# rows' abs-max) or its tile_n (a warpgroup's: no exchange, down in twice the k-steps); down's tile_k is set to it
FP8_HIDDEN_BLOCK = 128

# gate+up quantising its output in 128-wide blocks (`FP8_HIDDEN` "blocks"): `TILED_FP8_SWIGLU_CONFIG`, its compute
# warpgroups splitting a tile's columns and exchanging their rows' abs-max. The other form,
# `TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG` (the warpgroups split the rows: each holds whole blocks, no exchange), ran
# 1.88 ms against 1.78 on an H200 at 294,912 rows (bench_moe.py --fp8, 2026-11-29, one call), so it is not the default
TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG = TILED_FP8_SWIGLU_CONFIG._replace(epi_m=64, split_rows=True)
TILED_FP8_SWIGLU_BLOCKS_CONFIG = TILED_FP8_SWIGLU_CONFIG


def down_blocks_config(ffn: int) -> TileConfig:
    """Down's tiled config on block-scaled hidden rows (`FP8_HIDDEN` "blocks") at contraction ffn:
    `TILED_FP8_DOWN_SCALED_CONFIG` (one float32 sum per compute warpgroup) in k-steps of one block, pipelined as
    `_down_config`."""
    return _down_config(TILED_FP8_DOWN_SCALED_CONFIG._replace(tile_k=FP8_HIDDEN_BLOCK), ffn)


# where the fp8 experts apply down's scales on the tiled kernel: "epilogue" (the GEMM multiplies its float32
# accumulators by the row and column scales and writes scaled bf16 rows: the combine then reads only the rows, as
# in bf16) or "combine" (the GEMM writes the unscaled product, the combine reads each row's scale and its expert's
# 2,048 float32 column scales with it). One bf16 rounding of each row either way. Read at trace time.
FP8_DOWN_SCALES = "epilogue"

# how the token rows reach the tiled layout (`moe_rows.layout_rows`): "scatter" (on a GPU each token row read once
# and stored to its k rows; the 30B's encoder 2-5 ms faster than with the gather in fp8, 6.6 ms in bf16, on H200s,
# 2026-11-29: docs/BENCHMARKS.md) or "gather" (each layout row reads its token's row: k reads of every token
# row). Read at trace time.
ROW_COPY = "scatter"

# where the fp8 experts apply gate+up's scales and SwiGLU on the tiled kernel: "epilogue" (the GEMM scales and
# SwiGLUs its float32 accumulators and writes bf16 [R, F], which one pass quantises: half the bytes through
# memory, one more bf16 rounding before the e4m3 one) or "kernel" (the GEMM writes the unscaled [R, 2F] product,
# `expert_swiglu_quantize_pallas` scales, SwiGLUs and requantises it). Read at trace time.
FP8_SWIGLU = "epilogue"


# whether down's tiled GEMM (contraction F: 6 k-steps of fp8 at Qwen3-30B-A3B's 768, 12 of bf16) streams each CTA's
# tiles as one pipeline (`grouped_gemm.pipelined`: the next tile's loads start while the compute warpgroups finish
# the last one, its stages cut to a divisor of the k-steps). On an H200 (2026-11-29, 262,144 rows): fp8 down 1.073
# vs 1.139 ms, bf16 down 1.422 vs 1.545; gate+up (16 or 32 k-steps) lost (fp8 cut to 2 stages: 1.818 vs 1.575;
# bf16 with SwiGLU 2.723 vs 2.651), so it stays unpipelined; fp8 gate+up through 4 stages with 64-row pieces lost
# in the 30B's fp8 encoder too (326.8 vs 324.5 ms, H200, 2026-11-30: `git show af44f5f`). Down with its compute
# warpgroups taking a tile's column halves in turn (a ping-pong: one's epilogue under the other's product) lost by
# ~25%: fp8 on block scales 1.175 vs 0.921 ms, bf16 1.698 vs 1.446, the 30B's fp8 encoder 334.6 vs 322.8 ms
# (H200, 2026-11-30: `git show 303aeb8`). Read at trace time.
PIPELINED_DOWN = True


# how the dispatch sorts the (token, expert) slots by expert: True, 16-bit expert keys with the slots as payload (a
# stable pair sort, which XLA hands to CUB for unsigned keys: 2 radix passes, 6 bytes a row each); False, one int32
# key expert * slots + slot (a sort of one operand, CUB's radix sort of 4 passes). The same order. Pair sort
# measured ~0.5 ms faster per 30B fp8 encode on an H200 (2026-11-29, docs/BENCHMARKS.md; bench_encoder variant
# `fp8-moe-key-sort` is the other form). Read at trace time.
PAIR_SORT = True

# whether the router's softmax, top-k and renormalisation run as one Pallas kernel on a GPU
# (`top_k.router_top_k_pallas`: it reads the 16-bit logits once; XLA's softmax and division are two more kernels)
# instead of XLA's softmax, `top_k_rows` and XLA's division. The same arithmetic; its exp is Triton's. With
# PAIR_SORT, ~0.5 ms faster per 30B fp8 encode on H200s (2026-11-29; bench_encoder variant `fp8-moe-xla-router` is
# the other form). Read at trace time.
FUSED_ROUTER = True


def _down_config(config: TileConfig, ffn: int) -> TileConfig:
    """Down's config at contraction ffn: `grouped_gemm.pipelined` where `PIPELINED_DOWN`, it takes ffn and its
    stages stay deep enough (a prime number of k-steps would leave one: then as configured)."""
    if not PIPELINED_DOWN or ffn % config.tile_k:
        return config
    steps = ffn // config.tile_k
    piped = pipelined(config, ffn)
    return piped if piped.stages >= min(3, config.stages, steps) else config


def _fits(config: TileConfig, out_n: int, k: int) -> bool:
    return out_n % (2 * config.tile_n) == 0 and k % config.tile_k == 0 and config.tile_n % config.epi_n == 0


def tiled_configs(hidden: int, ffn: int, fp8: bool = False) -> tuple[TileConfig, TileConfig] | None:
    """The `TILED_CONFIGS` pair for gate+up with SwiGLU (F outputs, contraction D) and down (D outputs,
    contraction F), or with `fp8` the `TILED_FP8_CONFIGS` pair (gate+up: 2F outputs, no SwiGLU); None when no
    pair divides these shapes."""
    gate_up_outputs = 2 * ffn if fp8 else ffn
    for gate_up, down in TILED_FP8_CONFIGS if fp8 else TILED_CONFIGS:
        if _fits(gate_up, gate_up_outputs, hidden) and _fits(down, hidden, ffn) and gate_up.tile_m == down.tile_m:
            return gate_up, _down_config(down, ffn)
    return None


def _interpret_params() -> Any:
    """Mosaic GPU's interpreter off a GPU (the tiled kernel then runs on a CPU, slowly: tests), None on a GPU."""
    if _on_gpu():
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, impl: str | None = None,
                   tiling: dict[str, int] | None = None) -> jax.Array:
    """rows [M, K] sorted by group, weights [G, N, K] (contraction innermost), group_sizes int32 [G] summing to M:
    row r of group g times weights[g].T, in rows' dtype (float32 accumulation). impl: one of
    `GROUPED_MATMUL_IMPLS`, None = `default_grouped_matmul_impl()`; "mgpu" and "tiled" fall back to "ragged_dot"
    for shapes their tilings cannot take (small test models). tiling: "mgpu"'s block sizes (default
    `mgpu_tiling`). "tiled" here includes moving the rows into its tile-aligned layout and back (`moe_block` builds
    that layout once for both GEMMs instead)."""
    impl = impl or default_grouped_matmul_impl()
    if impl not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"grouped matmul impl must be one of {GROUPED_MATMUL_IMPLS} or None, got {impl!r}")
    n, k = weights.shape[1:]
    tiled = next((c for pair in TILED_CONFIGS for c in pair[::-1] if _fits(c, n, k)), None)
    if impl == "tiled" and tiled is not None and rows.dtype == weights.dtype:
        plan = tile_plan(group_sizes, rows.shape[0], tiled.tile_m)
        padded = jnp.zeros((plan.num_rows, k), rows.dtype).at[plan.padded_row].set(rows, unique_indices=True)
        out = tiled_grouped_matmul(padded, weights, plan.tile_groups, tiled, interpret=_interpret_params())
        return jnp.take(out, plan.padded_row, axis=0)
    tiling = tiling or mgpu_tiling(n, k)
    if impl == "mgpu" and tiling is not None and rows.dtype == weights.dtype:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        # its TMA stores need M to be a multiple of 8: zero rows appended to the last group, cut off after
        m = rows.shape[0]
        pad = -m % MGPU_ROW_MULTIPLE
        sizes = group_sizes.astype(jnp.int32)
        if pad:
            rows = jnp.pad(rows, ((0, pad), (0, 0)))
            sizes = sizes.at[-1].add(pad)
        out = ragged_dot_mgpu.ragged_dot(rows, weights, group_sizes=sizes, transpose_rhs=True, **tiling)
        return out[:m] if pad else out
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return lax.ragged_dot_general(rows, weights, group_sizes.astype(jnp.int32), dims,
                                  preferred_element_type=jnp.float32).astype(rows.dtype)


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """transformers' Qwen3-MoE router: logits x @ router [D, E] in x's dtype, softmax over all experts in float32,
    the top_k (ties: the lower expert index first; `jaxllm.top_k`, a Pallas kernel on a GPU), divided by their sum
    when `norm_topk_prob`, cast to x's dtype. x [N, D] -> (weights [N, top_k] in x's dtype, experts int32 [N, top_k]).
    With `FUSED_ROUTER` on a GPU, everything after the logits is one kernel (`jaxllm.top_k.router_top_k_pallas`)."""
    logits = x @ router
    if FUSED_ROUTER and _on_gpu() and logits.ndim == 2:
        return router_top_k_pallas(logits, top_k, norm_topk_prob, x.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = top_k_rows(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


class Dispatch(NamedTuple):
    """How the N*k (token, expert) rows are grouped: `order` [N*k] (sorted row r is flat slot order[r], token
    order[r] // k), `group_sizes` [E], `inverse` [N*k] (flat slot s sits at sorted row inverse[s]), `expert`
    [N*k] (the expert of sorted row r)."""

    order: jax.Array
    group_sizes: jax.Array
    inverse: jax.Array
    expert: jax.Array


def dispatch(experts: jax.Array, num_experts: int) -> Dispatch:
    """Groups the flat (token, expert) slots of experts [N, k] by expert (a stable sort: within an expert, tokens
    keep their order)."""
    flat = experts.reshape(-1).astype(jnp.int32)
    slots = jnp.arange(flat.shape[0], dtype=jnp.int32)
    if PAIR_SORT and num_experts <= 2**16:
        # 16-bit expert keys with the slots as payload: XLA hands a pair sort to CUB only for unsigned keys of 16,
        # 32 or 64 bits, and a radix sort of 16-bit keys takes half the passes of the int32 key below
        keys, order = lax.sort((flat.astype(jnp.uint16), slots), num_keys=1, is_stable=True)
        sorted_experts = keys.astype(jnp.int32)
    elif num_experts * flat.shape[0] < 2**31:
        # one int32 key expert * M + slot: unique keys make any sort stable, and a sort of one operand is a radix
        # sort on a GPU (XLA hands it to CUB) where a pair sort with signed keys is XLA's own comparison sort
        keys = lax.sort(flat * flat.shape[0] + slots)
        sorted_experts, order = keys // flat.shape[0], keys % flat.shape[0]
    else:
        sorted_experts, order = lax.sort((flat, slots), num_keys=1, is_stable=True)
    group_sizes = jnp.diff(_group_starts(sorted_experts, num_experts)).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(slots)
    return Dispatch(order, group_sizes, inverse, sorted_experts.astype(jnp.int32))


def _group_starts(sorted_groups: jax.Array, num_groups: int) -> jax.Array:
    """Where each group starts in sorted_groups int32 [M] (ascending), int32 [G + 1] ending with M: each group's
    first row stored at its group (one pass over the rows, no two rows storing to one place), then every empty
    group given the next group's start by a running minimum from the end. (A scatter-add of M ones into G bins
    would serialise on atomics; comparing every row with every boundary, searchsorted's "compare_all", was ~19 us
    a layer at Qwen3-30B-A3B's 294,912 rows on an H200.)"""
    m = sorted_groups.shape[0]
    rows = jnp.arange(m, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_groups[1:] != sorted_groups[:-1]])
    # rows that start no group store out of bounds (dropped), each to its own index, so the indices stay unique
    target = jnp.where(first, sorted_groups, num_groups + 1 + rows)
    starts = jnp.full((num_groups + 1,), m, jnp.int32).at[target].set(rows, mode="drop", unique_indices=True)
    return lax.cummin(starts, axis=0, reverse=True)


def experts_ffn(rows: jax.Array, gate_up: jax.Array, down: jax.Array, group_sizes: jax.Array,
                impl: str | None = None) -> jax.Array:
    """Each group's SwiGLU expert on its rows: down(silu(gate(x)) * up(x)), rows [M, D] sorted by expert,
    gate_up [E, 2F, D] (gate over up), down [E, D, F]; in rows' dtype, as transformers computes it."""
    return grouped_matmul(_swiglu(grouped_matmul(rows, gate_up, group_sizes, impl)), down, group_sizes, impl)


def _swiglu(gate_up_rows: jax.Array) -> jax.Array:
    f = gate_up_rows.shape[-1] // 2
    return jax.nn.silu(gate_up_rows[:, :f]) * gate_up_rows[:, f:]


def _tiled_experts(tokens: jax.Array, plan: Dispatch, gate_up: jax.Array, down: jax.Array, top_k: int,
                   configs: tuple[TileConfig, TileConfig], layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The experts on the tiled kernel: (output rows [R, D] in its tile-aligned layout, the row of each flat
    (token, expert) slot in them [N*k]). gate_up/down: one layer's [E, ...] or, with `layer`, the whole [L, E, ...]
    stacks, read in place (the tile table is offset to layer * E). The first GEMM applies SwiGLU in its epilogue
    (from float32: transformers rounds gate and up to the model dtype first; the difference is one bf16 rounding)."""
    offset = 0
    if layer is not None:
        offset = layer * plan.group_sizes.shape[0]
        gate_up, down = (w.reshape(-1, *w.shape[2:]) for w in (gate_up, down))
    groups, source, row_of_slot = _tile_layout(plan, tokens.shape[0], top_k, configs[0].tile_m, offset)
    rows = layout_rows(tokens, source, row_of_slot.reshape(-1, top_k), ROW_COPY)
    interpret = _interpret_params()
    hidden = tiled_grouped_matmul(rows, gate_up, groups, configs[0], swiglu=True, interpret=interpret)
    out = tiled_grouped_matmul(hidden, down, groups, configs[1], interpret=interpret)
    return out, row_of_slot


def _tile_layout(plan: Dispatch, num_tokens: int, top_k: int, tile_m: int,
                 offset: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tiled kernel's row layout of `plan` (`tile_plan`): (the expert of each row tile [R // tile_m], offset
    into the weights' flattened [L * E] stack, -1 for unused tiles; the token each row reads [R], num_tokens for
    padding rows, which a gather with mode="fill" makes zero rows; the row of each flat (token, expert) slot
    [N*k])."""
    tiles = tile_plan(plan.group_sizes, plan.order.shape[0], tile_m, row_group=plan.expert)
    groups = jnp.where(tiles.tile_groups >= 0, tiles.tile_groups + offset, -1)
    source = jnp.full((tiles.num_rows,), num_tokens, jnp.int32)
    source = source.at[tiles.padded_row].set(plan.order // top_k, unique_indices=True)
    # each slot's row: its sorted row's place in the layout, stored through the sort's order (one scatter; the
    # inverse permutation is then not needed here)
    row_of_slot = jnp.zeros_like(plan.order).at[plan.order].set(tiles.padded_row, unique_indices=True)
    return groups, source, row_of_slot


class _Fp8Rows(NamedTuple):
    """Rows of an fp8 expert GEMM: e4m3 `values` [R, K], float32 `scale` [R], the expert of each row `expert`
    int32 [R] (an index into the weights' flattened [L * E] stack; rows of unused tiles: -1)."""

    values: jax.Array
    scale: jax.Array
    expert: jax.Array


def expert_swiglu_quantize_reference(gate_up: jax.Array, row_scale: jax.Array, expert: jax.Array,
                                     col_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The fp8 experts' step between their GEMMs: the unscaled gate+up product [R, 2F] times each row's scale
    row_scale [R] and its expert's column scales col_scale[expert] ([G, 2F]; expert int32 [R], -1 read as 0), in
    float32; silu(gate) * up; quantised per row to e4m3 for down. Returns (e4m3 [R, F], float32 scale [R]).
    XLA's form of `jaxllm.fp8_kernels.expert_swiglu_quantize_pallas` (same arithmetic)."""
    gu = gate_up.astype(jnp.float32) * row_scale[:, None] * jnp.take(col_scale, expert, axis=0, mode="clip")
    f = gu.shape[-1] // 2
    return quantize_rows(jax.nn.silu(gu[:, :f]) * gu[:, f:])


def _expert_swiglu_quantize(gate_up: jax.Array, rows: _Fp8Rows, col_scale: jax.Array,
                            tiles: tuple[jax.Array, int] | None) -> tuple[jax.Array, jax.Array]:
    """`expert_swiglu_quantize_reference`'s result; for rows in the tiled layout (`tiles`: (the expert of each
    row tile, tile_m)) on a GPU with FP8 tensor cores from one Pallas kernel that reads each product row once."""
    if tiles is None or not native_fp8_available():
        return expert_swiglu_quantize_reference(gate_up, rows.scale, rows.expert, col_scale)
    from .fp8_kernels import expert_swiglu_quantize_pallas

    # 2 rows x 4 warps a program: 0.55 ms at 278,400 rows of Qwen3-30B-A3B (XLA's two passes: 1.04 ms) on one H200,
    # 0.76 ms (1.14; 1 row: 0.68) on another (scripts/bench_moe.py --movement, 2026-11-28)
    return expert_swiglu_quantize_pallas(gate_up, rows.scale, tiles[0], col_scale, tile_m=tiles[1], rows=2)


def _fp8_hidden_blocks_reference(rows: _Fp8Rows, gate_up: Fp8Matrix, down: Fp8Matrix, matmul: Any,
                                 out_dtype: Any) -> jax.Array:
    """The block-scaled fp8 experts (`FP8_HIDDEN` "blocks") in XLA, the arithmetic of the tiled kernels: gate+up's
    unscaled product scaled in float32, SwiGLU (`grouped_gemm.silu`), quantised per row and `FP8_HIDDEN_BLOCK`-wide
    block (`fp8.quantize_blocks`), down on the dequantised values (exact: an e4m3 value times a float32 scale),
    scaled by down's column scales, one rounding to out_dtype."""
    take = lambda scale: jnp.take(scale, rows.expert, axis=0, mode="clip")  # noqa: E731
    gu = matmul(rows.values, gate_up.weight, 0).astype(jnp.float32) * rows.scale[:, None] * take(gate_up.scale)
    f = gu.shape[-1] // 2
    hidden, scales = quantize_blocks(silu(gu[:, :f]) * gu[:, f:], FP8_HIDDEN_BLOCK)
    out = matmul(dequantize_blocks(hidden, scales), down.weight, 1).astype(jnp.float32) * take(down.scale)
    return out.astype(out_dtype)


def _fp8_experts_ffn(rows: _Fp8Rows, gate_up: Fp8Matrix, down: Fp8Matrix, matmul: Any,
                     tiles: tuple[jax.Array, int] | None = None, gate_up_swiglu: Any = None,
                     down_scaled: Any = None, hidden_blocks: Any = None) -> tuple[jax.Array, ExpertRowScales | None]:
    """W8A8 SwiGLU experts: gate+up on e4m3 rows, scaled, SwiGLU in float32, requantised per row to e4m3 for down
    (as the dense fp8 MLP). matmul(values, weight, which) is the grouped GEMM of e4m3 operands (unscaled products;
    which: 0 gate+up, 1 down); gate_up_swiglu(values, weight, row_scale=, col_scale=), where given, is gate+up
    with its scales and SwiGLU in the GEMM's epilogue (bf16 out: rounded once more before the requantisation);
    down_scaled(values, weight, row_scale=, col_scale=), where given, is down with its scales in the epilogue;
    `tiles` as `_expert_swiglu_quantize`'s. hidden_blocks, where given, is the pair (gate+up with its scales,
    SwiGLU and block quantisation in the epilogue, down on block-scaled rows with its column scales in the
    epilogue) of `FP8_HIDDEN` "blocks". Returns down's rows [R, D] and the scales the combine still has to apply to
    them (None when down's GEMM applied them)."""
    if hidden_blocks is not None:
        gate_up_blocks, down_blocks = hidden_blocks
        hidden, scales = gate_up_blocks(rows.values, gate_up.weight, row_scale=rows.scale, col_scale=gate_up.scale)
        return down_blocks(hidden, down.weight, row_block_scales=scales, col_scale=down.scale), None
    if gate_up_swiglu is not None:
        # 4 rows a program: a row of Qwen3-30B-A3B's hidden is 768 values (1 row: 2.5 TB/s on an H200)
        hidden, hidden_scale = quantize_rows_one_pass(
            gate_up_swiglu(rows.values, gate_up.weight, row_scale=rows.scale, col_scale=gate_up.scale), rows=4)
    else:
        product = matmul(rows.values, gate_up.weight, 0)
        hidden, hidden_scale = _expert_swiglu_quantize(product, rows, gate_up.scale, tiles)
    if down_scaled is not None:
        return down_scaled(hidden, down.weight, row_scale=hidden_scale, col_scale=down.scale), None
    return matmul(hidden, down.weight, 1), ExpertRowScales(hidden_scale, rows.expert, down.scale)


def _fp8_expert_outputs(tokens: jax.Array, plan: Dispatch, gate_up: Fp8Matrix, down: Fp8Matrix, top_k: int,
                        impl: str, layer: jax.Array | None, quantized: QuantizedRows | None = None
                        ) -> tuple[jax.Array, jax.Array, ExpertRowScales | None]:
    """fp8 (W8A8) experts: the tokens quantised per row to e4m3 once (before the row copy: half the bytes moved;
    `quantized`: already, by the step that normalised them), both GEMMs on e4m3 operands with float32
    accumulation and per-row (down: per row and block with `FP8_HIDDEN` "blocks") x per-column scales after them.
    Returns (down's rows, the row of each flat (token, expert) slot in them [N*k], and the scales the combine applies
    to them: each row's scale and expert, the experts' column scales; None where down's epilogue applied them,
    `FP8_DOWN_SCALES`)."""
    if (FP8_SWIGLU not in ("epilogue", "kernel") or FP8_DOWN_SCALES not in ("epilogue", "combine")
            or FP8_HIDDEN not in ("blocks", "rows")):
        raise ValueError(f"moe.FP8_SWIGLU must be 'epilogue' or 'kernel', moe.FP8_DOWN_SCALES 'epilogue' or "
                         f"'combine' and moe.FP8_HIDDEN 'blocks' or 'rows', got {FP8_SWIGLU!r}, "
                         f"{FP8_DOWN_SCALES!r} and {FP8_HIDDEN!r}")
    num_experts = plan.group_sizes.shape[0]
    stacked = gate_up.weight.ndim == 4
    if stacked != (layer is not None):
        raise ValueError("fp8 experts: pass `layer` with the whole [L, E, ...] stacks, and only with them")
    flat = lambda w: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), w) if stacked else w  # noqa: E731
    gate_up, down = flat(gate_up), flat(down)
    offset = layer * num_experts if layer is not None else 0
    if quantized is None:
        values, scale = quantize_rows(tokens)
    else:
        values, scale = quantized.values.reshape(tokens.shape), quantized.scale.reshape(-1)
    d, f = tokens.shape[-1], down.weight.shape[-1]
    blocks = FP8_HIDDEN == "blocks" and f % FP8_HIDDEN_BLOCK == 0
    configs = tiled_configs(d, f, fp8=True) if impl == "tiled" else None
    tiles, gate_up_swiglu, down_scaled, hidden_blocks = None, None, None, None
    if configs is not None:
        groups, source, row_of_slot = _tile_layout(plan, tokens.shape[0], top_k, configs[0].tile_m, offset)
        rows = _Fp8Rows(layout_rows(values, source, row_of_slot.reshape(-1, top_k), ROW_COPY),
                        jnp.take(scale, source, axis=0, mode="fill", fill_value=0),
                        jnp.repeat(groups, configs[0].tile_m))
        tiles = (groups, configs[0].tile_m)
        interpret = _interpret_params()

        def matmul(v: jax.Array, w: jax.Array, which: int) -> jax.Array:
            return tiled_grouped_matmul(v, w, groups, configs[which], interpret=interpret)

        def scaled_gemm(wanted: bool, config: TileConfig, out_n: int, k: int, **kwargs) -> Any:
            """The tiled GEMM at `config` with its scales in the epilogue, where wanted and the config takes
            these shapes and the layout's row tiles; else None."""
            if wanted and _fits(config, out_n, k) and config.tile_m == configs[0].tile_m:
                return functools.partial(tiled_grouped_matmul, tile_groups=groups, config=config,
                                         interpret=interpret, **kwargs)
            return None

        if blocks and FP8_HIDDEN_BLOCK in (TILED_FP8_SWIGLU_CONFIG.tile_n, 2 * TILED_FP8_SWIGLU_CONFIG.tile_n):
            gate_up_config = (TILED_FP8_SWIGLU_BLOCKS_CONFIG if FP8_HIDDEN_BLOCK == 2 * TILED_FP8_SWIGLU_CONFIG.tile_n
                              else TILED_FP8_SWIGLU_CONFIG)
            pair = (scaled_gemm(True, gate_up_config, f, d, swiglu=True, quantize_out=True,
                                quantize_block=FP8_HIDDEN_BLOCK),
                    scaled_gemm(True, down_blocks_config(f), d, f))
            hidden_blocks = pair if None not in pair else None
        if hidden_blocks is None:  # per row (`FP8_HIDDEN` "rows", or blocks the configs cannot take)
            gate_up_swiglu = scaled_gemm(FP8_SWIGLU == "epilogue", TILED_FP8_SWIGLU_CONFIG, f, d, swiglu=True)
            down_scaled = scaled_gemm(FP8_DOWN_SCALES == "epilogue", _down_config(TILED_FP8_DOWN_SCALED_CONFIG, f),
                                      d, f)

    else:  # e4m3 values multiplied in float32 by ragged_dot (exact products, as fp8 tensor cores compute them)
        sources = plan.order // top_k
        rows = _Fp8Rows(jnp.take(values, sources, axis=0), jnp.take(scale, sources), plan.expert + offset)
        sizes = plan.group_sizes

        def matmul(v: jax.Array, w: jax.Array, which: int) -> jax.Array:
            layer_w = lax.dynamic_slice_in_dim(w, offset, num_experts)  # the layer's E experts (all, unstacked)
            return grouped_matmul(v.astype(jnp.float32), layer_w.astype(jnp.float32), sizes, "ragged_dot")

        row_of_slot = plan.inverse
        if blocks:
            return _fp8_hidden_blocks_reference(rows, gate_up, down, matmul, tokens.dtype), row_of_slot, None
    out, scales = _fp8_experts_ffn(rows, gate_up, down, matmul, tiles, gate_up_swiglu, down_scaled, hidden_blocks)
    return out, row_of_slot, scales


def moe_expert_outputs(x: jax.Array | ValueAndRows, params: dict[str, Any], top_k: int, norm_topk_prob: bool,
                       impl: str | None = None, layer: jax.Array | None = None) -> ExpertOutputs:
    """`moe_block` up to its combine: the expert rows, where each token's k rows are, its routing weights and (fp8)
    the rows' scales (`moe_rows.ExpertOutputs`, whose `value()` is `moe_block`'s result). The decoder layer hands
    it to the residual step after the block (`layer_ops.residual_norm`), which combines the rows first
    (`ExpertOutputs.value()`: on a GPU the combine's own kernel) or, with `layer_ops.FUSED_MOE_COMBINE`, inside
    its residual kernel."""
    impl = impl or default_grouped_matmul_impl()
    x, quantized = (x.value, x.rows) if isinstance(x, ValueAndRows) else (x, None)
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    weights, experts = route(tokens, params["router"], top_k, norm_topk_prob)
    plan = dispatch(experts, params["router"].shape[-1])
    gate_up, down = params["gate_up"], params["down"]
    scales = None
    if isinstance(gate_up, Fp8Matrix):
        out, row_of_slot, scales = _fp8_expert_outputs(tokens, plan, gate_up, down, top_k, impl, layer, quantized)
    else:
        configs = tiled_configs(d, gate_up.shape[-2] // 2)
        tiled = impl == "tiled" and configs is not None and gate_up.dtype == x.dtype
        if layer is not None and not tiled:  # only the tiled kernel reads the stack in place
            gate_up, down = gate_up[layer], down[layer]
        if tiled:
            out, row_of_slot = _tiled_experts(tokens, plan, gate_up, down, top_k, configs, layer)
        else:
            rows = jnp.take(tokens, plan.order // top_k, axis=0)
            out, row_of_slot = experts_ffn(rows, gate_up, down, plan.group_sizes, impl), plan.inverse
    return ExpertOutputs(out, row_of_slot.reshape(tokens.shape[0], top_k), weights, scales, tuple(lead), x.dtype)


def moe_block(x: jax.Array | ValueAndRows, params: dict[str, Any], top_k: int, norm_topk_prob: bool,
              impl: str | None = None, layer: jax.Array | None = None) -> jax.Array:
    """Qwen3-MoE's sparse block on x [..., D]: router params["router"] [D, E], experts params["gate_up"]
    [E, 2F, D] and params["down"] [E, D, F], or `fp8.Fp8Matrix` of them: W8A8, the tokens quantised per row to
    e4m3 (or given so: x a `ValueAndRows`), e4m3 GEMMs with float32 accumulation, SwiGLU in float32 and its
    output quantised for down per row and 128-wide block (`FP8_HIDDEN` "blocks", the default; on the tiled kernel
    inside gate+up's epilogue) or per row (`FP8_HIDDEN` "rows": on the tiled kernel with `FP8_SWIGLU` "epilogue"
    rounded to bfloat16 first, down's scales in its epilogue with `FP8_DOWN_SCALES` "epilogue").
    With `layer` (an int32 scalar), gate_up and down are the whole [L, E, ...] stacks of the model and this block
    uses stack entry `layer` (the "tiled" kernel reads it in place; the others slice it).
    Each token's output is the sum over its top_k experts of routing weight x expert output (summed in float32,
    one rounding to x's dtype); tokens never interact, so padding tokens cost work but never change a real
    token's result. impl: the grouped GEMM (`GROUPED_MATMUL_IMPLS`, None = the backend's default)."""
    return moe_expert_outputs(x, params, top_k, norm_topk_prob, impl, layer).value()


def expert_load(experts: jax.Array, num_experts: int) -> jax.Array:
    """Rows per expert [E] for the routing choices experts [N, k] (max / mean tells how skewed the routing is)."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(1)
