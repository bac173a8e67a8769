"""Where a deployment's model lives: a given directory, or the embedded tiny model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pdd.model.tiny import make_tiny


def home() -> Path:
    return Path(os.environ.get("PDD_HOME") or Path.home() / ".cache" / "pdd")


def resolve_model(path: str) -> Path:
    """`path` if given; otherwise the tiny model, built once (atomically) under PDD_HOME."""
    if path:
        p = Path(path).expanduser().resolve()
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} is not a model directory (no config.json)")
        return p
    target = home() / "models" / "tiny"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
        try:
            make_tiny(tmp)
            try:
                tmp.rename(target)
            except OSError:  # another process finished first: theirs is identical
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
