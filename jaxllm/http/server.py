"""A small server of vLLM's embeddings API subset in front of the project's own JAX encoder.

    python -m jaxllm.http.server --model tiny --dtype float32 --port 8000 [--host 127.0.0.1 --layer -1 --pooling last]

It answers the requests ``jaxllm.http.client.VLLMClient`` sends to stock vLLM, with the same response and error
shapes (vLLM >= 0.10.1), so the trainer's ``--encoder vllm`` and the parity suite run end-to-end on
machines without vLLM, and so the cost of the HTTP round trip can be measured next to the in-scan path:

    GET  /health         200 (empty body) once the model is loaded and compiled; 503 before
    GET  /v1/models      {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": n, ...}]}
    POST /v1/embeddings  {"model": any, "input": [[ids], ...] or [ids], "encoding_format": "float" | "base64"}

Concurrent requests are gathered by one worker thread (``BatchingEncoder``) into a single encoder call:
prompts are sorted by length, cut into batches of at most ``max_batch``, and each batch is right-padded to
a bucketed shape (batch rounded up to a power of two, length to one of four sizes per power of two) so the
number of compiled shapes stays small. Bad requests get a 4xx with a JSON error body and the server keeps serving.
"""
from __future__ import annotations

import argparse
import base64
import json
import queue
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np

__all__ = ["BatchingEncoder", "EmbeddingService", "RequestError", "bucket", "make_http_server", "main"]

EncodeFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(ids int32 [B, T] right-padded, lengths int32 [B]) -> float32 [B, D]."""

MAX_BODY_BYTES = 256 * 1024 * 1024


def bucket(n: int, minimum: int, maximum: int, per_octave: int = 1) -> int:
    """``n`` rounded up to the next of ``per_octave`` evenly spaced sizes per power of two, within [minimum, maximum].

    per_octave=1 gives powers of two; per_octave=4 gives ..., 1024, 1280, 1536, 1792, 2048, ... (at most 25%
    padding, still only 4 shapes per doubling).
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

    ``submit(prompts)`` returns a Future of float32 [len(prompts), D]. A worker thread takes the first
    waiting job, keeps gathering jobs for up to ``max_wait_s`` or until ``max_batch`` prompts are
    waiting, then encodes them all (several calls when more than ``max_batch`` prompts are waiting).
    """

    def __init__(self, encode_fn: EncodeFn, *, max_batch: int = 64, max_len: int = 40960, min_len: int = 16,
                 max_wait_s: float = 0.002, pad_id: int = 0, len_buckets_per_octave: int = 4):
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
        self.shapes_seen: set[tuple[int, int]] = set()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="batching-encoder", daemon=True)
        self._worker.start()

    def padded_shape(self, batch: int, longest: int) -> tuple[int, int]:
        """The bucketed (B, T) a batch of ``batch`` prompts with longest ``longest`` is padded to."""
        return (bucket(batch, 1, self.max_batch),
                bucket(longest, self.min_len, self.max_len, self.len_buckets_per_octave))

    def encode_now(self, prompts: list[list[int]]) -> np.ndarray:
        """Encode in the calling thread (for warm-up and tests); same padding as the worker."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[np.ndarray | None] = [None] * len(prompts)
        for start in range(0, len(order), self.max_batch):
            chunk = order[start:start + self.max_batch]
            batch_b, batch_t = self.padded_shape(len(chunk), len(prompts[chunk[-1]]))
            ids = np.full((batch_b, batch_t), self.pad_id, dtype=np.int32)
            lengths = np.ones((batch_b,), dtype=np.int32)  # padding rows: one pad token, result dropped
            for row, i in enumerate(chunk):
                ids[row, :len(prompts[i])] = prompts[i]
                lengths[row] = len(prompts[i])
            self.shapes_seen.add((batch_b, batch_t))
            vectors = np.asarray(self.encode_fn(ids, lengths), dtype=np.float32)
            for row, i in enumerate(chunk):
                out[i] = vectors[row]
        return np.stack(out)

    def submit(self, prompts: list[list[int]]) -> Future:
        future: Future = Future()
        self._jobs.put(_Job(prompts, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=10)

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

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._jobs.get()
            if first is None:
                break
            jobs, stop = self._gather(first)
            jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
            try:
                vectors = self.encode_now([p for job in jobs for p in job.prompts])
            except Exception as exc:  # the encoder failed: every waiting request hears about it
                for job in jobs:
                    job.future.set_exception(exc)
                continue
            start = 0
            for job in jobs:
                job.future.set_result(vectors[start:start + len(job.prompts)])
                start += len(job.prompts)


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, vLLM error ``kind`` and a message for the caller."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


TEXT_REFUSAL = ("this server takes token ids, not text: send 'input' as a list of token-id lists "
                "(tokenize with the model's tokenizer first, e.g. render's template)")


class EmbeddingService:
    """The HTTP-independent part of the server: validation, batching, response bodies.

    It can exist before the model does (the server answers /health with 503 while loading): ``attach``
    the encoder once the model is loaded, then set ``ready`` after warm-up.
    """

    def __init__(self, model_name: str, encoder: BatchingEncoder | None = None, *, vocab_size: int = 0,
                 max_model_len: int = 0):
        self.model_name = model_name
        self.encoder = encoder
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.ready = threading.Event()
        self.created = int(time.time())

    def attach(self, encoder: BatchingEncoder, vocab_size: int, max_model_len: int) -> None:
        """Plug in the loaded model's encoder and limits (``ready`` stays unset until the caller sets it)."""
        self.encoder, self.vocab_size, self.max_model_len = encoder, vocab_size, max_model_len

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxllm",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len or None, "permission": []}
        return {"object": "list", "data": [card]}

    def parse_prompts(self, request: Any) -> tuple[list[list[int]], str]:
        """Validated prompts and encoding format of a decoded request body; RequestError when bad."""
        if not isinstance(request, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(request).__name__}")
        if "input" not in request:
            raise RequestError(400, "'input' is required: a list of token-id lists", param="input")
        raw = request["input"]
        fmt = request.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise RequestError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
        for unsupported in ("dimensions", "truncate_prompt_tokens"):
            if request.get(unsupported) is not None:
                raise RequestError(400, f"'{unsupported}' is not supported by this server", param=unsupported)
        if isinstance(raw, str) or (isinstance(raw, list) and any(isinstance(x, str) for x in raw)):
            raise RequestError(400, TEXT_REFUSAL, param="input")
        if not isinstance(raw, list) or not raw:
            raise RequestError(400, "'input' is empty: send at least one non-empty token-id list", param="input")
        prompts = [raw] if all(not isinstance(x, list) for x in raw) else raw
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not prompt:
                raise RequestError(400, f"input[{i}] must be a non-empty list of token ids", param="input")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                bad = next(t for t in prompt if not isinstance(t, int) or isinstance(t, bool))
                if isinstance(bad, str):
                    raise RequestError(400, TEXT_REFUSAL, param="input")
                raise RequestError(400, f"input[{i}] holds {bad!r}; token ids must be integers", param="input")
            low, high = min(prompt), max(prompt)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise RequestError(400, f"input[{i}] has token id {bad} outside the vocabulary [0, {self.vocab_size})",
                                   param="input")
            if len(prompt) > self.max_model_len:
                raise RequestError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                   f"you requested {len(prompt)} tokens in the input for embedding generation "
                                   f"(input[{i}]). Please reduce the length of the input.", param="input")
        return prompts, fmt

    def embeddings(self, request: Any, timeout: float | None = None) -> dict:
        """The response body of ``POST /v1/embeddings`` (raises RequestError for bad input)."""
        if not self.ready.is_set():
            raise RequestError(503, "the model is still loading or compiling; poll GET /health",
                               kind="ServiceUnavailableError")
        prompts, fmt = self.parse_prompts(request)
        vectors = self.encoder.submit(prompts).result(timeout=timeout)
        if fmt == "base64":
            encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            encoded = [v.tolist() for v in vectors]
        tokens = sum(len(p) for p in prompts)
        return {"id": f"embd-{time.time_ns():x}", "object": "list", "created": int(time.time()),
                "model": self.model_name,
                "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(encoded)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


def make_http_server(service: EmbeddingService, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer (not yet serving) that routes vLLM's API subset to ``service``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses one connection per thread
        server_version = "jaxllm-serve"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes; without TCP_NODELAY, Nagle's algorithm holds the body back
            # until the client's delayed ACK (~40 ms per response on Linux).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, fmt, *args):  # one line per error only; successful requests are silent
            pass

        def _send(self, status: int, payload: dict | None) -> None:
            body = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, error: RequestError) -> None:
            sys.stderr.write(f"[jaxllm.http.server] {self.command} {self.path}: {error.status} {error.message}\n")
            self._send(error.status, error.body())

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/health":
                if service.ready.is_set():
                    self._send(200, None)
                else:  # not logged: clients poll this while the model loads
                    self._send(503, RequestError(503, "the model is still loading or compiling",
                                                 kind="ServiceUnavailableError").body())
            elif path == "/v1/models":
                self._send(200, service.models())
            elif path == "/v1/embeddings":
                self._error(RequestError(405, "use POST for /v1/embeddings", kind="MethodNotAllowed"))
            else:
                self._error(RequestError(404, f"no route {path!r}; routes: GET /health, GET /v1/models, "
                                              "POST /v1/embeddings", kind="NotFoundError"))

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self._error(RequestError(413, f"request body of {length} bytes is over the {MAX_BODY_BYTES} limit; "
                                              "send fewer prompts per request"))
                return
            raw = self.rfile.read(length) if length else b""
            if path != "/v1/embeddings":
                self._error(RequestError(404, f"no route POST {path!r}; use POST /v1/embeddings", kind="NotFoundError"))
                return
            try:
                try:
                    request = json.loads(raw)
                except ValueError as exc:
                    raise RequestError(400, f"the request body is not valid JSON ({exc})") from None
                self._send(200, service.embeddings(request))
            except RequestError as error:
                self._error(error)
            except Exception as exc:  # an encoder failure is the server's fault: 500, keep serving
                self._error(RequestError(500, f"{type(exc).__name__}: {exc}", kind="InternalServerError"))

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


# --------------------------------------------------------------------------------------- CLI
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jaxllm.http.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint dir, preset ('tiny', 'qwen3-4b') or cached hub id")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--layer", type=int, default=-1, help="hidden-state index to return (HF numbering; -1 = final)")
    parser.add_argument("--pooling", choices=["last", "mean"], default="last")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models (default: --model)")
    parser.add_argument("--max-batch", type=int, default=64, help="prompts per encoder call (rounded to a power of 2)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt accepted (default: the model's max_position_embeddings)")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="how long to gather concurrent requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init for presets")
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        parser.error(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be >= 1, got {args.max_model_len}")
    return args


def build_encode_fn(model: Any, layer: int, pooling: str) -> EncodeFn:
    """(ids, lengths) -> float32 [B, D] through ``model.encode`` (jitted there) with layer and pooling fixed."""

    def encode_fn(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(model.encode(ids, lengths, layer=layer, pooling=pooling))

    return encode_fn


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    log = lambda msg: print(f"[jaxllm.http.server] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    from jaxllm import load_model

    # Bind first, so a taken port fails at once; /health answers 503 while the model loads and compiles.
    service = EmbeddingService(args.served_model_name or args.model)
    try:
        server = make_http_server(service, args.host, args.port)
    except OSError as exc:
        raise SystemExit(f"[jaxllm.http.server] cannot listen on {args.host}:{args.port}: {exc} "
                         "(is another server using the port? pick another with --port)") from None
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log(f"listening on http://{args.host}:{server.server_address[1]}; loading {args.model}")
    started = time.monotonic()
    try:
        model = load_model(args.model, dtype=args.dtype, seed=args.seed)
    except (OSError, ValueError) as exc:  # missing/corrupt checkpoint, unknown preset, bad dtype
        server.server_close()
        raise SystemExit(f"[jaxllm.http.server] cannot load --model {args.model!r}: {exc}") from None
    config = model.config
    max_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    max_batch = bucket(args.max_batch, 1, 1 << 30)
    encoder = BatchingEncoder(build_encode_fn(model, args.layer, args.pooling), max_batch=max_batch,
                              max_len=max_len, max_wait_s=args.max_wait_ms / 1000)
    service.attach(encoder, vocab_size=config.vocab_size, max_model_len=max_len)
    encoder.encode_now([[0]])  # compile the smallest bucket before /health says ready
    service.ready.set()
    log(f"ready: model={service.model_name} dtype={np.dtype(model.dtype).name} layer={args.layer} pooling={args.pooling} "
        f"max_batch={max_batch} max_model_len={max_len} (load + compile {time.monotonic() - started:.1f} s)")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log("shutting down")
    server.shutdown()
    server.server_close()
    encoder.close()


if __name__ == "__main__":
    main()
