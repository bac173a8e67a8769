"""scripts/gpu-check.sh, the checks for a lent GPU machine, runs where CI runs: without CUDA its
engine checks run as dry runs on the CPU, so one broken here fails before it costs device time,
and what a CPU cannot check says SKIP with its reason (20 s on two cores). Each engine check, with
a fault planted in its path (PDD_GPU_CHECK_INJECT), must say FAIL (5-10 s each): a check that cannot
fail proves nothing. Check c's verdict on CUDA, which CI has not, is tested on its parts."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECKS = (
    "a cuda-vs-cpu",
    "b kv-across-devices",
    "c vllm-layouts",
    "d bench-engine",
    "e copies-beside-decode",
    "f streamed-layers",
)
LINE = re.compile(r"^(PASS|FAIL|SKIP) ([a-f] [a-z-]+): (.+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path) -> subprocess.CompletedProcess[str]:
    """The script, once, under this interpreter, on the session's tiny model (PDD_HOME)."""
    return _script()


def _script(*args: str, inject: str = "") -> subprocess.CompletedProcess[str]:
    """scripts/gpu-check.sh with `args`, under this interpreter, with PDD_GPU_CHECK_INJECT=`inject`."""
    env = {**os.environ, "PYTHON": sys.executable, "PDD_GPU_CHECK_INJECT": inject}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), *args], env=env, capture_output=True, text=True, timeout=240
    )


