"""jaxllm vs HF transformers at the full Qwen3-4B shape on one GPU, for docs/PARITY.md.

    python -m scripts.gpu_parity_4b [--out parity_4b.json] [--workdir /tmp/qwen3-4b-random]
    python -m scripts.gpu_parity_4b --smoke           # tiny shape on CPU, to check the script

Writes random Qwen3-4B weights in HF layout as bf16 safetensors (~8 GB; generated on the GPU with torch;
norm weights != 1), then runs ``scripts.parity_report`` on them: HF transformers (torch, sdpa) and the
jaxllm encoder (JAX) on the same GPU, every hidden-state index, bf16 and f32, on real Craftax prompts.
Fits one 80 GB card (JAX may take half of it; the torch model is freed before JAX loads its copy) and
about 5 minutes on an H100. Prints a markdown section (card, date, table) ready to paste.

f32 here means true f32 on both sides: JAX's default f32 matmul precision on NVIDIA GPUs may use TF32,
so this script sets ``jax_default_matmul_precision=highest`` (torch's default already disallows TF32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_parity_4b", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="checkpoint dir to write (default: a temp dir, removed)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--out", default=None, help="JSON results (table included)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 2 prompts, CPU")
    args = parser.parse_args(argv)

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for torch on the same card
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from scripts import parity_report

    report_args = ["--model", "tiny" if args.smoke else "qwen3-4b", "--ckpt-dtype", "bfloat16",
                   "--dtypes", args.dtypes, "--num-prompts", str(2 if args.smoke else args.num_prompts),
                   "--steps", "0", "--batch-size", "2"]
    if args.smoke:
        report_args += ["--device", "cpu"]
    if args.workdir:
        report_args += ["--workdir", args.workdir]
    result = parity_report.main(report_args)

    card = result["setup"]["hf_device_name"]
    jax_device = jax.devices()[0].device_kind
    low, high = result["setup"]["prompt_tokens"]
    shape = "tiny shape (smoke)" if args.smoke else "Qwen3-4B shape"
    section = (f"### {shape}, random bf16 weights: jaxllm vs HF transformers ({card}, "
               f"{datetime.date.today().isoformat()})\n\n"
               f"`python -m scripts.gpu_parity_4b`: {result['setup']['num_prompts']} Craftax-Symbolic-v1 prompts "
               f"({low}-{high} tokens), every token; HF on torch {card}, JAX on {jax_device}.\n\n{result['table']}\n")
    print("\n" + section)
    result["markdown"] = section
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
