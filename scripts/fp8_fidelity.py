"""How far fp8 (W8A8) hidden states are from bfloat16 ones at a model's full shape, for docs/PARITY.md.

    python scripts/fp8_fidelity.py --model qwen3-4b --out fp8_4b.json    # 4B shape, random weights: a GPU
    python scripts/fp8_fidelity.py --model /path/to/Qwen3-4B               # a real checkpoint
    python scripts/fp8_fidelity.py --model tiny --num-prompts 2           # seconds

One set of random bfloat16 weights, N(0, initializer_range) like `jaxllm.init_params` but drawn a slice at a time
(`init_params` draws the whole tree in one program, which on a CPU peaks at ~4x the weights: 35 GB at the 4B
shape), and its fp8 conversion (`jaxllm.fp8.quantize_matrix` per layer, as `load_model(MODEL, "fp8")` does for
the whole stack), run on the same whole Craftax prompts (the template's prompt head + its text). For every hidden-state index (0 = embeddings, last = after the final norm):
the largest per-token relative L2 error ||fp8 - bf16|| / ||bf16|| and the smallest per-token cosine over every
token of every prompt. Off Hopper the fp8 matmuls are emulated (e4m3 values, float32 products and sums), which
gives the same products as the tensor cores' fp8 GEMM (exact in float32) summed in another order: the numbers
hold for the GPU up to float32 rounding. Memory: the 4B shape needs the bf16 and fp8 weights (12 GB) plus the
forward's temporaries; on a 23 GB CPU host the bfloat16 forward alone was killed for memory (XLA:CPU widens the
bfloat16 matrices to float32), so run it on a GPU or a host with >= 48 GB.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


SLICE_ELEMENTS = 1 << 25  # values drawn per jitted call: bounds the random generator's temporaries on a CPU


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, scale):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def random_bf16_params(config, seed: int = 0) -> dict:
    """Random bfloat16 params of `config`'s shape (norm weights 1), each leaf drawn in slices of its leading axis."""
    from jaxllm.params import leaf_of
    from jaxllm.weights import param_shapes

    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    base, leaves = jax.random.key(seed), []
    for index, (path, shape) in enumerate(flat):
        if leaf_of(tuple(k.key for k in path)).init == "ones":
            leaves.append(jnp.ones(shape, jnp.bfloat16))
            continue
        rows = max(1, SLICE_ELEMENTS // int(np.prod(shape[1:])))
        key = jax.random.fold_in(base, index)
        parts = [_normal(jax.random.fold_in(key, start), (min(rows, shape[0] - start),) + shape[1:],
                         config.initializer_range) for start in range(0, shape[0], rows)]
        leaves.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
        del parts
    return jax.tree_util.tree_unflatten(treedef, leaves)


def quantize_by_layer(params: dict) -> dict:
    """`fp8.quantize_params`, one layer at a time (peak memory: the weights plus one layer in float32)."""
    from jaxllm import fp8

    quantize = jax.jit(fp8.quantize_matrix)
    layers = {}
    for name, stacked in params["layers"].items():
        if name not in fp8.QUANTIZED_LEAVES:
            layers[name] = stacked
            continue
        per_layer = [quantize(stacked[i]) for i in range(stacked.shape[0])]
        layers[name] = fp8.Fp8Matrix(jnp.stack([m.weight for m in per_layer]), jnp.stack([m.scale for m in per_layer]))
        del per_layer
    return {**params, "layers": layers}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-4b", help="preset (random weights) or checkpoint directory")
    parser.add_argument("--num-prompts", type=int, default=4, help="whole prompts, each compared token by token")
    parser.add_argument("--steps", type=int, default=64, help="random play before each state (0: reset states)")
    parser.add_argument("--env", default="Craftax-Symbolic-v1")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights (presets)")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = parser.parse_args(argv)

    from jaxllm import PRESETS, Qwen3Config, fp8, load_tokenizer
    from jaxllm.api import Model
    from tests.parity.helpers import IndexStats, craftax_prompts, format_table

    started = time.perf_counter()
    config = PRESETS[args.model] if args.model in PRESETS else Qwen3Config.from_json(Path(args.model) / "config.json")
    if args.model in PRESETS:
        params = jax.block_until_ready(random_bf16_params(config, args.seed))
    else:
        from jaxllm import load_params

        params = load_params(Path(args.model), config, jnp.bfloat16)
    prompts = craftax_prompts(load_tokenizer(), args.num_prompts, env_name=args.env, steps=args.steps)
    wholes = prompts.whole()
    width = max(map(len, wholes))  # one compiled shape: right padding does not change a causal model's real tokens
    batch = np.full((len(wholes), width), 151643, np.int32)
    for row, whole in enumerate(wholes):
        batch[row, :len(whole)] = whole

    def run(model: Model, name: str) -> list[list[np.ndarray]]:
        """Per prompt, its real tokens' hidden states (float32 [T_i, D] per index), one prompt per call."""
        out = []
        for row, whole in enumerate(wholes):
            states = model.hidden_states(batch[row:row + 1])
            out.append([np.asarray(h[0, :len(whole)], np.float32) for h in states])
            print(f"{name}: prompt {row + 1}/{len(wholes)}, {len(whole)} tokens "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        return out

    # One model in memory at a time next to the weights it needs: bfloat16 first, then fp8 (the bfloat16
    # matrices dropped once quantised).
    want = run(Model(config, params, jnp.bfloat16), "bfloat16")
    quantized = jax.block_until_ready(quantize_by_layer(params))
    del params
    got = run(Model(config, quantized, jnp.bfloat16, quantization="fp8"), "fp8")
    stats = IndexStats.empty(config.num_hidden_layers + 1)
    for got_prompt, want_prompt in zip(got, want):
        for index, (g, w) in enumerate(zip(got_prompt, want_prompt)):
            stats.update(index, g, w)
        stats.tokens += want_prompt[0].shape[0]
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
