"""The q/k path between the projections and attention at the Qwen3-4B shape: the fp8 GEMM product's rescale,
RMSNorm over each head and RoPE, as `jaxllm.model` writes it against HF's concatenated `rotate_half`.

Each row is one jitted function over [1, tokens, heads, 128] (q: 32 heads, k: 8), steady state, with the number
of GPU kernels XLA made of it (fusions and custom calls in the optimised HLO) and the bytes a single pass would
move (read the product, write the result). Both forms must give the same values.

    python scripts/bench_qk_rope.py --out qk_rope.json     # GPU
    python scripts/bench_qk_rope.py --smoke                # tiny shapes on a CPU
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_fp8_mlp import time_call  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32_768)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="64 tokens, 2 iterations")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.iters = 64, 2

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.compile import compiler_options, jit
    from jaxllm.model import apply_rope, rms_norm, rope_cos_sin

    def concatenate_rope(x, cos, sin):  # HF's form
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    n, hd, eps = args.tokens, 128, 1e-6
    cos, sin = rope_cos_sin(jnp.arange(n) % 1000 + 877, hd, 1e6, jnp.bfloat16)
    rows = []
    for heads in (32, 8):
        keys = jax.random.split(jax.random.key(heads), 4)
        product = jax.random.normal(keys[0], (n, heads * hd), jnp.bfloat16)
        x_scale = jax.random.uniform(keys[1], (n,), jnp.float32, 0.01, 0.1)
        channel_scale = jax.random.uniform(keys[2], (heads * hd,), jnp.float32, 0.001, 0.01)
        weight = (1 + 0.1 * jax.random.normal(keys[3], (hd,))).astype(jnp.bfloat16)
        for scaled in (True, False):  # fp8: the GEMM's unscaled product and its scales; bf16: the product itself
            outputs = {}
            for form, rope in (("model", apply_rope), ("concatenate", concatenate_rope)):
                def path(y, xs, cs, w, c, s, rope=rope, scaled=scaled):
                    if scaled:
                        y = (y.astype(jnp.float32) * (xs[:, None] * cs)).astype(jnp.bfloat16)
                    return rope(rms_norm(y.reshape(1, n, heads, hd), w, eps), c, s)

                fn = jit(path, compiler_options=compiler_options())
                inputs = (product, x_scale, channel_scale, weight, cos, sin)
                hlo = fn.lower(*inputs).compile().as_text()
                entry = hlo[hlo.rfind("ENTRY"):]
                kernels = len(re.findall(r"= [^=]*\b(fusion|custom-call)\(", entry))
                seconds = time_call(lambda: fn(*inputs), args.iters)
                outputs[form] = np.asarray(fn(*inputs).astype(jnp.float32))
                one_pass = (n * heads * hd * 2) * 2
                rows.append({"heads": heads, "fp8_scales": scaled, "form": form, "ms": seconds * 1e3,
                             "kernels": kernels, "one_pass_gb_per_s": one_pass / seconds / 1e9,
                             "device": jax.devices()[0].device_kind})
                print(json.dumps(rows[-1]), flush=True)
            diff = float(np.abs(outputs["model"] - outputs["concatenate"]).max())
            print(f"heads {heads}, fp8 scales {scaled}: max |model - concatenate| = {diff}", flush=True)
            rows[-1]["max_abs_diff_vs_model"] = diff
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
