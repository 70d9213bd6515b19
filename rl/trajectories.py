"""Trajectory files: the `.npz` format of offline datasets, atomic writes, reading with validation, and the recorder.

One file holds N samples, every array with the sample axis first (REFERENCE §7, the format the people this
project serves already use, so their offline code reads ours and ours reads theirs):

    obs       float32 [N, O]  the Craftax symbolic observation the policy acted on
    next_obs  float32 [N, O]  the observation after the step (a new episode's first one where done)
    action    int32 [N]
    reward    float32 [N]
    done      bool [N]        the episode ended at this step
    log_prob  float32 [N]     log pi(action | obs) of the policy that acted

and, ours only, 0-d JSON strings: `recording` (env, samples, num_envs, sample order, source; written by
`--save-trajectories`) and, in a labelled file, `labelling` (model, layer, pooling, format, prompt hash) next to
`hidden_state` float16 [N, D] (`rl.label`). Sample order inside one recorded update: time-major, sample
i = step i // num_envs of env i % num_envs; the updates follow each other.

Files are written to a temporary name in the same directory and renamed (`save_npz_atomic`): a reader never
sees a half-written file under a final name.
"""
from __future__ import annotations

import json
import queue
import re
import threading
import zipfile
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from rl.files import atomic_write

ARRAYS = ("obs", "next_obs", "action", "reward", "done", "log_prob")
RECORDING_KEY = "recording"
LABELLING_KEY = "labelling"
HIDDEN_KEY = "hidden_state"
FILE_PATTERN = "{prefix}-{first:012d}.npz"  # recorded files are named by their first sample's stream index
_NAME_RE = re.compile(r"^(?P<prefix>.+)-(?P<first>\d{12})\.npz$")


class RecordedRollout(NamedTuple):
    """One rollout (or evaluation window) as the recorder takes it: time-major arrays [T, B, ...] of the steps,
    and the observation after the last step [B, O] (the next_obs of the final row)."""

    obs: Any  # float32 [T, B, O]
    last_obs: Any  # float32 [B, O]
    action: Any  # int32 [T, B]
    reward: Any  # float32 [T, B]
    done: Any  # bool [T, B]
    log_prob: Any  # float32 [T, B]


class TrajectoryError(ValueError):
    """A trajectory file that can't be used: the message says which file and why."""


def meta_array(meta: Mapping[str, Any]) -> np.ndarray:
    """A JSON dict as a 0-d unicode array (np.load reads it back without pickle)."""
    return np.array(json.dumps(meta, sort_keys=True))


def read_meta(npz, key: str) -> dict | None:
    """The JSON dict stored under `key` of an open npz, None if absent; TrajectoryError if it is not JSON."""
    if key not in npz.files:
        return None
    try:
        value = json.loads(str(npz[key][()]))
    except (ValueError, TypeError) as e:
        raise TrajectoryError(f"its {key!r} entry is not a JSON string ({e})") from None
    if not isinstance(value, dict):
        raise TrajectoryError(f"its {key!r} entry is not a JSON object")
    return value


