"""The built-in server's batching, validation and HTTP behaviour, with a numpy stand-in for the encoder.

The stand-in's answer for a row depends only on that row's real tokens, so any leak of padding or any
mix-up of rows between concurrent requests shows. The real-model contract is in test_http_contract.py.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from jaxllm.http.batching import BatchingEncoder, bucket
from jaxllm.http.client import VLLMClient, VLLMError
from jaxllm.http.server import HTTPServer
from jaxllm.http.service import EmbeddingService, Limits, body_bytes_for

VOCAB = 1000
MAX_LEN = 100


def fake_encode(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[length, sum of real ids, last real id, B, T]: the last two reveal the padded shape."""
    rows = np.arange(ids.shape[0])
    mask = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    return np.stack([lengths, (ids * mask).sum(1), ids[rows, lengths - 1],
                     np.full_like(lengths, ids.shape[0]), np.full_like(lengths, ids.shape[1])], 1).astype(np.float32)


def expected(prompt):
    return [len(prompt), sum(prompt), prompt[-1]]


class CountingEncode:
    def __init__(self, fail_on: int | None = None):
        self.calls = 0
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def __call__(self, ids, lengths):
        with self.lock:
            self.calls += 1
        if self.fail_on is not None and self.fail_on in ids[np.arange(len(ids)), lengths - 1]:
            raise RuntimeError("encoder exploded")
        return fake_encode(ids, lengths)


def random_prompts(n, seed=0, max_len=MAX_LEN):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=rng.integers(1, max_len + 1)).tolist() for _ in range(n)]


def test_bucket():
    assert [bucket(n, 1, 64) for n in (1, 2, 3, 4, 5, 33, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, 64]
    assert bucket(3, 16, 100) == 16 and bucket(70, 16, 100) == 100
    quarter = [bucket(n, 16, 4096, per_octave=4) for n in (1, 17, 20, 21, 1024, 1025, 1280, 1281, 2047)]
    assert quarter == [16, 20, 20, 24, 1024, 1280, 1280, 1536, 2048]
    sizes = {bucket(n, 16, 40960, per_octave=4) for n in range(1, 40961)}
    assert len(sizes) <= 4 * 12 and all(s >= n for n, s in [(n, bucket(n, 16, 40960, 4)) for n in (5, 999, 40000)])


def test_encode_now_pads_to_power_of_two_buckets_and_keeps_order():
    encoder = BatchingEncoder(fake_encode, max_batch=8, max_len=MAX_LEN, min_len=16)
    prompts = random_prompts(37)
    got = encoder.encode_now(prompts)
    np.testing.assert_array_equal(got[:, :3], [expected(p) for p in prompts])
    for batch_b, batch_t in encoder.shapes_seen:
        assert batch_b in (1, 2, 4, 8) and batch_t in (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 100)
    assert (got[:, 3] <= 8).all()
    encoder.close()


def test_concurrent_requests_are_gathered_into_shared_calls():
    encode = CountingEncode()
    encoder = BatchingEncoder(encode, max_batch=64, max_len=MAX_LEN, max_wait_s=0.05)
    requests = [random_prompts(3, seed=s) for s in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda r: encoder.submit(r).result(timeout=10), requests))
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result[:, :3], [expected(p) for p in request])
    assert encode.calls < len(requests)  # 48 prompts from 16 requests in fewer encoder calls
    encoder.close()


# ----------------------------------------------------------------------------------- HTTP
REQUEST_TOKENS = 8 * MAX_LEN
TIMEOUT_S = 0.5  # header and body timeouts of the test server


@pytest.fixture(scope="module")
def server():
    encode = CountingEncode(fail_on=999)
    service = EmbeddingService("fake-model")
    httpd = HTTPServer(service, "127.0.0.1", 0, header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S).start()
    url = httpd.url
    # Not ready yet: health and embeddings say 503.
    with pytest.raises(VLLMError, match="HTTP 503.*loading"):
        VLLMClient(url).health()
    assert post(url, {"input": [[1]]})[0] == 503
    encoder = BatchingEncoder(encode, max_batch=16, max_len=MAX_LEN, max_wait_s=0.001)
    service.attach(encoder, vocab_size=VOCAB,
                   limits=Limits(MAX_LEN, 16 * 128, REQUEST_TOKENS, body_bytes_for(REQUEST_TOKENS)))
    service.ready.set()
    yield url
    httpd.stop()
    encoder.close()


