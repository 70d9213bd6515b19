"""Benchmark of `rl.label`: record a dataset, label it disk to disk, and compare with the encoder alone.

In one call, on one device:
1. record `--samples` samples of random play (`rl.envs.BatchedEnv`, `rl.trajectories.TrajectoryWriter`: the
   recorder's file format and writer) into `--samples-per-file` files;
2. label them with `rl.label.label_files` (reader and writer threads, the jitted obs template + the trainer's
   LLM call), after one warm-up chunk (compile excluded): samples/s end to end, first file read to last file
   written;
3. time the same jitted chunk function (template + LLM) alone on `--encoder-chunks` chunks of the same
   observations already on the device: prompts/s of the encoder; their real token counts give tokens/s.
The ratio end-to-end / encoder is what the reading, writing and host work cost (>= 0.9 wanted: issue 16).

    python scripts/bench_label.py --model qwen3-4b --out $OUT/bench_label.json      # H100/H200, < 8 minutes
    python scripts/bench_label.py --smoke                                           # tiny shapes on CPU
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def record(env_name: str, num_envs: int, num_steps: int, samples: int, out_dir: Path, samples_per_file: int,
           seed: int = 0) -> tuple[list[Path], float]:
    """Random play written as trajectory files; returns (files, seconds after the first rollout's compile)."""
    import jax
    import jax.numpy as jnp

    from rl.envs import BatchedEnv
    from rl.trajectories import TrajectoryWriter, transitions_to_samples

    env = BatchedEnv(env_name, num_envs)
    uniform = -math.log(env.num_actions)

    @jax.jit
    def rollout(state, obs, key):
        def step(carry, k):
            state, obs = carry
            k_act, k_env = jax.random.split(k)
            action = jax.random.randint(k_act, (num_envs,), 0, env.num_actions)
            next_obs, state, reward, done, _ = env.step(k_env, state, action)
            return (state, next_obs), (obs, action, reward, done)

        (state, obs), (o, a, r, d) = jax.lax.scan(step, (state, obs), jax.random.split(key, num_steps))
        return state, obs, transitions_to_samples(o, obs, a, r, d, jnp.full(a.shape, uniform, jnp.float32))

    key = jax.random.PRNGKey(seed)
    obs, state = env.reset(key)
    writer = TrajectoryWriter(out_dir, samples_per_file, {"env": env_name, "num_envs": num_envs,
                                                          "source": "scripts/bench_label.py (random play)"})
    done, t_start = 0, None
    while done < samples:
        key, k = jax.random.split(key)
        state, obs, batch = rollout(state, obs, k)
        if t_start is None:
            jax.block_until_ready(batch)
            t_start = time.perf_counter()
            log(f"recording: first rollout compiled ({num_envs} envs x {num_steps} steps)")
        take = min(samples - done, num_envs * num_steps)
        writer.add({k: v[:take] for k, v in batch.items()} if take < num_envs * num_steps else batch)
        done += take
    files = writer.close()
    return files, time.perf_counter() - t_start


def encoder_alone(labeller, env_name: str, files: list[Path], chunks: int) -> dict:
    """The labeller's jitted chunk function on `chunks` chunks of the files' observations already on the device."""
    import jax

    from rl.trajectories import load_arrays

    obs_chunks = []
    for f in files:
        obs = load_arrays(f)[0]["obs"]
        for start in range(0, obs.shape[0] - labeller.batch + 1, labeller.batch):
            obs_chunks.append(obs[start:start + labeller.batch])
            if len(obs_chunks) == chunks:
                break
        if len(obs_chunks) == chunks:
            break
    tpl, cache, fn = labeller._setup(env_name)
    lengths = jax.jit(jax.vmap(tpl))
    tokens = sum(int(np.asarray(lengths(o)[1]).sum()) for o in obs_chunks)
    valid = jax.device_put(np.ones(labeller.batch, bool), labeller._rows)
    on_device = [jax.device_put(o, labeller._rows) for o in obs_chunks]
    jax.block_until_ready(fn(labeller.params, cache, on_device[0], valid))  # compiled already; one warm call
    t = time.perf_counter()
    outs = [fn(labeller.params, cache, o, valid) for o in on_device]
    jax.block_until_ready(outs)
    seconds = time.perf_counter() - t
    prompts = len(obs_chunks) * labeller.batch
    return {"prompts": prompts, "seconds": seconds, "prompts_per_s": prompts / seconds,
            "tokens_mean": tokens / prompts, "tokens_per_s": tokens / seconds, "prefix_tokens": len(tpl.prefix_ids)}


def save(path: Path | None, result: dict) -> None:
    """Write the results so far (a run cut short keeps what it measured)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--env", default="Craftax-Symbolic-v1")
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--samples-per-file", type=int, default=10_000)
    p.add_argument("--num-envs", type=int, default=1024, help="envs of the recording rollout")
    p.add_argument("--num-steps", type=int, default=64, help="steps per recording rollout")
    p.add_argument("--batch", type=int, default=1024, help="observations per labelling chunk")
    p.add_argument("--llm-layer", type=int, default=16, help="16 of 36: one of the layers the reference labelling saved")
    p.add_argument("--pooling", default="last")
    p.add_argument("--obs-format", default="compact")
    p.add_argument("--llm-dtype", default="auto")
    p.add_argument("--llm-encode", default="packed", help="packed (the trainer's default) or bucketed")
    p.add_argument("--encoder-chunks", type=int, default=10, help="chunks timed for the encoder alone")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model, Classic, a few hundred samples (CPU check)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.env, args.samples, args.samples_per_file = "tiny", "Craftax-Classic-Symbolic-v1", 96, 40
        args.num_envs, args.num_steps, args.batch, args.llm_layer, args.encoder_chunks = 8, 8, 16, -1, 2

    import jax

    from rl.label import LabelConfig, Labeller, label_files

    work = args.dir or Path(tempfile.mkdtemp(prefix="bench_label_"))
    src, dst = work / "trajectories", work / "labelled"
    for d in (src, dst):
        shutil.rmtree(d, ignore_errors=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(jax.devices()[0]),
              "devices": jax.device_count(), "config": {k: str(v) if isinstance(v, Path) else v
                                                        for k, v in vars(args).items()}}
    log(f"device {result['device']}; recording {args.samples:,} samples of {args.env} into {src}")
    files, rec_s = record(args.env, args.num_envs, args.num_steps, args.samples, src, args.samples_per_file)
    result["record"] = {"files": len(files), "seconds_after_compile": rec_s,
                        "bytes": sum(f.stat().st_size for f in files)}
    log(f"recorded {len(files)} files ({result['record']['bytes'] / 1e9:.2f} GB) in {rec_s:.1f} s after compile")
    save(args.out, result)

    cfg = LabelConfig(model=args.model, llm_layer=args.llm_layer, pooling=args.pooling, obs_format=args.obs_format,
                      llm_dtype=args.llm_dtype, llm_encode=args.llm_encode, batch=args.batch, devices=1)
    labeller = Labeller(cfg)
    log(f"model {args.model} loaded ({labeller.model.config.num_hidden_layers} layers, hidden "
        f"{labeller.hidden_size}); compiling the chunk function")
    from rl.trajectories import load_arrays

    warm = load_arrays(files[0])[0]["obs"][: args.batch]
    jax.block_until_ready(labeller.encode_chunk(args.env, warm))
    log("compiled; labelling (disk to disk)")
    t = time.perf_counter()
    summary = label_files(files, dst, cfg, labeller=labeller, quiet=args.smoke)  # the bar on stderr
    e2e = time.perf_counter() - t
    assert summary.files == len(files) and not summary.bad, summary
    result["label"] = {"files": summary.files, "samples": summary.samples, "seconds": e2e,
                       "samples_per_s": summary.samples / e2e,
                       "output_bytes": sum((dst / f.name).stat().st_size for f in files)}
    log(f"end to end: {summary.samples:,} samples in {e2e:.1f} s = {summary.samples / e2e:,.0f} samples/s")
    save(args.out, result)

    enc = encoder_alone(labeller, args.env, files, args.encoder_chunks)
    result["encoder"] = enc
    result["ratio_end_to_end_to_encoder"] = result["label"]["samples_per_s"] / enc["prompts_per_s"]
    log(f"encoder alone: {enc['prompts']:,} prompts in {enc['seconds']:.1f} s = {enc['prompts_per_s']:,.0f} "
        f"prompts/s ({enc['tokens_mean']:.0f} tokens/prompt + {enc['prefix_tokens']} cached prefix, "
        f"{enc['tokens_per_s']:,.0f} tokens/s)")
    log(f"end to end / encoder = {result['ratio_end_to_end_to_encoder']:.3f}")
    save(args.out, result)
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
