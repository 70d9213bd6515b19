"""What cuBLAS itself pays for finer fp8 scales, through torch._scaled_mm on a GPU: one dense GEMM shape (default
Qwen3-30B-A3B's down at one packed pass: M 262,144 rows, K 768, N 2,048, bf16 out) with per-tensor scales, per-row x
per-column scales, and block scales (A 1 x 128 with B 128 x 128, DeepSeek-V3's and Qwen3-FP8's recipe; A 1 x 128
with B 1 x 128), timed in alternating rounds, each form's median against the per-tensor GEMM of its round.

The yardstick for `jaxllm.grouped_gemm`'s down on block-scaled rows (`moe.FP8_HIDDEN` "blocks"): issue 33 divides
its FLOP rate by a dense fp8 GEMM's with one scale per operand, which never rescales inside its k loop; this says
how much of the block-scaled kernel's gap the vendor's own kernels share. torch is a test dependency of the
project and this script's only use of it. Needs cuBLAS >= 12.9 for block scales on Hopper (a form it lacks is
reported as an error row, the others still run).

    python scripts/bench_cublas_scales.py --out cublas_scales.json
    python scripts/bench_cublas_scales.py --m 262144 --k 2048 --n 1536    # gate+up's shape
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path
from typing import Any, Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--m", type=int, default=262144, help="rows (one pass's token-expert rows)")
    p.add_argument("--k", type=int, default=768, help="contraction (a multiple of 128)")
    p.add_argument("--n", type=int, default=2048, help="output columns (a multiple of 128)")
    p.add_argument("--iters", type=int, default=20, help="calls per timing (back to back, one sync)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; each form's ratio is their median")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def block_amax_scales(x, rows: int, cols: int):
    """One float32 scale per rows x cols block of x [R, C] (abs-max / 448), as [R // rows, C // cols]."""
    r, c = x.shape
    blocks = x.reshape(r // rows, rows, c // cols, cols).abs().amax(dim=(1, 3)).float()
    return (blocks / 448.0).clamp(min=1e-12)


def scaled_forms(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """name -> a call of torch._scaled_mm on the same fp8 operands with that form's scales (a [M, K] row-major,
    b [K, N] column-major, as cuBLAS's fp8 GEMMs want them)."""
    import torch

    torch.manual_seed(0)
    m, k, n = args.m, args.k, args.n
    a_real = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_real = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8 = (a_real * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w8 = (w_real * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    b8 = w8.t()  # [K, N], column-major
    one = torch.tensor(1.0, device="cuda")
    row_a = torch.rand(m, 1, device="cuda") + 0.5
    col_b = torch.rand(1, n, device="cuda") + 0.5
    # 1 x 128 scales must be outer-dim-major: [M, K // 128] stored K // 128-major
    a_1x128 = block_amax_scales(a_real, 1, 128).t().contiguous().t()
    w_128x128 = block_amax_scales(w_real, 128, 128)  # [N // 128, K // 128]
    w_1x128 = block_amax_scales(w_real, 1, 128).t().contiguous().t()  # [N, K // 128]

    def call(sa, sb):
        return lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    return {"per_tensor": call(one, one),
            "per_row_x_per_column": call(row_a, col_b),
            "a_1x128_b_128x128": call(a_1x128, w_128x128.t()),
            "a_1x128_b_1x128": call(a_1x128, w_1x128.t())}


def time_call(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call: iters calls back to back between two CUDA events (after one warm-up call)."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cublas_scales: needs a CUDA GPU (torch.cuda.is_available() is False)")
    flops = 2 * args.m * args.k * args.n
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cublas": torch.backends.cuda.preferred_blas_library().name if hasattr(torch.backends.cuda,
                                                                             "preferred_blas_library") else None,
        "shape": {"m": args.m, "k": args.k, "n": args.n}, "rows": []}
    forms, times = {}, {}
    for name, fn in scaled_forms(args).items():
        try:
            time_call(fn, 2)
        except Exception as err:  # noqa: BLE001 - a form this cuBLAS lacks: say so, keep the others
            result["rows"].append({"form": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"})
            print(result["rows"][-1], flush=True)
            continue
        forms[name], times[name] = fn, []
    for r in range(args.rounds):  # each round in the order of the last reversed: drift falls on every form
        for name in (list(forms) if r % 2 == 0 else list(reversed(forms))):
            times[name].append(time_call(forms[name], args.iters))
    base = times.get("per_tensor")
    for name, ts in times.items():
        row = {"form": name, "median_ms": statistics.median(ts) * 1e3,
               "tflops": flops / statistics.median(ts) / 1e12}
        if base:
            ratios = [b / t for b, t in zip(base, ts)]
            row |= {"of_per_tensor": statistics.median(ratios), "of_per_tensor_rounds": [round(v, 4) for v in ratios]}
        result["rows"].append(row)
        print(row, flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
