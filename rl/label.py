"""`python -m rl.label IN_DIR_OR_GLOB --out OUT_DIR --model ...`: label trajectory files with LLM hidden states.

Every `obs` of every file goes through the jitted observation template (`render.build_template(...,
source="obs")`) and the LLM call the trainer runs in-scan (`rl.llm.make_ids_encoder`), in chunks of
`--batch` observations split over all visible devices (a `jax.shard_map` over a 1-D mesh); the result is
`OUT_DIR/<same name>.npz`: the input's arrays plus `hidden_state` float16 [N, D] and the labelling settings
(`labelling`: model, layer, pooling, format, prompt hash, ...). A reader thread loads the next files and a writer
thread stores finished chunks while the devices encode, so the devices never wait for the disk.

Resuming: a rerun skips files already labelled with the same settings and continues a half-done file from its
last completed chunk. While a file is in progress its finished rows live beside the output under temporary names
(`.NAME.partial.npy`, the rows, and `.NAME.partial.json`, how many are done and with which settings); the output
appears under its final name only when complete (written to a temporary name, then renamed). Chunks always cover
the same rows of a file, so a resumed file is bit for bit the file an uninterrupted run writes.

A bad file (unreadable, no `obs`, an observation size that fits no env, or not the env it names, or an output
labelled with other settings) is reported with its name and the reason; the other files are still labelled and
the exit code is 1 at the end.

Example:
    python -m rl.label checkpoints/run/trajectories --out labelled --model qwen3-4b --llm-layer 24
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rl.config import CHOICES, LLMConfig, Sectioned
from rl.files import atomic_write, npz_headers
from rl.llm import comparable
from rl.trajectories import (HIDDEN_KEY, LABELLING_KEY, TrajectoryError, load_arrays, meta_array,
                             read_meta, save_npz_atomic, trajectory_env)

DATA_AXIS = "samples"
LABEL_OWN_LLM_FLAGS = ("llm_layer", "template_assembly")  # LLMConfig fields whose flag rl.label writes itself / lacks


@dataclass(frozen=True, init=False)
class LabelConfig(Sectioned):
    """What a labelling computes (everything but `batch`, `devices`, `env` and `quiet` is stored in each file).
    `llm`: the trainer's LLM settings (`rl.config.LLMConfig`; `template_assembly` does not apply to observations);
    they also go by their flat names, e.g. `LabelConfig(model="tiny", batch=64)`, `cfg.llm_layer`."""

    llm: LLMConfig = LLMConfig()
    more_layers: tuple = ()  # hidden-state indices labelled after `llm_layer` in the same pass (--llm-layer A,B,..)
    batch: int = 1024  # observations per chunk (all devices together): the unit of resuming
    devices: int = 0  # 0: all visible devices
    env: str | None = None  # override the env of every file


# ------------------------------------------------------------------------------------------------ files

def input_files(spec: str) -> list[Path]:
    """The .npz files of a directory, a glob pattern or one file, sorted; FileNotFoundError if none."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
    elif any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec) if Path(p).is_file())
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"{spec}: no such file, directory or matching glob pattern")
    if not files:
        raise FileNotFoundError(f"{spec}: no .npz files there")
    return files


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """`--shard K/N` -> (K, N) with 1 <= K <= N; None for None. ValueError (one line naming the fix) otherwise."""
    if text is None:
        return None
    k, sep, n = str(text).partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        k = n = None
    if not sep or k is None or n < 1 or not 1 <= k <= n:
        raise ValueError(f"--shard {text}: give K/N with whole numbers 1 <= K <= N (this job's share K of N "
                         f"shards, e.g. --shard 1/3, --shard 2/3, --shard 3/3)")
    return k, n


def shard_files(files: Sequence[Path], shard: tuple[int, int] | None) -> list[Path]:
    """Shard K of N of `files` (sorted by name): every N-th file from the K-th. The N shards are disjoint and
    together hold every file once, so N jobs label one dataset into one --out and never write the same file."""
    files = sorted(files, key=lambda p: (p.name, str(p)))
    if shard is None:
        return files
    k, n = shard
    return files[k - 1::n]


def sample_count(path: Path) -> int:
    """N of a file's `obs`, read from the .npy header only (0 if that fails: the reader reports why)."""
    try:
        shape = npz_headers(path, ("obs",))["obs"][0]
        return int(shape[0]) if shape else 0
    except Exception:
        return 0


