"""Shared test setup: JAX's persistent compilation cache and CPU-friendly defaults.

Session-scoped fixtures that several test files use live here; fixtures used by one
file stay in that file.
"""
import gc
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# On a machine without an NVIDIA GPU (CI, laptops) the suite's time is mostly XLA compiling for the CPU: LLVM
# optimisation level 0 compiles the Craftax and tiny-model programs in ~40-65% of the default level's time (HLO
# fusions are the same; measured 2026-11-27: tests/test_rl_units.py + test_rl_cli.py 128 s -> 84 s, empty cache).
# Set before JAX starts its backend; subprocesses the tests start inherit it. A user's own XLA_FLAGS are kept.
_O0 = "--xla_backend_optimization_level=0"
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_O0}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Files whose tests train, start servers or other processes, or compile many programs: `pytest -m "not slow"`
# (the README's fast subset) leaves them out; CI runs everything. A single slow test elsewhere: @pytest.mark.slow.
SLOW_FILES = {
    "test_bench_scripts.py", "test_http_contract.py", "test_http_scripts.py", "test_render_obs.py",
    "test_render_template.py", "test_parity_hf.py",
    "test_rl_inscan.py", "test_rl_label.py", "test_rl_probe.py", "test_rl_multidevice.py", "test_rl_multihost.py", "test_rl_train.py",
    "test_rl_units.py", "test_rl_usability.py", "test_rl_moe.py", "test_rl_vllm.py", "test_parity_http.py", "test_parity_vllm.py",
    "test_offline_train.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


# The suite's persistent compilation cache: outside the checkout (the user's cache directory), so that a machine
# that runs the suite again (a developer's, a CI runner that keeps its home) reuses the programs compiled before;
# keys include the program, the XLA flags and the JAX version, so a stale entry is never used. Subprocesses that
# tests start read the same directory from JAX_TEST_CACHE_DIR (set here when unset).
_DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "craftax-llm" / "jax-tests"
_CACHE_DIR = Path(os.environ.setdefault("JAX_TEST_CACHE_DIR", str(_DEFAULT_CACHE)))
jax.config.update("jax_compilation_cache_dir", str(_CACHE_DIR))
# a size limit makes JAX lock the directory around each read and write: the workers and the subprocesses the tests
# start share it (jaxllm.compile.CACHE_MAX_BYTES says why); subprocesses read it from the environment
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _compiled_program_holders(module) -> list:
    """The test module's own `functools.cache` / `lru_cache` functions (where tests keep shared compiled
    functions)."""
    return [v for v in vars(module).values()
            if callable(getattr(v, "cache_clear", None)) and getattr(v, "__module__", None) == module.__name__]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After each test file: JAX's caches and the file's own cached functions cleared, so the programs compiled for
    it are freed. Each live CPU executable holds ~5+ memory maps (its JIT-linked code), and a worker process that
    kept every program of its ~350 tests reached 50,000 maps, near Linux's per-process limit (vm.max_map_count,
    65,530): past it the next executable to load aborts or segfaults in XLA (CI, 2026-11-30: a worker died
    loading one from the persistent cache, and xdist then hung). Programs a later file needs again come back from
    the persistent cache."""
    yield
    for cached in _compiled_program_holders(request.module):
        cached.cache_clear()
    jax.clear_caches()
    gc.collect()


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


# XLA options for the programs that run on thousands of states (the batched templates, upstream observations): full
# LLVM optimisation, which the suite's O0 default (top of this file) would trade for slower runs (for comparison,
# Craftax's 512-state sampler: O0 compiles in 60 s and runs in 34 s, level 3 in 87 s and 9 s).
RUNTIME_BOUND = {"xla_backend_optimization_level": 3}


@pytest.fixture(scope="session")
def state_chunks():
    """env -> list of batched EnvStates (4 seeds x 512 states). The sampler runs 4 times per env: compiled once per
    env at full optimisation (RUNTIME_BOUND; the seed is traced), not at the suite's O0."""
    from render.sample_states import sample_states

    def chunks(env):
        sample = jax.jit(lambda seed: sample_states(env, RENDER_CHUNK, seed), compiler_options=RUNTIME_BOUND)
        return [sample(seed) for seed in RENDER_SEEDS]

    return {env: chunks(env) for env in RENDER_ENVS}


