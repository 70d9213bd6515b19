"""Down's fp8 GEMM at each granularity of scales, the vendor's dense GEMMs beside ours, in one process and in
alternating rounds: XLA's dense fp8 GEMM with one scale per operand (issue 33's denominator, `bench_moe.py`'s
"dense"); cuBLAS through torch._scaled_mm with per-tensor scales, per-row x per-column scales, and block scales (A
1 x 128 with B 128 x 128, DeepSeek-V3's and Qwen3-FP8's recipe; A 1 x 128 with B 1 x 128); and
`jaxllm.grouped_gemm`'s down as the fp8 experts run it, on row scales (`moe.FP8_HIDDEN` "rows") and on 1 x 128
block-scaled rows ("blocks", the default), at one pass's rows on a uniform routing. Default shape: Qwen3-30B-A3B's
down (262,144 rows, K 768, N 2,048, bf16 out). `--gemm gate_up` times gate+up instead (K 2,048, N 2 x 768): ours in
the model's form (row x column scales, SwiGLU and the 128-wide block quantisation of its output in the epilogue),
set against cuBLAS's GEMM on the same row x column scales (which writes the product alone).

Every row is timed the same way (`bench_moe.time_per_call`: --back-to-back calls queued and synchronised once,
the median of --iters such timings), each round in the order of the last reversed; each row's ratio to XLA's
dense and to cuBLAS's GEMM of the same scale form ("rows": per-row x per-column; "blocks": A 1 x 128, B 128 x
128, whose per-k-step rescale is ours) is the median of its per-round ratios. A dense GEMM on block scales
rescales its sum at each 128-deep k-step as ours does; the one-scale GEMM never does: this separates what block
scales cost any kernel from what our grouped kernel costs. torch is a test dependency of the project and only
this script's; cuBLAS >= 12.9 has block scales on Hopper (a form it lacks is reported as an error row, the others
still run).

    python scripts/bench_scale_forms.py --out scale_forms.json
    python scripts/bench_scale_forms.py --gemm gate_up --out scale_forms_gate_up.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_moe's dense GEMM and routing


# each expert GEMM's (K, N) at Qwen3-30B-A3B's shape: gate+up [rows, D] x [2F, D], down [rows, F] x [D, F]
GEMM_SHAPES = {"gate_up": (2048, 1536), "down": (768, 2048)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=262144, help="token-expert rows of one pass")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--gemm", choices=sorted(GEMM_SHAPES), default="down",
                   help="which expert GEMM: its default K and N are Qwen3-30B-A3B's (K, N): %(choices)s")
    p.add_argument("--k", type=int, default=None, help="contraction (a multiple of 128); default: the GEMM's")
    p.add_argument("--n", type=int, default=None,
                   help="output columns of the GEMM (gate_up: 2 x moe_intermediate_size, a multiple of 256; down: "
                        "hidden_size, a multiple of 256); default: the GEMM's")
    p.add_argument("--iters", type=int, default=10, help="timings per row and round (their median)")
    p.add_argument("--back-to-back", type=int, default=10, help="calls queued per timing")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    k, n = GEMM_SHAPES[args.gemm]
    args.k, args.n = args.k or k, args.n or n
    return args


def block_amax_scales(x, rows: int, cols: int):
    """One float32 scale per rows x cols block of the torch tensor x [R, C] (abs-max / 448), [R // rows, C // cols]."""
    r, c = x.shape
    blocks = x.reshape(r // rows, rows, c // cols, cols).abs().amax(dim=(1, 3)).float()
    return (blocks / 448.0).clamp(min=1e-12)


def cublas_forms(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """name -> a call of torch._scaled_mm on [rows, K] x [K, N] e4m3 operands with that form's scales (A row-major,
    B column-major, as cuBLAS's fp8 GEMMs take them; 1 x 128 scales stored K-block-major, as it asks)."""
    import torch

    torch.manual_seed(0)
    m, k, n = args.rows, args.k, args.n
    a_real = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_real = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, w8 = a_real.to(torch.float8_e4m3fn), w_real.to(torch.float8_e4m3fn)
    b8 = w8.t()  # [K, N], column-major
    one = torch.tensor(1.0, device="cuda")
    row_a = torch.rand(m, 1, device="cuda") + 0.5
    col_b = torch.rand(1, n, device="cuda") + 0.5
    a_1x128 = block_amax_scales(a_real, 1, 128).t().contiguous().t()  # [M, K // 128]
    w_128x128 = block_amax_scales(w_real, 128, 128)  # [N // 128, K // 128]
    w_1x128 = block_amax_scales(w_real, 1, 128).t().contiguous().t()  # [N, K // 128]

    def call(sa, sb):
        return lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    return {"cublas_per_tensor": call(one, one),
            "cublas_per_row_x_per_column": call(row_a, col_b),
            "cublas_a_1x128_b_128x128": call(a_1x128, w_128x128.t()),
            "cublas_a_1x128_b_1x128": call(a_1x128, w_1x128.t())}


def jax_forms(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """name -> a call of XLA's dense fp8 GEMM at [rows, K] x [N, K] (one scale per operand), and of our grouped
    GEMM as the fp8 experts run it (uniform routing over --experts, the rows laid out in tiles as the dispatch lays
    them): down on row scales and on 1 x 128 block scales, or (--gemm gate_up) gate+up with its scales, SwiGLU and
    block quantisation in the epilogue."""
    import jax
    import jax.numpy as jnp

    from bench_moe import dense_fp8, group_sizes_for
    from jaxllm import grouped_gemm, moe
    from jaxllm.compile import compiler_options, jit

    kx, kw, ks = jax.random.split(jax.random.key(0), 3)
    e4m3 = jnp.float8_e4m3fn
    x = jax.random.normal(kx, (args.rows, args.k), jnp.float32).astype(e4m3)
    w = jax.random.normal(kw, (args.experts, args.n, args.k), jnp.float32).astype(e4m3)
    sizes = group_sizes_for("uniform", args.rows, args.experts, args.top_k)
    gate_up = args.gemm == "gate_up"
    blocks_config = moe.TILED_FP8_SWIGLU_BLOCKS_CONFIG if gate_up else moe.down_blocks_config(args.k)
    plan = grouped_gemm.tile_plan(sizes, args.rows, blocks_config.tile_m)
    padded = jnp.zeros((plan.num_rows, args.k), e4m3).at[plan.padded_row].set(x)
    row_scale = jax.random.uniform(ks, (plan.num_rows,), minval=0.001, maxval=0.01)
    col_scale = jax.random.uniform(ks, (args.experts, args.n), minval=0.001, maxval=0.01)
    opts = compiler_options()
    dense = jit(dense_fp8, compiler_options=opts)
    w0 = w[0]
    forms = {"xla_dense_per_tensor": lambda: dense(x, w0)}
    if gate_up:  # the model's form: SwiGLU, its output quantised per row and 128-wide block
        ours = jit(lambda a, b, g, r, c: grouped_gemm.tiled_grouped_matmul(
            a, b, g, blocks_config, swiglu=True, row_scale=r, col_scale=c, quantize_out=True,
            quantize_block=moe.FP8_HIDDEN_BLOCK), compiler_options=opts)
        forms["ours_gate_up"] = lambda: ours(padded, w, plan.tile_groups, row_scale, col_scale)
        return forms
    rows_config = moe._down_config(moe.TILED_FP8_DOWN_SCALED_CONFIG, args.k)
    block_scales = jax.random.uniform(ks, (args.k // blocks_config.tile_k, plan.num_rows), minval=0.001, maxval=0.01)
    ours_rows = jit(lambda a, b, g, r, c: grouped_gemm.tiled_grouped_matmul(a, b, g, rows_config, row_scale=r,
                                                                           col_scale=c), compiler_options=opts)
    ours_blocks = jit(lambda a, b, g, r, c: grouped_gemm.tiled_grouped_matmul(a, b, g, blocks_config,
                                                                             row_block_scales=r, col_scale=c),
                      compiler_options=opts)
    forms["ours_down_rows"] = lambda: ours_rows(padded, w, plan.tile_groups, row_scale, col_scale)
    forms["ours_down_blocks"] = lambda: ours_blocks(padded, w, plan.tile_groups, block_scales, col_scale)
    return forms


# each scale form's cuBLAS GEMM, the like-for-like yardstick of our kernel on that form
SAME_FORM = {"ours_down_rows": "cublas_per_row_x_per_column", "ours_down_blocks": "cublas_a_1x128_b_128x128",
             "ours_gate_up": "cublas_per_row_x_per_column"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import jax
    import torch

    from bench_moe import time_per_call

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_scale_forms: needs a CUDA GPU (torch.cuda.is_available() is False)")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "jax": jax.__version__,
        "gemm": args.gemm, "shape": {"rows": args.rows, "k": args.k, "n": args.n, "experts": args.experts}, "rows": []}
    torch_sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    calls = {name: (fn, jax.block_until_ready) for name, fn in jax_forms(args).items()}
    calls |= {name: (fn, torch_sync) for name, fn in cublas_forms(args).items()}
    times: dict[str, list[float]] = {}
    for name, (fn, sync) in calls.items():  # compile / warm up; a form this cuBLAS lacks is an error row
        try:
            for _ in range(2):
                sync(fn())
        except Exception as err:  # noqa: BLE001
            result["rows"].append({"form": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"})
            print(result["rows"][-1], flush=True)
        else:
            times[name] = []
    for r in range(args.rounds):
        for name in (list(times) if r % 2 == 0 else list(reversed(times))):
            fn, sync = calls[name]
            times[name].append(time_per_call(fn, args, sync))
        print(f"round {r + 1} of {args.rounds} timed", flush=True)
    flops = 2 * args.rows * args.k * args.n

    def ratios(over: str, name: str) -> list[float]:
        return [round(b / t, 4) for b, t in zip(times[over], times[name])]

    for name, ts in times.items():
        row = {"form": name, "median_ms": statistics.median(ts) * 1e3, "tflops": flops / statistics.median(ts) / 1e12}
        for key, over in (("of_xla_dense", "xla_dense_per_tensor"), ("of_cublas_same_form", SAME_FORM.get(name))):
            if over in times:
                row[key + "_rounds"] = ratios(over, name)
                row[key] = statistics.median(row[key + "_rounds"])
        result["rows"].append(row)
        print(row, flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
