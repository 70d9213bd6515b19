"""The in-scan encoder (prefix cache, template inside a jitted lax.scan) vs the HTTP path (whole prompts
through the built-in server and VLLMClient): equal within f32 rounding (relative 1e-4).

The two paths share no code above `jaxllm.encode`: one feeds the rest of each prompt behind a
`PrefixCache`, batched by the scan; the other sends `prefix_ids + rest` as plain id lists over HTTP, where
the server pads them to bucketed shapes and encodes them whole.
"""
from __future__ import annotations


import jax
import numpy as np
import pytest

from jaxllm import encode, load_model
from jaxllm.http.batching import BatchingEncoder
from jaxllm.http.client import VLLMClient
from jaxllm.http.server import HTTPServer, build_encode_fn
from jaxllm.http.service import EmbeddingService, limits_for
from jaxllm.parity import vector_errors

CHUNKS = 2  # the scan runs over CHUNKS steps of NUM_PROMPTS / CHUNKS envs each


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", dtype="float32")


@pytest.fixture(scope="module")
def scanned(model, prompt_set):
    """{pooling: [N, D]} from one jitted scan (the template compiles once for both poolings)."""
    template, config = prompt_set.template, model.config
    states = jax.tree.map(lambda x: x.reshape((CHUNKS, -1) + x.shape[1:]), prompt_set.states)

    @jax.jit
    def run(params, cache, states):
        def step(carry, chunk):
            ids, lengths = jax.vmap(template)(chunk)
            return carry, {pooling: encode(params, config, ids, lengths, layer=-1, pooling=pooling, prefix=cache)
                           for pooling in ("last", "mean")}

        return jax.lax.scan(step, None, states)[1]

    cache = model.prefill(np.asarray(prompt_set.prefix_ids, np.int32))
    out = run(model.params, cache, states)
    return {pooling: np.asarray(v).reshape(-1, config.hidden_size) for pooling, v in out.items()}


def served_vectors(model, prompts, pooling):
    encoder = BatchingEncoder(build_encode_fn(model, -1, pooling), max_batch=4,
                              max_len=model.config.max_position_embeddings)
    service = EmbeddingService("tiny")
    service.attach(encoder, vocab_size=model.config.vocab_size, limits=limits_for(model.config.max_position_embeddings))
    service.ready.set()
    try:
        with HTTPServer(service, "127.0.0.1", 0) as server, \
                VLLMClient(server.url, batch_size=4, max_concurrency=2) as client:
            return client.embed(prompts)
    finally:
        encoder.close()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_in_scan_prefix_cache_equals_http_whole_prompts(model, prompt_set, scanned, pooling):
    scanned = scanned[pooling]
    served = served_vectors(model, prompt_set.whole(), pooling)
    assert scanned.shape == served.shape == (len(prompt_set.lengths), model.config.hidden_size)
    rel, cos = vector_errors(scanned, served)
    assert rel.max() <= 1e-4, f"relative L2 per prompt: {rel}"
    np.testing.assert_allclose(scanned, served, rtol=1e-4, atol=1e-4 * np.abs(served).max())
