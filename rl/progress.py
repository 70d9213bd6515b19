"""What a training run tells its user: what was loaded, a status line per update, and how it ended.

All output goes to one stream (stderr), only from process 0. The status line rewrites itself on a terminal
(clearing what a longer line left) and is one line per update otherwise; `quiet` keeps one line per checkpoint.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def param_count(params: Any) -> int:
    """Number of scalars in a parameter pytree (fp8-quantised leaves count once)."""
    import jax

    return sum(int(getattr(x, "size", 0)) for x in jax.tree.leaves(params))


def describe_llm(cfg: Any, llm: Any) -> str:
    """One line about the run's LLM: name, parameters, dtype and the prompt head's length."""
    head = len(llm.template.prefix_ids)
    if llm.model is None:  # --encoder vllm: the server holds the model
        return f"LLM: {cfg.model} on the embedding server {cfg.vllm_url}; prompt head {head} tokens"
    n = param_count(llm.model.params)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    dtype = cfg.llm_dtype if cfg.llm_dtype == "fp8" else getattr(llm.model.dtype, "__name__", str(llm.model.dtype))
    return (f"LLM: {cfg.model} ({size} parameters, {dtype}, hidden size {llm.hidden_size}); prompt head {head} "
            f"tokens (cached once), re-encoded every {cfg.skip_n} steps")


class Progress:
    """The run's messages. `record` per update, `checkpoint` per save, `finished` / `stopped` at the end."""

    def __init__(self, cfg: Any, run_dir: Any, start: int, *, quiet: bool = False, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.cfg, self.run_dir, self.start = cfg, run_dir, start
        self.quiet, self.enabled = quiet, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.first_seconds: float | None = None  # the first update (includes compilation)
        self.steady: list[float] = []  # seconds of every later update
        self.last: dict | None = None
        self._open_line = False

    def say(self, text: str) -> None:
        """A message on its own line (ends a pending status line first)."""
        if not self.enabled:
            return
        if self._open_line:
            print(file=self.stream)
            self._open_line = False
        print(text, file=self.stream, flush=True)

    def starting(self, devices: int, backend: str, llm_line: str | None) -> None:
        """Before the first update: what was loaded and that compilation comes first."""
        if self.quiet:
            return
        cfg = self.cfg
        self.say(f"{cfg.env}, {cfg.num_envs:,} envs x {cfg.num_steps} steps per update, {cfg.num_updates:,} updates "
                 f"({cfg.total_timesteps:,} env steps) on {devices} {backend} device{'s' if devices > 1 else ''}; "
                 f"run directory {self.run_dir}")
        if llm_line:
            self.say(llm_line)
        where = "about a minute on a GPU" if backend == "gpu" else "a minute or more on a CPU"
        self.say(f"compiling the first update ({where}) ...")

    def record(self, rec: dict) -> None:
        """Account one update's metrics record and show the status line."""
        if self.first_seconds is None:
            self.first_seconds = rec["seconds"]
        else:
            self.steady.append(rec["seconds"])
        self.last = rec
        if self.quiet or not self.enabled:
            return
        line = self.status_line(rec)
        if self.tty:
            print("\r\033[K" + line, end="", file=self.stream, flush=True)
            self._open_line = True
        else:
            print(line, file=self.stream, flush=True)

    def status_line(self, rec: dict) -> str:
        cfg, update = self.cfg, rec["update"]
        elapsed = time.perf_counter() - self.t0
        ret = rec.get("episode_return")
        parts = [f"[update {update}/{cfg.num_updates}] {rec['timestep']:,} steps"]
        if len(self.steady) == 0:
            parts.append(f"{rec['sps']:,.0f} SPS (includes compilation)")
        else:
            parts.append(f"{self.mean_sps():,.0f} SPS")
        parts.append(f"elapsed {_duration(elapsed)}")
        if self.steady and update < cfg.num_updates:
            per_update = sum(self.steady[-20:]) / len(self.steady[-20:])
            parts.append(f"ETA {_duration(per_update * (cfg.num_updates - update))}")
        parts.append("return " + ("-" if ret is None or not math.isfinite(ret) else f"{ret:.2f}"))
        share = rec.get("llm_time_share")
        if cfg.uses_llm and share is not None and math.isfinite(share):
            parts.append(f"LLM {share:.0%} of time")
        return " | ".join(parts)

    def mean_sps(self) -> float:
        """Env steps per second over the updates after the first (the first one also compiles)."""
        if not self.steady:
            return self.cfg.batch_size / self.first_seconds if self.first_seconds else float("nan")
        return self.cfg.batch_size * len(self.steady) / sum(self.steady)

    def checkpoint(self, update: int) -> None:
        """A checkpoint was saved: with `quiet`, this is the one line the run prints."""
        if self.quiet and self.enabled:
            self.say("checkpoint saved " + (self.status_line(self.last) if self.last else f"at update {update}"))

    def stopped(self, update: int) -> None:
        self.say(f"stopped at update {update}/{self.cfg.num_updates}; continue with "
                 f"python -m rl.train --resume {self.run_dir}")

    def finished(self) -> None:
        """The end of a finished run: final return, mean SPS, where it is and what to run next."""
        if not self.enabled:
            return
        rec = self.last or {}
        ret = rec.get("episode_return")
        d = self.run_dir
        sps = "(mean, compilation left out)" if self.steady else "(one update here, compilation included)"
        self.say(f"finished {self.cfg.num_updates:,} updates in {_duration(time.perf_counter() - self.t0)}: final "
                 f"return {'-' if ret is None or not math.isfinite(ret) else f'{ret:.2f}'}, {self.mean_sps():,.0f} SPS "
                 f"{sps}; run directory {d}")
        if not self.quiet:
            self.say(f"  curves:   python -m rl.plot {d}\n  evaluate: python -m rl.eval {d}")
