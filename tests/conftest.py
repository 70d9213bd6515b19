"""Shared test setup: JAX's persistent compilation cache and CPU-friendly defaults.

Session-scoped fixtures that several test files use live here; fixtures used by one
file stay in that file.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

# Files whose tests train, start servers or other processes, or compile many programs: `pytest -m "not slow"`
# (the README's fast subset) leaves them out; CI runs everything. A single slow test elsewhere: @pytest.mark.slow.
SLOW_FILES = {
    "test_bench_scripts.py", "test_http_contract.py", "test_http_scripts.py", "test_render_obs.py",
    "test_render_template.py", "test_parity_hf.py",
    "test_rl_inscan.py", "test_rl_label.py", "test_rl_probe.py", "test_rl_multidevice.py", "test_rl_multihost.py", "test_rl_train.py",
    "test_rl_units.py", "test_rl_usability.py", "test_rl_vllm.py", "test_parity_http.py", "test_parity_vllm.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


_CACHE_DIR = Path(os.environ.get("JAX_TEST_CACHE_DIR", Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE_DIR))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """A function returning a currently free loopback TCP port."""
    return _free_port


@pytest.fixture(scope="session")
def start_tiny_server():
    """Factory: start `python -m jaxllm.http.server --model tiny --dtype float32 [extra args]` on a free loopback port,
    wait until /health answers, and return (url, process). Every server it started is stopped at session end."""
    from jaxllm.http.client import VLLMClient, VLLMError

    repo = Path(__file__).resolve().parent.parent
    procs = []

    def start(*extra_args: str) -> tuple[str, subprocess.Popen]:
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "JAX_COMPILATION_CACHE_DIR": str(_CACHE_DIR)}
        proc = subprocess.Popen([sys.executable, "-m", "jaxllm.http.server", "--model", "tiny", "--dtype", "float32",
                                 "--port", str(port), *extra_args], cwd=repo, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        client = VLLMClient(url, timeout=5)
        try:
            client.wait_until_ready(wait_s=240, poll_s=0.2)
        except VLLMError:
            proc.kill()
            pytest.fail(f"jaxllm.http.server did not become ready:\n{proc.communicate()[1][-3000:]}")
        finally:
            client.close()
        return url, proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


# render: the tokenizer, diverse states and compiled state templates shared by test_render_template.py and
# test_render_obs.py (building and compiling them is most of those files' time)
RENDER_ENVS = ("Craftax-Symbolic-v1", "Craftax-Classic-Symbolic-v1")
RENDER_FORMATS = ("compact", "full")
RENDER_CHUNK = 512
RENDER_SEEDS = (0, 1, 2, 3)  # 4 x 512 = 2,048 states per env


@pytest.fixture(scope="session")
def tokenizer():
    from jaxllm import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def state_chunks():
    """env -> list of batched EnvStates (4 seeds x 512 states)."""
    from render.sample_states import sample_states

    return {env: [sample_states(env, RENDER_CHUNK, seed) for seed in RENDER_SEEDS] for env in RENDER_ENVS}


@pytest.fixture(scope="session")
def templates(tokenizer):
    """(env, fmt) -> the state template."""
    from render import build_template

    return {(env, fmt): build_template(tokenizer, env, fmt) for env in RENDER_ENVS for fmt in RENDER_FORMATS}


@pytest.fixture(scope="session")
def batched_templates(templates):
    """(env, fmt) -> jax.jit(jax.vmap(state template)), compiled once per input shape for the whole session."""
    return {key: jax.jit(jax.vmap(tpl)) for key, tpl in templates.items()}