def post(url, payload, path="/v1/embeddings"):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, response.read()
    conn.close()
    return status, json.loads(data) if data else None


def test_round_trip_through_the_client_in_both_encodings(server):
    prompts = random_prompts(40, seed=3)
    for fmt in ("float", "base64"):
        with VLLMClient(server, batch_size=7, max_concurrency=4, encoding_format=fmt) as client:
            assert client.health() is True
            got = client.embed(prompts)
            assert client.model == "fake-model"
        np.testing.assert_array_equal(got[:, :3], [expected(p) for p in prompts])


def test_response_has_vllm_shape_and_single_prompt_form(server):
    status, body = post(server, {"model": "fake-model", "input": [5, 6, 7]})
    assert status == 200
    assert body["object"] == "list" and body["model"] == "fake-model"
    assert body["usage"]["prompt_tokens"] == 3 == body["usage"]["total_tokens"]
    [item] = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0 and item["embedding"][:3] == [3, 18, 7]
    status, body = post(server, b"", path="/v1/models")
    assert status == 405 and "use GET" in body["error"]["message"]


def test_models_listing(server):
    with VLLMClient(server) as client:
        [card] = client.models()
    assert card["id"] == "fake-model" and card["max_model_len"] == MAX_LEN and card["object"] == "model"


@pytest.mark.parametrize("payload, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "fake-model"}, 400, "'input' is required"),
    ({"input": []}, 400, "'input' is empty"),
    ({"input": 5}, 400, "'input' must be a list of token-id lists .* got int"),
    ({"input": {"ids": [1]}}, 400, "'input' must be a list of token-id lists .* got dict"),
    ({"model": "other", "input": [[1]]}, 404, "model `other` does not exist"),
    ({"input": [[1] * MAX_LEN] * 9}, 413, f"{9 * MAX_LEN} tokens, over .* limit of {REQUEST_TOKENS}"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests JSON too deeply"),
    ({"input": "some text"}, 400, "token ids, not text"),
    ({"input": ["a", "b"]}, 400, "token ids, not text"),
    ({"input": [[1, 2], []]}, 400, r"input\[1\] must be a non-empty"),
    ({"input": [[1, 2.5]]}, 400, "must be integers"),
    ({"input": [[1, VOCAB]]}, 400, f"token id {VOCAB} outside the vocabulary"),
    ({"input": [[-1]]}, 400, "token id -1 outside"),
    ({"input": [[1] * (MAX_LEN + 1)]}, 400, f"maximum context length is {MAX_LEN} tokens"),
    ({"input": [[1]], "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": [[1]], "dimensions": 32}, 400, "'dimensions' is not supported"),
    ([1, 2], 400, "must be a JSON object"),
    ({"input": [[1, 999]]}, 500, "encoder exploded"),
])
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, payload, status, words):
    got_status, body = post(server, payload)
    assert got_status == status
    assert body["error"]["code"] == status
    assert re.search(words, body["error"]["message"]), body
    ok_status, ok_body = post(server, {"input": [[1, 2, 3]]})  # still serving
    assert ok_status == 200 and ok_body["data"][0]["embedding"][:3] == [3, 6, 3]


def test_unknown_routes(server):
    assert post(server, {"input": [[1]]}, path="/v1/completions")[0] == 404
    with VLLMClient(server, model="m") as client:
        with pytest.raises(VLLMError, match="HTTP 404"):
            client._request("GET", "/nothing", None, deadline=time.monotonic() + 5)


