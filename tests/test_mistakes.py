"""Every sub-command, given a mistake (a config file's typo, a file or model that is not
there, an instance name the file lacks, a port another process holds), says it in one
line naming what is wrong, exits 2, and shows no traceback (`pdd.errors`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pdd import config as cfg
from pdd.lab.deploy import resolve

TYPO = 'mode = "pdd"\n[router]\nprot = 8000\n'
TYPO_SAYS = "typo.toml: [router] has unknown keys: ['prot']"
NO_FILE_SAYS = "cannot read nope.toml: [Errno 2] No such file or directory: 'nope.toml'"
NO_MODEL_SAYS = "/nope/model: no such model directory"
HELD_SAYS = "cannot listen on 127.0.0.1:HELD: Address already in use"

CASES = [
    (["serve", "--config", "typo.toml", "--instance", "p0"], TYPO_SAYS),
    (["serve", "--config", "nope.toml", "--instance", "p0"], NO_FILE_SAYS),
    (["serve", "--config", "dep.toml", "--instance", "zz"],
     "dep.toml: [[instances]] has no name = 'zz' (it has p0, md0)"),
    (["serve", "--config", "dep.toml", "--instance", "p0"], HELD_SAYS),
    (["serve", "/nope/model"], NO_MODEL_SAYS),
    (["router", "--config", "typo.toml"], TYPO_SAYS),
    (["router", "--config", "nope.toml"], NO_FILE_SAYS),
    (["router", "--config", "dep.toml", "--port", "HELD"], HELD_SAYS),
    (["drain", "p0", "--config", "typo.toml"], TYPO_SAYS),
    (["drain", "p0", "--config", "bare.toml"], "bare.toml has no secret"),
    (["up", "--config", "typo.toml"], TYPO_SAYS),
    (["up", "--config", "nope.toml"], NO_FILE_SAYS),
    (["up", "--model", "/nope/model"], NO_MODEL_SAYS),
    (["up", "--mode", "colocated", "--port", "HELD"], "router: " + HELD_SAYS),
    (["soak", "--config", "nope.toml"], NO_FILE_SAYS),
    (["demo", "--model", "/nope/model"], NO_MODEL_SAYS),
    (["demo", "--config", "nope.toml"], "--config nope.toml: no such file"),
    (["bench", "engine", "--model", "/nope/model"], "/nope/model has no config.json"),
    (["netns", "up", "--config", "nope.toml"], NO_FILE_SAYS),
    (["plan", "--chips", "ZZ"], "chips must be A or B, got ['ZZ']"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir) -> tuple[Path, socket.socket]:
    """typo.toml, bare.toml (no secret), dep.toml (a resolved pd-cross-dc deployment whose
    p0 listens on the held port), and that port, held."""
    where = tmp_path_factory.mktemp("mistakes")
    held = socket.create_server(("127.0.0.1", 0))
    (where / "typo.toml").write_text(TYPO)
    (where / "bare.toml").write_text('mode = "pdd"\n')
    dep = resolve(cfg.Deployment(), "pd-cross-dc", 0)
    placed = tuple(i if i.name != "p0" else replace(i, port=held.getsockname()[1]) for i in dep.instances)
    (where / "dep.toml").write_text(cfg.dump(replace(dep, instances=placed)))
    yield where, held
    held.close()


@pytest.mark.parametrize("args, says", CASES, ids=[" ".join(a[:2]) + f" ({i})" for i, (a, _) in enumerate(CASES)])
def test_a_mistake_is_one_line_and_exit_2(files, args, says):
    where, held = files
    port = str(held.getsockname()[1])
    args = [port if a == "HELD" else a for a in args]
    out = subprocess.run([sys.executable, "-m", "pdd.cli", *args], cwd=where, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdd {args[0]}: ") and says.replace("HELD", port) in lines[0], lines
    assert " pid " not in out.stdout, out.stdout  # (pdd up) nothing was started
