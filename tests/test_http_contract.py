"""The contract: `python -m jaxllm.http.server --model tiny --dtype float32 --port P` answers what
`load_model("tiny", dtype="float32").encode(...)` (layer -1, pooling last) gives for the same ids,
refuses bad input with a 4xx while it keeps serving, and a client sees a clear error when it goes away.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from jaxllm import load_model
from jaxllm.http.client import VLLMClient, VLLMError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(start_tiny_server):
    return start_tiny_server()


@pytest.fixture(scope="module")
def reference():
    return load_model("tiny", dtype="float32")


def post_json(url: str, payload) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_contract_answers_equal_model_encode(server, reference):
    url, _ = server
    rng = np.random.default_rng(0)
    lengths = [1, 2, 7, 16, 17, 40, 100]
    prompts = [rng.integers(0, reference.config.vocab_size, size=n).tolist() for n in lengths]
    status, body = post_json(url, {"model": "tiny", "input": prompts})
    assert status == 200
    served = np.asarray([item["embedding"] for item in sorted(body["data"], key=lambda d: d["index"])], np.float32)

    ids = np.zeros((len(prompts), max(lengths)), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    want = np.asarray(reference.encode(ids, np.asarray(lengths, np.int32), layer=-1, pooling="last"))
    assert served.shape == want.shape == (len(prompts), reference.config.hidden_size)
    # Same f32 computation; only the padded shape differs (bucketed on the server), so rounding-level gaps.
    np.testing.assert_allclose(served, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_client_path_and_bad_input_keep_serving(server, reference):
    url, _ = server
    vocab = reference.config.vocab_size
    status, body = post_json(url, {"input": [[1, vocab]]})
    assert status == 400 and f"token id {vocab} outside the vocabulary" in body["error"]["message"]
    status, body = post_json(url, {"input": "text"})
    assert status == 400 and "token ids, not text" in body["error"]["message"]
    with VLLMClient(url, batch_size=2, max_concurrency=3, encoding_format="base64") as client:
        got = client.embed([[5], [6, 7], [8, 9, 10]])
    want = [np.asarray(reference.encode(np.asarray([p]), np.asarray([len(p)])))[0] for p in ([5], [6, 7], [8, 9, 10])]
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-6)


def test_server_going_away_gives_a_clear_error_within_the_timeout(server):
    url, proc = server
    proc.terminate()
    proc.wait(timeout=30)
    start = time.monotonic()
    with VLLMClient(url, model="tiny", timeout=3.0, backoff=0.1) as client, \
            pytest.raises(VLLMError, match="no HTTP response.*server running"):
        client.embed([[1, 2, 3]])
    assert time.monotonic() - start < 3.5


def test_unloadable_model_exits_with_a_clear_message(free_port):
    result = subprocess.run([sys.executable, "-m", "jaxllm.http.server", "--model", "no-such-checkpoint", "--port",
                             str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode != 0
    assert "cannot load --model 'no-such-checkpoint'" in result.stderr and "Traceback" not in result.stderr