def _partial_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(f".{out.name}.partial.npy"), out.with_name(f".{out.name}.partial.json")


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@dataclass
class Job:
    """One input file to label: its arrays, env, and the rows already done (a resumed file)."""

    src: Path
    out: Path
    arrays: dict[str, np.ndarray]
    meta: dict[str, dict]
    env: str
    settings: dict  # the `labelling` entry (hidden_size, prompt hash filled in by the labeller)
    start_row: int = 0
    rows: Any = None  # np.memmap float16 [N, D] of the partial result
    chunks_left: int = 0

    @property
    def n(self) -> int:
        return self.arrays["obs"].shape[0]


@dataclass
class Bad:
    src: Path
    reason: str


@dataclass
class Skipped:
    src: Path


# ------------------------------------------------------------------------------------------------ labeller

class Labeller:
    """The model, tokenizer, and per env the obs template, prefix cache and jitted chunk function."""

    def __init__(self, cfg: LabelConfig):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        from jaxllm import load_tokenizer

        from rl.llm import load_model

        self.cfg = cfg
        devices = jax.devices()
        n = cfg.devices or len(devices)
        if not 1 <= n <= len(devices):
            raise ValueError(f"--devices {cfg.devices}: {len(devices)} devices are visible")
        self.mesh = Mesh(np.array(devices[:n]), (DATA_AXIS,))
        self.batch = -(-cfg.batch // n) * n  # a multiple of the device count
        self.tokenizer = load_tokenizer(cfg.model)
        self.model = load_model(cfg.llm)
        self.hidden_size = int(self.model.config.hidden_size)
        depth = int(self.model.config.num_hidden_layers)
        layers = (cfg.llm_layer,) + tuple(cfg.more_layers)
        self.layers = tuple(k % (depth + 1) for k in layers)  # normalised: 0..L
        self.multi = len(layers) > 1
        self.depth = depth
        self.row_shape = (len(layers), self.hidden_size) if self.multi else (self.hidden_size,)
        self._replicated = NamedSharding(self.mesh, P())
        self._rows = NamedSharding(self.mesh, P(DATA_AXIS))
        self.params = jax.device_put(self.model.params, self._replicated)
        self._per_env: dict[str, tuple] = {}
        self._lock = threading.Lock()  # the reader thread asks for settings while the main thread encodes

    def settings(self, env: str) -> dict:
        """The `labelling` entry of a file of `env` (what makes two labellings comparable; `rl.llm`)."""
        from rl.llm import labelling_settings

        out = labelling_settings(self.cfg.llm, self.template(env), self.hidden_size, env)
        if self.multi:  # every layer of one pass: `hidden_state` the first, the others under rl.layers.layer_key
            out.update(llm_layers=list(self.layers), model_layers=self.depth)
        return out

    def template(self, env: str):
        return self._setup(env)[0]

    def _setup(self, env: str):
        with self._lock:
            return self._setup_locked(env)

    def _setup_locked(self, env: str):
        if env not in self._per_env:
            import jax
            from jax.sharding import PartitionSpec as P

            from rl.jit import compile_llm
            from rl.llm import label_observations, make_ids_encoder, make_template, prefix_cache

            c = self.cfg
            tpl = make_template(self.tokenizer, c.llm, env, source="obs")
            cache = jax.device_put(prefix_cache(self.model, tpl), self._replicated)
            opts = c.llm.encode_options()
            if self.multi:
                opts["layer"] = self.layers  # one pass to the deepest: [b, K, D]
            encode_ids = make_ids_encoder(self.model.config, **opts)
            fn = compile_llm(jax.shard_map(label_observations(tpl, encode_ids), mesh=self.mesh,
                                           in_specs=(P(), P(), P(DATA_AXIS), P(DATA_AXIS)),
                                           out_specs=P(DATA_AXIS), check_vma=False))
            self._per_env[env] = (tpl, cache, fn)
        return self._per_env[env]

    def encode_chunk(self, env: str, obs: np.ndarray):
        """Dispatch one chunk (float [k <= batch, O]): device float16 [batch, D], rows past k meaningless."""
        import jax

        _, cache, fn = self._setup(env)
        k = obs.shape[0]
        padded = np.zeros((self.batch, obs.shape[1]), np.float32)
        padded[:k] = obs
        valid = np.arange(self.batch) < k
        out = fn(self.params, cache, jax.device_put(padded, self._rows), jax.device_put(valid, self._rows))
        out.copy_to_host_async()
        return out


# ------------------------------------------------------------------------------------------------ preparing a file

def prepare(src: Path, out_dir: Path, labeller: Labeller) -> Job | Bad | Skipped:
    """Read and check one input file; decide what is left to do (nothing, all, or the rows after a partial run)."""
    out = out_dir / src.name
    try:
        if out.resolve() == src.resolve():
            raise TrajectoryError("its output would overwrite it; choose another --out")
        arrays, meta = load_arrays(src)
        for key in [k for k in arrays if k == HIDDEN_KEY or k.startswith(HIDDEN_KEY + "_L")]:
            arrays.pop(key)  # relabelling a labelled file: the new labels replace the old
            meta.pop(LABELLING_KEY, None)
        env = trajectory_env(arrays, meta, labeller.cfg.env)
        if arrays["obs"].shape[0] == 0:
            raise TrajectoryError("it has no samples")
        settings = labeller.settings(env)
        if out.exists():
            done = _labelled_settings(out)
            if comparable(done) == comparable(settings):
                _remove_partial(out)
                return Skipped(src)
            raise TrajectoryError(f"{out} exists, labelled with other settings ({_settings_diff(done, settings)}); "
                                  "use another --out or remove it")
        job = Job(src, out, arrays, meta, env, settings)
        _open_partial(job, labeller)
        return job
    except TrajectoryError as e:
        return Bad(src, str(e))


def _labelled_settings(out: Path) -> dict | None:
    try:
        with np.load(out, allow_pickle=False) as npz:
            return read_meta(npz, LABELLING_KEY)
    except Exception:
        return None


def _settings_diff(old: dict | None, new: dict) -> str:
    if not old:
        return "no labelling settings"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys)


