"""`python -m rl.eval DIR`: play episodes with a run's latest checkpoint; return and achievement rates.

Every env plays one episode from a fresh world and only that first episode counts (so short episodes are
not over-counted); it runs the trainer's own window scan, so the policy acts exactly as in training. For policies that read an LLM
hidden state, the same episodes (same seeds) are also played with ablated hidden states:
    real    the hidden states the policy was trained with (refreshed every skip_n steps)
    zeros   all-zero vectors
    noise   Gaussian noise with the per-feature mean and std of the real vectors of the same states
    shuffled  real vectors, but of another env's state (rolled by one over the batch)
    other_prompt  the real model on the same states, behind another system prompt (a second compile)
If the returns with `zeros`/`noise` match `real`, the policy does not use the LLM. A `vllm` run is
evaluated with the in-scan encoder of the same `--model` (it must be loadable locally).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.compile import jit as jit_with_options
from rl.encoders import LLMArgs, load_llm, make_llm_encoder
from rl.envs import StepInfo
from rl.runs import restore_policy
from rl.trainer import RolloutCarry
from rl.trajectories import RecordedRollout

MODES = ("real", "zeros", "noise", "shuffled", "other_prompt")
OTHER_PROMPT = "You are a helpful assistant. Describe what you see."


def ablate(h: jax.Array, mode: jax.Array, key: jax.Array) -> jax.Array:
    """Hidden states [B, D] for ablation `mode` (traced int: index into MODES; other_prompt acts as real)."""
    noise = h.mean(0, keepdims=True) + h.std(0, keepdims=True) * jax.random.normal(key, h.shape, h.dtype)
    options = jnp.stack([h, jnp.zeros_like(h), noise, jnp.roll(h, 1, axis=0), h])
    return options[mode]


class Episodes(NamedTuple):
    """Each env's first episode: its return, length and achievements once `finished`."""

    finished: jax.Array  # bool [B]
    returns: jax.Array  # float32 [B]
    lengths: jax.Array  # int32 [B]
    achievements: jax.Array  # bool [B, A]


def first_episodes(seen: Episodes, info: StepInfo) -> Episodes:
    """`seen` with the episodes that ended in a window's StepInfo [T, B] added, for envs that had none yet."""
    ended = info.episode_length > 0
    first = jnp.argmax(ended, axis=0)  # each env's first step that ended an episode
    at_first = lambda x: x[first, jnp.arange(x.shape[1])]
    new = ended.any(0) & ~seen.finished
    pick = lambda x, old: jnp.where(new.reshape(new.shape + (1,) * (old.ndim - 1)), at_first(x), old)
    return Episodes(seen.finished | new, pick(info.episode_return, seen.returns),
                    pick(info.episode_length, seen.lengths), pick(info.achievements, seen.achievements))


def make_player(trainer, num_episodes: int, encode=None, skip_n: int = 0):
    """Episode player: play(params, seed, max_steps, mode, llm_args) -> numpy results.

    Every env plays one episode, in windows of the trainer's own scan (`Trainer.run_window`: the trainer's
    envs, policy sampling and hidden-state handling); `encode` (llm_params, cache, raw_states) -> h refreshes
    the hidden state at the start of every `skip_n`-step window (0: once, at the start), and `mode` picks the
    ablation applied to it (one compile for all modes). An env's first finished episode is its result (what it plays after the restart is
    not counted); an env still playing after `max_steps` reports its episode so far.
    """
    env, n = trainer.env, num_episodes
    reset = jax.jit(lambda key: env.reset(key, jnp.arange(n)))

    def run_window(carry: RolloutCarry, seen: Episodes, params, mode, llm_params, cache, window, keep=False):
        if encode is not None:
            key, k = jax.random.split(carry.key)
            hidden = ablate(encode(llm_params, cache, carry.env_state.env_state), mode, k)
            carry = carry._replace(hidden=hidden, key=key)
        carry, steps = trainer.run_window(params, carry, window)
        out = carry._replace(hidden=None), first_episodes(seen, steps.info)
        tr = steps.transition
        return out + (RecordedRollout(tr.obs, carry.obs, tr.action, tr.reward, tr.done, tr.log_prob),) if keep else out

    run_window = jit_with_options(run_window, compiler_options=trainer.compiler_options,
                                  static_argnames=("window", "keep"))

    def play(params, seed: int, max_steps: int, mode: int = 0, llm_args=LLMArgs(), on_window=None, on_progress=None):
        """on_window: called with every window's `RecordedRollout` of device arrays (obs [T, B, O], the observation
        after the window [B, O], action, reward, done, log_prob [T, B]), e.g.
        `rl.trajectories.TrajectoryWriter.add_rollout`. on_progress: called after every window with (steps played,
        episodes finished)."""
        window = (skip_n or max_steps) if encode is not None else min(64, max_steps)  # skip_n 0: encode once
        k_reset, key = jax.random.split(jax.random.PRNGKey(seed))
        obs, state = reset(k_reset)
        carry = RolloutCarry(state, obs, None, key)
        seen = Episodes(jnp.zeros(n, bool), jnp.zeros(n), jnp.zeros(n, jnp.int32),
                        jnp.zeros((n, len(env.achievement_names)), bool))
        steps = 0
        while steps < max_steps and not bool(seen.finished.all()):
            out = run_window(carry, seen, params, jnp.int32(mode), *llm_args, window=window,
                             keep=on_window is not None)
            carry, seen = out[:2]
            if on_window is not None:
                on_window(out[2])
            steps += window
            if on_progress is not None:
                on_progress(steps, int(seen.finished.sum()))
        seen, running = jax.device_get((seen, carry.env_state))
        return dict(returns=np.where(seen.finished, seen.returns, running.episode_return),
                    lengths=np.where(seen.finished, seen.lengths, running.episode_length),
                    achievements=seen.achievements, unfinished=int((~seen.finished).sum()))

    return play


