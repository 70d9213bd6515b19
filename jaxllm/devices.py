"""What the default device is, asked at trace time by the kernels' choices (a Pallas kernel on a GPU, XLA's form
elsewhere). Tests that lower for a GPU on a CPU answer through `jax.devices`, so every choice reads it here."""
from __future__ import annotations

import jax


def on_gpu() -> bool:
    """Whether the first default device is a GPU (any: the Triton kernels' condition; the Hopper-only choices ask
    for the compute capability as well)."""
    return jax.devices()[0].platform == "gpu"
