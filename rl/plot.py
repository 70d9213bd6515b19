"""`python -m rl.plot DIR [DIR...] [--out FILE.png]`: learning curves of one or more runs.

Three panels against env steps: episode return, mean achievement rate (over all achievements), and
SPS. Return and achievement curves are smoothed with a moving average over `--smooth` updates (updates where
no episode ended are skipped); SPS is not smoothed and leaves out each invocation's first update, which also
compiled.
"""
from __future__ import annotations

import sys
from pathlib import Path

from rl.curves import load_curves, plot_runs  # noqa: F401 - the library (rl.curves); tests import it from here


def main(argv=None) -> int:
    from rl.cli import Parser

    p = Parser(prog="python -m rl.plot", description=__doc__)
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories written by rl.train")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.png",
                   help="PNG path (default: FIRST_DIR/curves.png)")
    p.add_argument("--smooth", type=int, default=10, metavar="N",
                   help="moving average over this many updates for return and achievements (1 = none)")
    args = p.parse_args(argv)
    try:
        out = plot_runs(args.run_dirs, args.out or args.run_dirs[0] / "curves.png", args.smooth)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
