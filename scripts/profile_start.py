"""Where `rl.train`'s first seconds go before any program compiles (issue 35: the start's setup).

Times each setup step of `python -m rl.train --encoder inscan --model M` up to the point where its compiles start
(imports, the config, the LLM's config and tokenizer with the template, the trainer built on the LLM's shapes) and
prints the `cProfile` functions that took longest. Nothing is compiled on purpose; the eager operations of these
steps (craftax's constants at import) compile as they would in a run.

    python scripts/profile_start.py --model qwen3-4b [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

T0 = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-4b")
    parser.add_argument("--llm-dtype", default="fp8")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    profile = cProfile.Profile()
    profile.enable()
    steps = []

    def step(name, fn):
        t = time.perf_counter()
        out = fn()
        steps.append((name, time.perf_counter() - t))
        print(f"{time.perf_counter() - T0:6.1f}s {name}: {steps[-1][1]:.2f} s", flush=True)
        return out

    jax = step("import jax", lambda: __import__("jax"))
    step("jax backend", lambda: jax.devices())
    train = step("import rl.train", lambda: __import__("rl.train", fromlist=["x"]))
    from rl.config import resolve_devices
    from rl.encoder_kinds import load_encoder
    argv = ["--encoder", "inscan", "--model", args.model, "--num-envs", "128", "--skip-n", "8",
            "--llm-dtype", args.llm_dtype]
    cfg = step("config", lambda: resolve_devices(train.resolve_config(train.build_parser().parse_args(argv))))
    encoder = step("LLM config, tokenizer, template (load_encoder, no weights)",
                   lambda: load_encoder(cfg.hidden, cfg.llm, cfg.env, weights=False))
    trainer_mod = step("import rl.trainer", lambda: __import__("rl.trainer", fromlist=["x"]))
    trainer = step("Trainer(...)", lambda: trainer_mod.Trainer(cfg.envs, cfg.ppo, encoder, devices=cfg.devices,
                                                              fusion=cfg.fusion, speed=cfg.speed))
    step("llm_arg_shapes", lambda: trainer.llm_arg_shapes(encoder.jit_args()))
    profile.disable()
    print(f"total {time.perf_counter() - T0:.1f} s from the interpreter's start of this script; torch imported: "
          f"{'torch' in sys.modules}; transformers imported: {'transformers' in sys.modules}")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
