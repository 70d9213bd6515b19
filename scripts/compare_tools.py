"""Same numbers across a refactor (issue 34 point 6): every tool on the test preset, run from two source trees, then
compared file by file.

    python scripts/compare_tools.py run TREE OUT         # play every tool with TREE's code (PYTHONPATH=TREE), into OUT
    python scripts/compare_tools.py compare OUT_A OUT_B  # bit-equal? one line per output; exit 1 when any differs

`run` (same seeds every time; a CPU is enough, a few minutes on two cores) writes under OUT:

    none/, none-traj/      rl.train --preset test --encoder none (with --save-trajectories)
    inscan/, inscan-traj/  rl.train --preset test --encoder inscan (tiny model, float32)
    vllm/, vllm-traj/      rl.train --preset test --encoder vllm against jaxllm.http.server --model tiny (TREE's own)
    labelled/              rl.label none-traj (tiny model, float32)
    awr/                   rl.offline train on labelled/ (real hidden states, hidden_skip_n 2), then rl.offline eval
    probe/                 rl.probe of the inscan run beside the offline one (health, zombie_adjacent, prompt:wood)
    none/eval.json         rl.eval of the none run (2 episodes, 48 steps at most)

`compare` checks the train runs with scripts/compare_runs.py (metrics without timing fields, every leaf of the newest
checkpoint, every trajectory array), every config.json, the labelled files array by array (their metadata as JSON),
the offline run's metrics, checkpoint and eval.json, rl.eval's eval.json and the probe's JSON outputs. JSON is
compared with timing fields left out and paths under OUT written as <OUT> (OUT_A and OUT_B differ by name only), and
without a labelled file's source `mtime_ns`, the test server's `vllm_url` (a free port) and the offline run's data
`digest` (it hashes file sizes, which hold the OUT path's length). Used for issue 34 (docs/TRAINING.md, "Same
numbers").
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.compare_runs import checkpoint_leaves, different, trajectory_arrays  # noqa: E402

# timing fields, a labelled file's source mtime, the test server's URL (its port differs from run to run) and the
# offline run's data digest (it hashes file sizes, and a labelled file's metadata holds its OUT path)
IGNORED_KEYS = {"sps", "seconds", "llm_time_share", "first_call_includes_compile", "updates_per_s", "mtime_ns",
                "vllm_url", "digest"}
TRAIN = ("none", "inscan", "vllm")


# run ------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(tree: Path, *argv: str) -> None:
    """`python -m argv...` with TREE's code; raises with the tail of its stderr when it fails."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    print("+ python -m " + " ".join(argv), flush=True)
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _server(tree: Path) -> tuple[str, subprocess.Popen]:
    """TREE's `jaxllm.http.server --model tiny --dtype float32` on a free port, once /health answers."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm.http.server", "--model", "tiny", "--dtype", "float32",
                             "--port", str(port)], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            import urllib.request

            urllib.request.urlopen(url + "/health", timeout=2).read()
            return url, proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("jaxllm.http.server exited before it answered") from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("jaxllm.http.server did not answer /health in 300 s")


def run_all(tree: Path, out: Path) -> None:
    """Every tool of `tree` on the test preset into `out` (see the module docstring)."""
    tree, out = tree.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    train = ("rl.train", "--preset", "test", "--seed", "0", "--quiet")
    llm = ("--model", "tiny", "--llm-dtype", "float32")
    _tool(tree, *train, "--run-dir", str(out / "none"), "--save-trajectories", str(out / "none-traj"),
          "--samples-per-file", "40")
    _tool(tree, *train, "--encoder", "inscan", *llm, "--run-dir", str(out / "inscan"), "--save-trajectories",
          str(out / "inscan-traj"))
    url, server = _server(tree)
    try:
        _tool(tree, *train, "--encoder", "vllm", "--vllm-url", url, "--model", "tiny", "--run-dir",
              str(out / "vllm"), "--save-trajectories", str(out / "vllm-traj"))
    finally:
        server.terminate()
        server.wait(timeout=60)
    _tool(tree, "rl.eval", str(out / "none"), "--episodes", "2", "--max-steps", "48")
    _tool(tree, "rl.label", str(out / "none-traj"), "--out", str(out / "labelled"), *llm, "--batch", "64", "--quiet")
    _tool(tree, "rl.offline", "train", "--data", str(out / "labelled"), "--out", str(out / "awr"), "--hidden", "real",
          "--hidden-skip-n", "2", "--steps", "300", "--quiet", "--width", "32", "--batch-size", "32",
          "--updates-per-dispatch", "50", "--log-every", "100", "--checkpoint-every", "100", "--val-fraction", "0.2")
    _tool(tree, "rl.offline", "eval", str(out / "awr"), "--episodes", "2", "--max-steps", "48")
    _tool(tree, "rl.probe", str(out / "inscan"), str(out / "awr"), "--pairs", "3", "--play-steps", "8", "--kinds",
          "health", "zombie_adjacent", "prompt:wood", "--out", str(out / "probe"), "--trajectories",
          str(out / "inscan-traj"))


# compare --------------------------------------------------------------------------------------------------------
def _clean(value: Any, root: str) -> Any:
    """A JSON value without timing fields, with `root` (the OUT directory) written as <OUT>."""
    if isinstance(value, dict):
        return {k: _clean(v, root) for k, v in value.items() if k not in IGNORED_KEYS}
    if isinstance(value, list):
        return [_clean(v, root) for v in value]
    if isinstance(value, str):
        if value.startswith(("{", "[")):
            try:
                return _clean(json.loads(value), root)
            except ValueError:
                pass
        return value.replace(root, "<OUT>")
    return value


def json_file(path: Path, root: Path) -> Any:
    return _clean(json.loads(path.read_text()), str(root.resolve()))


def metrics(run_dir: Path) -> list[Any]:
    """A run's metrics.jsonl records without timing fields (online and offline runs)."""
    return [_clean(json.loads(line), str(run_dir.parent.resolve()))
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def npz_arrays(directory: Path, root: Path) -> dict[str, Any]:
    """Every array of every .npz under `directory` as FILE:ARRAY; string arrays (metadata) as cleaned JSON."""
    out: dict[str, Any] = {}
    for path in sorted(directory.glob("*.npz")):
        with np.load(path) as npz:
            for k in npz.files:
                a = npz[k]
                out[f"{path.name}:{k}"] = _clean(str(a), str(root.resolve())) if a.dtype.kind in "US" else a
    return out


def _differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    arrays = {k: v for k, v in a.items() if isinstance(v, np.ndarray)}, {k: v for k, v in b.items()
                                                                        if isinstance(v, np.ndarray)}
    bad = different(*arrays)
    meta = sorted((set(a) | set(b)) - set(arrays[0]) - set(arrays[1]))
    return bad + [k for k in meta if a.get(k) != b.get(k)]


def compare_all(a: Path, b: Path) -> dict[str, list[str] | bool]:
    """{what: list of differing names (empty: bit-equal)} for every output of `run_all`."""
    checks: dict[str, Any] = {}
    for name in TRAIN:
        checks[f"train {name}: config.json"] = _json_diff(a / name / "config.json", b / name / "config.json", a, b)
        checks[f"train {name}: metrics.jsonl"] = [] if metrics(a / name) == metrics(b / name) else ["records"]
        checks[f"train {name}: newest checkpoint"] = different(checkpoint_leaves(a / name),
                                                               checkpoint_leaves(b / name))
        checks[f"train {name}: trajectories"] = different(trajectory_arrays(a / f"{name}-traj"),
                                                          trajectory_arrays(b / f"{name}-traj"))
    checks["eval none: eval.json"] = _json_diff(a / "none" / "eval.json", b / "none" / "eval.json", a, b)
    checks["label: labelled files"] = _differ(npz_arrays(a / "labelled", a), npz_arrays(b / "labelled", b))
    checks["offline train: config.json"] = _json_diff(a / "awr" / "config.json", b / "awr" / "config.json", a, b)
    checks["offline train: metrics.jsonl"] = [] if metrics(a / "awr") == metrics(b / "awr") else ["records"]
    checks["offline train: newest checkpoint"] = different(checkpoint_leaves(a / "awr"), checkpoint_leaves(b / "awr"))
    checks["offline eval: eval.json"] = _json_diff(a / "awr" / "eval.json", b / "awr" / "eval.json", a, b)
    for f in ("probe.json", "probe_details.json"):
        checks[f"probe: {f}"] = _json_diff(a / "probe" / f, b / "probe" / f, a, b)
    return checks


def _json_diff(pa: Path, pb: Path, ra: Path, rb: Path) -> list[str]:
    """Top-level keys whose cleaned JSON differs."""
    x, y = json_file(pa, ra), json_file(pb, rb)
    if not isinstance(x, dict) or not isinstance(y, dict):
        return [] if x == y else ["<whole file>"]
    return [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in ("run", "compare"):
        print(__doc__.strip().splitlines()[3].strip() + "\n" + __doc__.strip().splitlines()[4].strip(),
              file=sys.stderr)
        return 2
    if args[0] == "run":
        run_all(Path(args[1]), Path(args[2]))
        return 0
    checks = compare_all(Path(args[1]), Path(args[2]))
    for name, bad in checks.items():
        print(f"{'bit-equal' if not bad else 'DIFFERENT'}: {name}" + (f" ({', '.join(bad[:5])})" if bad else ""))
    return 0 if not any(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