def summarise(result: dict, names) -> dict[str, Any]:
    r = result["returns"]
    return {"episodes": len(r), "return_mean": float(r.mean()),
            "return_stderr": float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0,
            "length_mean": float(result["lengths"].mean()), "unfinished": result["unfinished"],
            "achievements": {n: float(x) for n, x in zip(names, result["achievements"].mean(0))}}


def evaluate(run_dir: Path, num_episodes: int = 32, seed: int = 1234, max_steps: int = 10_000,
             modes=MODES, save_trajectories: Path | None = None, samples_per_file: int = 8192,
             say=lambda text: None, status=lambda text: None) -> dict[str, dict]:
    """Evaluate the latest checkpoint of `run_dir` (all ablation modes for LLM policies). With `save_trajectories`
    every step of the `real` play (the trained policy, sampling, as in training) is recorded there as trajectory
    files (docs/OFFLINE.md). `say` gets a line before each mode is played, `status` one while it plays (steps and
    episodes finished so far). Each mode's entry also names its `checkpoint`, `seed`, `max_steps` and
    `system_prompt` (the text the run's LLM reads behind; `other_prompt` replaces it with OTHER_PROMPT)."""
    policy = restore_policy(run_dir, purpose="evaluate")
    cfg, step = policy.cfg, policy.step
    writer = None
    if save_trajectories is not None:
        from rl.trajectories import TrajectoryWriter

        meta = {"env": cfg.env, "num_envs": num_episodes, "encoder": cfg.encoder, "run_dir": str(run_dir),
                "checkpoint": int(step), "seed": seed, "source": "rl.eval"}
        writer = TrajectoryWriter(Path(save_trajectories), samples_per_file, meta)
    try:
        results = _play_modes(policy, num_episodes, seed, max_steps, modes,
                              writer.add_rollout if writer else None, say, status)
        prompt = _system_prompt(cfg)
        return {m: dict(r, checkpoint=int(step), seed=seed, max_steps=max_steps, system_prompt=prompt)
                for m, r in results.items()}
    finally:
        if writer is not None:
            writer.close()


def _system_prompt(cfg) -> str | None:
    """The system prompt an LLM run's hidden states are read behind (its text; None without an LLM)."""
    if not cfg.uses_llm:
        return None
    from render.chat import resolve_system_prompt

    return resolve_system_prompt(cfg.system_prompt, cfg.env, cfg.obs_format)


def _play_modes(policy, num_episodes, seed, max_steps, modes, on_window, say, status):
    """The results of every mode (only `real` without an LLM); `on_window` sees the `real` play's windows."""
    cfg, trainer, llm, runner, step = policy.cfg, policy.trainer, policy.llm, policy.runner, policy.step
    names = trainer.env.achievement_names

    def progress(mode):
        return lambda steps, done: status(f"  {mode}: {steps:,} steps played (at most {max_steps:,}), {done}/"
                                          f"{num_episodes} episodes finished")

    if llm is None:
        say(f"playing {num_episodes} episodes of update {step}'s policy (the first one compiles) ...")
        play = make_player(trainer, num_episodes)
        return {"real": summarise(play(runner.params, seed, max_steps, on_window=on_window,
                                       on_progress=progress("real")), names)}
    results = {}
    for setup in (llm, load_llm(cfg, system_prompt=OTHER_PROMPT) if "other_prompt" in modes else None):
        if setup is None:
            continue
        enc = policy.encode if setup is llm else make_llm_encoder(cfg.llm, setup)
        play = make_player(trainer, num_episodes, enc, cfg.skip_n)
        for mode in modes:
            if (mode == "other_prompt") == (setup is not llm):
                say(f"[{len(results) + 1}/{len(modes)}] {mode}: {num_episodes} episodes of update {step}'s policy"
                    + (" (compiles first)" if not results or mode == "other_prompt" else "") + " ...")
                results[mode] = summarise(play(runner.params, seed, max_steps, MODES.index(mode), setup.jit_args,
                                               on_window=on_window if mode == "real" else None,
                                               on_progress=progress(mode)), names)
    return {m: results[m] for m in modes}


