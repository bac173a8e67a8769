"""A model by its hub name from the local Hugging Face cache (offline), as vLLM takes it;
a local directory keeps working."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
from checkpoints import put_in_hub_cache

from pdd.config import ModelSpec
from pdd.model.store import resolve_model, served_name


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # huggingface_hub reads HF_HOME / HF_HUB_CACHE once, at import: point its constant here
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_name_resolves_to_its_cached_snapshot(tiny_model_dir: Path, hub_cache: Path) -> None:
    snapshot = put_in_hub_cache(tiny_model_dir, hub_cache, "acme/tiny-chat", revision="ab" * 20)
    assert resolve_model("acme/tiny-chat") == snapshot
    assert served_name("acme/tiny-chat") == "acme/tiny-chat"
    assert ModelSpec(path="acme/tiny-chat").served_name == "acme/tiny-chat"
    assert ModelSpec(path="acme/tiny-chat", name="chat").served_name == "chat"


def test_a_missing_hub_model_is_a_clear_error(hub_cache: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("acme/not-downloaded")
    message = str(err.value)
    assert "acme/not-downloaded" in message and str(hub_cache) in message and "does not download" in message
    # a ref whose snapshot is gone (a deleted or interrupted download) is not there either
    snapshot = put_in_hub_cache(tiny_model_dir, hub_cache, "acme/broken")
    for file in snapshot.iterdir():
        file.unlink()
    snapshot.rmdir()
    with pytest.raises(FileNotFoundError, match="acme/broken"):
        resolve_model("acme/broken")


def test_a_local_directory_wins_over_a_hub_name(tiny_model_dir: Path, hub_cache: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    put_in_hub_cache(tiny_model_dir, hub_cache, "acme/tiny")
    local = tmp_path / "acme" / "tiny"
    local.mkdir(parents=True)
    for file in tiny_model_dir.iterdir():
        (local / file.name).symlink_to(file)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny") == local.resolve()
    assert served_name("acme/tiny") == "tiny"  # a directory is served by its name
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        resolve_model("./no/such/dir")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model(str(tmp_path))
