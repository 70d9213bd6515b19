"""What a model's weights take on the device, said before loading: an estimate from the config and the dtype
against the device's memory, so a model that cannot fit fails in one line with the way out instead of an
out-of-memory traceback after minutes of loading.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from .config import Qwen3Config

GIB = 1 << 30
MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = 0.75  # JAX's default share of a GPU's memory for its allocator
# Left free for activations, the prefix cache and XLA's workspace when checking that the weights fit: the packed
# encoder's largest pass at 128 envs (Qwen3-30B-A3B: ~3 GiB of token-expert rows and their products) with margin.
DEFAULT_RESERVE_BYTES = 6 * GIB


class ModelTooLargeError(MemoryError, ValueError):
    """The model's weights cannot fit in the device's memory (raised before anything is loaded). A ValueError too,
    so every tool that reports bad arguments in one line reports this one the same way."""


def parameter_count(config: Qwen3Config) -> int:
    """Every parameter of the model (an untied LM head included)."""
    from .weights import param_shapes

    shapes = param_shapes(config)
    return int(sum(np.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))))


def weight_bytes(config: Qwen3Config, dtype: Any) -> int:
    """Bytes of the params on the device for load_model's `dtype` ("fp8": the decoder matrices and, for an MoE,
    the experts in e4m3 with float32 row scales; embeddings, norms and the router 16-bit)."""
    from . import fp8
    from .weights import param_shapes

    is_fp8 = isinstance(dtype, str) and dtype == "fp8"
    itemsize = 2 if is_fp8 else np.dtype(dtype or np.float32).itemsize
    shapes = param_shapes(config)
    total = 0
    for stack, leaves in shapes.items():
        if not isinstance(leaves, dict):
            total += int(np.prod(leaves)) * itemsize
            continue
        quantized = fp8.EXPERT_QUANTIZED_LEAVES if stack == "experts" else fp8.QUANTIZED_LEAVES
        for name, shape in leaves.items():
            n = int(np.prod(shape))
            if is_fp8 and name in quantized:
                total += n + 4 * n // shape[-1 if stack == "experts" else -2]  # e4m3 + one float32 scale per row
            else:
                total += n * itemsize
    return total


def host_memory_bytes() -> int | None:
    """This machine's memory: the physical RAM, or the container's limit (cgroup v2 `memory.max`, v1
    `memory.limit_in_bytes`) where that is lower; None where neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            total = min(total, int(text)) if total else int(text)
        break
    return total or None


def device_memory_bytes(device: Any = None) -> int | None:
    """The memory XLA may use on `device` (default: the first; a CPU: the machine's, `host_memory_bytes`), or None
    where it does not say."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return host_memory_bytes()
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return stats.get("bytes_limit")


def check_fits(config: Qwen3Config, dtype: Any, device: Any = None,
               reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
    """Raises ModelTooLargeError, in one line with the ways out, when the weights plus `reserve_bytes` exceed the
    device's memory (on a CPU, the machine's). Silent where the device does not report its memory."""
    limit = device_memory_bytes(device)
    if limit is None:
        return
    need = weight_bytes(config, dtype)
    if need + reserve_bytes <= limit:
        return
    device = device or jax.devices()[0]
    on_cpu = device.platform == "cpu"
    label = dtype if isinstance(dtype, str) else np.dtype(dtype or np.float32).name
    ways = []
    fraction = float(os.environ.get(MEM_FRACTION_VAR) or DEFAULT_MEM_FRACTION)
    card = limit / fraction  # JAX's allocator may use `fraction` of the card (default 75%)
    if not on_cpu and fraction < 0.95 and need + reserve_bytes <= 0.95 * card:
        ways.append(f"{MEM_FRACTION_VAR}=0.95 in the environment (JAX uses {fraction:.0%} of this GPU's "
                    f"~{card / GIB:.0f} GiB by default)")
    fp8_bytes = weight_bytes(config, "fp8")
    if label != "fp8" and (not on_cpu or fp8_bytes + reserve_bytes <= limit):
        ways.append(f"--llm-dtype fp8 (load_model(..., dtype='fp8'): {fp8_bytes / GIB:.1f} GiB)")
    if on_cpu:
        ways.append(f"a GPU with room for it ({weight_bytes(config, np.dtype('bfloat16')) / GIB:.1f} GiB in bf16, "
                    f"{fp8_bytes / GIB:.1f} in fp8, plus ~{reserve_bytes / GIB:.0f})")
        ways.append("a smaller model on this machine (the presets tiny, tiny-moe)")
        where = f"this machine has {limit / GIB:.1f} GiB of memory (running on the CPU)"
    else:
        ways.append("a GPU with more memory (an H200 has 141 GB)")
        where = f"{device.device_kind} has {limit / GIB:.1f} GiB"
    raise ModelTooLargeError(
        f"this model ({parameter_count(config) / 1e9:.1f}B parameters) needs {need / GIB:.1f} GiB for its weights "
        f"in {label} plus ~{reserve_bytes / GIB:.0f} GiB for activations; {where}. Ways out: " + "; ".join(ways))