def check_run(run_dir: Path, modes: list[str] | None) -> list[str]:
    """The modes to play for RUN_DIR, read from its config.json before anything loads (default: every mode of an
    LLM run, `real` without one). ValueError (one line) for an offline run (rl.offline eval plays those) and for
    ablation modes asked of a run without an LLM."""
    import json

    from rl.offline.config import KIND

    path = Path(run_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None  # play_settings says what is wrong with it
    if isinstance(raw, dict) and raw.get("kind") == KIND:
        raise ValueError(f"{run_dir} is an offline AWR run (rl.offline train); evaluate it with python -m rl.offline "
                         f"eval {run_dir}")
    from rl.runs import play_settings

    cfg = play_settings(run_dir)
    if not cfg.uses_llm:
        if modes is not None and list(modes) != ["real"]:
            raise ValueError(f"--modes {' '.join(modes)}: {run_dir} trained without an LLM (--encoder "
                             f"{cfg.encoder}), so only --modes real applies (the default)")
        return ["real"]
    return list(modes) if modes is not None else list(MODES)


def main(argv=None) -> int:
    from rl.cli import Parser, add_compile_cache_option, apply_compile_cache
    from rl.progress import StatusLine

    p = Parser(prog="python -m rl.eval", description=__doc__)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory written by rl.train")
    p.add_argument("--episodes", type=int, default=32, metavar="N", help="episodes per mode (one per env)")
    p.add_argument("--seed", type=int, default=1234, metavar="N",
                   help="seed of the evaluation worlds (the same for every mode)")
    p.add_argument("--max-steps", type=int, default=10_000, dest="max_steps", metavar="N",
                   help="stop an episode after this many steps (it is reported as unfinished)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None, metavar="MODE",
                   help=f"hidden-state ablations to play ({', '.join(MODES)}; LLM runs only; default: all of them, "
                        f"real alone without an LLM); eval.json keeps the other modes played with the same "
                        f"checkpoint, seed, --episodes, --max-steps and system prompt")
    p.add_argument("--save-trajectories", type=Path, default=None, dest="save_trajectories", metavar="DIR",
                   help="record every step of the real-hidden-state play there as trajectory files (docs/OFFLINE.md)")
    p.add_argument("--samples-per-file", type=int, default=8192, dest="samples_per_file", metavar="N",
                   help="samples per trajectory file")
    p.add_argument("--video", type=Path, default=None, metavar="OUT.gif|OUT.mp4",
                   help="also record episodes: Craftax's pixel view beside the text the LLM read (rl.video)")
    p.add_argument("--video-episodes", type=int, default=1, metavar="N", help="episodes in the video, one after another")
    p.add_argument("--video-max-steps", type=int, default=300, metavar="N", help="steps per recorded episode at most")
    p.add_argument("--video-fps", type=float, default=6.0, metavar="X", help="frames (env steps) per second")
    add_compile_cache_option(p)
    args = p.parse_args(argv)
    for flag, value in (("--episodes", args.episodes), ("--max-steps", args.max_steps),
                        ("--samples-per-file", args.samples_per_file), ("--video-episodes", args.video_episodes),
                        ("--video-max-steps", args.video_max_steps)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not args.video_fps > 0:
        p.error(f"--video-fps must be > 0, got {args.video_fps}")
    try:
        args.modes = check_run(args.run_dir, args.modes)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    apply_compile_cache(args)
    line = StatusLine(sys.stderr)
    say = line.say
    if args.video is not None:
        from rl.video import check_video_path

        try:
            check_video_path(args.video)
        except ValueError as e:
            p.error(str(e))
    try:
        results = evaluate(args.run_dir, args.episodes, args.seed, args.max_steps, args.modes,
                           args.save_trajectories, args.samples_per_file, say=say, status=line.update)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        line.done()
    from rl.eval_report import format_table, save_results

    print(format_table(results))
    written, note = save_results(args.run_dir, results)  # merged with earlier modes of the same play
    print(f"{written[0]}: {note}")
    if args.video is not None:
        from rl.video import record_video

        try:
            written.append(record_video(args.run_dir, args.video, episodes=args.video_episodes, seed=args.seed,
                                        max_steps=args.video_max_steps, fps=args.video_fps, say=say))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
