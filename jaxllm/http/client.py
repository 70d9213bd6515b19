"""Client for servers that speak vLLM's OpenAI-style embeddings API.

It sends token ids (never strings, so tokenization cannot diverge from the in-scan encoder) and gets
back one vector per prompt. It talks to stock vLLM started by ``scripts/start_vllm.sh`` and to this
project's own server (``python -m jaxllm.http.server``), which speak the same subset:

    GET  /health          -> 200 once the model is ready
    GET  /v1/models       -> {"object": "list", "data": [{"id": ..., "max_model_len": ...}, ...]}
    POST /v1/embeddings   {"model": m, "input": [[ids], ...], "encoding_format": "float" | "base64"}
                          -> {"object": "list", "data": [{"index": i, "embedding": [...]}, ...], ...}

Only the standard library is used for HTTP. Requests are split into batches, sent by a bounded pool
of threads (one keep-alive connection per thread), retried with exponential backoff on transient
failures (connection errors, 408/429/5xx), and every failure ends in one ``VLLMError`` that names the
URL, the HTTP status and what the server said. Each batch finishes, succeeds or fails within
``timeout`` seconds, retries included, so a server that is down or goes away never hangs a caller.
"""
from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["VLLMClient", "VLLMError", "parse_embeddings", "parse_error_message"]

# Statuses worth another try: the server is busy, restarting or timed out; the request itself is fine.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class VLLMError(RuntimeError):
    """Any failure talking to an embeddings server.

    Attributes: ``url`` (the full URL of the failing request), ``status`` (HTTP status, or None when
    no HTTP answer came back: refused, reset, timed out) and ``server_message`` (what the server said,
    or the transport error).
    """

    def __init__(self, url: str, status: int | None, server_message: str, hint: str = ""):
        self.url = url
        self.status = status
        self.server_message = server_message
        where = f"HTTP {status}" if status is not None else "no HTTP response"
        text = f"{url}: {where}: {server_message}"
        if hint:
            text += f" ({hint})"
        super().__init__(text)


