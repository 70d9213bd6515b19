"""Hidden-state parity of jaxllm (our pure-JAX Qwen3) against HF transformers (and optionally a vLLM server).

    python -m scripts.parity_report --model CHECKPOINT_DIR [--dtypes float32,bfloat16] [--vllm-url URL]
    python -m scripts.parity_report --model tiny --smoke      # random tiny HF checkpoint, CPU, seconds

For every hidden-state index (HF ``output_hidden_states`` numbering: 0 = embeddings, L = after the final
norm) it prints the largest per-token relative L2 error ||jaxllm - hf|| / ||hf|| and the smallest per-token
cosine over all real tokens of real Craftax prompts (``render`` templates of craftax states), in each
dtype. With two dtypes it adds the HF-bf16-vs-HF-f32 gap, the floor that bf16 rounding alone sets.
With ``--vllm-url`` it adds a row comparing the server's ``/v1/embeddings`` vector with jaxllm's last-token
final hidden state (what ``scripts/start_vllm.sh`` configures vLLM to return).

The library is shared with the parity suite: random checkpoints, hidden states and comparisons in
jaxllm/parity.py, real Craftax prompts in render/sample_prompts.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from render.envs import ENV_NAMES, FORMATS  # noqa: E402
from jaxllm.parity import (IndexStats, collect_hidden_states, compare_hidden_states, format_table,  # noqa: E402
                           hf_hidden_states, jax_hidden_states, vector_errors, write_random_checkpoint)
from render.sample_prompts import ENV_DEFAULT, craftax_prompts  # noqa: E402


# ------------------------------------------------------------------------------------ CLI
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.parity_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="HF Qwen3 checkpoint dir, or a jaxllm preset name ('tiny') for a random checkpoint")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--env", default=ENV_DEFAULT, choices=ENV_NAMES)
    parser.add_argument("--fmt", default="compact", choices=FORMATS)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64, help="random play of up to this many steps before each state (0: reset states)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="torch device for HF (default: cuda if available)")
    parser.add_argument("--ckpt-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the random checkpoint written for a preset --model")
    parser.add_argument("--workdir", default=None, help="where to write that checkpoint (default: a temp dir)")
    parser.add_argument("--vllm-url", default=None, help="also compare against this vLLM-compatible server")
    parser.add_argument("--smoke", action="store_true", help="2 prompts from reset states (fast CPU check)")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.steps = 2, 0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    import torch

    from jaxllm import PRESETS, Qwen3Config, load_model, load_tokenizer

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "bfloat16", "fp8"):
            raise SystemExit(f"--dtypes: unknown dtype {d!r}; use float32, bfloat16 and/or fp8")
    if "fp8" in dtypes:  # HF has no fp8: the fp8 model is compared with HF float32 (and the float32 model)
        dtypes = ["float32"] + [d for d in dtypes if d != "float32"]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tmp = None
    ckpt = Path(args.model)
    if not ckpt.is_dir():
        if args.model not in PRESETS:
            raise SystemExit(f"--model {args.model!r} is neither a checkpoint directory nor a preset {sorted(PRESETS)}")
        if args.workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="parity-ckpt-")
        started = time.perf_counter()
        ckpt = write_random_checkpoint(args.workdir or tmp.name, PRESETS[args.model], dtype=args.ckpt_dtype,
                                       seed=args.seed, device=device)
        print(f"wrote a random {args.model} checkpoint ({args.ckpt_dtype}) to {ckpt} in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    config = Qwen3Config.from_json(ckpt / "config.json")
    tokenizer = load_tokenizer(ckpt if (ckpt / "tokenizer.json").exists() else None)
    prompts = craftax_prompts(tokenizer, args.num_prompts, env_name=args.env, fmt=args.fmt, seed=args.seed,
                              steps=args.steps)
    whole = prompts.whole()
    print(f"{len(whole)} {args.env} prompts ({args.fmt}), {min(map(len, whole))}-{max(map(len, whole))} tokens; "
          f"checkpoint {args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}", flush=True)

    hf: dict[str, list] = {}
    columns: dict[str, IndexStats] = {}
    ours_final: dict[str, np.ndarray] = {}
    for dtype in dtypes:
        started = time.perf_counter()
        if dtype != "fp8":  # HF has no fp8: the fp8 model is compared with HF float32 (computed first)
            run_hf = hf_hidden_states(ckpt, dtype, device)
            hf[dtype] = collect_hidden_states(run_hf, whole, args.batch_size)
            del run_hf  # free the torch model before JAX loads its copy
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        model = load_model(ckpt, dtype=dtype)
        ours = collect_hidden_states(jax_hidden_states(model), whole, args.batch_size)
        column = "jaxllm fp8 vs HF f32" if dtype == "fp8" else f"jaxllm vs HF {dtype}"
        columns[column] = compare_hidden_states(ours, hf["float32" if dtype == "fp8" else dtype])
        ours_final[dtype] = np.stack([p[-1][-1] for p in ours])
        del model, ours
        gc.collect()
        print(f"{dtype}: jaxllm{'' if dtype == 'fp8' else ' and HF'} done in {time.perf_counter() - started:.0f} s",
              flush=True)
    if "float32" in hf and "bfloat16" in hf:
        columns["HF bf16 vs HF f32"] = compare_hidden_states(hf["bfloat16"], hf["float32"])
    print(format_table(columns))
    result: dict[str, Any] = {name: {"max_rel": s.max_rel.tolist(), "min_cos": s.min_cos.tolist()}
                              for name, s in columns.items()}
    result["table"] = format_table(columns)
    result["setup"] = {"model": args.model, "env": args.env, "fmt": args.fmt, "num_prompts": len(whole),
                       "prompt_tokens": [min(map(len, whole)), max(map(len, whole))], "device": device,
                       "hf_device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}

    if args.vllm_url:
        from jaxllm.http.client import VLLMClient

        with VLLMClient(args.vllm_url) as client:
            served = client.embed(whole)
        for dtype, vectors in ours_final.items():
            rel, cos = vector_errors(vectors, served)
            print(f"vLLM ({args.vllm_url}) vs jaxllm {dtype}, last-token final state: max rel L2 {rel.max():.2e}, "
                  f"min cos {cos.min():.6f}, served norm {np.linalg.norm(served, axis=-1).mean():.3g}")
            result[f"vllm vs jaxllm {dtype}"] = {"max_rel": float(rel.max()), "min_cos": float(cos.min())}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
