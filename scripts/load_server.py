"""Load check of the built-in embeddings server: N concurrent clients on loopback, bounded in count and time.

    python -m scripts.load_server --clients 64 --requests 2000 --duration 120      # starts the tiny server itself
    python -m scripts.load_server --url http://127.0.0.1:8000 --server-pid PID     # a server already running

Each client is a thread with its own keep-alive connection (plain ``http.client``, no retries: a reset or a
refused connection counts as an error). Each request sends ``--prompts`` random prompts of ``--min-len`` to
``--max-len`` tokens. Reports requests/s, p50/p99 latency, errors by kind and the server's RSS before and after.
Only loopback addresses are accepted.
"""
from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.load_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (loopback only); default: start the tiny one")
    parser.add_argument("--server-pid", type=int, default=None, help="pid of --url's server, for its RSS")
    parser.add_argument("--server-args", default="--model tiny --dtype float32",
                        help="arguments of the server this script starts")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (threads), at most 1024")
    parser.add_argument("--requests", type=int, default=2000, help="stop after this many requests in all")
    parser.add_argument("--duration", type=float, default=120.0, help="stop after this many seconds")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per request")
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=60.0, help="socket timeout of one request")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 1024 or args.requests < 1 or not 0 < args.duration <= 3600:
        parser.error("need 1 <= --clients <= 1024, --requests >= 1 and 0 < --duration <= 3600")
    if not 1 <= args.min_len <= args.max_len or args.prompts < 1:
        parser.error("need 1 <= --min-len <= --max-len and --prompts >= 1")
    return args


def _loopback_host_port(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parsed.scheme != "http" or not loopback or parsed.port is None:
        raise SystemExit(f"--url must be http://<loopback address>:<port> (this is a load test), got {url!r}")
    return host, parsed.port


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of ``pid`` in MiB (Linux /proc), None when unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _start_server(server_args: str) -> tuple[str, subprocess.Popen]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxllm.http.server", *server_args.split(), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{proc.stderr.read()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return f"http://127.0.0.1:{port}", proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready within 300 s")


def run_load(host: str, port: int, args: argparse.Namespace) -> dict:
    """Run the clients; latencies of the successful requests and the errors by kind."""
    latencies: list[float] = []
    errors: Counter = Counter()
    lock = threading.Lock()
    issued = iter(range(args.requests))
    stop_at = time.monotonic() + args.duration

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection(host, port, timeout=args.timeout)
        while time.monotonic() < stop_at:
            with lock:
                if next(issued, None) is None:
                    break
            prompts = [rng.integers(1, 1000, rng.integers(args.min_len, args.max_len + 1)).tolist()
                       for _ in range(args.prompts)]
            body = json.dumps({"input": prompts, "encoding_format": "base64"}).encode()
            started = time.monotonic()
            try:
                conn.request("POST", "/v1/embeddings", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
                ok = response.status == 200 and len(json.loads(data)["data"]) == len(prompts)
                kind = None if ok else f"HTTP {response.status}"
            except (OSError, http.client.HTTPException, ValueError) as exc:
                kind = type(exc).__name__
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=args.timeout)
            with lock:
                if kind is None:
                    latencies.append(time.monotonic() - started)
                else:
                    errors[kind] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.duration + args.timeout + 10)
    elapsed = time.monotonic() - started
    done = len(latencies)
    return {"requests_ok": done, "errors": dict(errors), "seconds": round(elapsed, 2),
            "requests_per_s": round(done / elapsed, 1),
            "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1) if done else None,
            "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1) if done else None}


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    proc = None
    if args.url is None:
        url, proc = _start_server(args.server_args)
        pid = proc.pid
    else:
        url, pid = args.url, args.server_pid
    host, port = _loopback_host_port(url)
    try:
        rss_before = rss_mib(pid)
        result = run_load(host, port, args)
        rss_after = rss_mib(pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    result.update(clients=args.clients, prompts_per_request=args.prompts, lengths=[args.min_len, args.max_len],
                  server_rss_mib_before=rss_before and round(rss_before), server_rss_mib_after=rss_after and round(rss_after))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
