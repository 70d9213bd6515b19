"""`python -m rl.probe RUN_DIR [RUN_B] [--pairs N] [--kinds ...] [--out OUT] [--show K] [--trajectories DIR]`

Probe what a trained agent's value and policy do on counterfactual game states: pairs (low, high) built by editing
real game states from the run's own play (status low vs high, inventory 0 vs N, a zombie / skeleton / arrow
adjacent vs far vs absent, a table / water / ladder in view, darkness, floor), so observation, text and game state
agree; for runs with an LLM also prompt-only edits (the observation unchanged, only the LLM's text edited or with an
injected sentence) under every hidden-state mode (real, zero, noise, shuffled, other_prompt). Prints a table and
writes OUT/probe.json (the contract), OUT/probe_details.json, OUT/probe.png and, with --show, OUT/show.txt.
Two runs (augmented beside unaugmented) are probed on the same seeds and drawn side by side.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    from rl.cli import Parser, add_compile_cache_option, apply_compile_cache

    p = Parser(prog="python -m rl.probe", description=__doc__)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (rl.train or rl.offline train)")
    p.add_argument("run_b", type=Path, nargs="?", default=None, metavar="RUN_B", help="a second run, shown beside")
    p.add_argument("--pairs", type=int, default=128, metavar="N", help="pairs per kind (base states played)")
    p.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                   help="pair kinds to probe (default: all that apply; unknown names list the choices)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="output directory (default: RUN_DIR/probe)")
    p.add_argument("--show", type=int, default=0, metavar="K", help="write K pairs' texts per kind side by side")
    p.add_argument("--trajectories", type=Path, default=None, metavar="DIR",
                   help="trajectory files (rl.eval --save-trajectories) for value vs return-to-go diagnostics")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the base states' play and of the edits")
    p.add_argument("--play-steps", type=int, default=1024, dest="play_steps", metavar="N",
                   help="steps the policy plays; each base state is taken at a random step of them")
    add_compile_cache_option(p)
    args = p.parse_args(argv)
    say = lambda text: print(text, file=sys.stderr, flush=True)
    for name, value in (("--pairs", args.pairs), ("--play-steps", args.play_steps)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if args.show < 0:
        p.error(f"--show must be >= 0, got {args.show}")
    apply_compile_cache(args)
    try:
        return _run(args, say)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args, say) -> int:
    from rl.probe import report
    from rl.probe.core import check_kinds, probe_policy, trajectory_values
    from rl.probe.policy import check_run_dir, load_policy

    if args.kinds:
        check_kinds(args.kinds)
    for run_dir in [args.run_dir] + ([args.run_b] if args.run_b else []):
        check_run_dir(run_dir)
    if args.trajectories is not None:
        from rl.probe.metrics import check_trajectory_files

        check_trajectory_files(args.trajectories)  # before minutes of play
    out = args.out or args.run_dir / "probe"
    runs, timing = [], {}
    for run_dir in [args.run_dir] + ([args.run_b] if args.run_b else []):
        say(f"loading {run_dir} ...")
        policy = load_policy(run_dir)
        kinds = [k for k in args.kinds if policy.uses_hidden or not k.startswith("prompt:")] if args.kinds else None
        t0 = time.perf_counter()
        probe = probe_policy(policy, kinds, args.pairs, args.seed, args.play_steps, args.show, say=say)
        timing[str(run_dir)] = round(time.perf_counter() - t0, 2)
        if args.trajectories is not None:
            say("value diagnostics on the trajectory files ...")
            probe["value"] = trajectory_values(policy, args.trajectories)
        runs.append((str(run_dir), probe))
        print(report.format_table(str(run_dir), probe))
        if "value" in probe:
            v = probe["value"]
            print("value vs return-to-go: " + ", ".join(f"{k} {v[k]:.3f}" if isinstance(v.get(k), float) else
                                                         f"{k} -" for k in ("pearson", "spearman",
                                                                            "explained_variance")))
    out.mkdir(parents=True, exist_ok=True)
    written = [report.write_json(out / "probe.json", report.contract_json(runs)),
               report.write_json(out / "probe_details.json",
                                 report.details_json(runs, {"pairs": args.pairs, "seed": args.seed,
                                                            "play_steps": args.play_steps, "seconds": timing})),
               report.plot(runs, out / "probe.png")]
    if args.show:
        written.append(report.write_atomic(out / "show.txt", report.show_text(runs)))
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
