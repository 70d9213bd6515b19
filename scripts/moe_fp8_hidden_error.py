"""What quantising the fp8 experts' hidden rows per 128-wide block (`moe.FP8_HIDDEN` "blocks", the default) costs
against one scale per row ("rows"), for docs/PARITY.md.

    python scripts/moe_fp8_hidden_error.py                    # Qwen3-30B-A3B's expert shape, 512 tokens: a CPU, ~1 min
    python scripts/moe_fp8_hidden_error.py --hidden 64 --ffn 256 --experts 8 --top-k 2 --tokens 256   # seconds

Random weights (N(0, 0.02), as `jaxllm.init_params`) and tokens (N(0, 1), as after an RMS norm). Two numbers per
form, each the mean over tokens of ||x - reference|| / ||reference||:
- `hidden`: the hidden rows silu(gate) * up alone, quantised and dequantised, against their float32 values, and
  what that error becomes after down's float32 product (only the hidden rows' quantisation, nothing else);
- `block`: the whole sparse block in fp8 (tokens and weights in e4m3 too: `moe.moe_block` on `fp8.quantize_out_in`
  weights) against the float32 block, on the same routing (the router stays float32 in both).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def relative_error(x: np.ndarray, reference: np.ndarray) -> float:
    """Mean over rows of ||x - reference|| / ||reference||."""
    x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
    return float(np.mean(np.linalg.norm(x - reference, axis=-1) / np.linalg.norm(reference, axis=-1)))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048, help="the model's width D")
    p.add_argument("--ffn", type=int, default=768, help="an expert's width F (a multiple of 128 for blocks)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from jaxllm import moe
    from jaxllm.fp8 import dequantize_blocks, quantize_blocks, quantize_out_in, quantize_rows

    if args.ffn % moe.FP8_HIDDEN_BLOCK:
        p.error(f"--ffn {args.ffn} must be a multiple of moe.FP8_HIDDEN_BLOCK {moe.FP8_HIDDEN_BLOCK}")
    rng = np.random.default_rng(args.seed)
    d, f, e = args.hidden, args.ffn, args.experts
    params = {"router": jnp.asarray(rng.normal(0, 0.02, (d, e)), jnp.float32),
              "gate_up": jnp.asarray(rng.normal(0, 0.02, (e, 2 * f, d)), jnp.float32),
              "down": jnp.asarray(rng.normal(0, 0.02, (e, d, f)), jnp.float32)}
    tokens = jnp.asarray(rng.normal(size=(args.tokens, d)), jnp.float32)

    # the hidden rows of expert 0 for every token, alone
    gate_up, down = np.asarray(params["gate_up"][0]), np.asarray(params["down"][0], np.float64)
    gate, up = np.split(np.asarray(tokens) @ gate_up.T, 2, axis=-1)
    hidden = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
    hidden_after_down = hidden @ down.T
    values, scales = quantize_rows(jnp.asarray(hidden))
    forms = {"rows": np.asarray(values, np.float32) * np.asarray(scales, np.float32).reshape(-1, 1),
             "blocks": np.asarray(dequantize_blocks(*quantize_blocks(jnp.asarray(hidden), moe.FP8_HIDDEN_BLOCK)))}

    reference = np.asarray(moe.moe_block(tokens, params, args.top_k, True))
    fp8_params = dict(params, gate_up=quantize_out_in(params["gate_up"]), down=quantize_out_in(params["down"]))
    result = {"shape": {"hidden": d, "ffn": f, "experts": e, "top_k": args.top_k, "tokens": args.tokens},
              "block_width": moe.FP8_HIDDEN_BLOCK, "forms": {}}
    for form, dequantized in forms.items():
        with mock.patch.object(moe, "FP8_HIDDEN", form):
            block = np.asarray(moe.moe_block(tokens, fp8_params, args.top_k, True))
        result["forms"][form] = {
            "hidden": relative_error(dequantized, hidden),
            "hidden_after_down": relative_error(dequantized.astype(np.float64) @ down.T, hidden_after_down),
            "block": relative_error(block, reference)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
