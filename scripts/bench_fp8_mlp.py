"""The fp8 MLP's pieces at the Qwen3-4B shape, one device, steady state (compile and warm-up excluded).

Rows: the attention output's quantisation by XLA and by the one-pass Pallas kernel; the SwiGLU quantisation of down_proj's input by XLA (the 16-bit form before issue 23's kernel, and the
float32 reference) and by the one-pass Pallas kernel (`jaxllm.fp8_kernels`, several warp counts), against an
elementwise op that moves the same bytes (the bandwidth reference); the fp8 GEMMs (gate and up apart or as one
[2I, D] matrix, down); and the whole MLP before and after. The kernel's e4m3 rows are compared with the reference's.

    python scripts/bench_fp8_mlp.py --out fp8_mlp.json          # GPU (FP8 tensor cores)
    python scripts/bench_fp8_mlp.py --smoke                     # tiny shapes on a CPU (the kernel interpreted)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32_768, help="rows (the packed encoder's capacity)")
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=9728)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", nargs="+", default=["1:4:512", "1:4:1024", "2:8:512"],
                   help="Pallas kernel settings to time, each ROWS:WARPS:CHUNK (swiglu_quantize_pallas's tuning)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations (CPU: the kernel interpreted)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.intermediate, args.iters, args.configs = 64, 64, 96, 2, ["2:4:64"]
    return args


def time_call(fn: Callable[[], Any], iters: int) -> float:
    """Median seconds of `fn()` (synchronised), after two warm-up calls."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import fp8
    from jaxllm.compile import compiler_options, jit
    from jaxllm.fp8_kernels import quantize_rows_pallas, swiglu_quantize_pallas

    args = parse_args(argv)
    n, d, width = args.tokens, args.hidden, args.intermediate
    gpu = fp8.native_fp8_available()
    opts = compiler_options()
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    gate_w, up_w = (fp8.quantize_matrix(jax.random.normal(k, (d, width)) * 0.02) for k in keys[1:3])
    down_w = fp8.quantize_matrix(jax.random.normal(keys[3], (width, d)) * 0.02)
    xq, x_scale = jax.jit(fp8.quantize_rows)(x)
    gate = jax.jit(lambda a, w: fp8._fp8_dot(a, w, jnp.bfloat16))(xq, gate_w.weight)
    up = jax.jit(lambda a, w: fp8._fp8_dot(a, w, jnp.bfloat16))(xq, up_w.weight)
    scales = (x_scale, gate_w.scale, up_w.scale)

    def before(g, u, xs, gs, us):  # the MLP's form before the kernel: 16-bit gate, up and product, then quantise
        g = (g.astype(jnp.float32) * (xs[:, None] * gs)).astype(jnp.bfloat16)
        u = (u.astype(jnp.float32) * (xs[:, None] * us)).astype(jnp.bfloat16)
        return fp8.quantize_rows(jax.nn.silu(g) * u)

    swiglu_bytes = n * width * (2 + 2 + 1) + n * 4
    rows: list[dict[str, Any]] = []

    def row(name: str, fn: Callable, inputs: tuple, moved_bytes: float | None = None, flops: float | None = None):
        jitted = jit(fn, compiler_options=opts)
        t0 = time.perf_counter()
        out = jax.block_until_ready(jitted(*inputs))
        compile_s = time.perf_counter() - t0
        seconds = time_call(lambda: jitted(*inputs), args.iters)
        r = {"row": name, "ms": seconds * 1e3, "first_call_s": compile_s}
        if moved_bytes:
            r["GB_per_s"] = moved_bytes / seconds / 1e9
        if flops:
            r["TFLOP_per_s"] = flops / seconds / 1e12
        rows.append(r)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
        return out

    row("bandwidth reference: gate + up (bf16 out)", lambda g, u: g + u, (gate, up), n * width * 6)
    row("swiglu quantise, XLA, 16-bit gate/up/product (before)", before, (gate, up) + scales, swiglu_bytes)
    ref_q, ref_s = row("swiglu quantise, XLA, float32 (reference)", fp8.swiglu_quantize_reference, (gate, up) + scales,
                       swiglu_bytes)
    for setting in args.configs:
        rows_, warps, chunk = (int(v) for v in setting.split(":"))
        q, s = row(f"swiglu quantise, Pallas kernel, {rows_} rows x {warps} warps, chunk {chunk}",
                   lambda g, u, xs, gs, us, r=rows_, w=warps, c=chunk: swiglu_quantize_pallas(
                       g, u, xs, gs, us, interpret=not gpu, rows=r, num_warps=w, chunk=c),
                   (gate, up) + scales, swiglu_bytes)
        rows[-1]["e4m3_mismatch_fraction"] = float(np.mean(np.asarray(q.astype(jnp.float32))
                                                           != np.asarray(ref_q.astype(jnp.float32))))
        rows[-1]["scale_max_rel_diff"] = float(np.max(np.abs(np.asarray(s) / np.asarray(ref_s) - 1)))
        print(f"    vs reference: {rows[-1]['e4m3_mismatch_fraction']:.2e} of e4m3 values differ, scales "
              f"{rows[-1]['scale_max_rel_diff']:.1e}", flush=True)
    attn = jax.random.normal(keys[4], (n, 4096), jnp.bfloat16)  # the attention output of Qwen3-4B (32 x 128)
    quant_bytes = n * 4096 * (2 + 1) + n * 4
    ref_aq, _ = row("quantise attention output [N, 4096], XLA", fp8.quantize_rows, (attn,), quant_bytes)
    aq, _ = row("quantise attention output [N, 4096], Pallas kernel (default tuning)",
                lambda a: quantize_rows_pallas(a, interpret=not gpu), (attn,), quant_bytes)
    rows[-1]["e4m3_mismatch_fraction"] = float(np.mean(np.asarray(aq.astype(jnp.float32))
                                                       != np.asarray(ref_aq.astype(jnp.float32))))
    gemm = 2.0 * n * d * width
    row("fp8 GEMMs gate and up apart", lambda a, g, u: (fp8._fp8_dot(a, g, jnp.bfloat16), fp8._fp8_dot(a, u, jnp.bfloat16)),
        (xq, gate_w.weight, up_w.weight), flops=2 * gemm)
    merged = jnp.concatenate([gate_w.weight, up_w.weight], axis=0)
    row("fp8 GEMM gate|up as one [2I, D] matrix", lambda a, w: fp8._fp8_dot(a, w, jnp.bfloat16), (xq, merged),
        flops=2 * gemm)
    hq = ref_q
    row("fp8 GEMM down", lambda a, w: fp8._fp8_dot(a, w, jnp.bfloat16), (hq, down_w.weight), flops=gemm)

    def mlp_before(x, g, u, dn):
        return fp8.linear(jax.nn.silu(fp8.linear(x, g)) * fp8.linear(x, u), dn)

    row("whole fp8 MLP before (XLA SwiGLU quantisation)", mlp_before, (x, gate_w, up_w, down_w), flops=3 * gemm)
    row("whole fp8 MLP now (fp8.mlp)", fp8.mlp, (x, gate_w, up_w, down_w), flops=3 * gemm)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "tokens": n,
                                              "hidden": d, "intermediate": width, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