def _open_partial(job: Job, labeller: Labeller) -> None:
    """The memmap of the job's rows; continues a partial run with the same settings and input, else starts anew."""
    rows_path, state_path = _partial_paths(job.out)
    shape = (job.n,) + labeller.row_shape
    start = 0
    if rows_path.exists() and state_path.exists():
        try:
            state = json.loads(state_path.read_text())
            expected = _state(job, labeller.batch, 0)
            if all(state[k] == expected[k] for k in ("settings", "input", "batch")):
                rows = np.lib.format.open_memmap(rows_path, mode="r+")
                if rows.shape == shape and rows.dtype == np.float16:
                    job.rows, start = rows, int(state["rows_done"])
        except (ValueError, KeyError, OSError):
            pass
    if job.rows is None:
        _remove_partial(job.out)
        job.rows = np.lib.format.open_memmap(rows_path, mode="w+", dtype=np.float16, shape=shape)
        _write_state(job, labeller.batch, 0)
    job.start_row = start


def _state(job: Job, batch: int, rows_done: int) -> dict:
    """What a partial result records: the settings, the input file's identity, the chunk size, the rows done."""
    return {"settings": job.settings, "input": _file_identity(job.src), "batch": batch, "rows_done": rows_done}


def _write_state(job: Job, batch: int, rows_done: int) -> None:
    atomic_write(_partial_paths(job.out)[1], json.dumps(_state(job, batch, rows_done)))


def _remove_partial(out: Path) -> None:
    for p in _partial_paths(out):
        if p.exists():
            p.unlink()


def _finish(job: Job) -> None:
    """Write the labelled file (atomically) and drop the partial result."""
    arrays = dict(job.arrays)
    rows = np.asarray(job.rows)
    if rows.ndim == 3:  # several layers: the first is `hidden_state` (today's readers), the others by index
        from rl.layers import layer_key

        arrays[HIDDEN_KEY] = np.ascontiguousarray(rows[:, 0])
        for j, k in enumerate(job.settings["llm_layers"][1:], start=1):
            arrays[layer_key(k)] = np.ascontiguousarray(rows[:, j])
    else:
        arrays[HIDDEN_KEY] = rows
    for key, value in job.meta.items():
        if key != LABELLING_KEY and value is not None:
            arrays[key] = meta_array(value)
    arrays[LABELLING_KEY] = meta_array(job.settings)
    save_npz_atomic(job.out, arrays)
    job.rows = None
    _remove_partial(job.out)


# ------------------------------------------------------------------------------------------------ the run

@dataclass
class Summary:
    files: int = 0
    samples: int = 0
    skipped: int = 0
    bad: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        return (f"labelled {self.files} files ({self.samples:,} samples) in {self.seconds:.1f} s: {rate:,.0f} "
                f"samples/s; {self.skipped} already done; {len(self.bad)} bad")


