"""Shared test setup: JAX's persistent compilation cache and CPU-friendly defaults.

Session-scoped fixtures that several test files use live here; fixtures used by one
file stay in that file.
"""
import os
from pathlib import Path

import jax

_CACHE_DIR = Path(os.environ.get("JAX_TEST_CACHE_DIR", Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE_DIR))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
