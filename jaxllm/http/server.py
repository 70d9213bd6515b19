"""A server of vLLM's embeddings API subset in front of the project's own JAX encoder (Starlette on uvicorn).

    python -m jaxllm.http.server --model tiny --dtype float32 --port 8000 [--host 127.0.0.1 --layer -1 --pooling last]

It answers the requests ``jaxllm.http.client.VLLMClient`` sends to stock vLLM, with the same response and error
shapes (vLLM >= 0.10.1), so the trainer's ``--encoder vllm`` and the parity suite run end-to-end on
machines without vLLM, and so the cost of the HTTP round trip can be measured next to the in-scan path:

    GET  /health         200 (empty body) once the model is loaded and compiled; 503 before
    GET  /v1/models      {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": n, ...}]}
    POST /v1/embeddings  {"model": name or absent, "input": [[ids], ...] or [ids], "encoding_format": "float" | "base64"}

HTTP parsing, keep-alive, chunked bodies, the listen backlog and method routing are uvicorn's (h11) and
Starlette's, as in vLLM. This module adds: every error as vLLM's JSON error body (protocol errors included),
a timeout for a connection's request headers and for its body, the body limit, and the request limits of
``jaxllm.http.service`` (defaults fit the device's memory). Concurrent requests are gathered by one worker
thread (``jaxllm.http.batching.BatchingEncoder``) into bucketed encoder calls; bad requests get a 4xx and
never fail the requests batched beside them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import threading
import time
from typing import Any

import anyio
import h11
import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from .batching import BatchingEncoder, EncodeFn, bucket
from .service import EmbeddingService, Limits, RequestError, body_bytes_for, default_limits, free_device_memory

__all__ = ["HTTPServer", "build_app", "build_encode_fn", "main"]

LOG_PREFIX = "[jaxllm.http.server]"
ROUTES_TEXT = "routes: GET /health, GET /v1/models, POST /v1/embeddings"


def _log(message: str) -> None:
    print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def _error_response(error: RequestError, request: Request | None = None, log: bool = True) -> JSONResponse:
    if log:
        where = f"{request.method} {request.url.path}: " if request is not None else ""
        _log(f"{where}{error.status} {error.message}")
    headers = {"Connection": "close"} if error.status in (408, 413) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body (Content-Length or chunked), refused with 413 past ``limit`` bytes and 408 past
    ``timeout_s`` seconds. h11 has already refused a Content-Length that is not a decimal number (400)."""
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes is over this server's {limit}-byte limit; "
                                "send fewer prompts per request")
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(413, f"request body is over this server's {limit}-byte limit; send fewer "
                                            "prompts per request")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {timeout_s:g} s",
                           kind="RequestTimeoutError") from None
    return b"".join(chunks)


def _decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError(400, "the request body nests JSON too deeply") from None
    except ValueError as exc:
        raise RequestError(400, f"the request body is not valid JSON ({str(exc)[:200]})") from None


