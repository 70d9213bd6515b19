"""What the HTTP round trip costs next to the in-scan encoder, at the same batch.

    python -m scripts.bench_http                       # Qwen3-4B shape, random weights (GPU)
    python -m scripts.bench_http --smoke               # tiny model, small shapes (CPU, seconds)

Prompts are random token ids shaped like the trainer's: a constant prefix of --prefix-len tokens plus a
rest of --rest-len tokens per env, --batch envs per call. Rows, all in prompts/s (steady state: one
warm-up call, then the median of --iters calls, each blocked until ready):

  in-scan       jitted ``encode(rest, lengths, prefix=cache)``: what the trainer runs inside its scan
  whole         jitted ``encode`` of whole prompts (prefix recomputed), padded as the server pads them
  http/<fmt>    ``VLLMClient.embed(whole prompts)`` through the built-in server (same process, a thread;
                client batches of --client-batch, --concurrency requests in flight, JSON floats or base64)

"whole" vs "in-scan" is the cost of not caching the prefix; "http" vs "whole" is the cost of HTTP, JSON
and batching. The server runs in this process, so client and server share one Python GIL (a pessimistic
setting for HTTP; a separate process would overlap better). Pass --url to time an external server instead.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _median_time(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up: compile
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-4b", help="preset or checkpoint dir (default qwen3-4b, random)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 on GPU, f32 on CPU)")
    parser.add_argument("--batch", type=int, default=128, help="prompts per call (envs)")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--rest-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--client-batch", type=int, default=16, help="prompts per HTTP request")
    parser.add_argument("--concurrency", type=int, default=8, help="HTTP requests in flight")
    parser.add_argument("--encodings", default="float,base64")
    parser.add_argument("--url", default=None, help="time this server instead of an in-process one")
    parser.add_argument("--smoke", action="store_true", help="tiny model, batch 8, prefix 64, rest 32, 2 iters")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.batch, args.prefix_len, args.rest_len, args.iters = "tiny", 8, 64, 32, 2
        args.client_batch, args.concurrency = 4, 2
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    import jax

    from jaxllm import load_model
    from jaxllm.http.client import VLLMClient
    from jaxllm.http.batching import BatchingEncoder
    from jaxllm.http.server import HTTPServer, build_encode_fn
    from jaxllm.http.service import EmbeddingService, limits_for

    model = load_model(args.model, dtype=args.dtype)
    config = model.config
    rng = np.random.default_rng(0)
    vocab = min(config.vocab_size, 151643)  # ordinary BPE tokens
    prefix = rng.integers(0, vocab, args.prefix_len).astype(np.int32)
    lengths = rng.integers(args.rest_len * 3 // 4, args.rest_len + 1, args.batch).astype(np.int32)
    rest = rng.integers(0, vocab, (args.batch, args.rest_len)).astype(np.int32)
    whole = [prefix.tolist() + rest[i, :n].tolist() for i, n in enumerate(lengths)]
    device = jax.devices()[0]
    print(f"{device.device_kind} ({jax.default_backend()}), model {args.model} {np.dtype(model.dtype).name}, "
          f"batch {args.batch}, prefix {args.prefix_len} + rest <= {args.rest_len} tokens", flush=True)

    results: dict[str, float] = {}
    cache = model.prefill(prefix)
    results["in-scan"] = args.batch / _median_time(
        lambda: jax.block_until_ready(model.encode(rest, lengths, prefix=cache)), args.iters)

    encoder = BatchingEncoder(build_encode_fn(model, -1, "last"), max_batch=args.batch,
                              max_len=config.max_position_embeddings, max_wait_s=0.005)
    results["whole"] = args.batch / _median_time(lambda: encoder.encode_now(whole), args.iters)

    server = None
    url = args.url
    if url is None:
        service = EmbeddingService(args.model)
        service.attach(encoder, vocab_size=config.vocab_size, limits=limits_for(config.max_position_embeddings))
        service.ready.set()
        server = HTTPServer(service, "127.0.0.1", 0).start()
        url = server.url
    for fmt in [f.strip() for f in args.encodings.split(",") if f.strip()]:
        with VLLMClient(url, timeout=600, batch_size=args.client_batch, max_concurrency=args.concurrency,
                        encoding_format=fmt) as client:
            results[f"http/{fmt}"] = args.batch / _median_time(lambda: client.embed(whole), args.iters)
    if server is not None:
        server.stop()
    encoder.close()

    print("| path | prompts/s | vs in-scan |\n|---|---|---|")
    for name, rate in results.items():
        print(f"| {name} | {rate:,.1f} | {rate / results['in-scan']:.3f} |")
    record = {"device": device.device_kind, "backend": jax.default_backend(),
              "date": datetime.date.today().isoformat(), "args": vars(args), "prompts_per_s": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
