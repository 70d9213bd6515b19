"""VLLMClient against a fake server that replays vLLM's recorded response and error shapes.

The fixtures (tests/parity/fixtures/, see its README) are vLLM's documented shapes; the fake server
also misbehaves on purpose (503s, silence, dropped connections, a closed port) to test retries,
timeouts and error messages. No JAX here: these tests take about a second.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from jaxllm.http.client import VLLMClient, VLLMError, parse_embeddings, parse_error_message

FIXTURES = Path(__file__).parent / "parity" / "fixtures"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


EXPECTED = np.asarray(json.loads(fixture("expected_vectors.json")), dtype=np.float32)


class FakeServer:
    """A loopback HTTP server whose answer per (method, path) is a function of the request JSON.

    ``routes[(method, path)]`` is a callable ``payload -> (status, body_bytes)`` or the string
    ``"hang"`` (never answer) or ``"drop"`` (close the socket without answering). Every request is
    recorded in ``self.requests`` as ``(method, path, payload)``.
    """

    def __init__(self, routes):
        self.routes = routes
        self.requests: list[tuple[str, str, object]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                payload = json.loads(raw) if raw else None
                with outer._lock:
                    outer.requests.append((method, self.path, payload))
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    route = outer.routes.get((method, self.path))
                    if route == "hang":
                        outer._stop.wait(30)
                        return
                    if route == "drop":
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    status, body = route(payload) if route else (404, b'{"detail": "Not Found"}')
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                finally:
                    with outer._lock:
                        outer.in_flight -= 1

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(routes):
        server = FakeServer(routes)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def replay(name, status=200):
    return lambda payload: (status, fixture(name))


MODELS = {("GET", "/v1/models"): replay("models.json"), ("GET", "/health"): lambda p: (200, b"")}


def vector_of(ids):
    """What the dynamic fake server returns for a prompt: [length, sum, first, last]."""
    return [float(len(ids)), float(sum(ids)), float(ids[0]), float(ids[-1])]


def dynamic_embeddings(delay=0.0):
    def answer(payload):
        time.sleep(delay)
        data = [{"index": i, "object": "embedding", "embedding": vector_of(ids)} for i, ids in enumerate(payload["input"])]
        return 200, json.dumps({"object": "list", "model": payload["model"], "data": data[::-1]}).encode()
    return answer


# ----------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("name", ["embeddings_float.json", "embeddings_base64.json"])
def test_recorded_embedding_responses_parse_in_index_order(serve, name):
    server = serve({**MODELS, ("POST", "/v1/embeddings"): replay(name)})
    with VLLMClient(server.url) as client:
        got = client.embed([[1, 2], [3, 4, 5], [6]])
    assert got.dtype == np.float32 and got.shape == (3, 8)
    np.testing.assert_array_equal(got, EXPECTED)


def test_request_body_carries_ids_and_the_served_model_name(serve):
    server = serve({**MODELS, ("POST", "/v1/embeddings"): replay("embeddings_float.json")})
    with VLLMClient(server.url + "/v1/") as client:  # a trailing /v1/ is accepted
        client.embed(np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32))
        assert client.model == "Qwen/Qwen3-4B"
    method, path, payload = server.requests[-1]
    assert (method, path) == ("POST", "/v1/embeddings")
    assert payload == {"model": "Qwen/Qwen3-4B", "input": [[1, 2], [3, 4], [5, 6]], "encoding_format": "float"}


def test_models_and_health(serve):
    server = serve(MODELS)
    with VLLMClient(server.url) as client:
        assert client.health() is True
        cards = client.models()
    assert cards[0]["id"] == "Qwen/Qwen3-4B" and cards[0]["max_model_len"] == 40960


@pytest.mark.parametrize("payload, problem", [
    ({"data": [{"index": 0, "embedding": [1.0]}]}, "sent 2 prompts but got 1"),
    ({"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [2.0]}]}, "index 0"),
    ({"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [2.0, 3.0]}]}, "different lengths"),
    ({"data": [{"index": 0, "embedding": "not base64!"}, {"index": 1, "embedding": [2.0]}]}, "base64"),
    ({"object": "list"}, "'data' list"),
])
def test_malformed_responses_are_named(payload, problem):
    with pytest.raises(ValueError, match=problem):
        parse_embeddings(payload, expected=2)


def test_error_message_shapes():
    assert "maximum context length is 40960" in parse_error_message(fixture("error_too_long_nested.json"))
    assert "maximum context length is 40960" in parse_error_message(fixture("error_too_long_flat.json"))
    assert parse_error_message(b'{"detail": "Not Found"}') == '"Not Found"'
    assert parse_error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


# ----------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name, status", [("error_too_long_nested.json", 400), ("error_too_long_flat.json", 400),
                                          ("error_model_not_found.json", 404)])
def test_client_errors_name_url_status_and_message_without_retrying(serve, name, status):
    server = serve({**MODELS, ("POST", "/v1/embeddings"): replay(name, status)})
    with VLLMClient(server.url, retries=3, backoff=0.01) as client, pytest.raises(VLLMError) as info:
        client.embed([[1, 2, 3]])
    error = info.value
    assert error.status == status and error.url == server.url + "/v1/embeddings"
    message = json.loads(fixture(name)).get("error", json.loads(fixture(name)))["message"]
    assert message in str(error) and server.url in str(error) and f"HTTP {status}" in str(error)
    assert sum(1 for r in server.requests if r[1] == "/v1/embeddings") == 1


def test_transient_503_is_retried_then_succeeds(serve):
    answers = iter([(503, fixture("retryable_503.json"))] * 2)
    embeddings = dynamic_embeddings()
    server = serve({**MODELS, ("POST", "/v1/embeddings"): lambda p: next(answers, None) or embeddings(p)})
    with VLLMClient(server.url, retries=3, backoff=0.01) as client:
        got = client.embed([[4, 5, 6]])
    np.testing.assert_array_equal(got, [vector_of([4, 5, 6])])
    assert sum(1 for r in server.requests if r[1] == "/v1/embeddings") == 3


def test_persistent_503_gives_up_with_the_server_message(serve):
    server = serve({**MODELS, ("POST", "/v1/embeddings"): replay("retryable_503.json", 503)})
    with VLLMClient(server.url, retries=2, backoff=0.01) as client, pytest.raises(VLLMError, match="overloaded") as info:
        client.embed([[1]])
    assert info.value.status == 503 and "3 attempt(s)" in str(info.value)


def test_unreachable_server_fails_fast_with_a_clear_error():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with VLLMClient(f"http://127.0.0.1:{port}", model="m", timeout=2.0, backoff=0.05) as client:
        with pytest.raises(VLLMError, match="no HTTP response.*server running") as info:
            client.embed([[1, 2]])
        with pytest.raises(VLLMError):
            client.health()
    assert info.value.status is None and f":{port}/v1/embeddings" in str(info.value)
    assert time.monotonic() - start < 2.5


@pytest.mark.parametrize("behaviour, words", [("hang", "timed out"), ("drop", "RemoteDisconnected")])
def test_silent_or_vanishing_server_fails_within_the_timeout(serve, behaviour, words):
    server = serve({**MODELS, ("POST", "/v1/embeddings"): behaviour})
    start = time.monotonic()
    with VLLMClient(server.url, timeout=1.0, retries=5, backoff=0.05) as client, pytest.raises(VLLMError, match=words):
        client.embed([[1, 2]])
    assert time.monotonic() - start < 1.5


def test_bad_prompts_are_refused_before_sending():
    client = VLLMClient("http://127.0.0.1:9", model="m")
    with pytest.raises(TypeError, match="token ids, not strings"):
        client.embed(["a prompt"])
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        client.embed([[1], []])
    with pytest.raises(TypeError, match="integer token ids"):
        client.embed([[1.5, 2.0]])
    with pytest.raises(ValueError, match="url must look like"):
        VLLMClient("ftp://host")


# ----------------------------------------------------------------------------------- batching
def test_batches_run_concurrently_and_come_back_in_input_order(serve):
    server = serve({**MODELS, ("POST", "/v1/embeddings"): dynamic_embeddings(delay=0.05)})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, size=rng.integers(1, 9)).tolist() for _ in range(23)]
    with VLLMClient(server.url, batch_size=4, max_concurrency=3) as client:
        got = client.embed(prompts)
    np.testing.assert_array_equal(got, np.asarray([vector_of(p) for p in prompts], dtype=np.float32))
    sizes = [len(r[2]["input"]) for r in server.requests if r[1] == "/v1/embeddings"]
    assert sorted(sizes) == [3] + [4] * 5
    assert 2 <= server.max_in_flight <= 3


def test_one_failing_batch_fails_the_call(serve):
    embeddings = dynamic_embeddings()

    def answer(payload):
        if payload["input"][0] == [666]:
            return 400, fixture("error_too_long_nested.json")
        return embeddings(payload)

    server = serve({**MODELS, ("POST", "/v1/embeddings"): answer})
    with VLLMClient(server.url, batch_size=1, max_concurrency=4) as client, pytest.raises(VLLMError, match="HTTP 400"):
        client.embed([[1], [2], [666], [3]])
