"""pdd on a lent GPU machine: the checks scripts/gpu-check.sh runs, one line each.

a cuda-vs-cpu: the embedded engine on CUDA against the same engine on the CPU, on the tiny
  model in fp32: every prompt position's first-step logits within a tolerance, and the same
  64 greedy and 64 seeded tokens for prompts of a few hundred tokens.
b kv-across-devices: a prompt's KV exported by a CUDA engine, sent as bytes, imported by a
  CPU one that decodes on, and the reverse: the continuations equal a colocated run's.
c vllm-layouts: tests/test_vllm_layouts.py's CUDA cases (its CPU cases without CUDA), where vLLM
  is installed: they run on vLLM's own code, which no lent machine has, so there they say SKIP.
d bench-engine: `pdd bench engine --device cuda` figures, engine and HTTP, printed and never judged.

Each line reads PASS, FAIL or SKIP, the check, its numbers; the exit code is 1 if one failed.
Without CUDA, a and b run as a dry run, the CPU in the GPU's place, and say SKIP (CPU against
CPU is tests/test_engine.py's): a check broken here fails before it costs device time.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from pdd.engine.engine import Engine
from pdd.engine_port import EngineConfig
from pdd.kv import codec
from pdd.model.store import resolve_model
from pdd.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The CPU's fp32 logits against an fp64 run of the tiny model: max |diff| 5.8e-3 over 4 prompts of
# 262-396 tokens (logits up to 38), |diff| / |ref| 1.4e-5: its sharp last layer (attention score
# std 300) magnifies rounding. CUDA's fp32 may be as far again. Greedy picks lie >= 0.47 apart
# (pdd/model/tiny.py): two logits off by 0.05 each, opposite ways, are still 4x short of a flip.
MAX_ABS_TOL, REL_TOL = 0.05, 1e-4
GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0, seed=7)
SUBPROCESS_S = 180  # a hung pytest or bench fails its check and leaves the device call time to report


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 4096) for _ in range(rng.randrange(200, 400))] for _ in range(n)]


def drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Outputs of prompts run together from an empty cache, and each one's first-step logits (on the CPU)."""
    engine.flush_cache()
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(batch)]
    for seq in seqs:
        seq.want_logits = True
    drain(engine)
    return [s.output for s in seqs], [s.step_logits for s in seqs]


def verdict(ok: bool, numbers: str) -> tuple[str, str]:
    if not CUDA:
        return ("SKIP" if ok else "FAIL"), f"no CUDA; dry run, the CPU in the GPU's place: {numbers}"
    return ("PASS" if ok else "FAIL"), numbers


def check_cuda_vs_cpu(cpu: Engine, dev: Engine) -> tuple[str, str]:
    batch = prompts(1, 4)
    want, want_logits = run(cpu, batch, GREEDY)
    got, got_logits = run(dev, batch, GREEDY)
    pairs = list(zip(got_logits, want_logits, strict=True))
    max_abs = max((g - w).abs().max().item() for g, w in pairs)
    rel = max(((g - w).norm() / w.norm()).item() for g, w in pairs)
    greedy = sum(g == w for g, w in zip(got, want, strict=True))
    seeded = sum(g == w for g, w in zip(run(dev, batch, SEEDED)[0], run(cpu, batch, SEEDED)[0], strict=True))
    ok = max_abs <= MAX_ABS_TOL and rel <= REL_TOL and greedy == seeded == len(batch)
    lengths = sorted(len(p) for p in batch)
    return verdict(
        ok,
        f"first-step logits max |diff| {max_abs:.2g} (tol {MAX_ABS_TOL}), |diff|/|ref| {rel:.2g} (tol {REL_TOL}); "
        f"{greedy}/{len(batch)} greedy and {seeded}/{len(batch)} seeded runs of 64 tokens equal "
        f"(prompts of {lengths[0]}-{lengths[-1]} tokens)",
    )


