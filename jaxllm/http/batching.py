"""Gathers concurrent encode requests into padded, bucketed encoder calls of bounded size.

One worker thread owns the encoder. It takes the first waiting job, gathers more for up to ``max_wait_s``,
sorts all their prompts by length and cuts them into calls of at most ``max_batch`` prompts and at most
``max_batch_tokens`` padded tokens (B x T after bucketing), shortest first. Each job's Future resolves as soon
as its last prompt is encoded, so a short request gathered beside a long one does not wait for the long one's
calls. When a call fails, the jobs it held are retried one at a time: only the job that fails alone hears
about it.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["BatchingEncoder", "EncodeFn", "bucket"]

EncodeFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(ids int32 [B, T] right-padded, lengths int32 [B]) -> float32 [B, D]."""


def bucket(n: int, minimum: int, maximum: int, per_octave: int = 1) -> int:
    """``n`` rounded up to the next of ``per_octave`` evenly spaced sizes per power of two, within [minimum, maximum].

    per_octave=1 gives powers of two; per_octave=2 gives ..., 1024, 1536, 2048, 3072, ... (at most 50% padding,
    two shapes per doubling); per_octave=4 gives ..., 1024, 1280, 1536, 1792, 2048, ...
    """
    n = max(n, minimum, 1)
    base = 1 << (n.bit_length() - 1)  # largest power of two <= n
    step = max(base // per_octave, 1)
    return min(-(-n // step) * step, maximum)


@dataclass
class _Job:
    prompts: list[list[int]]
    future: Future


class BatchingEncoder:
    """Runs ``encode_fn`` on padded, bucketed batches gathered from concurrent callers.

    ``submit(prompts)`` returns a Future of float32 [len(prompts), D]. ``max_batch_tokens`` (default: no bound
    beyond ``max_batch`` x the longest bucket) bounds the padded B x T of one encoder call, the memory one call
    may take; it must hold one prompt of ``max_len``. Callers check prompt lengths against ``max_len`` first.
    """

    def __init__(self, encode_fn: EncodeFn, *, max_batch: int = 64, max_len: int = 40960, min_len: int = 16,
                 max_wait_s: float = 0.002, pad_id: int = 0, len_buckets_per_octave: int = 2,
                 max_batch_tokens: int | None = None):
        if max_batch < 1 or max_len < 1 or min_len < 1 or max_wait_s < 0:
            raise ValueError(f"need max_batch, max_len, min_len >= 1 and max_wait_s >= 0; got "
                             f"{max_batch}, {max_len}, {min_len}, {max_wait_s}")
        self.encode_fn = encode_fn
        self.max_batch = max_batch
        self.max_len = max_len
        self.min_len = min(min_len, max_len)
        self.max_wait_s = max_wait_s
        self.pad_id = pad_id
        self.len_buckets_per_octave = len_buckets_per_octave
        longest = self.padded_shape(1, max_len)[1]
        self.max_batch_tokens = max_batch_tokens or bucket(max_batch, 1, max_batch) * longest
        if self.max_batch_tokens < longest:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} cannot hold one prompt of max_len={max_len} "
                             f"(padded to {longest}): raise it or lower max_len")
        self.shapes_seen: set[tuple[int, int]] = set()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="batching-encoder", daemon=True)
        self._worker.start()

    def padded_shape(self, batch: int, longest: int) -> tuple[int, int]:
        """The bucketed (B, T) a batch of ``batch`` prompts with longest ``longest`` is padded to."""
        return (bucket(batch, 1, self.max_batch),
                bucket(longest, self.min_len, self.max_len, self.len_buckets_per_octave))

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Indices into ``lengths`` grouped into encoder calls: shortest first, each call within max_batch
        prompts and max_batch_tokens padded tokens."""
        calls: list[list[int]] = []
        current: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            batch_b, batch_t = self.padded_shape(len(current) + 1, lengths[i])
            if current and (len(current) == self.max_batch or batch_b * batch_t > self.max_batch_tokens):
                calls.append(current)
                current = []
            current.append(i)
        if current:
            calls.append(current)
        return calls

    def encode_call(self, prompts: list[list[int]]) -> np.ndarray:
        """One encoder call on ``prompts`` (already planned to fit), padded to its bucket: float32 [N, D]."""
        batch_b, batch_t = self.padded_shape(len(prompts), max(len(p) for p in prompts))
        ids = np.full((batch_b, batch_t), self.pad_id, dtype=np.int32)
        lengths = np.ones((batch_b,), dtype=np.int32)  # padding rows: one pad token, result dropped
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
            lengths[row] = len(prompt)
        self.shapes_seen.add((batch_b, batch_t))
        return np.asarray(self.encode_fn(ids, lengths), dtype=np.float32)[:len(prompts)]

    def encode_now(self, prompts: list[list[int]]) -> np.ndarray:
        """Encode in the calling thread (for warm-up and tests); same plan and padding as the worker."""
        out: list[np.ndarray | None] = [None] * len(prompts)
        for call in self.plan([len(p) for p in prompts]):
            for i, vector in zip(call, self.encode_call([prompts[i] for i in call])):
                out[i] = vector
        return np.stack(out)

    def submit(self, prompts: list[list[int]]) -> Future:
        """A Future of float32 [len(prompts), D], encoded by the worker together with concurrent submissions."""
        future: Future = Future()
        self._jobs.put(_Job(prompts, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=10)

    # ------------------------------------------------------------------------------ worker
    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        jobs, waiting = [first], len(first.prompts)
        deadline = time.monotonic() + self.max_wait_s
        while waiting < self.max_batch:
            try:
                job = self._jobs.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            waiting += len(job.prompts)
        return jobs, False

    def _encode_jobs(self, jobs: list[_Job]) -> None:
        """Encode the prompts of ``jobs`` together; resolve each job as soon as its last prompt is done."""
        owners = [(j, k) for j, job in enumerate(jobs) for k in range(len(job.prompts))]
        prompts = [jobs[j].prompts[k] for j, k in owners]
        results = [[None] * len(job.prompts) for job in jobs]
        missing = [len(job.prompts) for job in jobs]
        for call in self.plan([len(p) for p in prompts]):
            vectors = self.encode_call([prompts[i] for i in call])
            for i, vector in zip(call, vectors):
                j, k = owners[i]
                results[j][k] = vector
                missing[j] -= 1
                if missing[j] == 0:
                    jobs[j].future.set_result(np.stack(results[j]))

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._jobs.get()
            if first is None:
                break
            jobs, stop = self._gather(first)
            jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
            try:
                self._encode_jobs(jobs)
            except Exception as exc:
                pending = [job for job in jobs if not job.future.done()]
                if len(pending) == 1:
                    pending[0].future.set_exception(exc)
                    continue
                for job in pending:  # find the culprit: each job alone, so one bad job fails only itself
                    try:
                        self._encode_jobs([job])
                    except Exception as alone:
                        job.future.set_exception(alone)