def build_app(service: EmbeddingService, body_timeout_s: float = 30.0) -> Starlette:
    """The ASGI app: vLLM's routes on ``service``, every answer JSON (errors in vLLM's error shape)."""

    async def health(request: Request) -> Response:
        if service.ready.is_set():
            return Response(status_code=200)
        # not logged: clients poll this while the model loads
        return _error_response(RequestError(503, "the model is still loading or compiling",
                                            kind="ServiceUnavailableError"), log=False)

    async def models(request: Request) -> Response:
        return JSONResponse(service.models())

    async def embeddings(request: Request) -> Response:
        try:
            raw = await _read_body(request, service.max_body_bytes, body_timeout_s)
            service.check_ready()
            prompts, fmt = await run_in_threadpool(lambda: service.parse_prompts(_decode_json(raw)))
            vectors = await asyncio.wrap_future(service.encoder.submit(prompts))
            body = await run_in_threadpool(lambda: json.dumps(service.response(vectors, prompts, fmt)).encode())
            return Response(body, media_type="application/json")
        except RequestError as error:
            return _error_response(error, request)
        except Exception as exc:  # an encoder failure is the server's fault: 500, keep serving
            return _error_response(RequestError(500, f"{type(exc).__name__}: {str(exc)[:500]}",
                                                kind="InternalServerError"), request)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            allowed = " or ".join(m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip() != "HEAD")
            error = RequestError(405, f"method {request.method} is not allowed on {request.url.path}; use "
                                      f"{allowed or 'GET or POST'} ({ROUTES_TEXT})", kind="MethodNotAllowed")
        elif exc.status_code == 404:
            error = RequestError(404, f"no route {request.method} {request.url.path!r}; {ROUTES_TEXT}",
                                 kind="NotFoundError")
        else:
            error = RequestError(exc.status_code, str(exc.detail))
        response = _error_response(error, request)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/embeddings", embeddings, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _protocol_class(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with JSON 400s and a deadline for each request's headers.

    uvicorn times out idle keep-alive connections but not a client that opens a connection (or starts the next
    request) and never finishes its headers; this closes such a connection ``header_timeout_s`` seconds later.
    It uses H11Protocol's attributes (``cycle``, ``conn``, ``loop``, ``transport``); tests/test_http_server.py
    checks both behaviours, so a uvicorn release that changes them fails there.
    """

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            waiting_after = self.cycle  # the request that must not still be the latest one at the deadline
            self.loop.call_later(header_timeout_s, self._header_deadline, waiting_after)

        def _header_deadline(self, waiting_after) -> None:
            no_new_request = self.cycle is waiting_after and (waiting_after is None or waiting_after.response_complete)
            if no_new_request and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(RequestError(400, f"malformed HTTP request: {msg} (check Content-Length and the "
                                                "request line and headers)").body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol


class HTTPServer:
    """``service`` served by uvicorn in a background thread. The socket is bound at construction (a taken port
    fails at once); ``start()`` serves, ``stop()`` stops.

    header_timeout_s: a connection must finish each request's headers within this; body_timeout_s: the body;
    keep_alive_s: an idle keep-alive connection is closed after this; backlog: the listen queue;
    max_connections: open connections and requests in progress beyond which new requests get 503.
    """

    def __init__(self, service: EmbeddingService, host: str = "127.0.0.1", port: int = 8000, *,
                 header_timeout_s: float = 10.0, body_timeout_s: float = 30.0, keep_alive_s: float = 5.0,
                 backlog: int = 2048, max_connections: int = 1024):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=backlog)
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(build_app(service, body_timeout_s), http=_protocol_class(header_timeout_s),
                                lifespan="off", access_log=False, log_config=None, log_level="warning", backlog=backlog,
                                timeout_keep_alive=keep_alive_s, limit_concurrency=max_connections,
                                server_header=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, wait_s: float = 30.0) -> "HTTPServer":
        """Serve in a daemon thread; returns once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + wait_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop accepting, let requests in progress finish (up to ``wait_s``), close the socket."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=wait_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout=2)
        self.socket.close()

    def __enter__(self) -> "HTTPServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------------------- CLI
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help as the project's other commands show it (rl.cli.HelpFormatter): 120 columns, every option's default
    after its help, none for required options and flags."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=120)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or not action.option_strings or "(default" in text or action.default is False or \
                action.default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            return text
        return f"{text} (default: {'none' if action.default is None else action.default})"


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line (as in rl.cli.Parser), not the usage first."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m jaxllm.http.server", description=__doc__.split("\n\n")[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint dir, preset ('tiny', 'qwen3-4b') or hub id (downloaded once)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=8000, metavar="N", help="TCP port to listen on (0..65535)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="model dtype (none: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--layer", type=int, default=-1, help="hidden-state index to return (HF numbering; -1 = final)")
    parser.add_argument("--pooling", choices=["last", "mean"], default="last",
                        help="how a prompt's token states become one vector: last token or mean")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models (none: --model)")
    parser.add_argument("--max-batch", type=int, default=64, help="prompts per encoder call (rounded to a power of 2)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt accepted, 400 above it (none: what fits the device's free memory, "
                             "at most the model's max_position_embeddings)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="padded tokens (batch x length) per encoder call (none: what fits the device)")
    parser.add_argument("--max-request-tokens", type=int, default=None,
                        help="tokens per request, 413 above it (none: --max-batch x --max-model-len)")
    parser.add_argument("--len-buckets-per-octave", type=int, default=2,
                        help="padded lengths per doubling: fewer compiles (1) or less padding (4)")
    parser.add_argument("--warmup-len", type=int, default=0,
                        help="compile every batch size for lengths up to this before /health says ready")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="how long to gather concurrent requests")
    parser.add_argument("--header-timeout", type=float, default=10.0, help="seconds to finish a request's headers")
    parser.add_argument("--body-timeout", type=float, default=30.0, help="seconds to finish a request's body")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="open connections beyond which new requests get 503")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init for presets")
    for action in parser._actions:  # placeholders as in rl.train: N, X, TEXT
        if action.option_strings and action.metavar is None and action.choices is None and action.nargs != 0:
            action.metavar = {int: "N", float: "X"}.get(action.type, "TEXT")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be a TCP port number from 0 to 65535 (0: any free port), got {args.port}")
    for flag in ("max_batch", "max_model_len", "max_num_batched_tokens", "max_request_tokens", "len_buckets_per_octave",
                 "max_connections"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return args


def build_encode_fn(model: Any, layer: int, pooling: str) -> EncodeFn:
    """(ids, lengths) -> float32 [B, D] through ``model.encode`` (jitted there) with layer and pooling fixed."""

    def encode_fn(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(model.encode(ids, lengths, layer=layer, pooling=pooling))

    return encode_fn


def resolve_limits(args: argparse.Namespace, config: Any, dtype: Any, max_batch: int) -> Limits:
    """The limits in force: the flags given, the device-fitting defaults for the rest."""
    from jaxllm.model import default_attention_impl

    quadratic = not default_attention_impl(dtype).startswith("cudnn")
    auto = default_limits(config, free_device_memory(), quadratic_attention=quadratic, max_batch=max_batch,
                          per_octave=args.len_buckets_per_octave)
    max_len = min(args.max_model_len or auto.max_model_len, config.max_position_embeddings)
    request_tokens = args.max_request_tokens or max(max_batch * max_len, max_len)
    try:
        return Limits(max_len, args.max_num_batched_tokens or max(auto.max_batch_tokens, max_len), request_tokens,
                      body_bytes_for(request_tokens))
    except ValueError as exc:
        raise SystemExit(f"{LOG_PREFIX} {exc} (set --max-model-len / --max-request-tokens)") from None


def warm_up(encoder: BatchingEncoder, max_len: int) -> int:
    """Compile every (batch bucket, length bucket) with length <= ``max_len`` (at least the smallest); the count."""
    lengths = sorted({encoder.padded_shape(1, t)[1] for t in range(1, max(max_len, 1) + 1)})
    batches = sorted({encoder.padded_shape(b, 1)[0] for b in range(1, encoder.max_batch + 1)})
    shapes = [(b, t) for t in lengths for b in batches if b * t <= encoder.max_batch_tokens] if max_len else [(1, 1)]
    for b, t in shapes:
        encoder.encode_call([[0] * t] * b)
    return len(shapes)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)

    from jaxllm import load_model

    # Bind first, so a taken port fails at once; /health answers 503 while the model loads and compiles.
    service = EmbeddingService(args.served_model_name or args.model)
    try:
        server = HTTPServer(service, args.host, args.port, header_timeout_s=args.header_timeout,
                            body_timeout_s=args.body_timeout, max_connections=args.max_connections)
    except OSError as exc:
        raise SystemExit(f"{LOG_PREFIX} cannot listen on {args.host}:{args.port}: {exc} "
                         "(is another server using the port? pick another with --port)") from None
    server.start()
    _log(f"listening on {server.url}; loading {args.model}")
    started = time.monotonic()
    try:
        model = load_model(args.model, dtype=args.dtype, seed=args.seed)
    except (OSError, ValueError) as exc:  # missing/corrupt checkpoint, unknown preset, bad dtype
        server.stop()
        raise SystemExit(f"{LOG_PREFIX} cannot load --model {args.model!r}: {exc}") from None
    config = model.config
    max_batch = bucket(args.max_batch, 1, 1 << 30)
    limits = resolve_limits(args, config, model.dtype, max_batch)
    try:
        encoder = BatchingEncoder(build_encode_fn(model, args.layer, args.pooling), max_batch=max_batch,
                                  max_len=limits.max_model_len, max_wait_s=args.max_wait_ms / 1000,
                                  len_buckets_per_octave=args.len_buckets_per_octave,
                                  max_batch_tokens=limits.max_batch_tokens)
    except ValueError as exc:
        server.stop()
        raise SystemExit(f"{LOG_PREFIX} {exc} (--max-num-batched-tokens / --max-model-len)") from None
    service.attach(encoder, vocab_size=config.vocab_size, limits=limits)
    compiled = warm_up(encoder, min(args.warmup_len, limits.max_model_len))
    service.ready.set()
    _log(f"ready: model={service.model_name} dtype={np.dtype(model.dtype).name} layer={args.layer} "
         f"pooling={args.pooling} max_batch={max_batch} max_model_len={limits.max_model_len} "
         f"max_num_batched_tokens={limits.max_batch_tokens} max_request_tokens={limits.max_request_tokens} "
         f"({compiled} shapes compiled; load + compile {time.monotonic() - started:.1f} s)")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    _log("shutting down")
    server.stop()
    encoder.close()


if __name__ == "__main__":
    main()