class _BuiltOnFirstUse(Mapping):
    """A read-only mapping over fixed keys whose values are built by `build(key)` on first access (a file that
    needs one template does not build all four)."""

    def __init__(self, keys, build):
        self._keys, self._build, self._values = tuple(keys), build, {}

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._values:
            self._values[key] = self._build(key)
        return self._values[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


@pytest.fixture(scope="session")
def templates(tokenizer):
    """(env, fmt) -> the state template (each built on first use)."""
    from render import build_template

    keys = [(env, fmt) for env in RENDER_ENVS for fmt in RENDER_FORMATS]
    return _BuiltOnFirstUse(keys, lambda key: build_template(tokenizer, *key))


@pytest.fixture(scope="session")
def batched_templates(templates):
    """(env, fmt) -> jax.jit(jax.vmap(state template)), compiled once per input shape for the whole session."""
    return _BuiltOnFirstUse(templates, lambda key: jax.jit(jax.vmap(templates[key]), compiler_options=RUNTIME_BOUND))


# ------------------------------------------------------------------------------- xdist schedule (CI: -n 2 --dist loadfile)
# Files that share expensive session fixtures run as one unit on one worker, so the fixtures are built once:
# the render files share the sampled states and the compiled templates above, the parity files their prompts and
# checkpoint (tests/parity/conftest.py).
SHARED_FIXTURE_GROUPS = (("test_render_template.py", "test_render_obs.py"),
                         ("test_parity_hf.py", "test_parity_http.py", "test_parity_vllm.py"))
# The longest units first (on CI's 2-core machine, empty compilation cache, 2026-11: test_rl_multidevice ~450 s,
# the render pair and test_rl_inscan ~250-300 s, test_bench_scripts ~250 s, the parity files ~150-200 s,
# test_rl_multihost's three training processes), so that none starts last and leaves the other worker idle at the
# end (xdist alone hands out files with the most tests first, and these have few). Files not listed follow in
# xdist's order. test_rl_multihost after test_rl_multidevice: its reference run reuses that file's 2-device compile.
LONGEST_UNITS = ("test_rl_multidevice.py", "test_render_template.py", "test_rl_probe.py", "test_rl_inscan.py",
                 "test_bench_scripts.py", "test_rl_usability.py", "test_parity_hf.py", "test_rl_multihost.py",
                 "test_offline_train.py", "test_rl_train.py")


def _file_scheduler(config, log):
    """`--dist loadfile` with SHARED_FIXTURE_GROUPS as single units and LONGEST_UNITS handed out first; None (xdist's
    own scheduler) where this xdist lacks the internals it relies on."""
    try:
        from xdist.scheduler import LoadFileScheduling
    except ImportError:
        return None
    if not all(hasattr(LoadFileScheduling, name) for name in ("_split_scope", "_assign_work_unit")):
        return None
    group_of = {name: group[0] for group in SHARED_FIXTURE_GROUPS for name in group}
    rank = {name: k for k, name in enumerate(LONGEST_UNITS)}

    class GroupedLongestFirst(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            folder, _, name = path.rpartition("/")
            return f"{folder}/{group_of[name]}" if name in group_of else path

        def _assign_work_unit(self, node) -> None:
            if not self.ordered and hasattr(self, "workqueue"):
                units = list(self.workqueue.items())
                position = {scope: k for k, (scope, _) in enumerate(units)}
                key = lambda item: (rank.get(item[0].rpartition("/")[2], len(rank)), position[item[0]])
                self.workqueue.clear()
                self.workqueue.update(sorted(units, key=key))
                self.ordered = True
            super()._assign_work_unit(node)

    return GroupedLongestFirst(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The README's `-n 2 --dist loadfile` with this suite's schedule (see SHARED_FIXTURE_GROUPS, LONGEST_UNITS)."""
    return _file_scheduler(config, log) if config.getvalue("dist") == "loadfile" else None
