"""Turns a model argument (local directory or hub id already in the local HF cache) into a directory."""
from __future__ import annotations

from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """A model argument that is neither a directory, a preset, nor a hub id in the local HF cache."""


def resolve_checkpoint_dir(name: str | Path, presets: tuple[str, ...] = ()) -> Path:
    """A local directory as is; otherwise a hub id looked up in the local HF cache only (never the network)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    name = str(name)
    hint = (f"'{name}' is not a local directory{', a preset ' + str(list(presets)) if presets else ''}, "
            f"or a Hugging Face hub id in the local cache")
    if path.exists():
        raise ModelNotFoundError(f"{path}: is a file; pass the checkpoint directory holding config.json")
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(hint)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=name, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"{hint} ({type(e).__name__}). Download it once on a machine with network access, e.g. "
            f"`hf download {name}` (or `huggingface-cli download {name}`), which fills the cache under "
            f"$HF_HOME, or pass the path of a local checkpoint directory.") from None