def parse_error_message(body: bytes) -> str:
    """The human-readable message of an error body, in any shape vLLM (or a proxy) sends.

    Handles vLLM >= 0.9's ``{"error": {"message", "type", "param", "code"}}``, older vLLM's flat
    ``{"object": "error", "message", "type", "param", "code"}``, FastAPI's ``{"detail": ...}`` and
    non-JSON bodies (returned as text, shortened).
    """
    text = body.decode("utf-8", errors="replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:500] if text else "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            kind = error.get("type")
            return f"{kind}: {error['message']}" if kind else str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in payload:
            kind = payload.get("type")
            return f"{kind}: {payload['message']}" if kind else str(payload["message"])
        if "detail" in payload:
            return json.dumps(payload["detail"])[:500]
    return text[:500]


def _decode_embedding(value: Any, where: str) -> np.ndarray:
    """One ``data[i].embedding``: a list of numbers, or base64 of little-endian float32."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ValueError(f"{where} is a string but not valid base64: {exc}") from None
        if len(raw) % 4:
            raise ValueError(f"{where}: base64 payload of {len(raw)} bytes is not whole float32 values")
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if isinstance(value, list) and value and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return np.asarray(value, dtype=np.float32)
    raise ValueError(f"{where} must be a non-empty list of numbers or a base64 string, got {type(value).__name__}")


def parse_embeddings(payload: Any, expected: int) -> np.ndarray:
    """The vectors of an embeddings response, ordered by ``index``, as float32 [expected, D].

    Raises ValueError naming what is wrong: not a dict, no ``data`` list, missing or duplicate
    indices, a count that differs from the number of prompts sent, or vectors of unequal length.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError(f"expected a JSON object with a 'data' list, got {str(payload)[:200]}")
    vectors: dict[int, np.ndarray] = {}
    for position, item in enumerate(payload["data"]):
        if not isinstance(item, dict) or "embedding" not in item:
            raise ValueError(f"data[{position}] has no 'embedding': {str(item)[:200]}")
        index = item.get("index", position)
        if not isinstance(index, int) or not 0 <= index < expected or index in vectors:
            raise ValueError(f"data[{position}] has index {index!r}: want each of 0..{expected - 1} exactly once")
        vectors[index] = _decode_embedding(item["embedding"], f"data[{position}].embedding")
    if len(vectors) != expected:
        raise ValueError(f"sent {expected} prompts but got {len(vectors)} embeddings back")
    dims = {v.shape[0] for v in vectors.values()}
    if len(dims) != 1:
        raise ValueError(f"embeddings have different lengths {sorted(dims)}")
    return np.stack([vectors[i] for i in range(expected)])


def _as_prompts(prompts: Sequence[Sequence[int]] | np.ndarray) -> list[list[int]]:
    """Validate and convert prompts to plain lists of Python ints (JSON-ready)."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], str)):
        raise TypeError("embed() takes token ids, not strings: tokenize first (e.g. render's template)")
    out = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"prompt {i} must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0:
            raise ValueError(f"prompt {i} has a negative token id {int(ids.min())}")
        out.append([int(x) for x in ids])
    return out


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes


class VLLMClient:
    """Gets last-token hidden states from a vLLM-compatible embeddings server.

    Args:
        url: server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model: model name to send; None asks ``/v1/models`` once and uses the first one listed.
        timeout: seconds a batch may take, retries and backoff included; also the socket timeout.
        max_concurrency: requests in flight at once.
        batch_size: prompts per request.
        retries: extra attempts after a transient failure (refused, reset, 408/429/5xx).
        backoff: first wait between attempts in seconds; doubles each time.
        encoding_format: "float" (JSON numbers) or "base64" (packed float32; smaller and faster).
    """

    def __init__(self, url: str, model: str | None = None, timeout: float = 60.0, max_concurrency: int = 8,
                 batch_size: int = 32, retries: int = 3, backoff: float = 0.25, encoding_format: str = "float"):
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url must look like http://host:port, got {url!r}")
        if timeout <= 0 or max_concurrency < 1 or batch_size < 1 or retries < 0 or backoff < 0:
            raise ValueError("need timeout > 0, max_concurrency >= 1, batch_size >= 1, retries >= 0, backoff >= 0; "
                             f"got {timeout}, {max_concurrency}, {batch_size}, {retries}, {backoff}")
        if encoding_format not in ("float", "base64"):
            raise ValueError(f"encoding_format must be 'float' or 'base64', got {encoding_format!r}")
        self._scheme = parsed.scheme
        self._host = parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._base_path = parsed.path.rstrip("/").removesuffix("/v1")
        self.url = f"{parsed.scheme}://{parsed.netloc}{self._base_path}"
        self.model = model
        self.timeout = float(timeout)
        self.max_concurrency = int(max_concurrency)
        self.batch_size = int(batch_size)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.encoding_format = encoding_format
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ----------------------------------------------------------------------------- public API
    def health(self) -> bool:
        """True when ``GET /health`` answers 200; raises VLLMError otherwise (unreachable, not ready)."""
        self._request("GET", "/health", None, deadline=time.monotonic() + self.timeout, retry=False)
        return True

    def wait_until_ready(self, wait_s: float = 300.0, poll_s: float = 0.5) -> None:
        """Poll ``/health`` until it answers 200; raise the last VLLMError after ``wait_s`` seconds."""
        stop = time.monotonic() + wait_s
        while True:
            try:
                self.health()
                return
            except VLLMError as exc:
                if time.monotonic() + poll_s > stop:
                    raise VLLMError(exc.url, exc.status, exc.server_message,
                                    f"still not ready after {wait_s:.0f} s") from None
                time.sleep(poll_s)

    def models(self) -> list[dict]:
        """The model cards of ``GET /v1/models`` (each has at least ``id``)."""
        path = "/v1/models"
        body = self._request("GET", path, None, deadline=time.monotonic() + self.timeout)
        payload = self._json(path, body)
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list) or not all(isinstance(card, dict) and "id" in card for card in data):
            raise VLLMError(self.url + path, 200, f"expected {{'data': [{{'id': ...}}, ...]}}, got {str(payload)[:200]}")
        return data

    def embed(self, prompts: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """One vector per prompt (token-id lists, unpadded), as float32 [N, D] in input order."""
        prompts = _as_prompts(prompts)
        if not prompts:
            raise ValueError("embed() got no prompts")
        model = self._resolve_model()
        batches = [prompts[i:i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]
        if len(batches) == 1:
            return self._embed_batch(model, batches[0])
        pool = self._executor()
        futures = [pool.submit(self._embed_batch, model, batch) for batch in batches]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                for other in pending:
                    other.cancel()
                raise future.exception()
        return np.concatenate([f.result() for f in futures])

    def close(self) -> None:
        """Close the pool and every open connection."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()

    def __enter__(self) -> "VLLMClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="vllm-client")
        return self._pool

    def _resolve_model(self) -> str:
        if self.model is None:
            cards = self.models()
            if not cards:
                raise VLLMError(self.url + "/v1/models", 200, "the server lists no models")
            self.model = str(cards[0]["id"])
        return self.model

    def _embed_batch(self, model: str, batch: list[list[int]]) -> np.ndarray:
        path = "/v1/embeddings"
        request = {"model": model, "input": batch, "encoding_format": self.encoding_format}
        body = self._request("POST", path, json.dumps(request).encode(), deadline=time.monotonic() + self.timeout)
        try:
            return parse_embeddings(self._json(path, body), len(batch))
        except ValueError as exc:
            raise VLLMError(self.url + path, 200, f"malformed embeddings response: {exc}") from None

    def _json(self, path: str, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise VLLMError(self.url + path, 200, f"response is not JSON: {body[:200]!r}") from None

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)

    def _send_once(self, method: str, path: str, body: bytes | None, socket_timeout: float) -> _Answer:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        for fresh_try in (False, True):
            conn = self._connection()
            reused = conn.sock is not None
            conn.timeout = socket_timeout
            if reused:
                conn.sock.settimeout(socket_timeout)
            try:
                conn.request(method, self._base_path + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop_connection()
                if not reused or fresh_try:  # a kept-alive socket the server had closed: one fresh try
                    raise
            except BaseException:
                self._drop_connection()
                raise
        if response.will_close:
            self._drop_connection()
        return _Answer(response.status, data)

    def _request(self, method: str, path: str, body: bytes | None, deadline: float, retry: bool = True) -> bytes:
        """Send with retries until success, a non-retryable answer, or the deadline; return the body."""
        url = self.url + path
        attempts = (self.retries + 1) if retry else 1
        wait_s = self.backoff
        last: VLLMError | None = None
        for attempt in range(attempts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                answer = self._send_once(method, path, body, remaining)
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, closed mid-answer
                reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                last = VLLMError(url, None, reason)
            else:
                if 200 <= answer.status < 300:
                    return answer.body
                last = VLLMError(url, answer.status, parse_error_message(answer.body))
                if answer.status not in RETRYABLE_STATUSES:
                    raise last
            if attempt + 1 < attempts and time.monotonic() + wait_s < deadline:
                time.sleep(wait_s)
                wait_s *= 2
            else:
                break
        if last is None:
            last = VLLMError(url, None, "no answer before the deadline")
        hint = f"gave up after {attempt + 1} attempt(s) within the {self.timeout:g} s timeout"
        if last.status is None:
            hint = "is the server running and reachable? " + hint
        raise VLLMError(last.url, last.status, last.server_message, hint)
