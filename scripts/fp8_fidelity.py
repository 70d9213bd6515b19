"""How far fp8 (W8A8) hidden states are from bfloat16 ones at a model's full shape, for docs/PARITY.md.

    python scripts/fp8_fidelity.py --model qwen3-4b --out fp8_4b.json    # 4B shape, random weights: a GPU
    python scripts/fp8_fidelity.py --model /path/to/Qwen3-4B               # a real checkpoint
    python scripts/fp8_fidelity.py --model tiny --num-prompts 2           # seconds

The model in bfloat16 (`jaxllm.load_model(MODEL, "bfloat16")`; a preset gets its random weights) and its fp8
conversion (`jaxllm.fp8.quantize_params`, as `load_model(MODEL, "fp8")` does), run on the same whole Craftax
prompts (the template's prompt head + its text). For every hidden-state index (0 = embeddings, last = after the
final norm): the largest per-token relative L2 error ||fp8 - bf16|| / ||bf16|| and the smallest per-token cosine
over every token of every prompt. Off Hopper the fp8 matmuls are emulated (e4m3 values, float32 products and
sums), which gives the same products as the tensor cores' fp8 GEMM (exact in float32) summed in another order:
the numbers hold for the GPU up to float32 rounding. Memory: at the 4B shape a 23 GB CPU host was not enough
(drawing the random weights alone asks XLA:CPU for 35 GB; the bfloat16 forward widens the matrices to float32),
so run it on a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-4b", help="preset (random weights) or checkpoint directory")
    parser.add_argument("--num-prompts", type=int, default=4, help="whole prompts, each compared token by token")
    parser.add_argument("--steps", type=int, default=64, help="random play before each state (0: reset states)")
    parser.add_argument("--env", default="Craftax-Symbolic-v1")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights (presets)")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = parser.parse_args(argv)

    import jax

    from jaxllm import fp8, load_model, load_tokenizer
    from jaxllm.api import Model
    from jaxllm.parity import collect_hidden_states, compare_hidden_states, format_table, jax_hidden_states
    from render.sample_prompts import craftax_prompts

    started = time.perf_counter()
    model = load_model(args.model, "bfloat16", seed=args.seed)
    config, params, dtype = model.config, model.params, model.dtype
    del model
    prompts = craftax_prompts(load_tokenizer(), args.num_prompts, env_name=args.env, steps=args.steps)
    wholes = prompts.whole()

    def run(model: Model, name: str) -> list[list[np.ndarray]]:
        """Per prompt, its real tokens' hidden states; all prompts in one call (one compiled shape)."""
        states = collect_hidden_states(jax_hidden_states(model), wholes, batch_size=len(wholes))
        print(f"{name}: {len(wholes)} prompts ({time.perf_counter() - started:.0f} s)", flush=True)
        return states

    # One model in memory at a time next to the weights it needs: bfloat16 first, then fp8 (the bfloat16
    # matrices dropped once quantised).
    want = run(Model(config, params, dtype), "bfloat16")
    quantized = jax.block_until_ready(fp8.quantize_params(params))
    del params
    stats = compare_hidden_states(run(Model(config, quantized, dtype, quantization="fp8"), "fp8"), want)
    lengths = [len(w) for w in wholes]
    table = format_table({"fp8 vs bf16": stats})
    device = jax.devices()[0]
    result = {"model": args.model, "device": f"{device.platform}: {device.device_kind}",
              "date": datetime.date.today().isoformat(), "fp8_native": fp8.native_fp8_available(),
              "prompt_tokens": lengths, "tokens": stats.tokens, "max_rel": stats.max_rel.tolist(),
              "min_cos": stats.min_cos.tolist(), "table": table}
    print(table)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
