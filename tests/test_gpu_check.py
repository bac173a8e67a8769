"""scripts/gpu-check.sh, the checks for a lent GPU machine, runs where CI runs: without CUDA its
engine checks run as dry runs on the CPU, so one broken here fails before it costs device time,
and what a CPU cannot check says SKIP with its reason (10 s on two cores)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("a cuda-vs-cpu", "b kv-across-devices", "c vllm-layouts", "d bench-engine")


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path) -> subprocess.CompletedProcess[str]:
    """The script, once, under this interpreter, on the session's tiny model (PDD_HOME)."""
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")], env=env, capture_output=True, text=True, timeout=240
    )


def _lines(run: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """check -> (status, what it said), from the `STATUS check: numbers` lines, each check once."""
    found = re.findall(r"^(PASS|FAIL|SKIP) ([a-d] [a-z-]+): (.+)$", run.stdout, re.MULTILINE)
    assert [check for _, check, _ in found] == list(CHECKS), run.stdout + run.stderr[-3000:]
    return {check: (status, said) for status, check, said in found}


def test_every_check_reports_and_none_fails(run):
    lines = _lines(run)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert not [check for check, (status, _) in lines.items() if status == "FAIL"]


def test_each_check_says_what_it_did(run):
    """Without CUDA a, b and c run dry and say SKIP, with their reason and their numbers; d says SKIP."""
    lines = _lines(run)
    cuda = torch.cuda.is_available()
    for check in ("a cuda-vs-cpu", "b kv-across-devices", "c vllm-layouts"):
        status, said = lines[check]
        assert (status, said.startswith("no CUDA; dry run")) == (("PASS", False) if cuda else ("SKIP", True)), said
    device = "cuda" if cuda else "cpu"
    assert "4/4 greedy and 4/4 seeded runs of 64 tokens equal" in lines["a cuda-vs-cpu"][1]
    assert f"{device}->cpu 3/3, cpu->{device} 3/3 continuations" in lines["b kv-across-devices"][1]
    status, said = lines["d bench-engine"]
    assert (status == "PASS" and "decode_batch8_tok_s" in said) if cuda else status == "SKIP" and said, said
    assert "12/12 caches (NHD, HND, MLA latent; fp16, bf16, fp32, fp8 bytes)" in lines["c vllm-layouts"][1]