def _lines(run: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """check -> (status, what it said), from the `STATUS check: numbers` lines, each check once."""
    found = LINE.findall(run.stdout)
    assert [check for _, check, _ in found] == list(CHECKS), run.stdout + run.stderr[-3000:]
    return {check: (status, said) for status, check, said in found}


def test_every_check_reports_and_none_fails(run):
    lines = _lines(run)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert not [check for check, (status, _) in lines.items() if status == "FAIL"]


def test_each_check_says_what_it_did(run):
    """Without CUDA a, b, c and e run dry and say SKIP, with their reason and their numbers; d says SKIP."""
    lines = _lines(run)
    cuda = torch.cuda.is_available()
    for check in (c for c in CHECKS if c != "d bench-engine"):
        status, said = lines[check]
        if cuda and check == "c vllm-layouts" and importlib.util.find_spec("vllm") is None:
            assert status == "SKIP" and "did not run" in said, said  # vLLM's own kernels did not run: no PASS
            continue
        assert (status, said.startswith("no CUDA; dry run")) == (("PASS", False) if cuda else ("SKIP", True)), said
    device = "cuda" if cuda else "cpu"
    assert "4/4 greedy and 4/4 seeded runs of 64 tokens equal" in lines["a cuda-vs-cpu"][1]
    assert f"{device}->cpu 3/3, cpu->{device} 3/3 continuations" in lines["b kv-across-devices"][1]
    status, said = lines["d bench-engine"]
    assert (status == "PASS" and "decode_batch8_tok_s" in said) if cuda else status == "SKIP" and said, said
    assert "12/12 caches (NHD, HND, MLA latent; fp16, bf16, fp32, fp8 bytes)" in lines["c vllm-layouts"][1]
    said = lines["e copies-beside-decode"][1]
    assert (
        f"imported into {device} and exported back in " in said
        and "3/3 landed byte-equal, 3/3 exported back byte-equal" in said
    )
    assert "3/3 continuations (64 tokens)" in said, said
    assert re.search(r"ITL p50/p99 [\d.]+/[\d.]+ ms without, [\d.]+/[\d.]+ ms during; import [\d,]+ MB/s", said), said
    said = lines["f streamed-layers"][1]
    assert f"3 prompts prefilled on {device} in 64-token steps" in said and "3/3 prompts' pieces equal" in said, said


@pytest.mark.parametrize(
    ("fault", "check", "caught"),
    [
        ("logit-offset", "a cuda-vs-cpu", "first-step logits max |diff| 1 (tol 0.05)"),
        ("corrupt-page", "b kv-across-devices", "->cpu 2/3, cpu->"),
        ("lost-slice", "e copies-beside-decode", "2/3 landed byte-equal, 2/3 exported back byte-equal"),
        ("stale-piece", "f streamed-layers", "2/3 prompts' pieces equal"),
    ],
)
def test_an_injected_fault_fails_its_check(tiny_model_dir, fault, check, caught):
    """The fault planted in the check's path is caught by the check's own comparison, CPU or CUDA:
    FAIL, the number that caught it, exit 1. The dry run's SKIP says only that the comparison held."""
    proc = _script("--only", check[0], inject=fault)
    found = LINE.findall(proc.stdout)
    assert [(status, name) for status, name, _ in found] == [("FAIL", check)], proc.stdout + proc.stderr[-3000:]
    assert caught in found[0][2], found[0][2]
    assert proc.returncode == 1


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    """scripts/gpu_check.py as a module, for the parts of its checks a CPU cannot reach by running it."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("args", "fault", "error"),
    [
        (["--only", "ag"], "", "--only takes letters"),
        ([], "nan-logits", "known faults are logit-offset, corrupt-page, lost-slice, stale-piece"),
        (["--only", "abcd"], "lost-slice", "targets check e, which --only leaves out"),
        (["--only", "a"], "corrupt-page", "targets check b, which --only leaves out"),
    ],
)
def test_usage_errors(gpu_check, monkeypatch, capsys, args, fault, error):
    """A fault named wrong, or planted in a check that will not run, is a usage error, not a clean run."""
    monkeypatch.setenv("PDD_GPU_CHECK_INJECT", fault)
    with pytest.raises(SystemExit) as exit_:
        gpu_check.arguments(args)
    assert exit_.value.code == 2 and error in capsys.readouterr().err


def _pytest(code: int, stdout: str) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], code, stdout, "")


SKIPPED = "SKIPPED [2] tests/test_vllm_layouts.py:40: vLLM built without CUDA\n"


@pytest.mark.parametrize(
    ("proc", "status", "said"),
    [
        (_pytest(0, "== 6 passed, 20 deselected in 3.1s =="), "PASS", "-k cuda: 6 passed, 20 deselected in 3.1s"),
        (_pytest(0, SKIPPED + "== 4 passed, 2 skipped in 3s =="), "SKIP", "2 of vLLM's kernel cases did not run: "),
        (_pytest(0, SKIPPED + "== 2 skipped, 20 deselected in 1s =="), "SKIP", "vLLM built without CUDA"),
        (_pytest(5, "== 26 deselected in 1s =="), "SKIP", "collected no test: vLLM's own kernels did not run"),
        (_pytest(1, "== 1 failed, 5 passed in 3s =="), "FAIL", "1 failed, 5 passed in 3s (exit 1)"),
        (_pytest(0, ""), "SKIP", "no summary"),
    ],
)
def test_vllm_cases_pass_only_when_all_ran_and_passed(gpu_check, proc, status, said):
    """On CUDA, check c's pytest run of vLLM's kernel cases: a skipped case, or none, is SKIP, not PASS."""
    got = gpu_check.vllm_cases(proc, "12/12 caches", "tests/test_vllm_layouts.py")
    assert got[0] == status and said in got[1], got


def test_vllm_layouts_without_vllm_skips_on_cuda(gpu_check, monkeypatch):
    """On CUDA without vLLM the synthetic cases pass, but vLLM's own did not run: SKIP, naming them."""
    monkeypatch.setattr(gpu_check, "CUDA", True)  # DEVICE stays: the synthetic cases run where they can
    monkeypatch.setattr(gpu_check, "vllm_installed", lambda: False)
    status, said = gpu_check.check_vllm_layouts()
    assert (
        status == "SKIP" and said.startswith("12/12 caches") and "CUDA cases (vLLM's own kernels) did not run" in said
    )
