"""What recording trajectories (`rl.train --save-trajectories`) costs the training loop.

In one call: the same training updates (`rl.trainer.Trainer.step`: one update, then its metrics fetched; `rl.train`
also dispatches the next update before that fetch, so this loop leaves the copy less to overlap with) without and
with recording, each after one compiling update; samples/s of each and their ratio.
With recording, every rollout goes to `rl.trajectories.TrajectoryWriter.add_rollout` (the copy to the host
overlaps the next update; a writer thread writes the files); the time to write what is still queued after the
last update is reported apart (`close_s`).

    python scripts/bench_record.py --out $OUT/bench_record.json                         # Craftax, --encoder none
    python scripts/bench_record.py --encoder inscan --model qwen3-4b --skip-n 8 --num-envs 128 --out ...
    python scripts/bench_record.py --smoke                                              # tiny shapes on CPU
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed_updates(cfg, updates: int, out_dir: Path | None) -> dict:
    """Samples/s of `updates` training updates (after one compiling update), recording into `out_dir` if given."""
    import jax

    from rl.encoder_kinds import load_encoder
    from rl.trainer import Trainer
    from rl.trajectories import TrajectoryWriter

    if out_dir is not None:
        cfg = cfg.replace(save_trajectories=str(out_dir))
    encoder = load_encoder(cfg.hidden, cfg.llm, cfg.env)
    trainer = Trainer.from_config(cfg, encoder)
    llm_args = trainer.place_llm_args(encoder.jit_args())
    runner = trainer.init_state(llm_args)
    writer = None
    if out_dir is not None:
        writer = TrajectoryWriter(out_dir, cfg.samples_per_file, {"env": cfg.env, "num_envs": cfg.num_envs,
                                                                   "source": "scripts/bench_record.py"})
    record = writer.add_rollout if writer else None
    runner, _ = trainer.step(runner, llm_args, record)  # compile
    t = time.perf_counter()
    for _ in range(updates):
        runner, _ = trainer.step(runner, llm_args, record)
    jax.block_until_ready(runner)
    seconds = time.perf_counter() - t
    result = {"updates": updates, "seconds": seconds, "sps": updates * cfg.batch_size / seconds}
    if writer is not None:
        t = time.perf_counter()
        files = writer.close()
        result.update(close_s=time.perf_counter() - t, files=len(files),
                      bytes=sum(f.stat().st_size for f in files))
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="Craftax-Symbolic-v1")
    p.add_argument("--encoder", default="none", choices=["none", "inscan"])
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--skip-n", type=int, default=8)
    p.add_argument("--num-envs", type=int, default=1024)
    p.add_argument("--num-steps", type=int, default=64)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--samples-per-file", type=int, default=8192)
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="Classic, 8 envs, tiny model, 2 updates (CPU check)")
    args = p.parse_args(argv)
    if args.smoke:
        args.env, args.num_envs, args.num_steps, args.updates, args.model = "Craftax-Classic-Symbolic-v1", 8, 8, 2, "tiny"
        args.samples_per_file = 40

    import jax

    from rl.config import TrainConfig

    cfg = TrainConfig(env=args.env, encoder=args.encoder, model=args.model, skip_n=args.skip_n,
                      num_envs=args.num_envs, num_steps=args.num_steps, devices=1,
                      total_timesteps=args.num_envs * args.num_steps * (args.updates + 1),
                      num_minibatches=min(8, args.num_envs), samples_per_file=args.samples_per_file,
                      **({"width": 32, "update_epochs": 1} if args.smoke else {}))
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench_record_"))
    shutil.rmtree(work / "trajectories", ignore_errors=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(jax.devices()[0]),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    result["without"] = timed_updates(cfg, args.updates, None)
    print(f"without recording: {result['without']['sps']:,.0f} samples/s", flush=True)
    result["with"] = timed_updates(cfg, args.updates, work / "trajectories")
    w = result["with"]
    print(f"with recording:    {w['sps']:,.0f} samples/s ({w['files']} files, {w['bytes'] / 1e9:.2f} GB; "
          f"{w['close_s']:.1f} s to write the rest after the last update)", flush=True)
    result["ratio_with_to_without"] = w["sps"] / result["without"]["sps"]
    print(f"with / without = {result['ratio_with_to_without']:.3f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
