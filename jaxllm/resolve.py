"""Turns a model argument (local directory or Hugging Face hub id) into a local checkpoint directory.

A hub id is looked up in the local HF cache first; one that is not there is downloaded once with
`huggingface_hub.snapshot_download` (its own progress bars; weights, config and tokenizer files only), unless
HF_HUB_OFFLINE=1, which keeps the lookup local and says how to fill the cache.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# what a checkpoint needs: config and tokenizer files (json / txt / sentencepiece) and safetensors weights
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


class ModelNotFoundError(FileNotFoundError):
    """A model argument that is neither a directory, a preset, nor a hub id in the cache or on the hub."""


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set to a true value (read now, not at import, so a test or caller can set it late)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_checkpoint_dir(name: str | Path, presets: tuple[str, ...] = ()) -> Path:
    """A local directory as is; otherwise a hub id from the local HF cache, downloaded into it when missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    name = str(name)
    hint = (f"'{name}' is not a local directory{', a preset ' + str(list(presets)) if presets else ''}, "
            f"or a Hugging Face hub id")
    if path.exists():
        raise ModelNotFoundError(f"{path}: is a file; pass the checkpoint directory holding config.json")
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(hint)
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=name, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        if hub_offline():
            raise ModelNotFoundError(
                f"{hint} in the local cache ({type(e).__name__}; HF_HUB_OFFLINE=1 forbids downloading). Download "
                f"it once on a machine with network access, e.g. `hf download {name}` (or `huggingface-cli download "
                f"{name}`), which fills the cache under $HF_HOME, or pass the path of a local checkpoint "
                f"directory.") from None
    return _download(name, hint)


def _download(name: str, hint: str) -> Path:
    import huggingface_hub

    print(f"downloading {name} from the Hugging Face hub into {huggingface_hub.constants.HF_HUB_CACHE} (once) ...",
          file=sys.stderr, flush=True)
    try:
        return Path(huggingface_hub.snapshot_download(repo_id=name, allow_patterns=list(DOWNLOAD_PATTERNS)))
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: all end the same way, in one line
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelNotFoundError(
            f"{hint} that could be downloaded ({type(e).__name__}: {reason}). Check the id and your network "
            f"(a gated model needs `hf auth login` or HF_TOKEN), or pass the path of a local checkpoint "
            f"directory.") from None
