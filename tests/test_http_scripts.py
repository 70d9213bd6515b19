"""The HTTP scripts stay runnable: bench_http's CPU smoke run, load_server against an in-process server with a
numpy encoder, and start_vllm.sh's flag choice per vLLM version (checked with a stand-in `vllm` executable that
prints its arguments; no vLLM needed)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from jaxllm.http.service import EmbeddingService, limits_for

REPO = Path(__file__).resolve().parent.parent


def test_bench_http_smoke():
    from scripts.bench_http import main

    record = main(["--smoke"])
    assert set(record["prompts_per_s"]) == {"in-scan", "whole", "http/float", "http/base64"}
    assert all(rate > 0 for rate in record["prompts_per_s"].values())


def test_load_server_counts_every_request_and_stays_on_loopback():
    import numpy as np

    from jaxllm.http.batching import BatchingEncoder
    from jaxllm.http.server import HTTPServer
    from scripts.load_server import main

    encoder = BatchingEncoder(lambda ids, lengths: np.zeros((len(ids), 4), np.float32), max_batch=16, max_len=64)
    service = EmbeddingService("fake")
    service.attach(encoder, vocab_size=1000, limits=limits_for(64))
    service.ready.set()
    with HTTPServer(service, "127.0.0.1", 0) as server:
        record = main(["--url", server.url, "--server-pid", str(os.getpid()), "--clients", "8", "--requests", "64",
                       "--prompts", "2"])
    encoder.close()
    assert record["requests_ok"] == 64 and record["errors"] == {} and record["p99_ms"] >= record["p50_ms"] > 0
    assert record["server_rss_mib_before"] > 0
    with pytest.raises(SystemExit, match="loopback"):
        main(["--url", "http://10.1.2.3:8000", "--requests", "1"])


@pytest.mark.parametrize("version, mode, pooler_flag, pooler_key", [
    ("0.9.2", "--task embed", "--override-pooler-config", '"normalize":false'),
    ("0.10.1", "--runner pooling --convert embed", "--override-pooler-config", '"normalize":false'),
    ("0.11.0", "--runner pooling --convert embed", "--pooler-config", '"normalize":false'),
    ("0.16.1", "--runner pooling --convert embed", "--pooler-config", '"use_activation":false'),
])
def test_start_vllm_flags_per_version(tmp_path, version, mode, pooler_flag, pooler_key):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "vllm"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(tmp_path)}
    env.pop("HOST", None)
    env.pop("PORT", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / "start_vllm.sh"), "Qwen/Qwen3-4B", "--", "--seed", "1"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"serve Qwen/Qwen3-4B {mode} {pooler_flag} ")
    assert '"pooling_type":"LAST"' in out and pooler_key in out
    assert "--host 127.0.0.1 --port 8000" in out and out.strip().endswith("--seed 1")
