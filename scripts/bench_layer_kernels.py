"""The fp8 layer's one-pass kernels at the Qwen3-4B shape against their XLA forms, and a sweep of their tuning.

Rows: the residual add + RMSNorm + e4m3 quantisation (`residual_norm_quantize_pallas`, ROWS:WARPS:CHUNK), the
q/k scale + per-head RMSNorm + RoPE (`head_norm_rope_pallas`, ROWS:WARPS, for q's 32 heads and k's 8), each
against its jitted XLA form (`jaxllm.layer_ops`), and packed attention's two halves merged and quantised for
o_proj (`merge_quantize_pallas`, WARPS:HEADS) against XLA's merge followed by the quantisation kernel (the
fp8 model without `packed_attention.FUSED_MERGE_QUANTIZE`), in ms and GB/s of the bytes each must move
(`--sections` picks which). Steady state: the
median of `--iters` synchronised calls after two warm-ups.

    python scripts/bench_layer_kernels.py --out layer_kernels.json    # GPU (FP8 tensor cores)
    python scripts/bench_layer_kernels.py --smoke                     # tiny shapes on a CPU (kernels interpreted)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_fp8_mlp import time_call  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32_768, help="rows (the packed encoder's capacity)")
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--residual-configs", nargs="+", default=["1:4:512", "1:4:1024", "2:4:512", "2:8:512", "4:8:512"],
                   help="residual_norm_quantize_pallas settings, each ROWS:WARPS:CHUNK")
    p.add_argument("--head-configs", nargs="+", default=["8:2", "8:4", "16:2", "16:4", "16:8", "32:4", "32:8", "64:8"],
                   help="head_norm_rope_pallas settings, each ROWS:WARPS")
    p.add_argument("--merge-configs", nargs="+",
                   default=["4:32", "4:16", "4:8", "8:32", "2:32", "2:8"],
                   help="merge_quantize_pallas settings, each WARPS:HEADS (Triton warps, heads per load)")
    p.add_argument("--sections", nargs="+", default=["residual", "head", "merge"],
                   choices=["residual", "head", "merge"], help="which kernels to time")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations (CPU: the kernels interpreted)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.heads, args.head_dim, args.iters = 40, 96, [4, 2], 16, 2
        args.residual_configs, args.head_configs, args.merge_configs = ["2:4:64"], ["8:4"], ["4:2"]
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from jaxllm import fp8_kernels
    from jaxllm.fp8 import Fp8Product, native_fp8_available
    from jaxllm.layer_ops import head_norm_rope_reference, residual_norm_reference, rope_cos_sin

    args = parse_args(argv)
    interpret = not native_fp8_available()
    n, d, hd = args.tokens, args.hidden, args.head_dim
    keys = jax.random.split(jax.random.key(0), 6)
    bf16 = jnp.bfloat16
    h = jax.random.normal(keys[0], (1, n, d), bf16)
    y = jax.random.normal(keys[1], (1, n, d), bf16) * 100
    row_scale = jax.random.uniform(keys[2], (1, n), minval=1e-3, maxval=0.05)
    col_scale = jax.random.uniform(keys[3], (d,), minval=0.1, maxval=1.0)
    weight = jnp.ones((d,), bf16)
    rows_out: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows_out.append(row)
        print(f"{row['kernel']:>22} {row['setting']:>10}  {row['ms']:7.3f} ms  {row['gb_per_s']:7.0f} GB/s", flush=True)

    if "residual" in args.sections:
        moved = n * d * (2 + 2 + 2 + 1)  # h and the product in, the new h and e4m3 out
        ref = jax.jit(residual_norm_reference, static_argnums=(3, 4))
        product = Fp8Product(y, row_scale, col_scale, bf16)
        s = time_call(lambda: ref(h, product, weight, 1e-6, True), args.iters)
        report(dict(kernel="residual_norm_quantize", setting="xla", ms=s * 1e3, gb_per_s=moved / s / 1e9))
        h2, y2, rs1 = jax.block_until_ready((h[0], y[0], row_scale[0]))  # sliced once, outside the timed calls
        for config in args.residual_configs:
            rows, warps, chunk = (int(v) for v in config.split(":"))
            call = lambda: fp8_kernels.residual_norm_quantize_pallas(h2, y2, rs1, col_scale, weight, eps=1e-6,
                                                                     interpret=interpret, rows=rows, num_warps=warps,
                                                                     chunk=chunk)
            s = time_call(call, args.iters)
            report(dict(kernel="residual_norm_quantize", setting=config, ms=s * 1e3, gb_per_s=moved / s / 1e9))

    if "head" in args.sections:
        cos, sin = rope_cos_sin(jnp.arange(n) + 877, hd, 1e6, bf16)
        ref = jax.jit(head_norm_rope_reference, static_argnums=(4, 5))
        for name, heads in zip(("q", "k"), args.heads):
            width = heads * hd
            yq = jax.random.normal(keys[4], (1, n, width), bf16) * 100
            cs = jax.random.uniform(keys[5], (width,), minval=0.1, maxval=1.0)
            moved = n * width * 4 + n * hd * 4  # the product in, the result out, cos and sin
            product = Fp8Product(yq, row_scale, cs, bf16)
            s = time_call(lambda: ref(product, weight[:hd], cos, sin, 1e-6, heads), args.iters)
            report(dict(kernel=f"head_norm_rope ({name})", setting="xla", ms=s * 1e3, gb_per_s=moved / s / 1e9))
            yq2, w1 = jax.block_until_ready((yq[0], weight[:hd]))
            for config in args.head_configs:
                rows, warps = (int(v) for v in config.split(":"))
                call = lambda: fp8_kernels.head_norm_rope_pallas(yq2, rs1, cs, w1, cos, sin,
                                                                 head_dim=hd, eps=1e-6, dtype=bf16, interpret=interpret,
                                                                 rows=rows, num_warps=warps)
                s = time_call(call, args.iters)
                report(dict(kernel=f"head_norm_rope ({name})", setting=config, ms=s * 1e3, gb_per_s=moved / s / 1e9))
    if "merge" in args.sections:
        from jaxllm.fp8_kernels import merge_quantize_pallas, quantize_rows_pallas
        from jaxllm.packed_attention import merge_halves

        heads = args.heads[0]
        halves = [jax.random.normal(keys[i], (n, heads, hd), bf16) for i in (0, 1)]
        w_p = jax.random.uniform(keys[2], (n, heads))
        w_r = 1.0 - w_p
        moved = n * heads * hd * (2 + 2 + 1) + n * heads * 8  # both halves in, e4m3 out, the weights
        merge = jax.jit(lambda *a: merge_halves(*a, bf16).reshape(n, heads * hd))

        def xla_merge_then_kernel():
            return quantize_rows_pallas(merge(*halves, w_p, w_r), interpret=interpret)

        s = time_call(xla_merge_then_kernel, args.iters)
        report(dict(kernel="merge_quantize", setting="xla+kernel", ms=s * 1e3, gb_per_s=moved / s / 1e9))
        for config in args.merge_configs:
            warps, per = (int(v) for v in config.split(":"))
            call = lambda: merge_quantize_pallas(*halves, w_p, w_r, interpret=interpret, num_warps=warps,
                                                 heads_per=per)
            s = time_call(call, args.iters)
            report(dict(kernel="merge_quantize", setting=config, ms=s * 1e3, gb_per_s=moved / s / 1e9))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, tokens=n, rows=rows_out),
                                             indent=2))
    return rows_out


if __name__ == "__main__":
    main()
