"""Hub ids: the local cache first, then one download (huggingface_hub.snapshot_download, monkeypatched: no
network here), never with HF_HUB_OFFLINE=1; failures are one ModelNotFoundError line."""
import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from jaxllm import ModelNotFoundError
from jaxllm.resolve import resolve_checkpoint_dir


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake hub: `remote` ids can be downloaded into tmp_path/cache; `calls` records every call."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    state = {"cached": set(), "remote": {"Org/model"}, "calls": []}

    def snapshot_download(repo_id, local_files_only=False, allow_patterns=None, **kw):
        state["calls"].append((repo_id, local_files_only, allow_patterns))
        folder = tmp_path / "cache" / repo_id.replace("/", "--")
        if repo_id in state["cached"]:
            return str(folder)
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        if repo_id not in state["remote"]:
            raise ConnectionError("404 Client Error: Repository Not Found\nmore")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        state["cached"].add(repo_id)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return state


def test_uncached_hub_id_is_downloaded_once(hub, capsys):
    first = resolve_checkpoint_dir("Org/model")
    assert (first / "config.json").exists() and "downloading Org/model" in capsys.readouterr().err
    assert resolve_checkpoint_dir("Org/model") == first  # now from the cache
    assert [(c[0], c[1]) for c in hub["calls"]] == [("Org/model", True), ("Org/model", False), ("Org/model", True)]
    assert "*.safetensors" in hub["calls"][1][2] and "*.bin" not in hub["calls"][1][2]


def test_offline_never_downloads(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"HF_HUB_OFFLINE=1 .*hf download Org/model"):
        resolve_checkpoint_dir("Org/model")
    assert all(local for _, local, _ in hub["calls"])


def test_download_failure_is_one_line(hub):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_checkpoint_dir("Org/missing")
    msg = str(e.value)
    assert "ConnectionError: 404 Client Error" in msg and "\n" not in msg and "HF_TOKEN" in msg


def test_load_model_and_server_args_take_the_same_path(hub):
    """rl.train (load_model / load_tokenizer) and jaxllm.http.server resolve through resolve_checkpoint_dir."""
    from jaxllm import load_model

    with pytest.raises(Exception) as e:  # the fake checkpoint has an empty config: it was downloaded, then read
        load_model("Org/model")
    assert not isinstance(e.value, ModelNotFoundError)
    assert hub["calls"][1][:2] == ("Org/model", False)