def label_files(files: Sequence[Path], out_dir: Path, cfg: LabelConfig, *, quiet: bool = False,
                labeller: Labeller | None = None, prefetch: int = 2, in_flight: int = 4) -> Summary:
    """Label `files` into `out_dir` (see the module docstring); returns the summary (bad files listed in it)."""
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    labeller = labeller or Labeller(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        summary = _label_into(files, out_dir, labeller, quiet, prefetch, in_flight)
    finally:
        _tidy(out_dir, created)
    return summary


def _tidy(out_dir: Path, created: bool) -> None:
    """After a labelling run (finished or failed): drop partial results of files that got no row done, and the
    output directory itself when this run created it and left nothing in it (every file bad, or a failure)."""
    for state in out_dir.glob(".*.partial.json"):
        try:
            done = int(json.loads(state.read_text()).get("rows_done", 0))
        except (OSError, ValueError, AttributeError):
            continue
        if done == 0:
            _remove_partial(out_dir / state.name[1:-len(".partial.json")])
    if created and not any(out_dir.iterdir()):
        out_dir.rmdir()


def _label_into(files: Sequence[Path], out_dir: Path, labeller: Labeller, quiet: bool, prefetch: int,
                in_flight: int) -> Summary:
    summary = Summary()
    bar = _progress(sum(sample_count(f) for f in files) or None, len(files), quiet)  # bad files count 0
    jobs: queue.Queue = queue.Queue(maxsize=prefetch)
    results: queue.Queue = queue.Queue(maxsize=in_flight)
    t0 = time.perf_counter()

    errors: list[BaseException] = []  # of the reader and writer threads, raised by the main thread

    def read():
        try:
            for src in files:
                if errors:
                    break
                jobs.put(prepare(src, out_dir, labeller))
        except BaseException as e:
            errors.append(e)
        finally:
            jobs.put(None)

    def write():
        while True:
            item = results.get()
            if item is None:
                return
            if errors:
                continue  # keep draining so the main thread never blocks on a full queue
            try:
                job, start, rows = item
                stop = min(start + labeller.batch, job.n)
                job.rows[start:stop] = np.asarray(rows)[: stop - start]
                job.rows.flush()
                _write_state(job, labeller.batch, stop)
                summary.samples += stop - start
                bar.update(stop - start)
                if stop == job.n:
                    _finish(job)
                    summary.files += 1
                    bar.file_done()
            except BaseException as e:
                errors.append(e)

    reader = threading.Thread(target=read, name="label-reader", daemon=True)
    writer = threading.Thread(target=write, name="label-writer", daemon=True)
    reader.start()
    writer.start()
    try:
        while not errors:
            item = jobs.get()
            if item is None:
                break
            if isinstance(item, (Bad, Skipped)):
                if isinstance(item, Bad):
                    summary.bad.append(item)
                else:
                    summary.skipped += 1
                bar.file_done()
                bar.update(sample_count(item.src))
                continue
            bar.update(item.start_row)
            if item.start_row >= item.n:  # every row was done before a stop: only the output is missing
                results.put((item, item.n, np.zeros((0,) + labeller.row_shape, np.float16)))
            for start in range(item.start_row, item.n, labeller.batch):
                if errors:
                    break
                obs = item.arrays["obs"][start:start + labeller.batch]
                results.put((item, start, labeller.encode_chunk(item.env, obs)))
    finally:
        results.put(None)
        writer.join()
        bar.close()
        if errors:  # let the reader finish its put, then stop
            while reader.is_alive():
                try:
                    jobs.get(timeout=0.1)
                except queue.Empty:
                    pass
    if errors:
        raise errors[0]
    summary.seconds = time.perf_counter() - t0
    return summary


class _progress:
    """tqdm over samples with a files counter (nothing when quiet); `total` None (no readable sample count): a
    count without a bar."""

    def __init__(self, total: int | None, files: int, quiet: bool, stream: Any = None):
        self.files, self.done = files, 0
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            stream = stream or sys.stderr
            tty = hasattr(stream, "isatty") and stream.isatty()
            shape = ("{desc}: {percentage:3.0f}%|{bar}| {n:,}/{total:,} samples [{elapsed}<{remaining}, "
                     "{rate_fmt}{postfix}]" if total else "{desc}: {n:,} samples [{elapsed}, {rate_fmt}{postfix}]")
            self.bar = tqdm(total=total, unit=" samples", unit_scale=True, desc="label", file=stream,
                            bar_format=shape, dynamic_ncols=True, smoothing=0.1, mininterval=0.5 if tty else 10.0)
            self.bar.set_postfix_str(f"files 0/{files}")

    def update(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.update(n)

    def file_done(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"files {self.done}/{self.files}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------ CLI

DESCRIPTION = """\
Label trajectory files (rl.train/rl.eval --save-trajectories) with the LLM hidden state of every observation, as
the trainer's in-scan encoder computes it. Each IN file becomes OUT_DIR/<same name>.npz: its arrays plus
`hidden_state` [N, D] (float16) and the labelling settings.

A rerun skips the files already labelled with the same settings and continues a half-done file where it stopped
(the result is the same as an uninterrupted run). A bad file is reported by name with the reason; the others are
still labelled, and the exit code is 1 at the end.

Example:
    python -m rl.label checkpoints/run/trajectories --out labelled --model qwen3-4b --llm-layer 24
"""

def build_parser() -> argparse.ArgumentParser:
    from render.envs import ENV_NAMES

    from rl.cli import Parser, add_compile_cache_option, add_dataclass_options, prompt_text

    p = Parser(prog="python -m rl.label", description=DESCRIPTION)
    p.add_argument("inputs", metavar="IN_DIR_OR_GLOB", help="a directory of .npz files, a glob pattern or one file")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory (same file names)")
    d = LabelConfig()
    # the LLM section's flags, as rl.train has them (rl.config.LLMConfig: a new LLM setting appears here too), but
    # --llm-layer, which takes a list here, and --template-assembly (observations have one template assembly)
    add_dataclass_options(p, [f for f in dataclasses.fields(LLMConfig) if f.name not in LABEL_OWN_LLM_FLAGS], (),
                          CHOICES, types={"system_prompt": prompt_text}, defaults=True)
    p.add_argument("--llm-layer", default=str(d.llm_layer), dest="llm_layer", metavar="N[,N...]",
                   help="hidden state index (HF numbering: 0 embeddings, k after k layers; -1 final, normed); "
                        "several (8,16,24,-1) are labelled from one pass: `hidden_state` holds the first, "
                        "`hidden_state_L<k>` the others")
    p.add_argument("--batch", type=int, default=1024, metavar="N",
                   help="observations per chunk, all devices together (a rerun resumes at whole chunks)")
    p.add_argument("--devices", type=int, default=0, metavar="N", help="devices to use (0: all visible)")
    p.add_argument("--env", choices=ENV_NAMES, default=None,
                   help="env of every file (default: the file's recorded env, else told by the observation size)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="label only shard K of N of the files (every N-th file from the K-th, by name): N jobs or "
                        "hosts label one dataset into one --out together (docs/OFFLINE.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_compile_cache_option(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from rl.cli import apply_compile_cache

    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value, low in (("--batch", args.batch, 1), ("--devices", args.devices, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    llm_settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(LLMConfig)
                    if f.name not in LABEL_OWN_LLM_FLAGS}
    try:
        LLMConfig(**llm_settings).check()
    except ValueError as e:
        parser.error(str(e))
    apply_compile_cache(args)
    try:
        shard = parse_shard(args.shard)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        from rl.layers import model_depth, parse_layers

        layers = parse_layers(args.llm_layer)
        layers = parse_layers(args.llm_layer, model_depth(args.model))  # past the depth: before anything is loaded
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = LabelConfig(**llm_settings, llm_layer=layers[0], more_layers=layers[1:], batch=args.batch,
                      devices=args.devices, env=args.env)
    try:
        files = shard_files(input_files(args.inputs), shard)
        if not files:
            print(f"shard {args.shard}: no files in this shard (fewer files than shards); nothing to do")
            return 0
        if not args.quiet:
            many = "s" if len(files) > 1 else ""
            part = f" (shard {args.shard})" if shard else ""
            print(f"loading the LLM ({cfg.model}) and its tokenizer for {len(files)} file{many}{part} ...",
                  file=sys.stderr, flush=True)
            if args.system_prompt is not None:  # the files keep only its hash: show what it is
                lines = args.system_prompt.strip().splitlines() or [""]
                more = " ..." if len(lines[0]) > 80 or len(lines) > 1 else ""
                print(f"system prompt: {lines[0][:80]!r}{more} ({len(args.system_prompt):,} characters)",
                      file=sys.stderr, flush=True)
        summary = label_files(files, args.out, cfg, quiet=args.quiet)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for bad in summary.bad:
        print(f"bad file {bad.src}: {bad.reason}", file=sys.stderr)
    print(summary.line(), flush=True)
    return 1 if summary.bad else 0


if __name__ == "__main__":
    sys.exit(main())
