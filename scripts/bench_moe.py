"""Qwen3-30B-A3B's expert GEMMs on one device: the grouped-GEMM candidates side by side with a dense GEMM of the
same FLOPs, and the whole sparse block (routing, sort, two grouped GEMMs, combine).

Shapes (defaults): a packed pass of 32,768 tokens, 8 experts each of 128 -> 262,144 sorted rows; gate+up is
[rows, 2048] x [2048, 1536] per group, down [rows, 768] x [768, 2048]. Group sizes come from a random router on
random tokens ("uniform"), a skewed draw (a Zipf-like expert popularity: what a real router can look like), every
row in one expert ("one"), every token on the same top_k experts ("same": what the random Qwen3-30B-A3B does on
real prompts, its experts' weights staying in L2) or every expert the same rows ("even": a trained router's
spread load, every expert's weights read from HBM).

Candidates (each also checked against a per-group reference on a few groups):
- `dense`: [rows, K] x [K, N] bf16 (jnp.matmul), the same FLOPs: the ceiling the others are compared with;
- `mgpu`: jaxllm.moe's default on Hopper, JAX's `ragged_dot_mgpu` with weights [E, N, K] (transpose_rhs); with
  `--tune`, a sweep of its tilings (block_m/n/k, pipeline depth, grid_block_n) for each shape;
- `mgpu_kn`: the same kernel with weights pre-transposed to [E, K, N];
- `tiled`: jaxllm.grouped_gemm, our kernel, on rows already in its tile-aligned layout (what `moe_block` gives
  it); FLOP/s count the real rows only. With `--tune`, a sweep of its block sizes;
- `cudnn`: `lax.ragged_dot` compiled with XLA's cuDNN ragged-dot fusion
  (`xla_gpu_experimental_use_ragged_dot_fusion`): timed only when the compiled HLO has a cuDNN call for it
  (otherwise XLA's fallback is the masked dense dot, tens of GiB);
- `padded`: a batched einsum [E, C, K] x [E, K, N] with C = the largest group rounded up to 128 (dropless only
  because C is the actual maximum: the cost of a padded batched GEMM at this routing).

With `--fp8` (the W8A8 experts of `--llm-dtype fp8`): rows and weights in e4m3, `dense` is the fp8 GEMM of the same
FLOPs (cuBLASLt, both operands K-major), `tiled` runs `TILED_FP8_CONFIGS` (gate+up without the SwiGLU epilogue, as
`moe_block` runs it in fp8), `--tune-tiled` sweeps its fp8 block sizes, and the block has e4m3 experts; the others
are skipped.

Each kernel row times a jitted call, synchronised: ~0.25 ms of it is dispatch and synchronisation on an H200,
and rows of the same kernel move by up to 10% between runs. `--back-to-back N` queues N calls per timed iteration
and synchronises once, so the rows come near the kernels' own time (A/B a kernel change with it, several rows each
way; the encoder benchmark stays the witness of what a change gives).

    python scripts/bench_moe.py --out moe.json [--tune]     # GPU
    python scripts/bench_moe.py --fp8 --candidates dense tiled --routings uniform --tune-tiled   # GPU, fp8
    python scripts/bench_moe.py --smoke                       # CPU: tiny shapes, ragged_dot only
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_encoder import time_calls  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="tokens in one pass (default 32768)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768, help="moe_intermediate_size")
    p.add_argument("--shapes", nargs="+", default=["gate_up", "down"], choices=["gate_up", "down"],
                   help="the expert GEMMs to time")
    p.add_argument("--routings", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed", "one", "same", "even"])
    p.add_argument("--candidates", nargs="+", default=["dense", "mgpu", "tiled", "cudnn", "padded"],
                   choices=["dense", "mgpu", "mgpu_kn", "tiled", "cudnn", "padded", "ragged_dot"])
    p.add_argument("--block-impls", nargs="+", default=None, choices=["ragged_dot", "mgpu", "tiled"],
                   help="grouped GEMMs to time the whole sparse block with (default: the backend's default)")
    p.add_argument("--profile-block", type=Path, default=None,
                   help="trace one call of each timed block into DIR/<impl> and log where its GPU time goes")
    p.add_argument("--block-layers", type=int, default=4,
                   help="the sparse block reads layer 1 of a stack of this many layers, as the model does")
    p.add_argument("--tune", action="store_true", help="sweep ragged_dot_mgpu's tilings (uniform routing)")
    p.add_argument("--tune-tiled", action="store_true", help="sweep the tiled kernel's block sizes (uniform)")
    p.add_argument("--tune-blocks", action="store_true",
                   help="--fp8: sweep down's configs on block-scaled rows (uniform; with --rounds, re-timed)")
    p.add_argument("--tune-seconds", type=float, default=150.0, help="stop the sweep after this long")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--back-to-back", type=int, default=1,
                   help="kernel and movement rows: time this many calls queued back to back, synchronised once, per "
                        "timed iteration (ms per call), so each call's dispatch and synchronisation (~0.25 ms on an "
                        "H200, against 1.3 ms of gate+up kernel under Nsight Compute) overlap the kernels before it")
    p.add_argument("--rounds", type=int, default=1,
                   help="kernel rows: time every row again in this many alternating rounds in all (each round "
                        "times each row once, in order), so a row and the dense GEMM it is compared with are timed "
                        "minutes apart at most and the GPU's clock drift falls on both; each row gets its ms per "
                        "round and, by shape, its dense/row ratio per round and their median")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (ragged_dot and dense only)")
    p.add_argument("--fp8", action="store_true", help="e4m3 rows and weights (the W8A8 experts), module doc")
    p.add_argument("--pipeline-tiles", type=int, nargs="+", default=[0], choices=[0, 1],
                   help="tiled: time the model's kernel forms without (0) and with (1) TileConfig.pipeline_tiles "
                        "(grouped_gemm.pipelined: a CTA's tiles as one pipeline)")
    p.add_argument("--silu", nargs="+", default=None, choices=["exp", "exp2"],
                   help="tiled, gate+up with SwiGLU: time its kernel forms with each of these ways to compute the "
                        "SiLU (grouped_gemm.SILU; default: its value)")
    p.add_argument("--pipeline-stages", type=int, default=None,
                   help="with --pipeline-tiles 1: the stages before grouped_gemm.pipelined cuts them to a divisor "
                        "of the k-steps (default: the config's; fp8 gate+up at 4 keeps 4 of its 16 k-steps)")
    p.add_argument("--movement", action="store_true",
                   help="time the block's memory-bound steps alone: the row gather (bf16 and e4m3 rows, each "
                        "`jaxllm.moe_rows` impl), the fp8 scale + SwiGLU + requantisation and the combine (XLA vs "
                        "Pallas)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.experts, args.top_k, args.hidden, args.ffn, args.iters = 64, 4, 2, 64, 32, 2
        args.candidates = ["dense", "ragged_dot", "padded"]
        args.tune = args.tune_tiled = False
        args.block_layers = 2
    if args.fp8:
        args.candidates = [c for c in args.candidates if c in FP8_CANDIDATES]
        args.tune = False
    return args


FP8_CANDIDATES = ("dense", "ragged_dot", "tiled")  # the candidates that take e4m3 operands


def time_per_call(fn, args: argparse.Namespace, sync: Callable[[Any], Any] | None = None) -> float:
    """Seconds per call of fn: the median over --iters of --back-to-back calls queued and synchronised once (by
    `sync` on the last call's output: default `jax.block_until_ready`)."""
    import jax

    def calls():
        out = None
        for _ in range(args.back_to_back):
            out = fn()
        return out

    return time_calls(calls, sync or jax.block_until_ready, args.iters) / args.back_to_back


def time_rounds(replays: list[tuple[dict[str, Any], Any]], args: argparse.Namespace, log) -> None:
    """--rounds: times each (row, call) again, row by row in order, for rounds 2..N; adds to each row its ms per
    round ("round_ms", the first being its row's "ms"), their median ("median_ms") and, where its shape has dense
    rows, the best dense ms of the round (the faster of "dense" and "dense_xla_defaults") over its ms per round
    ("of_dense_rounds") and their median ("of_dense")."""
    import numpy as np

    for row, _ in replays:
        row["round_ms"] = [row["ms"]]
    for r in range(2, args.rounds + 1):
        for row, call in replays:
            row["round_ms"].append(time_per_call(call, args) * 1e3)
        log(f"round {r} of {args.rounds} timed")
    dense: dict[str, list[float]] = {}  # shape -> the best dense ms of each round
    for row, _ in replays:
        if row["candidate"].startswith("dense"):
            best = dense.get(row["shape"], row["round_ms"])
            dense[row["shape"]] = [min(a, b) for a, b in zip(best, row["round_ms"])]
    for row, _ in replays:
        row["median_ms"] = float(np.median(row["round_ms"]))
        if row["shape"] in dense:
            ratios = [d / m for d, m in zip(dense[row["shape"]], row["round_ms"])]
            row["of_dense_rounds"] = [round(v, 4) for v in ratios]
            row["of_dense"] = float(np.median(ratios))
        log({k: row.get(k) for k in ("shape", "routing", "candidate", "median_ms", "of_dense", "of_dense_rounds")})


def dense_fp8(a, b_nk):
    """a [M, K] x b [N, K] in e4m3, float32 accumulation, bf16 out: the dense fp8 GEMM the experts' fp8 kernels
    are compared with (`jaxllm.fp8`'s: one cuBLASLt call on a GPU with FP8 tensor cores, float32 elsewhere)."""
    import jax.numpy as jnp

    from jaxllm.fp8 import _fp8_dot

    return _fp8_dot(a, b_nk, jnp.bfloat16)


def group_sizes_for(kind: str, rows: int, experts: int, top_k: int, seed: int = 0):
    """int32 [E] group sizes summing to rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.moe import expert_load, route

    if kind == "one":
        return jnp.zeros((experts,), jnp.int32).at[0].set(rows)
    if kind == "same":  # every token on the same top_k experts, as the random Qwen3-30B-A3B routes
        return jnp.zeros((experts,), jnp.int32).at[:top_k].set(rows // top_k).at[0].add(rows % top_k)
    if kind == "even":  # every expert the same rows, as bench_encoder's *-moe-spread-routing
        return jnp.full((experts,), rows // experts, jnp.int32).at[0].add(rows % experts)
    if kind == "uniform":
        kx, kr = jax.random.split(jax.random.key(seed))
        tokens = rows // top_k
        x = jax.random.normal(kx, (tokens, 256), jnp.float32)
        router = jax.random.normal(kr, (256, experts), jnp.float32) * 0.02
        _, chosen = route(x, router, top_k, True)
        return expert_load(chosen, experts)
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** 0.8
    popularity = rng.permutation(popularity / popularity.sum())
    counts = np.floor(popularity * rows).astype(np.int64)
    counts[np.argmax(counts)] += rows - counts.sum()
    return jnp.asarray(counts, jnp.int32)


def time_tiled(record, x, w, sizes, config, name: str = "tiled", swiglu: bool = False, scaled: bool = False,
               quantize_out: bool = False, block_scaled: bool = False, quantize_block: int | None = None) -> None:
    """Times `jaxllm.grouped_gemm.tiled_grouped_matmul` on x's rows moved into its tile-aligned layout (the move is
    not timed: moe_block builds that layout in its dispatch) and checks it against the per-group reference (not
    with `swiglu`: its output is silu(gate) * up; tests/test_llm_grouped_gemm.py checks that). `scaled`: with
    row and column scales applied in the epilogue (the fp8 experts' gate+up with `moe.FP8_SWIGLU` "epilogue", and
    down with `moe.FP8_DOWN_SCALES` "epilogue"). `moe.FP8_HIDDEN` "blocks"' forms: `quantize_out` (gate+up's
    epilogue writes e4m3 rows and their block scales) and `block_scaled` (down on rows with one scale per row and
    k-step, the running sum rescaled at each; with the column scales)."""
    import jax
    import jax.numpy as jnp

    from jaxllm import grouped_gemm
    from jaxllm.compile import compiler_options, jit

    plan = grouped_gemm.tile_plan(sizes, x.shape[0], config.tile_m)
    padded = jnp.zeros((plan.num_rows, x.shape[1]), x.dtype).at[plan.padded_row].set(x)
    scales = ()
    if scaled or block_scaled:
        ks, kc = jax.random.split(jax.random.key(11))
        row_shape = (x.shape[1] // config.tile_k, plan.num_rows) if block_scaled else (plan.num_rows,)
        scales = (jax.random.uniform(ks, row_shape, minval=0.001, maxval=0.01),
                  jax.random.uniform(kc, w.shape[:2], minval=0.001, maxval=0.01))
    kernel = jit(lambda a, b, g, *s: grouped_gemm.tiled_grouped_matmul(
        a, b, g, config, swiglu=swiglu, row_scale=s[0] if s and not block_scaled else None,
        row_block_scales=s[0] if block_scaled else None, col_scale=s[1] if s else None, quantize_out=quantize_out,
        quantize_block=quantize_block),
        compiler_options=compiler_options())
    back = jax.jit(lambda out: jnp.take(out, plan.padded_row, axis=0))
    suffix = ("_swiglu" * swiglu + "_scaled" * scaled + "_quantized" * quantize_out + "_blocks" * block_scaled
              + f"_{quantize_block}" * (quantize_block is not None))
    record(name + suffix, kernel, padded, w, plan.tile_groups, *scales,
           extra={"config": config._asdict(), "padded_rows": plan.num_rows},
           check=name == "tiled" and not (swiglu or scaled or block_scaled), view=back)
    del padded


def time_movement(args: argparse.Namespace, log, result: dict[str, Any]) -> None:
    """The sparse block's memory-bound steps at one pass's shapes, each candidate checked bit for bit against the
    first: the row gather of the tokens into the tiled layout (uniform routing; bf16 and e4m3 rows), the fp8
    experts' step between their GEMMs, and the combine (with fp8 scales and without: checked against the first up
    to the order of its float32 sums). GB/s counts bytes written plus bytes read once."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import fp8_kernels, moe, moe_rows
    from jaxllm.compile import compiler_options, jit

    d, f, e = args.hidden, args.ffn, args.experts
    tile_m = 128
    key = jax.random.key(7)
    routed = jax.random.normal(key, (args.tokens, d), jnp.float32)
    _, experts = moe.route(routed, jax.random.normal(key, (d, e)) * 0.02, args.top_k, True)
    plan = moe.dispatch(experts, e)
    groups, source, row_of_slot = moe._tile_layout(plan, args.tokens, args.top_k, tile_m, 0)
    opts = compiler_options()
    rows_out = source.shape[0]
    interpret = jax.default_backend() != "gpu"  # --smoke on a CPU: the Pallas kernels in their interpreter

    def record(step: str, name: str, fn, operands, nbytes: int, reference=None):
        row = {"step": step, "candidate": name, "rows": rows_out}
        try:
            out = jax.block_until_ready(fn(*operands))
            seconds = time_per_call(lambda: fn(*operands), args)
        except Exception as err:  # noqa: BLE001 - report and keep measuring the others
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        else:
            row |= {"ms": seconds * 1e3, "gb_per_s": nbytes / seconds / 1e9}
            if reference is not None:
                row["equal_to_first"] = all(np.array_equal(np.asarray(a.astype(jnp.float32)),
                                                           np.asarray(b.astype(jnp.float32)))
                                            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)))
        result.setdefault("movement", []).append(row)
        log(row)
        return out if "ms" in row else None

    for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
        values = routed.astype(dtype)
        nbytes = 2 * rows_out * d * jnp.dtype(dtype).itemsize
        step = f"gather {jnp.dtype(dtype).name}"
        first = record(step, "elements", jit(lambda v, s: moe_rows.gather_rows(v, s, "elements"),
                                             compiler_options=opts), (values, source), nbytes)
        record(step, "words", jit(moe_rows.gather_rows_words, compiler_options=opts), (values, source), nbytes,
               first)
        # (rows a program, warps, one gathered [rows, slice] load)
        for rows, warps, block in ((4, 4, False), (8, 8, False), (16, 8, False), (8, 4, True), (16, 4, True),
                                   (16, 8, True), (32, 8, True)):
            fn = jax.jit(lambda v, s, r=rows, w=warps, b=block: moe_rows.gather_rows_pallas(
                v, s, interpret=interpret, rows=r, num_warps=w, block=b))
            record(step, f"pallas rows {rows} warps {warps}" + " block" * block, fn, (values, source), nbytes,
                   first)
        # the other way round: each token row read once and stored to its k layout rows (moe.ROW_COPY "scatter")
        slot_row = row_of_slot.reshape(args.tokens, args.top_k)
        for per, warps in ((4, 4), (8, 4), (8, 8), (16, 8)):
            fn = jax.jit(lambda v, s, r, p_=per, w_=warps: moe_rows.scatter_rows_pallas(
                v, r, s, interpret=interpret, tokens_per_program=p_, num_warps=w_))
            record(step, f"scatter tokens {per} warps {warps}", fn, (values, source, slot_row), nbytes, first)
        del values
    kp, ks, kc = jax.random.split(key, 3)
    product = (jax.random.normal(kp, (rows_out, 2 * f), jnp.float32) * 30).astype(jnp.bfloat16)
    row_scale = jax.random.uniform(ks, (rows_out,), minval=0.001, maxval=0.05)
    col_scale = jax.random.uniform(kc, (e, 2 * f), minval=0.1, maxval=1.0)
    expert = jnp.repeat(groups, tile_m)
    nbytes = rows_out * (2 * f * 2 + f + 8)
    step = "fp8 scale + swiglu + requantise"
    first = record(step, "xla", jit(moe.expert_swiglu_quantize_reference, compiler_options=opts),
                   (product, row_scale, expert, col_scale), nbytes)
    for rows, warps, chunk in ((1, 4, 512), (2, 4, 512), (4, 8, 256), (1, 2, 256)):
        fn = jax.jit(lambda p, r_s, g, c, r=rows, w=warps, k=chunk: fp8_kernels.expert_swiglu_quantize_pallas(
            p, r_s, g, c, tile_m=tile_m, interpret=interpret, rows=r, num_warps=w, chunk=k))
        out = record(step, f"pallas rows {rows} warps {warps} chunk {chunk}", fn,
                     (product, row_scale, groups, col_scale), nbytes)
        if out is not None and first is not None:  # exp's last bit may differ from XLA's: count the changes
            result["movement"][-1]["values_changed"] = float(np.mean(np.asarray(out[0].astype(jnp.float32))
                                                                     != np.asarray(first[0].astype(jnp.float32))))
    # the combine: each token's 8 expert rows (bf16 down products) weighted and summed, without and with fp8 scales
    slot_row = row_of_slot.reshape(args.tokens, args.top_k)
    weights = jax.nn.softmax(jax.random.normal(kp, slot_row.shape), axis=-1).astype(jnp.bfloat16)
    down_rows = (jax.random.normal(kp, (rows_out, d), jnp.float32) * 30).astype(jnp.bfloat16)
    scales = moe_rows.ExpertRowScales(row_scale, expert, jax.random.uniform(kc, (e, d), minval=0.1, maxval=1.0))
    nbytes = args.tokens * (args.top_k + 1) * d * 2
    for label, sc in (("combine", None), ("combine fp8 scales", scales)):
        first = record(label, "xla", jit(lambda r, s, w, c: moe_rows.combine_rows_reference(r, s, w, c, jnp.bfloat16),
                                         compiler_options=opts), (down_rows, slot_row, weights, sc), nbytes)
        for per, warps, chunk in ((1, 4, 1024), (2, 8, 1024), (2, 8, 2048), (1, 8, 2048), (4, 8, 2048),
                                  (2, 4, 2048)):
            fn = jax.jit(lambda r, s, w, c, p_=per, w_=warps, k_=chunk: moe_rows.combine_rows_pallas(
                r, s, w, c, jnp.bfloat16, interpret=interpret, rows_per_program=p_, num_warps=w_, chunk=k_))
            out = record(label, f"pallas tokens {per} warps {warps} chunk {chunk}", fn,
                         (down_rows, slot_row, weights, sc), nbytes)
            if out is not None and first is not None:  # float32 sums in another order: bf16 roundings may differ
                result["movement"][-1]["max_abs_diff_over_max"] = float(
                    jnp.max(jnp.abs(out.astype(jnp.float32) - first.astype(jnp.float32)))
                    / jnp.max(jnp.abs(first.astype(jnp.float32))))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import grouped_gemm, moe
    from jaxllm.compile import compiler_options, jit

    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    operand_dtype = jnp.float8_e4m3fn if args.fp8 else dtype  # the GEMMs' rows and weights
    rows_n, e, d, f = args.tokens * args.top_k, args.experts, args.hidden, args.ffn
    shapes = {name: kn for name, kn in {"gate_up": (d, 2 * f), "down": (f, d)}.items() if name in args.shapes}  # (K, N)
    result: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "date": datetime.date.today().isoformat(),
                              "jax": jax.__version__, "host": platform.node(), "rows": rows_n, "experts": e,
                              "shapes": shapes, "operands": jnp.dtype(operand_dtype).name, "results": []}
    opts = compiler_options()
    key = jax.random.key(0)
    replays = []  # (row, timed call) of each kernel row, for --rounds
    if args.movement:
        time_movement(args, log, result)
    for shape_name, (k, n) in shapes.items():
        kx, kw = jax.random.split(jax.random.fold_in(key, k))
        scale = 1.0 if args.fp8 else 0.02  # e4m3 values near 1 (as quantised weights are), not in its subnormals
        x = jax.random.normal(kx, (rows_n, k), jnp.float32).astype(operand_dtype)
        w = (jax.random.normal(kw, (e, n, k), jnp.float32) * scale).astype(operand_dtype)  # [E, N, K]
        flops = 2 * rows_n * k * n
        dense_w = w[0].T
        for routing in args.routings:
            sizes = group_sizes_for(routing, rows_n, e, args.top_k)
            sizes_np = np.asarray(sizes)
            starts = np.concatenate([[0], np.cumsum(sizes_np)[:-1]])
            check_groups = [int(g) for g in np.argsort(sizes_np)[-2:]] + [int(np.argmin(np.where(sizes_np > 0, sizes_np, rows_n)))]
            load = {"max": int(sizes_np.max()), "mean": float(sizes_np.mean()),
                    "max_over_mean": float(sizes_np.max() / sizes_np.mean()), "empty": int((sizes_np == 0).sum())}
            log(f"{shape_name} [{rows_n}, {k}] x [{e}, {n}, {k}], routing {routing}: load {load}")

            def record(name: str, fn, *operands, extra: dict | None = None, check: bool = True, view=None) -> None:
                """Times fn(*operands); checks view(output) (default: the output) against a per-group reference."""
                row = {"shape": shape_name, "routing": routing, "candidate": name, "load": load} | (extra or {})
                try:
                    out = jax.block_until_ready(fn(*operands))
                    seconds = time_per_call(lambda: fn(*operands), args)
                except Exception as err:  # noqa: BLE001 - report and keep measuring the others
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    log(row)
                    result["results"].append(row)
                    return
                row |= {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
                if args.rounds > 1:  # (a replay keeps its operands alive: only when they are replayed)
                    replays.append((row, lambda: fn(*operands)))
                if check:
                    out = view(out) if view is not None else out
                    errs = []
                    for g in check_groups:
                        lo, hi = int(starts[g]), int(starts[g] + sizes_np[g])
                        if hi > lo:
                            want = np.asarray(jnp.matmul(x[lo:hi].astype(jnp.float32), w[g].T.astype(jnp.float32)))
                            got = np.asarray(out[lo:hi], np.float32)
                            errs.append(float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9)))
                    row["max_rel_err"] = max(errs) if errs else 0.0
                result["results"].append(row)
                log({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items() if kk != "load"})

            if "dense" in args.candidates and routing == args.routings[0]:
                for label, o in (("dense", opts), ("dense_xla_defaults", {})):
                    if args.fp8:
                        record(label, jit(dense_fp8, compiler_options=o), x, w[0], check=False)
                    else:
                        record(label, jit(jnp.matmul, compiler_options=o), x, dense_w, check=False)
            if "ragged_dot" in args.candidates:
                as_float = (lambda a: a.astype(jnp.float32)) if args.fp8 else (lambda a: a)  # noqa: E731
                record("ragged_dot", jit(lambda a, b, s: moe.grouped_matmul(as_float(a), as_float(b), s,
                                                                            "ragged_dot"),
                                         compiler_options=opts), x, w, sizes)
            if "mgpu" in args.candidates:
                record("mgpu", jit(lambda a, b, s: moe.grouped_matmul(a, b, s, "mgpu"), compiler_options=opts),
                       x, w, sizes, extra={"tiling": moe.mgpu_tiling(n, k)})
            if "mgpu_kn" in args.candidates:
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

                w_kn = jnp.swapaxes(w, 1, 2)
                record("mgpu_kn", jit(lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s,
                                                                                  **moe.mgpu_tiling(n, k)),
                                      compiler_options=opts), x, w_kn, sizes)
                del w_kn

            def kernel_forms(config, swiglu: bool):
                """(row name, config, grouped_gemm.SILU) for each --pipeline-tiles value (config as set, or
                pipelined at contraction k) and, with `swiglu`, each --silu value (a row name says a form other
                than the default)."""
                piped = grouped_gemm.pipelined(config._replace(stages=args.pipeline_stages or config.stages), k)
                forms = [("tiled_pipelined", piped) if on else ("tiled", config) for on in args.pipeline_tiles]
                silus = (args.silu or [grouped_gemm.SILU]) if swiglu else [grouped_gemm.SILU]
                return [(name + f"_silu_{silu}" * (silu != grouped_gemm.SILU), c, silu) for name, c in forms
                        for silu in silus]

            if "tiled" in args.candidates and args.fp8:  # each GEMM at its own fp8 config, no SwiGLU epilogue
                with mock.patch.object(moe, "PIPELINED_DOWN", False):
                    pair = moe.tiled_configs(d, f, fp8=True) or (grouped_gemm.TileConfig(tile_k=128),) * 2
                time_tiled(record, x, w, sizes, pair[0 if shape_name == "gate_up" else 1])
                # and the epilogue forms the model runs: gate+up with its scales and SwiGLU, down with its scales
                model_config = (moe.TILED_FP8_SWIGLU_CONFIG if shape_name == "gate_up"
                                else moe.TILED_FP8_DOWN_SCALED_CONFIG)
                for name, config, silu in kernel_forms(model_config, shape_name == "gate_up"):
                    with mock.patch.object(grouped_gemm, "SILU", silu):
                        time_tiled(record, x, w, sizes, config, name=name, swiglu=shape_name == "gate_up",
                                   scaled=True)
                    if shape_name == "down":  # and with the warpgroups splitting the tile's rows
                        time_tiled(record, x, w, sizes, grouped_gemm.split_rows(config), name=name + "_split_rows",
                                   scaled=True)
                # moe.FP8_HIDDEN "blocks": gate+up quantising its output in the epilogue; down on block-scaled
                # rows at the model's config (pipelined as it runs)
                # (blocks of a CTA's 128 columns, and of a warpgroup's 64: moe.FP8_HIDDEN_BLOCK)
                for block in (128, 64):
                    if shape_name == "gate_up":  # the warpgroups splitting columns (128: exchanging abs-max, as
                        # the model runs it), then (128) rows
                        time_tiled(record, x, w, sizes, model_config, swiglu=True, scaled=True, quantize_out=True,
                                   quantize_block=block)
                        if block == 128:
                            time_tiled(record, x, w, sizes, moe.TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG,
                                       name="tiled_split_rows", swiglu=True, scaled=True, quantize_out=True)
                        continue
                    with mock.patch.object(moe, "FP8_HIDDEN_BLOCK", block):  # the warpgroups splitting the
                        # tile's columns (the model's config), then its rows (grouped_gemm.split_rows)
                        config = moe.down_blocks_config(k)
                        time_tiled(record, x, w, sizes, config, name=f"tiled_rescale_{block}", block_scaled=True)
                        time_tiled(record, x, w, sizes, grouped_gemm.split_rows(config),
                                   name=f"tiled_split_rows_rescale_{block}", block_scaled=True)
            elif "tiled" in args.candidates:
                with mock.patch.object(moe, "PIPELINED_DOWN", False):  # the configs as set; pipelined below
                    pair = moe.tiled_configs(d, f) or (grouped_gemm.TileConfig(),) * 2
                if shape_name == "gate_up":  # gate+up with SwiGLU in the epilogue, as moe_block runs it
                    for name, config, silu in kernel_forms(pair[0], True):
                        with mock.patch.object(grouped_gemm, "SILU", silu):
                            time_tiled(record, x, w, sizes, config, name=name, swiglu=True)
                for name, config, _ in kernel_forms(pair[1], False):
                    time_tiled(record, x, w, sizes, config, name=name)
                    if shape_name == "down":  # and with the warpgroups splitting the tile's rows
                        time_tiled(record, x, w, sizes, grouped_gemm.split_rows(config), name=name + "_split_rows")
            if "cudnn" in args.candidates:
                cudnn_opts = dict(opts) | {"xla_gpu_experimental_use_ragged_dot_fusion": True}
                fn = jit(lambda a, b, s: moe.grouped_matmul(a, b, s, "ragged_dot"), compiler_options=cudnn_opts)
                try:
                    hlo = fn.lower(x, w, sizes).compile().as_text()
                    fused = "cudnn" in hlo.lower()
                except Exception as err:  # noqa: BLE001
                    hlo, fused = "", False
                    log(f"cudnn ragged-dot fusion: compile failed ({type(err).__name__}: {str(err)[:200]})")
                if fused:
                    record("cudnn", fn, x, w, sizes)
                else:
                    result["results"].append({"shape": shape_name, "routing": routing, "candidate": "cudnn",
                                              "error": "no cuDNN call in the compiled HLO (fusion not applied)"})
                    log(result["results"][-1])
            if "padded" in args.candidates:
                cap = int(-(-int(sizes_np.max()) // 128) * 128)
                xp = jax.random.normal(kx, (e, cap, k), jnp.float32).astype(dtype)
                row = {"capacity": cap, "padded_rows": cap * e}
                fn = jit(lambda a, b: jnp.einsum("eck,enk->ecn", a, b), compiler_options=opts)
                record("padded", fn, xp, w, extra=row, check=False)
                if "ms" in result["results"][-1]:  # useful FLOP/s: the real rows only
                    result["results"][-1]["tflops"] = flops / (result["results"][-1]["ms"] / 1e3) / 1e12
                del xp
        if args.tune_tiled:
            sizes = group_sizes_for("uniform", rows_n, e, args.top_k)
            routing, tune_start = "uniform", time.perf_counter()
            # (config, swiglu, scaled) in the order they are timed, until --tune-seconds are spent
            candidates = []
            if args.fp8:
                # first the epilogue forms the fp8 model runs: gate+up with its scales and SwiGLU
                # (`moe.TILED_FP8_SWIGLU_CONFIG`: two float32 accumulators per warpgroup leave registers for
                # 64-wide column tiles only), down with its scales (`moe.TILED_FP8_DOWN_SCALED_CONFIG`). A stage
                # holds A (128 rows) and B (2 x tn columns, twice for gate and up) of tk bytes; the epilogue's
                # output pieces and scales take ~34 KiB more, 227 KiB in all
                swiglu = shape_name == "gate_up"
                for tn, tk, stages, band in itertools.product((64,) if swiglu else (128, 64), (128, 64),
                                                              (2, 3, 4, 5), (8, 16)):
                    if tk * (128 + 2 * tn * (1 + swiglu)) * stages <= 193 * 1024:
                        candidates.append((grouped_gemm.TileConfig(128, tn, tk, stages, band=band), swiglu, True))
            # bf16: 128-deep k steps and 6 stages overflow shared memory (measured 2026-11-28); band 1 was slowest.
            # fp8 (one-byte values): 128-deep k steps fit; the unscaled kernels (`FP8_SWIGLU` "kernel",
            # `FP8_DOWN_SCALES` "combine")
            swiglus, depths = ((False,), (128, 64)) if args.fp8 else ((shape_name == "gate_up",), (64, 32))
            for swiglu, tn, tk, stages, band in itertools.product(swiglus, (128, 64), depths, (3, 4, 5), (8, 16)):
                candidates.append((grouped_gemm.TileConfig(128, tn, tk, stages, band=band), swiglu, False))
            for config, swiglu, scaled in candidates:
                if time.perf_counter() - tune_start > args.tune_seconds:
                    log("tiled tuning: time budget spent")
                    break
                if not moe._fits(config, n // (1 + swiglu), k):
                    continue
                time_tiled(record, x, w, sizes, config, name="tiled_tune", swiglu=swiglu, scaled=scaled)
        if args.tune_blocks and args.fp8 and shape_name == "down":
            # down on block-scaled rows (`moe.FP8_HIDDEN` "blocks"): k-steps of one 128-deep block, 128-row tiles
            # (the layout's); pipelined over a tile's 6 k-steps (stages dividing them) or not (bands of tiles);
            # 128- or 64-wide column tiles, 128- or 64-row epilogue pieces, warpgroups splitting columns or rows.
            # Shared memory: a stage is A (128 x 128) and B (2 tn x 128) bytes, the pieces 2 x 2 x epi_m x 64 x 2
            sizes = group_sizes_for("uniform", rows_n, e, args.top_k)
            routing, steps = "uniform", k // 128
            for tn, stages, epi_m, piped, rows_split, band in itertools.product(
                    (128, 64), (2, 3, 4, 6), (128, 64), (True, False), (False, True), (16, 8)):
                config = grouped_gemm.TileConfig(128, tn, 128, stages, epi_m=epi_m, band=band, pipeline_tiles=piped,
                                                 split_rows=rows_split)
                smem = stages * 128 * (128 + 2 * tn) + 2 * 2 * epi_m * 64 * 2
                if (smem > 216 * 1024 or (piped and (steps % stages or band != 16))
                        or (rows_split and (tn != 128 or epi_m != 64)) or (not piped and stages > 4)):
                    continue
                time_tiled(record, x, w, sizes, config, name="tiled_tune_blocks", block_scaled=True)
        if args.tune:
            sizes = group_sizes_for("uniform", rows_n, e, args.top_k)
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

            tune_start, best = time.perf_counter(), None
            # 64-row blocks and 256-wide columns measured slower at both shapes (2026-11-28, H100): left out
            grid = itertools.product((128,), (192, 128), (64, 128), (4, 3, 5, 6), (4, 8, 2))
            for bm, bn, bk, steps, gbn in grid:
                if time.perf_counter() - tune_start > args.tune_seconds:
                    log("tuning: time budget spent")
                    break
                if n % (bn * gbn) or k % bk:
                    continue
                tiling = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)
                fn = jax.jit(lambda a, b, s, t=tiling: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s,
                                                                                  transpose_rhs=True, **t))
                try:
                    seconds = time_calls(lambda: fn(x, w, sizes), jax.block_until_ready, 5, warmup=1)
                except Exception as err:  # noqa: BLE001 - shared memory overflow and the like
                    log(f"tune {tiling}: {type(err).__name__}")
                    continue
                row = {"shape": shape_name, "routing": "uniform", "candidate": "mgpu_tune", "tiling": tiling,
                       "ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
                result["results"].append(row)
                log(f"tune {tiling}: {row['tflops']:.0f} TFLOP/s")
                if best is None or row["tflops"] > best["tflops"]:
                    best = row
            result.setdefault("best_tiling", {})[shape_name] = best
            log(f"best tiling for {shape_name}: {best}")
        x = w = None  # free them before the next shape (--rounds keeps them alive through its replays)
    if args.rounds > 1:
        time_rounds(replays, args, log)
    replays.clear()
    # the whole sparse block at these shapes: route + sort + two grouped GEMMs + combine (uniform routing), reading
    # layer 1 of a stack of --block-layers layers as the model's layer scan does (a kernel that cannot read the
    # stack in place pays a copy of the layer's experts)
    nl = args.block_layers
    block_params = {"router": (jax.random.normal(key, (d, e), jnp.float32) * 0.02).astype(dtype),
                    "gate_up": (jax.random.normal(key, (nl, e, 2 * f, d), jnp.float32) * 0.02).astype(dtype),
                    "down": (jax.random.normal(key, (nl, e, d, f), jnp.float32) * 0.02).astype(dtype)}
    if args.fp8:  # e4m3 experts with per-column scales, as load_model(..., dtype="fp8") stores them
        from jaxllm.fp8 import quantize_out_in

        block_params |= {name: quantize_out_in(block_params[name]) for name in ("gate_up", "down")}
    tokens = jax.random.normal(key, (args.tokens, d), jnp.float32).astype(dtype)
    gemm_flops = 2 * rows_n * d * 3 * f
    reference = None
    for impl in args.block_impls or [moe.default_grouped_matmul_impl()]:
        fn = jit(lambda t, p, j, impl=impl: moe.moe_block(t, p, args.top_k, True, impl=impl, layer=j),
                 compiler_options=opts)
        layer = jnp.int32(1)
        out = jax.block_until_ready(fn(tokens, block_params, layer))
        seconds = time_calls(lambda: fn(tokens, block_params, layer), jax.block_until_ready, args.iters)
        row = {"impl": impl, "ms": seconds * 1e3, "expert_tflops": gemm_flops / seconds / 1e12}
        if reference is None:
            reference = np.asarray(out, np.float32)
        else:
            row["max_rel_err_vs_first"] = float(np.abs(np.asarray(out, np.float32) - reference).max()
                                                / (np.abs(reference).max() + 1e-9))
        if args.profile_block is not None:
            from scripts.kernel_times import profile_call

            row["profile"] = profile_call(lambda: fn(tokens, block_params, layer), args.profile_block / impl)
        result.setdefault("moe_blocks", []).append(row)
        log(f"whole sparse block ({args.tokens} tokens, stack of {nl}): {row}")
        del out
    result["moe_block"] = result["moe_blocks"][0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
