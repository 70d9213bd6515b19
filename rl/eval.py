"""`python -m rl.eval DIR`: play episodes with a run's latest checkpoint; return and achievement rates.

Every env plays one episode from a fresh world and only that first episode counts (so short episodes are
not over-counted); it runs the trainer's own window scan, so the policy acts exactly as in training. For policies that read an LLM
hidden state, the same episodes (same seeds) are also played with ablated hidden states (the one table of modes,
`rl.modes`; other_prompt is a second compile):
{modes}
If the returns with `zero`/`noise` match `real`, the policy does not use the LLM. A `vllm` run is
evaluated with the in-scan encoder of the same `--model` (it must be loadable locally).
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp

from rl.llm import LLMArgs, make_llm_encoder
from rl.modes import MODES, OTHER_PROMPT, describe
from rl.play import episode_results, no_episodes, play_windows, summarise, trainer_start, trainer_window
from rl.runs import restore_policy
from rl.trajectories import RecordedRollout

__doc__ = __doc__.replace("{modes}", describe())

def make_player(trainer, num_episodes: int, encode=None, skip_n: int = 0, zero=None, keyed: bool = False):
    """Episode player: play(params, seed, max_steps, mode, llm_args) -> numpy results (`rl.play`).

    Every env plays one episode, in windows of the trainer's own scan (`rl.play.trainer_window`: the trainer's
    envs, policy sampling and hidden-state handling, a reset env reading what the run's `--reset-hidden` says:
    its pool world's hidden state with "pool", zeros with "zero"); `encode` (llm_params, cache, raw_states) -> h refreshes
    the hidden state at the start of every `skip_n`-step window (0: once, at the start), and `mode` (an index
    into `rl.modes.MODES`) picks the ablation applied to it (one compile for all modes; `zero`: the policy's zero
    vector, None = raw zeros). An env's first finished episode is its result (what it plays after the restart is
    not counted); an env still playing after `max_steps` reports its episode so far. `keyed`: `encode` also takes
    the window's ablation key (a prompt variant's random tokens, `rl.variants`).
    """
    env, n = trainer.env, num_episodes
    start = trainer_start(trainer, n)
    run_window = trainer_window(trainer, encode, zero=zero, keyed=keyed, record=_recorded)

    def play(params, seed: int, max_steps: int, mode: int = 0, llm_args=LLMArgs(), on_window=None, on_progress=None):
        """on_window: called with every window's `RecordedRollout` of device arrays (obs [T, B, O], the observation
        after the window [B, O], action, reward, done, log_prob [T, B]), e.g.
        `rl.trajectories.TrajectoryWriter.add_rollout`. on_progress: called after every window with (steps played,
        episodes finished)."""
        window = (skip_n or max_steps) if encode is not None else min(64, max_steps)  # skip_n 0: encode once
        keep = on_window is not None
        step = lambda carry, seen, length: run_window(carry, seen, params, jnp.int32(mode), llm_args, length=length,
                                                      keep=keep)
        carry, seen = play_windows(step, start(seed), no_episodes(n, len(env.achievement_names)),
                                   max_steps, window, on_window=on_window, on_progress=on_progress)
        return episode_results(seen, carry.env_state)

    return play


def _recorded(carry, steps) -> RecordedRollout:
    """The samples of a window that `--save-trajectories` keeps (`carry`: the trainer's `RolloutCarry` after the
    window)."""
    tr = steps.transition
    return RecordedRollout(tr.obs, carry.obs, tr.action, tr.reward, tr.done, tr.log_prob)


def evaluate(run_dir: Path, num_episodes: int = 32, seed: int = 1234, max_steps: int = 10_000,
             modes=MODES, save_trajectories: Path | None = None, samples_per_file: int = 8192,
             say=lambda text: None, status=lambda text: None, variants=()) -> dict[str, dict]:
    """Evaluate the latest checkpoint of `run_dir` (all ablation modes for LLM policies). With `save_trajectories`
    every step of the `real` play (the trained policy, sampling, as in training) is recorded there as trajectory
    files (docs/OFFLINE.md). `say` gets a line before each mode is played, `status` one while it plays (steps and
    episodes finished so far). Each mode's entry also names its `checkpoint`, `seed`, `max_steps` and
    `system_prompt` (the text the run's LLM reads behind; `other_prompt` and the variants replace it, but the field
    keeps the run's: it says which play the entry belongs to). `variants` (`rl.variants.Variant`): prompt variants,
    each played like `real` on the same worlds under its own name."""
    if variants:
        from rl.readrun import play_settings
        from rl.variants import check_sections

        settings = play_settings(run_dir)
        if not settings.uses_llm:
            raise ValueError(f"{run_dir} is a run without an LLM (--encoder none): --prompt/--prompts apply to runs "
                             f"whose policy reads an LLM hidden state")
        check_sections(variants, settings.obs_format)
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
        results.update(_play_variants(policy, num_episodes, seed, max_steps, variants, say, status))
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
    for setup in (llm, llm.with_prompt(OTHER_PROMPT) if "other_prompt" in modes else None):
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


def _play_variants(policy, num_episodes, seed, max_steps, variants, say, status):
    """The results of every prompt variant: played as `real` (same worlds and seeds), the LLM reading the variant's
    ids behind the variant's prefix cache (`rl.variants`); each entry names its `variant` (what the LLM read)."""
    from rl.llm import make_ids_encoder
    from rl.variants import make_variant_encoder, setup_for

    cfg, trainer, llm, runner, step = policy.cfg, policy.trainer, policy.llm, policy.runner, policy.step
    names = trainer.env.achievement_names
    results = {}
    for i, v in enumerate(variants):
        setup = setup_for(v, llm)
        encode = make_variant_encoder(v, setup, make_ids_encoder(setup.model.config, **cfg.llm.encode_options()))
        play = make_player(trainer, num_episodes, encode, cfg.skip_n, keyed=True)
        say(f"[variant {i + 1}/{len(variants)}] {v.name}: {num_episodes} episodes of update {step}'s policy "
            f"(compiles first) ...")
        progress = lambda steps, done, n=v.name: status(f"  {n}: {steps:,} steps played (at most {max_steps:,}), "  # noqa: E731
                                                         f"{done}/{num_episodes} episodes finished")
        entry = summarise(play(runner.params, seed, max_steps, 0, setup.jit_args, on_progress=progress), names)
        results[v.name] = dict(entry, variant=dict(v.describe(), note=v.note()))
    return results


def check_run(run_dir: Path, modes: list[str] | None) -> list[str]:
    """The modes to play for RUN_DIR, read from its config.json before anything loads (default: every mode of an
    LLM run, `real` without one). FileNotFoundError / ValueError (one line) for a directory that is not a run, for
    an offline run (rl.offline eval plays those) and for ablation modes asked of a run without an LLM."""
    from rl.readrun import OFFLINE, play_settings, run_kind

    if run_kind(run_dir)[0] == OFFLINE:
        raise ValueError(f"{run_dir} is an offline AWR run (rl.offline train); evaluate it with python -m rl.offline "
                         f"eval {run_dir}")
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
    p.add_argument("--prompt", action="append", default=[], metavar="NAME=TEXT|NAME=@FILE",
                   help="also play a prompt variant NAME: the system prompt replaced by TEXT or by FILE's text (may "
                        "repeat); each is a column of the table, a bar of the chart, its text kept in eval.json")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="prompt variants from a YAML or JSON file: NAME -> TEXT, {system: TEXT}, {system_file: "
                        "PATH}, {drop: inventory|map|status}, {game_text: TEXT}, {random_tokens: true}, "
                        "{empty: true} (docs/TRAINING.md)")
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
    from rl.variants import gather

    try:
        variants = gather(args.prompt, args.prompts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
                           args.save_trajectories, args.samples_per_file, say=say, status=line.update,
                           variants=variants)
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
            written.append(record_video(restore_policy(args.run_dir, purpose="record"), args.video, episodes=args.video_episodes, seed=args.seed,
                                        max_steps=args.video_max_steps, fps=args.video_fps, say=say))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