def handover(src: Engine, dst: Engine, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    """Prefill on src, ship each prompt's KV as bytes, decode on dst (tests/test_engine.py's _handover, batched);
    the outputs and the bytes shipped."""
    src.flush_cache()
    dst.flush_cache()  # nothing cached: every prompt token's KV crosses
    for i, p in enumerate(batch):
        src.add_request(f"p{i}", p, SamplingParams(max_tokens=1, ignore_eos=True), hold=True)
    drain(src)
    seqs, shipped = [], 0
    for i, p in enumerate(batch):
        hit = dst.reserve(f"d{i}", p, GREEDY)
        data = codec.encode(src.export_kv(f"p{i}", hit, len(p)))
        shipped += len(data)
        dst.import_kv(f"d{i}", codec.decode(data))
        seqs.append(dst.start(f"d{i}", src.seqs[f"p{i}"].output))
        src.release(f"p{i}")
    drain(dst)
    return [s.output for s in seqs], shipped


def check_kv_across_devices(cpu: Engine, dev: Engine) -> tuple[str, str]:
    batch = prompts(2, 3)
    parts, ok, shipped = [], True, 0
    for src, dst in ((dev, cpu), (cpu, dev)):
        want = run(dst, batch, GREEDY)[0]  # colocated on the importer: device rounding stays out of it
        got, sent = handover(src, dst, batch)
        equal = sum(g == w for g, w in zip(got, want, strict=True))
        ok, shipped = ok and equal == len(batch), shipped + sent
        parts.append(f"{src.config.device}->{dst.config.device} {equal}/{len(batch)}")
    return verdict(
        ok, f"{', '.join(parts)} continuations (64 tokens) equal a colocated run; {shipped / 2**20:.1f} MiB of KV sent"
    )


def tail(proc: subprocess.CompletedProcess[str], lines: int = 15) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


def check_vllm_layouts() -> tuple[str, str]:
    test = "tests/test_vllm_layouts.py"
    if not (ROOT / test).exists():
        return "SKIP", f"{test} is not there"
    if importlib.util.find_spec("vllm") is None:
        # vLLM's CUDA build is a wheel of hundreds of MiB: more than a device call carries (64 MiB)
        return "SKIP", f"vLLM is not installed: {test} runs on vLLM's own allocator, backends and kernels"
    select = "cuda" if CUDA else "not cuda"  # the CUDA cases: a "cuda" device parameter, or "cuda" in the name
    cmd = [sys.executable, "-m", "pytest", test, "-k", select, "-p", "no:cacheprovider", "-rs"]
    env = {**os.environ, "PDD_VLLM": "1"}  # a vLLM test: PDD_VLLM=0 would leave the file out
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_S)
    counts = re.findall(r"^\d+ (?:passed|failed|errors?|skipped|deselected).*$", proc.stdout, re.MULTILINE)
    summary = counts[-1] if counts else "no summary"
    if proc.returncode:
        print(tail(proc), file=sys.stderr)
        return "FAIL", f"{test} -k '{select}': {summary} (exit {proc.returncode})"
    if not re.search(r"\d+ passed", summary):  # every case skipped: nothing was checked
        return "SKIP", f"{test} -k '{select}': {summary}"
    return "PASS", f"{test} -k '{select}': {summary}"


def check_bench(model: Path) -> tuple[str, str]:
    if not CUDA:  # (the CPU run keeps under a minute on 2 cores: c's vLLM import alone takes 20 s of it)
        return "SKIP", "no CUDA: CPU figures are `pdd bench engine`'s own (tests/test_cli_e2e.py runs it, 20 s)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "pdd.cli", "bench", "engine", "--device", DEVICE, "--model", str(model)]
        proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_S)
        if proc.returncode:
            print(tail(proc), file=sys.stderr)
            return "FAIL", f"pdd bench engine --device {DEVICE} exited {proc.returncode}"
        figures = json.loads(out.read_text())
    return "PASS", ", ".join(f"{k} {v:,.1f}" for k, v in figures.items())


def main() -> int:
    # fp32 on the matrix units (tf32) keeps 10 mantissa bits: ~1e-3 relative, 10x what a allows
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # the tiny model's CPU steps are too small to share: 4 prompts' 64 greedy tokens took 17 s on
    # 2 threads of a 2-core machine beside other work, 1.2 s on one (the project's rule for benches too)
    torch.set_num_threads(1)
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if CUDA else "no CUDA device"
    print(f"gpu-check: python {sys.version.split()[0]}, torch {torch.__version__}, {where}", flush=True)
    model = resolve_model("")

    @functools.cache
    def engines() -> tuple[Engine, Engine]:  # built by the first check that needs them: one that fails fails it
        cpu, dev = (Engine(model, EngineConfig(page_size=16, num_pages=512, device=d)) for d in ("cpu", DEVICE))
        return cpu, dev

    checks: dict[str, Callable[[], tuple[str, str]]] = {
        "a cuda-vs-cpu": lambda: check_cuda_vs_cpu(*engines()),
        "b kv-across-devices": lambda: check_kv_across_devices(*engines()),
        "c vllm-layouts": check_vllm_layouts,
        "d bench-engine": lambda: check_bench(model),
    }
    failed = 0
    for name, check in checks.items():
        t = time.perf_counter()
        try:
            status, numbers = check()
        except Exception as e:  # one broken check is reported and the others still run
            traceback.print_exc()
            status, numbers = "FAIL", f"{type(e).__name__}: {e}"
        print(f"{status} {name}: {numbers} [{time.perf_counter() - t:.1f} s]", flush=True)
        failed += status == "FAIL"
    print(f"gpu-check: {failed} failed, {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
