"""Where a deployment's model lives: a directory, a hub name in the local Hugging Face
cache, or the embedded tiny model.

A hub name (`ORG/NAME`, as vLLM takes it) is looked up offline, in the cache that
`huggingface_hub` uses (`HF_HUB_CACHE`, else `HF_HOME/hub`): pdd never downloads, so a
model that is not there is an error that says where it looked and how to get it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from pdd.errors import ModelNotFound


def home() -> Path:
    return Path(os.environ.get("PDD_HOME") or Path.home() / ".cache" / "pdd")


def resolve_model(path: str) -> Path:
    """The model directory of `path`: a local directory, else a hub name's cached
    snapshot (its `refs/main`); the tiny model, built once under PDD_HOME, when empty."""
    if not path:
        return _tiny()
    local = Path(path).expanduser()
    if local.is_dir():
        local = local.resolve()
        if not (local / "config.json").is_file():
            raise ModelNotFound(f"{local} is not a model directory (no config.json)")
        return local
    if not is_hub_name(path):
        raise ModelNotFound(f"{path}: no such model directory")
    return _from_hub_cache(path)


def is_hub_name(path: str) -> bool:
    """A hub model id (`ORG/NAME` or `NAME`) that is not a directory here."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(path).expanduser().is_dir() or path.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def served_name(path: str) -> str:
    """The model id the API serves by default: the hub name as given, else the
    directory's name, else "tiny" for the embedded model."""
    if not path:
        return "tiny"
    return path if is_hub_name(path) else Path(path).expanduser().resolve().name


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, IncompleteSnapshotError) as e:
        raise ModelNotFound(
            f"{repo_id}: no such directory, and no complete snapshot of it in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (set HF_HOME or HF_HUB_CACHE to use another). pdd does not download: "
            f"fetch it where there is network (`hf download {repo_id}`) and copy the cache here, or pass "
            f"a model directory. ({type(e).__name__})"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"{repo_id}: the cached snapshot {snapshot} has no config.json")
    return snapshot


def _tiny() -> Path:
    models = home() / "models"
    target, stamp = models / "tiny", models / "tiny.revision"  # (the stamp beside it: a model dir holds the model)
    if not (target / "config.json").is_file() or not stamp.is_file() or stamp.read_text() != TINY_REVISION:
        from pdd.model.tiny import make_tiny  # torch and tokenizers: only when it has to be built

        models.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=models, prefix=".tiny-"))
        try:
            make_tiny(tmp)
            if target.exists():  # an earlier revision's: moved aside whole, then removed
                old = Path(tempfile.mkdtemp(dir=models, prefix=".tiny-old-"))
                with contextlib.suppress(OSError):  # (another process moved it first)
                    target.rename(old / "tiny")
                shutil.rmtree(old, ignore_errors=True)
            with contextlib.suppress(OSError):  # another process finished first: theirs is identical
                tmp.rename(target)
            stamp.write_text(TINY_REVISION)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# make_tiny's output, counted up when it changes, so a build cached under PDD_HOME by an
# earlier release is built again (2: a chat template that renders tools)
TINY_REVISION = "2"
