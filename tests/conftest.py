"""Shared fixtures for the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model, built once per session: it takes seconds, and is read-only."""
    from pdd.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-model"))
