"""`pdd bench overhead`: what pdd adds on top of the vLLM it runs.

A vLLM-backed standalone `pdd serve --engine vllm` and a plain `vllm serve` run on the
same weights (fp32, eager, the same block size, KV blocks, batch and sequence budgets,
OpenMP threads) at once, and one client replays the same requests against each in turn:
a warm-up each, then `--pairs` pairs, the order alternating (pdd first, then vLLM first)
so neither always runs on the warmer machine, each pair on requests of its own seed (a
repeat never hits the previous one's prefix cache). Whatever differs is pdd: its HTTP
front, its engine loop, its KV connector, its KV events and its sampler on vLLM's
steps. It prints TTFT (p50, p90) and output tokens/s of each, their ratio per pair, and
the spread (median, min-max) across the pairs. Plain vLLM runs as `vllm serve` starts it
(its API server, engine core and worker in processes of their own) unless
`--vllm-layout in-process` runs it as pdd runs vLLM on CPU (the worker inside the engine
core's process: `pdd.engines.vllm.args`): then only pdd's own code differs, not the
process layout. `--control` puts a second plain vLLM in pdd's place: the same pairs,
ratios and spreads then measure the method's own noise (two identical servers), the
floor under which no difference between pdd and vLLM can be read.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.lab.bench import options
from pdd.lab.deploy import STOP_GRACE_S, free_port, start, stop_group, wait_http
from pdd.lab.workload.types import Session

SERVERS = ("vllm", "pdd")  # plain vLLM, pdd on vLLM
START_TIMEOUT_S = 600.0  # vLLM starts in tens of seconds alone; two at once on two busy cores take minutes
SETTLE_S = 2.0  # between runs: vLLM's engine core spins a second after its last step
BLOCK_TOKENS = 32  # pdd's page on vLLM = vLLM's block
# metric -> (what a summary says, whether more is better)
METRICS: dict[str, tuple[str, bool]] = {
    "ttft_p50_ms": ("TTFT p50 (ms)", False),
    "ttft_p90_ms": ("TTFT p90 (ms)", False),
    "tpot_p50_ms": ("TPOT p50 (ms)", False),
    "output_tok_s": ("output tokens/s", True),
}
TARGET = 0.05  # the bound on pdd's overhead: the median pair within 5 % of plain vLLM


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.model_dir(p)
    options.threads(p)
    options.client(p)
    options.workload(p)
    options.out(p)
    p.add_argument("--pairs", type=int, default=5, help="measured runs of each server, alternating")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="each server's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument(
        "--control",
        action="store_true",
        help="a second plain vLLM in pdd's place (the same layout): the spread two identical servers "
        "show, the benchmark's noise floor",
    )
    p.add_argument(
        "--vllm-layout",
        choices=("default", "in-process"),
        default="default",
        help="plain vLLM's processes: default, as `vllm serve` starts them (API server, engine "
        "core and worker apart); in-process, as pdd runs vLLM on CPU (the worker inside the engine core's "
        "process), so only pdd's own code differs",
    )


def metrics_of(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The numbers this benchmark compares, from one `pdd bench` summary."""
    return {
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"],
        "output_tok_s": summary["output_tokens_per_s"],
    }


