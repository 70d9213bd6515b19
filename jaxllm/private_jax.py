"""Guarded use of JAX's private cuDNN attention module (`jax._src.cudnn.fused_attention_stablehlo`).

The split-prefix and packed attention paths call it for what the public `jax.nn.dot_product_attention` does not
offer (float32 softmax statistics, the packed layout). A private module can change with any JAX release, so each
path traces its own call once at tiny shapes before using it, and falls back to a public path with one warning.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import jax

MODULE = "jax._src.cudnn.fused_attention_stablehlo"


def cudnn_attention_module() -> Any:
    """The private module (ImportError where this JAX has moved it)."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def probe(trace: Callable[[], tuple[Any, Any]], what: str, fallback: str) -> bool:
    """Whether `trace()` (an `eval_shape` of the private call; returns (got shape, expected shape)) runs and gives
    the expected shape. If not, warns once, naming `what` failed and the `fallback` taken, and returns False."""
    try:
        got, want = trace()
        if got != want:
            raise ValueError(f"returned shape {got}, expected {want}")
    except Exception as e:  # ImportError, TypeError, IndexError, ...: whatever this JAX version raises
        warnings.warn(f"{MODULE}'s {what} does not work as expected with JAX {jax.__version__} "
                      f"({type(e).__name__}: {e}); {fallback}", RuntimeWarning, stacklevel=3)
        return False
    return True
