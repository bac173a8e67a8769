"""Shared fixtures for the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def pdd_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private PDD_HOME, so deployments the tests start use a model built here, once."""
    home = tmp_path_factory.mktemp("pdd-home")
    os.environ["PDD_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model_dir(pdd_home: Path) -> Path:
    """The default tiny model (the one `pdd up` serves), built once per session."""
    from pdd.model.store import resolve_model

    return resolve_model("")
