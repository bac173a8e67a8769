"""pdd on a lent GPU machine: the checks scripts/gpu-check.sh runs, one line each.

a cuda-vs-cpu: the embedded engine on CUDA against the same engine on the CPU, on the tiny
  model in fp32: every prompt position's first-step logits within a tolerance, and the same
  64 greedy and 64 seeded tokens for prompts of a few hundred tokens.
b kv-across-devices: a prompt's KV exported by a CUDA engine, sent as bytes, imported by a
  CPU one that decodes on, and the reverse: the continuations equal a colocated run's.
c vllm-layouts: pdd's layouts on caches in each physical order vLLM allocates, written as its
  kernels write them (synthetic: vLLM's CUDA wheel is too large to carry), and, where vLLM is
  installed with CUDA, tests/test_vllm_layouts.py's CUDA cases on vLLM's own kernels.
d bench-engine: `pdd bench engine --device cuda` figures, engine and HTTP, printed and never judged.
e copies-beside-decode: KV a CPU engine exported, imported by the embedded engine's runtime on CUDA in
  many small slices on its copy thread (page-locked memory, a copy stream), beside its decode steps, and
  exported back: the bytes equal the CPU's both ways and the decode continues as a colocated CPU run;
  then `pdd bench stall --device cuda`'s inter-token latency without and during an import (never judged).

Each line reads PASS, FAIL or SKIP, the check, its numbers; the exit code is 1 if one failed.
PASS means every part of the check ran and held; a part that did not run makes it SKIP, naming it.
Without CUDA, a, b, c and e run as a dry run, the CPU in the GPU's place, and say SKIP (CPU against
CPU is tests/test_engine.py's) when they hold and FAIL when not: a check broken here fails before
it costs device time. `--only ab` runs those checks alone.

A check that cannot fail proves nothing, so PDD_GPU_CHECK_INJECT plants a fault in one check's own
path, for its comparison to catch (on the CPU too: its line must then say FAIL, and the exit be 1):
  logit-offset  a: the device engine's logits gain +1.0 on one prompt position;
  corrupt-page  b: one page of a prompt's KV is scaled on its way, between the bytes and the import;
  lost-slice    e: the device runtime's first import loses one of its middle slices.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pdd.engines.embedded.engine import Engine
from pdd.engines.port import EngineConfig
from pdd.kv import codec
from pdd.model.store import resolve_model
from pdd.sampling.params import SamplingParams

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
INJECTIONS = {
    "logit-offset": "a",
    "corrupt-page": "b",
    "lost-slice": "e",
    "stale-piece": "f",
}  # PDD_GPU_CHECK_INJECT's faults -> the check they target
LOGIT_OFFSET = 1.0  # 20x check a's MAX_ABS_TOL
PAGE_SCALE = -4.0  # corrupt-page: a page's K and V, sign flipped and 4x: attention over it is another


def inject() -> str:
    """The fault PDD_GPU_CHECK_INJECT asks for ("" for none); read per call so a test can set it."""
    return os.environ.get("PDD_GPU_CHECK_INJECT", "")


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


@contextlib.contextmanager
def offset_logits(engine: Engine, offset: float = LOGIT_OFFSET) -> Iterator[None]:
    """The logit-offset fault: while it lasts, the first row of each of the engine's logits calls gains
    `offset` in every entry. In a first step's logits that row is the first prompt position, which check
    a's tolerance must catch; in a sampling call it is one sequence's row, whose sampling (greedy,
    seeded: no penalties) a uniform shift leaves as it was, so the tolerance alone is what catches it.
    The engine is check b's too: its own logits come back after."""
    model = engine.model
    original = model.logits

    def shifted(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        return torch.cat([out[:1] + offset, out[1:]])  # out of place: an inference-mode tensor

    model.logits = shifted  # an instance attribute over the method (nn.Module keeps plain callables as such)
    try:
        yield
    finally:
        del model.logits


def check_cuda_vs_cpu(cpu: Engine, dev: Engine) -> tuple[str, str]:
    """a: the device engine's first-step logits and 64-token outputs against the CPU engine's."""
    batch = prompts(1, 4)
    want, want_logits = run(cpu, batch, GREEDY)
    faulty = inject() == "logit-offset"
    with offset_logits(dev) if faulty else contextlib.nullcontext():
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


def corrupt_page(blob: codec.KVBlob, page_size: int) -> None:
    """The corrupt-page fault: the blob's first page of tokens, K and V in every layer, scaled by PAGE_SCALE
    in place, as a line or a buffer gone wrong would leave the bytes the importer reads."""
    page = slice(0, min(page_size, blob.header.num_tokens))
    blob.k[:, page] *= PAGE_SCALE
    blob.v[:, page] *= PAGE_SCALE


def handover(src: Engine, dst: Engine, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    """Prefill on src, ship each prompt's KV as bytes, decode on dst (tests/test_engine.py's _handover, batched);
    the outputs and the bytes shipped. With the corrupt-page fault the first prompt's KV arrives with one page
    corrupted: its continuation should then differ from a colocated run's."""
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
        blob = codec.decode(data)
        if i == 0 and inject() == "corrupt-page":
            corrupt_page(blob, dst.config.page_size)
        dst.import_kv(f"d{i}", blob)
        seqs.append(dst.start(f"d{i}", src.seqs[f"p{i}"].output))
        src.release(f"p{i}")
    drain(dst)
    return [s.output for s in seqs], shipped


def check_kv_across_devices(cpu: Engine, dev: Engine) -> tuple[str, str]:
    """b: KV handed over as bytes each way between the engines continues as a colocated run does."""
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


def synthetic_layouts() -> tuple[bool, str]:
    """pdd's layouts over one layer's cache in each physical order vLLM allocates
    (`create_kv_cache_views`: token-major NHD, head-major HND, MLA's latent), on DEVICE, in
    each storage dtype (an fp8 cache's bytes too): what a kernel writes at a token's (block,
    offset), indexed here by hand, pdd reads back, and what pdd writes lands there."""
    from pdd.engines.vllm.layout import LatentLayout, TokenMajorLayout

    g = torch.Generator().manual_seed(0)
    blocks, n, heads, d, width = 8, 16, 4, 32, 72
    slots = torch.randperm(blocks * n, generator=g)[:40]
    at = [(int(s) // n, int(s) % n) for s in slots]
    passed, cases = 0, 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.uint8):
        for order in ("NHD", "HND", "latent"):

            def values(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                if dtype is torch.uint8:
                    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
                return torch.randn(*shape, generator=g).to(dtype)

            if order == "latent":
                cache = torch.zeros(blocks, n, width, dtype=dtype, device=DEVICE)
                layout: LatentLayout | TokenMajorLayout = LatentLayout(cache.view(blocks, 1, n, width), width)
                k, v = values(len(slots), 1, width), None
                rows = [k[i, 0] for i in range(len(slots))]
            else:
                shape = (blocks, n, heads, 2 * d) if order == "NHD" else (blocks, heads, n, 2 * d)
                cache = torch.zeros(shape, dtype=dtype, device=DEVICE)
                layout = TokenMajorLayout(cache.permute(0, 2, 1, 3) if order == "NHD" else cache, d)
                k, v = values(len(slots), heads, d), values(len(slots), heads, d)
                rows = [torch.cat([k[i], v[i]], -1) for i in range(len(slots))]

            def slot(i: int, cache: torch.Tensor = cache, order: str = order) -> torch.Tensor:  # a kernel's index
                b, o = at[i]
                return cache[b, :, o] if order == "HND" else cache[b, o]

            for i, row in enumerate(rows):
                slot(i).copy_(row)
            rk, rv = layout.read(slots)
            ok = torch.equal(rk, k) and (v is None or torch.equal(rv, v))
            cache.zero_()
            layout.write(slots, k, k[..., :0] if v is None else v)
            ok = ok and all(torch.equal(slot(i).cpu(), row) for i, row in enumerate(rows))
            cases, passed = cases + 1, passed + ok
    what = "caches (NHD, HND, MLA latent; fp16, bf16, fp32, fp8 bytes)"
    return passed == cases, f"{passed}/{cases} {what} read what a kernel wrote and written where it reads"


def vllm_installed() -> bool:
    """Whether vLLM can be imported: its CUDA cases need it (a function, for a test to stand in for it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_cases(proc: subprocess.CompletedProcess[str], said: str, test: str) -> tuple[str, str]:
    """Check c's verdict from its pytest run of vLLM's CUDA cases, after synthetic cases that passed (`said`):
    PASS only if some ran and all of them passed, FAIL if one failed, SKIP naming what did not run (pytest
    finding none, or skipping some): a case that did not run is not one that passed."""
    summaries = re.findall(
        r"^=* ?(\d+ (?:passed|failed|errors?|skipped|deselected).*?) ?=*$", proc.stdout, re.MULTILINE
    )
    summary = summaries[-1] if summaries else "no summary"
    counts = {word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    where = f"{said}; {test} -k cuda: {summary}"
    if proc.returncode == 5:  # pytest: no test collected
        return "SKIP", f"{said}; {test} -k cuda collected no test: vLLM's own kernels did not run"
    if proc.returncode:
        print(tail(proc), file=sys.stderr)
        return "FAIL", f"{where} (exit {proc.returncode})"
    if counts.get("skipped") or not counts.get("passed"):
        reasons = re.findall(r"^SKIPPED \[\d+\] (.+)$", proc.stdout, re.MULTILINE)
        why = f": {reasons[0][:200]}" if reasons else ""
        why += f" and {len(reasons) - 1} more" if len(reasons) > 1 else ""
        return "SKIP", f"{where}; {counts.get('skipped', 0)} of vLLM's kernel cases did not run{why}"
    return "PASS", where


def check_vllm_layouts() -> tuple[str, str]:
    """c: the synthetic layout cases (synthetic_layouts), then, on CUDA with vLLM, tests/test_vllm_layouts.py's
    CUDA cases on vLLM's own kernels. PASS only when both ran and passed; SKIP, naming the part that did not
    run, when one did not (always without CUDA: a dry run); FAIL when a part that ran failed."""
    status, said = verdict(*synthetic_layouts())
    test = "tests/test_vllm_layouts.py"
    if status == "FAIL":
        return status, said
    if not CUDA:
        return status, f"{said}; vLLM's own kernels: {test}, whose CPU cases the suite runs"
    if not vllm_installed() or not (ROOT / test).exists():
        # vLLM's CUDA build is a wheel of hundreds of MiB: more than a device call carries (64 MiB)
        return "SKIP", f"{said}; vLLM is not installed: {test}'s CUDA cases (vLLM's own kernels) did not run"
    # the CUDA cases: a "cuda" device parameter, or "cuda" in the name
    cmd = [sys.executable, "-m", "pytest", test, "-k", "cuda", "-p", "no:cacheprovider", "-rs"]
    env = {**os.environ, "PDD_VLLM": "1"}  # a vLLM test: PDD_VLLM=0 would leave the file out
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_S)
    return vllm_cases(proc, said, test)


def check_bench(model: Path) -> tuple[str, str]:
    if not CUDA:
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


def check_copies_beside_decode(cpu: Engine, model: Path) -> tuple[str, str]:
    """e: KV copied on the device runtime's copy thread, beside its steps, byte for byte both ways and decoded
    on as a colocated CPU run (scripts/gpu_checks_kv.py), then `pdd bench stall`'s figures there."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))  # scripts/ is no package
    import gpu_checks_kv as kv

    batch = prompts(5, 3)
    want = run(cpu, batch, GREEDY)[0]
    with kv.lost_slice() if inject() == "lost-slice" else contextlib.nullcontext():
        ok, said = kv.copies_on_device(cpu, model, DEVICE, batch, want, GREEDY)
    return verdict(ok, f"{said}; {kv.stall_figures(DEVICE)}")


def check_streamed_layers(model: Path) -> tuple[str, str]:
    """f: a prefill's layers streamed off the device as they are computed (P's layer-by-layer path), each
    equal to the device's export of the same tokens (scripts/gpu_checks_kv.py)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))  # scripts/ is no package
    import gpu_checks_kv as kv

    with kv.stale_piece() if inject() == "stale-piece" else contextlib.nullcontext():
        return verdict(*kv.streamed_on_device(model, DEVICE, prompts(6, 3)))


def arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line (--only), checked with PDD_GPU_CHECK_INJECT: a fault named wrong, or planted in a check
    left out, is a usage error (exit 2), not a run whose checks could not have failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="abcdef", help="the checks to run, by letter: a, ab, b,c (default: all)")
    args = parser.parse_args(argv)
    args.only = set(args.only.replace(",", ""))
    if not args.only or not args.only <= set("abcdef"):
        parser.error(f"--only takes letters of a, b, c, d, e, f, not {''.join(sorted(args.only))!r}")
    fault = inject()
    if fault and fault not in INJECTIONS:
        parser.error(f"PDD_GPU_CHECK_INJECT={fault!r}: known faults are {', '.join(INJECTIONS)}")
    if fault and INJECTIONS[fault] not in args.only:
        parser.error(f"PDD_GPU_CHECK_INJECT={fault} targets check {INJECTIONS[fault]}, which --only leaves out")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    # fp32 on the matrix units (tf32) keeps 10 mantissa bits: ~1e-3 relative, 10x what a allows
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # the tiny model's CPU steps are too small to share: 4 prompts' 64 greedy tokens took 17 s on
    # 2 threads of a 2-core machine beside other work, 1.2 s on one (the project's rule for benches too)
    torch.set_num_threads(1)
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if CUDA else "no CUDA device"
    print(f"gpu-check: python {sys.version.split()[0]}, torch {torch.__version__}, {where}", flush=True)
    if inject():
        print(f"gpu-check: injecting {inject()} into check {INJECTIONS[inject()]}: its line must say FAIL", flush=True)
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
        "e copies-beside-decode": lambda: check_copies_beside_decode(engines()[0], model),
        "f streamed-layers": lambda: check_streamed_layers(model),
    }
    failed = 0
    for name, check in checks.items():
        if name[0] not in args.only:
            continue
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