# ------------------------------------------------------------------------------ protocol edges (raw sockets)
def raw_exchange(url, data: bytes, read_s: float = 5.0) -> bytes:
    """Send raw bytes, return everything the server sends back until it closes (or ``read_s`` passes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except socket.timeout:
            pass
    return b"".join(chunks)


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), answer[:300]
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.parametrize("length", [b"-1", b"abc"])
def test_bad_content_length_is_a_json_400(server, length):
    answer = raw_exchange(server, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: " + length
                          + b"\r\n\r\n{\"input\": [[1]]}")
    status, error = status_and_error(answer)
    assert status == 400 and "malformed HTTP request" in error["message"]
    assert post(server, {"input": [[1, 2, 3]]})[0] == 200


def test_chunked_upload_is_supported(server):
    body = json.dumps({"input": [[4, 5]]}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
    answer = raw_exchange(server, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                          b"Connection: close\r\n\r\n" + chunked)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"200", answer[:300]
    assert json.loads(payload)["data"][0]["embedding"][:3] == [2, 9, 5]


def test_body_over_the_limit_is_413_before_it_is_read(server):
    answer = raw_exchange(server, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
    status, error = status_and_error(answer)
    assert status == 413 and "byte limit" in error["message"]


def test_unfinished_headers_and_bodies_time_out(server):
    started = time.monotonic()
    assert raw_exchange(server, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n", read_s=10) == b""  # closed, no answer
    status, error = status_and_error(raw_exchange(
        server, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"in", read_s=10))
    assert status == 408 and "did not arrive" in error["message"]
    assert time.monotonic() - started < 8  # both closed by the server, long before the client gave up


@pytest.mark.parametrize("method", ["PUT", "DELETE", "OPTIONS", "PATCH"])
def test_other_methods_get_a_json_405(server, method):
    status, error = status_and_error(raw_exchange(
        server, f"{method} /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()))
    assert status == 405 and "use POST" in error["message"]


def test_head_of_health_answers_without_a_body(server):
    answer = raw_exchange(server, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.split()[1] == b"200" and answer.endswith(b"\r\n\r\n")


def test_errors_do_not_echo_a_huge_bad_value(server):
    status, body = post(server, {"input": [[1, [0.5] * 100_000]], "encoding_format": "x" * 100_000})
    assert status == 400 and len(json.dumps(body)) < 500, len(json.dumps(body))
    status, body = post(server, {"input": [[1, [0.5] * 100_000]]})
    assert status == 400 and "token ids must be integers" in body["error"]["message"] and len(json.dumps(body)) < 500


def test_a_bad_request_batched_with_good_ones_fails_alone():
    """One worker gathers a job that makes the encoder fail together with good ones: only the bad one fails."""
    encode = CountingEncode(fail_on=999)
    encoder = BatchingEncoder(encode, max_batch=64, max_len=MAX_LEN, max_wait_s=0.5)
    good = [encoder.submit([[1, 2, 3]]), encoder.submit([[7] * 50, [8]])]
    bad = encoder.submit([[5, 999]])
    late_good = encoder.submit([[4]])
    with pytest.raises(RuntimeError, match="exploded"):
        bad.result(timeout=10)
    assert good[0].result(timeout=10)[0, :3].tolist() == [3, 6, 3]
    assert good[1].result(timeout=10)[:, :3].tolist() == [[50, 350, 7], [1, 8, 8]]
    assert late_good.result(timeout=10)[0, :3].tolist() == [1, 4, 4]
    assert encode.calls >= 2  # the shared call failed, then the jobs ran one at a time
    encoder.close()


def test_a_request_over_the_budget_beside_good_ones(server):
    """Concurrent good requests and over-budget ones: the good ones all get 200, the others 400/413."""
    payloads = [{"input": [[1] * (MAX_LEN + 1)]}, {"input": [[2] * MAX_LEN] * 9}] * 4 + [{"input": [[1, 2, 3]]}] * 8
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda p: post(server, p)[0], payloads))
    assert statuses[:8] == [400, 413] * 4 and statuses[8:] == [200] * 8


def test_calls_stay_within_the_batch_token_budget():
    encoder = BatchingEncoder(fake_encode, max_batch=64, max_len=MAX_LEN, min_len=16, max_batch_tokens=256)
    prompts = random_prompts(60, seed=5)
    got = encoder.encode_now(prompts)
    np.testing.assert_array_equal(got[:, :3], [expected(p) for p in prompts])
    assert all(b * t <= 256 for b, t in encoder.shapes_seen), encoder.shapes_seen
    with pytest.raises(ValueError, match="cannot hold one prompt"):
        BatchingEncoder(fake_encode, max_len=MAX_LEN, max_batch_tokens=64)


def test_many_concurrent_clients_without_retries_see_no_resets(server):
    """64 threads, each its own connection, plain http.client (no retry on reset): every request answered."""
    def one(i):
        return post(server, {"input": [[i % VOCAB + 1] * (i % 20 + 1)]})[0]
    with ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(one, range(256)))
    assert statuses == [200] * 256
