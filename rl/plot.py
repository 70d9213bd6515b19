"""`python -m rl.plot DIR [DIR...] [--out FILE.png]`: learning curves of one or more runs.

rl.train runs: three panels against env steps: episode return, mean achievement rate (over all achievements), and
SPS. Return and achievement curves are smoothed with a moving average over `--smooth` updates (updates where
no episode ended are skipped); SPS is not smoothed and leaves out each invocation's first update, which also
compiled.

rl.offline runs (offline AWR): three panels: the policy's -log pi(a|s) of the data's actions and the value loss
against updates, on the training files and the held-out ones, and the mean return of each evaluated mode in the
game (its eval.json, from python -m rl.offline eval).
"""
from __future__ import annotations

import sys
from pathlib import Path

from rl.curves import load_curves, load_offline_curves, plot_offline_runs, plot_runs  # noqa: F401 - the library
# (rl.curves); tests import it from here
from rl.readrun import is_offline


def main(argv=None) -> int:
    from rl.cli import Parser

    p = Parser(prog="python -m rl.plot", description=__doc__)
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="run directories written by rl.train, or by rl.offline train (not both in one chart)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.png",
                   help="PNG path (default: FIRST_DIR/curves.png)")
    p.add_argument("--smooth", type=int, default=10, metavar="N",
                   help="moving average over this many updates for return and achievements (1 = none)")
    args = p.parse_args(argv)
    if args.smooth < 1:
        p.error(f"--smooth must be >= 1, got {args.smooth}")
    offline = [is_offline(d) for d in args.run_dirs]
    if any(offline) and not all(offline):
        mixed = ", ".join(str(d) for d, o in zip(args.run_dirs, offline) if o)
        p.error(f"{mixed}: offline AWR runs have other curves than rl.train runs; plot them in a chart of their own")
    try:
        out = args.out or args.run_dirs[0] / "curves.png"
        out = plot_offline_runs(args.run_dirs, out) if all(offline) else plot_runs(args.run_dirs, out, args.smooth)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
