"""How often Qwen3-MoE routing flips between dtypes on real Craftax prompts, and what a flip does to the vector.

Runs the same prompts (prefix + game text, the real tokenizer and template) through an MoE model in float32 (the
reference, or `--reference`), bfloat16 and fp8, and records every sparse layer's top-k expert choices per token.
Reports, per dtype: the share of (token, layer) routing decisions whose expert set differs from the reference's, the
share of slots (one of the k experts) that differ, the expert load (max / mean rows per expert: what a padded batched
GEMM would waste), and the cosine of the pooled vectors to the reference's, for prompts with and without a flip.
Used by docs/PARITY.md.

    python scripts/moe_routing_report.py --model tiny-moe --prompts 16          # CPU
    python scripts/moe_routing_report.py --model qwen3-30b-a3b --prompts 32 --reference bfloat16 --dtypes fp8 \
        --env Craftax-Symbolic-v1      # GPU (random weights; a float32 30B does not fit next to its activations)
    python scripts/moe_routing_report.py --moe-intermediate-size 256 --dtypes fp8 fp8-hidden-rows  # CPU: the fp8
        # experts' hidden rows in 128-wide blocks (the default) against one scale per row (tiny-moe's 64 is below a block)

The model is random (no real weights are reachable here): a trained router is more decisive, so the flip rates of
a real checkpoint are expected to be lower; run it with `--model /path/to/Qwen3-30B-A3B` to measure them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def routing_trace(model, ids) -> tuple[list, np.ndarray]:
    """Runs the model's forward pass on ids, compiled, and returns (per sparse layer, in order: experts int [N, k];
    the final hidden state [B, T, D] in float32). Each sparse block hands its router's choices and its layer index
    to the host by a callback. (Unordered: an ordered callback inside the layer scan crashed XLA's GPU fusion pass,
    jax 0.11.2, 2026-11-29; so the host sorts them by layer.)"""
    import jax

    from jaxllm import model as model_lib
    from jaxllm import moe

    trace, routed = [], []
    original_route, original_outputs = moe.route, model_lib.moe_expert_outputs

    def recording_route(x, router, top_k, norm_topk_prob):
        weights, experts = original_route(x, router, top_k, norm_topk_prob)
        routed.append(experts)
        return weights, experts

    def recording_outputs(x, params, top_k, norm_topk_prob, impl=None, layer=None):
        # `model.forward` passes every sparse block its index in the expert stack: the layer order
        outputs = original_outputs(x, params, top_k, norm_topk_prob, impl, layer)
        jax.debug.callback(lambda e, i: trace.append((int(i), np.asarray(e))), routed.pop(), layer)
        return outputs

    moe.route, model_lib.moe_expert_outputs = recording_route, recording_outputs
    try:  # a new function: traced now, with the recording router
        final = jax.jit(lambda params, ids: model_lib.forward(params, model.config, ids, layer=-1)[0])(
            model.params, jax.numpy.asarray(ids))
        final = np.asarray(final, np.float32)
        jax.effects_barrier()
    finally:
        moe.route, model_lib.moe_expert_outputs = original_route, original_outputs
    return [experts for _, experts in sorted(trace, key=lambda pair: pair[0])], final


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-moe", help="an MoE preset or checkpoint directory")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--env", default="Craftax-Classic-Symbolic-v1")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "fp8"],
                   help="bfloat16, fp8 or fp8-hidden-rows (fp8 with moe.FP8_HIDDEN 'rows': one scale per hidden row)")
    p.add_argument("--reference", default="float32", help="the dtype the others are compared with")
    p.add_argument("--moe-intermediate-size", type=int, default=None,
                   help="a preset's expert width replaced (random weights only), e.g. 256 for two 128-wide blocks")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import dataclasses
    from unittest import mock

    from jaxllm import PRESETS, load_model, load_tokenizer, moe
    from render.sample_prompts import craftax_prompts

    prompts = craftax_prompts(load_tokenizer(), args.prompts, args.env, steps=20)
    whole = prompts.whole()
    width = max(len(w) for w in whole)
    lengths = np.array([len(w) for w in whole])
    ids = np.zeros((len(whole), width), np.int32)
    for i, w in enumerate(whole):
        ids[i, :len(w)] = w
    real = np.arange(width)[None, :] < lengths[:, None]  # routing of pad tokens is left out

    source = args.model
    if args.moe_intermediate_size:
        if args.model not in PRESETS:
            p.error("--moe-intermediate-size takes a preset (random weights), not a checkpoint")
        source = dataclasses.replace(PRESETS[args.model], moe_intermediate_size=args.moe_intermediate_size)

    start = time.perf_counter()

    def run(dtype):
        hidden = "rows" if dtype == "fp8-hidden-rows" else moe.FP8_HIDDEN
        with mock.patch.object(moe, "FP8_HIDDEN", hidden):
            model = load_model(source, dtype="fp8" if dtype == "fp8-hidden-rows" else dtype)
            assert model.config.is_moe, f"{args.model} is not an MoE model"
            print(f"[{time.perf_counter() - start:6.1f} s] {dtype}: loaded, tracing", file=sys.stderr, flush=True)
            trace, final = routing_trace(model, ids)
        last = final[np.arange(len(whole)), lengths - 1]
        return model.config, [t.reshape(len(whole), width, -1)[real] for t in trace], last

    config, ref_trace, ref_vec = run(args.reference)
    loads = [np.bincount(t.reshape(-1), minlength=config.num_experts) for t in ref_trace]
    result = {"model": args.model, "moe_intermediate_size": config.moe_intermediate_size, "env": args.env,
              "reference": args.reference, "prompts": len(whole), "tokens": int(real.sum()),
              "sparse_layers": len(ref_trace), "top_k": config.num_experts_per_tok,
              "load_max_over_mean": [float(x.max() / x.mean()) for x in loads], "dtypes": {}}
    print(f"load max / mean per sparse layer ({args.reference}): {np.round(result['load_max_over_mean'], 3).tolist()}",
          file=sys.stderr, flush=True)
    token_of_row = np.repeat(np.arange(len(whole)), lengths)
    for dtype in args.dtypes:
        _, trace, vec = run(dtype)
        set_flips = [np.any(np.sort(a, -1) != np.sort(b, -1), axis=-1) for a, b in zip(ref_trace, trace)]
        slot_flips = [np.mean([len(set(x) - set(y)) for x, y in zip(a, b)]) / config.num_experts_per_tok
                      for a, b in zip(ref_trace, trace)]
        flipped_prompt = np.zeros(len(whole), bool)
        for f in set_flips:
            flipped_prompt |= np.bincount(token_of_row[f], minlength=len(whole)) > 0
        cos = (vec * ref_vec).sum(-1) / np.linalg.norm(vec, axis=-1) / np.linalg.norm(ref_vec, axis=-1)
        result["dtypes"][dtype] = {
            "token_layer_set_flip_rate": float(np.mean(np.concatenate(set_flips))),
            "slot_flip_rate": float(np.mean(slot_flips)),
            "set_flip_rate_by_layer": [float(f.mean()) for f in set_flips],
            "prompts_with_a_flip": int(flipped_prompt.sum()),
            "cosine_to_reference": {"min": float(cos.min()), "mean": float(cos.mean()),
                                    "mean_with_flip": float(cos[flipped_prompt].mean()) if flipped_prompt.any()
                                    else None,
                                    "mean_without_flip": float(cos[~flipped_prompt].mean())
                                    if (~flipped_prompt).any() else None}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