def _spread(values: Sequence[float | None]) -> dict[str, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def compare(pairs: Sequence[Mapping[str, Mapping[str, float | None]]]) -> dict[str, dict[str, Any]]:
    """Per metric: each server's spread across the pairs, the spread of pdd / vLLM taken
    pair by pair (both ran back to back, so a pair's ratio cancels what the machine
    did meanwhile), and whether the median ratio is within `TARGET` on the right side."""
    out: dict[str, dict[str, Any]] = {}
    for metric, (_, more_is_better) in METRICS.items():
        ratios = []
        for pair in pairs:
            ours, theirs = pair["pdd"][metric], pair["vllm"][metric]
            ratios.append(ours / theirs if ours is not None and theirs else None)
        ratio = _spread(ratios)
        within = None
        if ratio is not None:
            within = ratio["median"] >= 1 - TARGET if more_is_better else ratio["median"] <= 1 + TARGET
        out[metric] = {
            **{server: _spread([pair[server][metric] for pair in pairs]) for server in SERVERS},
            "ratio": ratio,
            "within_target": within,
        }
    return out


def _pair_line(name: str, m: Mapping[str, float | None]) -> str:
    return f"{name} " + ", ".join(
        f"{label} {'-' if m[key] is None else format(m[key], ',.1f')}" for key, (label, _) in METRICS.items()
    )


def _cell(spread: Mapping[str, float] | None, fmt: str) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:{fmt}} ({spread['min']:{fmt}}-{spread['max']:{fmt}})"


