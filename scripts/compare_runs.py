"""Are two rl.train runs the same, bit for bit? For checking that a refactor left results unchanged.

    python scripts/compare_runs.py BEFORE_RUN_DIR AFTER_RUN_DIR [BEFORE_TRAJ_DIR AFTER_TRAJ_DIR]

Compares metrics.jsonl record by record (the timing fields sps, seconds, llm_time_share left out), every leaf of
the newest checkpoint (restored as saved, no target structure) and, given two --save-trajectories directories,
every array of every trajectory file (the `recording` entry, which names the run directory, left out). Prints one
line per check and exits 1 when anything differs. Used for issue 22: the same seed gave bit-equal results before and
after the encoder and config refactor for --encoder none, inscan and vllm on the test preset.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMING = {"sps", "seconds", "llm_time_share", "first_call_includes_compile"}


def metrics(run_dir: Path) -> list[dict]:
    """The run's metrics records without their timing fields."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def checkpoint_leaves(run_dir: Path) -> dict[str, np.ndarray]:
    """Every leaf of the newest checkpoint by its tree path."""
    import jax

    from rl.rundir import Checkpoints

    ckpt = Checkpoints(run_dir)
    try:
        state = ckpt.restore(None)
    finally:
        ckpt.close()
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def different(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Names whose arrays differ in name, dtype, shape or any byte."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or a[n].tobytes() != b[n].tobytes()]


def trajectory_arrays(traj_dir: Path) -> dict[str, np.ndarray]:
    """Every array of every trajectory file, as FILE:ARRAY (the `recording` entry left out)."""
    out = {}
    for path in sorted(traj_dir.glob("*.npz")):
        with np.load(path) as npz:
            out.update({f"{path.name}:{k}": npz[k] for k in npz.files if k != "recording"})
    return out


def main(argv: list[str] | None = None) -> int:
    args = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if len(args) not in (2, 4):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    checks = {"metrics.jsonl": metrics(args[0]) == metrics(args[1])}
    bad = different(checkpoint_leaves(args[0]), checkpoint_leaves(args[1]))
    checks["newest checkpoint" + (f" (differs: {', '.join(bad[:5])})" if bad else "")] = not bad
    if len(args) == 4:
        bad = different(trajectory_arrays(args[2]), trajectory_arrays(args[3]))
        checks["trajectory files" + (f" (differs: {', '.join(bad[:5])})" if bad else "")] = not bad
    for name, same in checks.items():
        print(f"{'bit-equal' if same else 'DIFFERENT'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