def save_npz_atomic(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write `arrays` as an uncompressed .npz at `path`: to a temporary name beside it, fsync, then rename."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    atomic_write(path, write, sync=True)


def load_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """All arrays of an .npz (JSON entries apart): (arrays, {key: meta dict}); TrajectoryError if unreadable or
    the arrays disagree on the sample count. Object arrays (they need pickle, which is never used) are left out."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = {k: read_meta(npz, k) for k in (RECORDING_KEY, LABELLING_KEY) if k in npz.files}
            arrays = {}
            for k in npz.files:
                if k in meta:
                    continue
                try:
                    arrays[k] = npz[k]
                except ValueError as e:  # an object array (e.g. strings saved as objects) needs pickle: left out
                    if "allow_pickle" not in str(e):
                        raise
    except TrajectoryError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise TrajectoryError(f"unreadable as .npz ({type(e).__name__}: {e})") from None
    counts = {k: a.shape[0] for k, a in arrays.items() if a.ndim >= 1}
    if len(set(counts.values())) > 1:
        raise TrajectoryError(f"its arrays disagree on the sample count: {counts}")
    return arrays, meta


def trajectory_env(arrays: Mapping[str, np.ndarray], meta: Mapping[str, dict], env: str | None = None) -> str:
    """The env of a file's `obs`: `env` if given, else the recorder's stored setting, else the one whose
    observation size it has; TrajectoryError if `obs` is missing, not [N, O] floats, or its size fits no env
    (or not the env named)."""
    from render.observation import OBS_SIZES, env_for_obs_size

    obs = arrays.get("obs")
    if obs is None:
        raise TrajectoryError(f"it has no 'obs' array (arrays: {', '.join(sorted(arrays)) or 'none'})")
    if obs.ndim != 2 or not np.issubdtype(obs.dtype, np.floating):
        raise TrajectoryError(f"its 'obs' is {obs.dtype} {list(obs.shape)}, not float [samples, observation size]")
    env = env or (meta.get(RECORDING_KEY) or {}).get("env")
    if env is None:
        try:
            return env_for_obs_size(obs.shape[1])
        except ValueError as e:
            raise TrajectoryError(str(e)) from None
    if env not in OBS_SIZES:
        raise TrajectoryError(f"its env {env!r} is not one of {', '.join(OBS_SIZES)}")
    if obs.shape[1] != OBS_SIZES[env]:
        raise TrajectoryError(f"its observations have {obs.shape[1]} floats, but {env} observations have "
                              f"{OBS_SIZES[env]}")
    return env


# ------------------------------------------------------------------------------------------------ recorder

class TrajectoryWriter:
    """Collects samples and writes them to `out_dir` in files of exactly `samples_per_file` samples (a last,
    shorter file at `close`), named by the stream index of their first sample, on a background thread.

    `add` takes the arrays of ARRAYS with the sample axis first, numpy or device arrays: device arrays start
    their copy to the host at once (`copy_to_host_async`) and the thread waits for it, so the caller (the
    training loop) goes on with the next update while the copy and the write run. At most `max_pending` adds
    wait for the thread; beyond that `add` blocks (the disk sets the pace). Errors of the thread are raised by
    the next `add` or by `close`.

    A new stream (`continue_stream=False`) refuses a directory that already holds files of `prefix`
    (`check_new_stream`). `continue_stream=True` continues one at `first_sample` (a resumed run): files that start at
    or after it are removed and one that spans it is cut at it, so the directory never holds a sample twice.
    """

    def __init__(self, out_dir: Path, samples_per_file: int, recording: Mapping[str, Any], *,
                 prefix: str = "traj", first_sample: int = 0, continue_stream: bool = False, max_pending: int = 2):
        if samples_per_file < 1:
            raise ValueError(f"--samples-per-file must be >= 1, got {samples_per_file}")
        if not continue_stream:
            check_new_stream(out_dir, prefix)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.samples_per_file = samples_per_file
        self.recording = dict(recording)
        self.prefix = prefix
        self.files_written: list[Path] = []
        self._next = first_sample  # stream index of the first sample in the buffer
        self._buffer: list[dict[str, np.ndarray]] = []
        self._buffered = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._truncate_at(first_sample)
        self._thread = threading.Thread(target=self._run, name="trajectory-writer", daemon=True)
        self._thread.start()

    def _truncate_at(self, first_sample: int) -> None:
        for path in sorted(self.out_dir.glob(f"{self.prefix}-*.npz")):
            m = _NAME_RE.match(path.name)
            if not m or m["prefix"] != self.prefix:
                continue
            start = int(m["first"])
            if start >= first_sample:
                path.unlink()
            else:
                arrays, meta = load_arrays(path)
                n = next(iter(arrays.values())).shape[0]
                if start + n > first_sample:
                    keep = first_sample - start
                    rec = dict(meta.get(RECORDING_KEY) or {}, samples=keep)
                    save_npz_atomic(path, {**{k: a[:keep] for k, a in arrays.items()},
                                           RECORDING_KEY: meta_array(rec)})

    def add(self, arrays: Mapping[str, Any]) -> None:
        """Queue one batch of samples (a dict of ARRAYS, sample axis first)."""
        self._put(dict(arrays))

    def add_rollout(self, rollout: RecordedRollout) -> None:
        """Queue one rollout's time-major arrays (`RecordedRollout`); the thread flattens them
        (`transitions_to_samples`)."""
        self._put(RecordedRollout(*rollout))

    def _put(self, item) -> None:
        self._raise_if_failed()
        for a in (item.values() if isinstance(item, dict) else item):
            if hasattr(a, "copy_to_host_async"):
                a.copy_to_host_async()
        self._queue.put(item)

    def close(self) -> list[Path]:
        """Write what is buffered (a last, shorter file), stop the thread; the files written, in order."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.files_written

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing trajectories to {self.out_dir} failed: {self._error}") from self._error

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    self._flush(final=True)
                    return
                if isinstance(item, dict):
                    batch = {k: np.asarray(v) for k, v in item.items()}
                else:
                    batch = transitions_to_samples(*(np.asarray(v) for v in item))
                self._buffer.append(batch)
                self._buffered += next(iter(batch.values())).shape[0]
                self._flush(final=False)
        except BaseException as e:  # reported to the training loop by the next add / close
            self._error = e
            while True:  # keep draining so `add` and `close` never block on a dead thread
                if self._queue.get() is None:
                    return

    def _flush(self, final: bool) -> None:
        while self._buffered >= self.samples_per_file or (final and self._buffered > 0):
            n = min(self.samples_per_file, self._buffered)
            pieces, taken = [], 0
            while taken < n:  # whole batches from the front, the last one split
                batch = self._buffer[0]
                size = next(iter(batch.values())).shape[0]
                take = min(size, n - taken)
                pieces.append({k: v[:take] for k, v in batch.items()})
                if take == size:
                    self._buffer.pop(0)
                else:
                    self._buffer[0] = {k: v[take:] for k, v in batch.items()}
                taken += take
            head = {k: np.concatenate([p[k] for p in pieces]) if len(pieces) > 1 else pieces[0][k]
                    for k in pieces[0]}
            path = self.out_dir / FILE_PATTERN.format(prefix=self.prefix, first=self._next)
            meta = dict(self.recording, samples=n, first_sample=self._next)
            save_npz_atomic(path, {**head, RECORDING_KEY: meta_array(meta)})
            self.files_written.append(path)
            self._next += n
            self._buffered -= n


def check_new_stream(out_dir: Path, prefix: str = "traj") -> None:
    """Raise ValueError if `out_dir` already holds recorded files of `prefix` (a new recording would mix with them)."""
    existing = sorted(Path(out_dir).glob(f"{prefix}-*.npz")) if Path(out_dir).is_dir() else []
    if any(_NAME_RE.match(p.name) for p in existing):
        raise ValueError(f"{out_dir} already holds {len(existing)} trajectory files ({existing[0].name}, ...); record "
                         f"into an empty directory, or --resume the run that wrote them")


def transitions_to_samples(obs, next_obs_last, action, reward, done, log_prob) -> dict[str, Any]:
    """One rollout's time-major arrays [T, B, ...] (and the observation after its last step, [B, O]) as the
    samples of the file format, flattened time-major: sample i = step i // B, env i % B. Works on numpy and on
    device arrays (jnp), so a jitted update can return them ready to copy."""
    import jax.numpy as jnp

    xp = np if isinstance(obs, np.ndarray) else jnp
    next_obs = xp.concatenate([obs[1:], next_obs_last[None]], axis=0)

    def flat(x, dtype):
        x = x.reshape((-1,) + tuple(x.shape[2:]))
        return x.astype(dtype, copy=False) if xp is np else x.astype(dtype)

    return {"obs": flat(obs, np.float32), "next_obs": flat(next_obs, np.float32), "action": flat(action, np.int32),
            "reward": flat(reward, np.float32), "done": flat(done, bool), "log_prob": flat(log_prob, np.float32)}