def format_comparison(result: Mapping[str, Mapping[str, Any]], pairs: int, control: bool = False) -> Table:
    """The comparison as a table: median (min-max) over the pairs."""
    kind = "control: plain vLLM against a second plain vLLM" if control else "pdd on vLLM against plain vLLM"
    table = Table(title=f"pdd bench overhead ({kind}): median (min-max) over {pairs} pairs")
    tested = "plain vLLM (2nd)" if control else "pdd on vLLM"
    for column in ("metric", "plain vLLM", tested, f"{tested} / plain", f"within {TARGET:.0%}"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for metric, (label, _) in METRICS.items():
        r = result[metric]
        verdict = {None: "-", True: "yes", False: "no"}[r["within_target"]]
        table.add_row(label, _cell(r["vllm"], ",.1f"), _cell(r["pdd"], ",.1f"), _cell(r["ratio"], ".3f"), verdict)
    return table


@dataclasses.dataclass
class _Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path


@contextlib.contextmanager
def _server(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Iterator[_Server]:
    """One server in its own process group, its output in a log file (quoted if it
    fails to start), stopped whole."""
    port = free_port()
    log = log_dir / f"{name}.log"
    with log.open("w") as out:
        proc = start([sys.executable, *args, "--port", str(port)], out, env)
    try:
        yield _Server(name, f"http://127.0.0.1:{port}", proc, log)
    finally:
        stop_group(proc, STOP_GRACE_S)


def _kv_blocks(model_dir: Path, gib: int) -> int:
    """The blocks `VLLM_CPU_KVCACHE_SPACE=gib` gives plain vLLM on this model (fp32)."""
    from pdd.model.config import Declared  # (not pdd.engines: the benchmarks know no engine internals)

    return (gib << 30) // (Declared.from_dir(model_dir).kv_values_per_token * 4 * BLOCK_TOKENS)


def _commands(model_dir: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    """Both servers' command lines, every budget the same: pdd gets plain vLLM's block
    count (less vLLM's null block, which pdd adds back), plain vLLM pdd's default batch
    and sequence budgets."""
    from pdd.engines.port import EngineConfig

    budgets = EngineConfig()
    common = ["--model", str(model_dir), "--served-model-name", "bench", "--host", "127.0.0.1"]
    # pdd's own layout on CPU (`pdd.engines.vllm.args`); the environment variable comes with it
    in_process = ["--distributed-executor-backend", "uni"] if args.vllm_layout == "in-process" else []
    plain = [
        "-m",
        "vllm.entrypoints.openai.api_server",  # `vllm serve` (vllm-cpu ships no `vllm` script)
        *common,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_TOKENS),
        "--max-num-seqs",
        str(budgets.max_running),
        "--max-num-batched-tokens",
        str(budgets.max_batch_tokens),
        *in_process,
    ]
    return {
        "vllm": plain,
        "pdd": plain
        if args.control
        else [
            "-m",
            "pdd.cli",
            "serve",
            *common,
            "--engine",
            "vllm",
            "--dtype",
            "float32",
            "--page-size",
            str(BLOCK_TOKENS),
            "--num-pages",
            str(_kv_blocks(model_dir, args.kv_cache_gib) - 1),
            "--max-running",  # (on vLLM pdd would leave these to vLLM's defaults: the same budgets as plain's)
            str(budgets.max_running),
            "--max-batch-tokens",
            str(budgets.max_batch_tokens),
            "--threads",
            str(args.threads),
        ],
    }


def _sessions(args: argparse.Namespace, url: str, vocab_size: int, seed: int) -> list[Session]:
    """The requests of one seed, planned once for both servers (fitted to the context
    `url`'s /v1/models says; the vocabulary is the model's, which plain vLLM does not say)."""
    from pdd.lab.bench.cli import plan_workload

    return plan_workload(argparse.Namespace(**{**vars(args), "seed": seed, "url": url, "vocab_size": vocab_size}))[0]


def _replay(server: _Server, sessions: list[Session], args: argparse.Namespace) -> dict[str, Any]:
    from pdd.lab.bench.client import run_bench
    from pdd.lab.bench.summary import summarize

    run = run_bench(server.url, sessions, timeout_s=args.timeout_s, quiet=True)
    summary = summarize(run.records, line_bytes=0, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    if summary["failed"]:
        errors = {r.error for r in run.records if r.error}
        raise RuntimeError(f"{server.name}: {summary['failed']} of {summary['requests']} requests failed: {errors}")
    time.sleep(SETTLE_S)
    return summary


def run(args: argparse.Namespace) -> int:
    import json

    from pdd.model.config import Declared
    from pdd.model.store import resolve_model

    if args.pairs < 1:
        print("pdd bench overhead: --pairs must be >= 1", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model or "")
    vocab_size = args.vocab_size or Declared.from_dir(model_dir).vocab_size
    threads = str(max(1, args.threads))
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": threads,
    }
    began = time.monotonic()
    pairs: list[dict[str, dict[str, float | None]]] = []
    with tempfile.TemporaryDirectory(prefix="pdd-overhead-") as tmp, contextlib.ExitStack() as stack:
        commands = _commands(model_dir, args)
        plain_env = env | ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.vllm_layout == "in-process" else {})
        envs = {"vllm": plain_env, "pdd": plain_env if args.control else env}
        servers = {name: stack.enter_context(_server(name, commands[name], envs[name], Path(tmp))) for name in SERVERS}
        for server in servers.values():
            try:
                wait_http(f"{server.url}/health", server.proc, START_TIMEOUT_S)
            except RuntimeError as exc:
                tail = server.log.read_text(errors="replace").splitlines()[-20:]
                print(f"pdd bench overhead: {server.name}: {exc}\n  " + "\n  ".join(tail), file=sys.stderr)
                return 1
        print(
            f"both up after {time.monotonic() - began:.0f} s (plain vLLM's layout: {args.vllm_layout}"
            f"{'; control: a second plain vLLM stands in for pdd' if args.control else ''}); "
            f"warm-up, then {args.pairs} pairs",
            flush=True,
        )
        warm_up = _sessions(args, servers["pdd"].url, vocab_size, args.seed + 1000)
        for name in SERVERS:
            _replay(servers[name], warm_up, args)
        for i in range(args.pairs):
            sessions = _sessions(args, servers["pdd"].url, vocab_size, args.seed + i)
            order = SERVERS[::-1] if i % 2 == 0 else SERVERS
            pair = {name: metrics_of(_replay(servers[name], sessions, args)) for name in order}
            pairs.append(pair)
            print(f"pair {i + 1}: " + "; ".join(_pair_line(name, m) for name, m in pair.items()), flush=True)
    result = compare(pairs)
    Console(width=140).print(format_comparison(result, len(pairs), args.control))
    print(f"wall time {time.monotonic() - began:.0f} s")
    if getattr(args, "out", None):
        Path(args.out).write_text(
            json.dumps({"control": args.control, "pairs": pairs, "comparison": result}, indent=2) + "\n"
        )
    return 0
