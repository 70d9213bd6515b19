"""The built-in server's batching, validation and HTTP behaviour, with a numpy stand-in for the encoder.

The stand-in's answer for a row depends only on that row's real tokens, so any leak of padding or any
mix-up of rows between concurrent requests shows. The real-model contract is in test_http_contract.py.
"""
from __future__ import annotations

import http.client
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from jaxllm.http.client import VLLMClient, VLLMError
from jaxllm.http.server import BatchingEncoder, EmbeddingService, bucket, make_http_server

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
@pytest.fixture(scope="module")
def server():
    encode = CountingEncode(fail_on=999)
    service = EmbeddingService("fake-model")
    httpd = make_http_server(service, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    # Not ready yet: health and embeddings say 503.
    with pytest.raises(VLLMError, match="HTTP 503.*loading"):
        VLLMClient(url).health()
    assert post(url, {"input": [[1]]})[0] == 503
    encoder = BatchingEncoder(encode, max_batch=16, max_len=MAX_LEN, max_wait_s=0.001)
    service.attach(encoder, vocab_size=VOCAB, max_model_len=MAX_LEN)
    service.ready.set()
    yield url
    httpd.shutdown()
    httpd.server_close()
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
    status, body = post(server, {"model": "anything", "input": [5, 6, 7]})
    assert status == 200
    assert body["object"] == "list" and body["model"] == "fake-model"
    assert body["usage"]["prompt_tokens"] == 3 == body["usage"]["total_tokens"]
    [item] = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0 and item["embedding"][:3] == [3, 18, 7]
    status, body = post(server, b"", path="/v1/models")
    assert status == 404


def test_models_listing(server):
    with VLLMClient(server) as client:
        [card] = client.models()
    assert card["id"] == "fake-model" and card["max_model_len"] == MAX_LEN and card["object"] == "model"


@pytest.mark.parametrize("payload, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "m"}, 400, "'input' is required"),
    ({"input": []}, 400, "'input' is empty"),
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
