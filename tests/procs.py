"""Start real `pdd` processes for integration tests, and always stop them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai

from pdd import config as cfg
from pdd.engines.port import EngineConfig
from pdd.lab import deploy
from pdd.lab.deploy import wait_http

# the tests' one HTTP client: building a client's TLS context costs tens of milliseconds of CPU,
# and tests poll. No connection is kept between requests: each opens its own, as `httpx.get` does,
# so a server a test stops or kills is never reached through a connection pooled before.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), trust_env=False)

_DRAWN: set[int] = set()  # every port this test process drew: a test's several draws never repeat


def free_port() -> int:
    """A port free to listen on, never one this test process drew before."""
    return deploy.free_port(_DRAWN)


@contextlib.contextmanager
def pdd_process(args: list[str], health_url: str | None = None, timeout: float = 60.0,
                env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run `python -m pdd.cli ARGS` (with `env` added to the environment) in its own
    process group; kill the group on exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "pdd.cli", *args], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if health_url:
            wait_http(health_url, proc, timeout)
            # keep the pipe drained: a server whose log fills it (a few tracebacks) blocks on write and hangs
            threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield proc
    finally:
        stop_group(proc)


@contextlib.contextmanager
def standalone(model_dir: object, *extra: str, pages: int = 256) -> Iterator[str]:
    """A `pdd serve` standalone instance serving `model_dir` as "tiny"; yields its URL
    and checks, on the way out, that it survived whatever the test sent it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--role", "standalone", "--model", str(model_dir), "--port", str(port),
            "--served-model-name", "tiny", "--num-pages", str(pages), *extra]
    with pdd_process(args, f"{url}/health") as proc:
        yield url
        assert proc.poll() is None, "the server died during the tests"


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        deploy.stop_group(proc, grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer, for one token, in the engines' KV dtype (the defaults)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    engine = EngineConfig()
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[engine.kv_dtype or engine.dtype]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def metrics(url: str) -> dict[str, float]:
    """A server's `pdd_*` Prometheus series (name with labels -> value)."""
    lines = HTTP.get(f"{url}/metrics", timeout=5).text.splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("pdd_")}


def rejected_frames(url: str) -> float:
    """The frames a server rejected, over every reason (`pdd_rejected_frames_total{reason}`:
    no series at all until the first)."""
    return sum(v for k, v in metrics(url).items() if k.startswith("pdd_rejected_frames_total{"))


def handed_over_within(send: Callable[[], Any], handed: Callable[[Any], bool], tries: int = 4) -> Any:
    """The first of up to `tries` answers to `send()` that `handed` says the relay and MD
    both produced: the premise of a test of what crosses a handoff. On a loaded machine
    the relay may finish a request alone before MD is ready (the design's answer to a
    slow MD), so the same request goes again."""
    for _ in range(tries):
        answer = send()
        if handed(answer):
            return answer
    raise AssertionError(f"{tries} requests in a row were not handed over to MD in time: {answer}")


def wait_until(condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> Any:
    """Poll `condition()` until it returns something truthy, and return that; fail naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(poll)
    raise AssertionError(f"not within {timeout:g} s: {what} (last: {last!r})")


class Deployment:
    """A running `pdd up`, with what it printed: router URL, instance pids and HTTP URLs,
    the line emulator's admin URL, run directory (its `deployment.toml` holds the secret)."""

    def __init__(self, proc: subprocess.Popen, lines: list[str]) -> None:
        self.proc = proc
        self.lines = lines
        self.url = next(line.split()[1] for line in lines if line.startswith("router: "))
        mode_line = next(line for line in lines if line.startswith("pdd up: mode"))
        self.run_dir = Path(mode_line.split("run directory ")[1].strip())
        self.http = {line.split()[1]: line.split()[-1] for line in lines if line.startswith("instance ")}
        self.pids = {line.split()[1].rstrip(":"): int(line.split("pid ")[1].split(",")[0])
                     for line in lines if line.startswith("process ")}
        admin = [line.split("admin ")[1].strip() for line in lines if line.startswith("line: ") and "admin " in line]
        self.line_admin = admin[0] if admin else None

    def exit_code(self, name: str) -> int | None:
        """The code a child of `pdd up` exited with, as `pdd up` said; None while it runs."""
        said = [line.rsplit(" ", 1)[1] for line in self.lines if line.startswith(f"pdd up: {name} exited with code ")]
        return int(said[0]) if said else None

    def fault(self, **fault: Any) -> dict:
        """Inject (or clear) a fault on the line; the emulator's stats after it."""
        r = HTTP.post(f"{self.line_admin}/fault", json=fault, timeout=5)
        r.raise_for_status()
        return r.json()


@contextlib.contextmanager
def pdd_up(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> Iterator[Deployment]:
    """`pdd up ARGS --port 0` (with `env` added to the environment), torn down (whole
    process group) on exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "pdd.cli", "up", "--port", "0", *args], env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while not any(line.startswith("router: ") for line in lines):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("pdd up exited before its router was ready:\n" + "".join(lines))
            lines.append(line)
            if time.monotonic() > deadline:
                raise TimeoutError("pdd up did not print its router line:\n" + "".join(lines))
        # keep the pipe drained, its lines kept (`pdd up: NAME exited with code N`: `Deployment.exit_code`)
        threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        dep = Deployment(proc, lines)
        try:
            yield dep
        except BaseException:  # what its processes logged, into the test's captured output: gone after
            for title, text in logged_warnings(dep.run_dir):
                print(f"---- {title}\n{text}")
            raise
    finally:
        stop_group(proc)



def join_main(dep, tmp_path: Path, name: str, env: dict[str, str] | None = None):
    """Start a new MD in datacenter B on the running deployment: a route across the
    emulated line, a config that lists it, and `pdd serve --join` (with its own OpenAI
    API, `--openai-api`, which a P/D instance serves only when asked)."""
    conf = cfg.load(dep.run_dir / "deployment.toml")
    hop = f"127.0.0.1:{free_port()}"  # callers in A reach it through the emulator
    spec = cfg.InstanceSpec(name, "main", conf.line.b, port=free_port(), kv_port=free_port(),
                            advertise={conf.line.a: hop}, engine=conf.engine)
    route = f"{hop}=127.0.0.1:{spec.kv_port}"
    HTTP.post(f"{dep.line_admin}/routes", json={"route": route}, timeout=5).raise_for_status()
    path = tmp_path / "joined.toml"
    path.write_text(cfg.dump(dataclasses.replace(conf, instances=(*conf.instances, spec))))
    http = f"http://127.0.0.1:{spec.port}"
    return pdd_process(["serve", "--config", str(path), "--instance", name, "--join", "--openai-api"],
                       f"{http}/health", env=env), str(dep.run_dir / "deployment.toml"), http

# a failed test's report shows its deployment's processes' pdd warnings and errors (`pdd up`
# removes its run directory on exit: read now, or never; CI prints only the report)
LOG_LINES = 30
PDD_WARNING = re.compile(r" pdd\.[\w.]+ (WARNING|ERROR|CRITICAL) ")  # pdd's own (vLLM's start-up warnings are many)


def logged_warnings(run_dir: Path) -> list[tuple[str, str]]:
    """(title, text) for each process log in `run_dir`: its last pdd warnings, errors and tracebacks."""
    out = []
    for log in sorted(run_dir.glob("*.log")) if run_dir.is_dir() else []:
        lines = log.read_text(errors="replace").splitlines()
        notable = [line for line in lines if PDD_WARNING.search(line) or line.startswith("Traceback")]
        text = "\n".join(notable[-LOG_LINES:]) or "(none)"
        out.append((f"{log.name}: its last {LOG_LINES} warnings and errors", text))
    return out


# ---- vLLM ---------------------------------------------------------------------------------

# what every vLLM process the tests start shares the machine's few cores with: one OpenMP
# thread each, not pinned, a KV cache of 1 GiB (vLLM on CPU sizes it in whole GiB)
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_START_S = 300.0  # vLLM starts in tens of seconds alone; several at once on two busy cores take minutes


class PlainVllm:
    """A plain `vllm serve` on the same weights, fp32, no pdd anywhere: the reference a
    vLLM-backed pdd deployment must equal. Greedy outputs are asked once and kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._seen: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._seen:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            r = HTTP.post(f"{self.url}/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            self._seen[key] = r.json()["choices"][0]["token_ids"]
        return self._seen[key]


@contextlib.contextmanager
def plain_vllm(model_dir: Path, *extra: str, eager: bool = True) -> Iterator[PlainVllm]:
    """A plain `vllm serve` of `model_dir` (`extra`: more of vLLM's arguments), eager unless
    not `eager` (vLLM-CPU runs pipeline stages only compiled: `pdd.engines.vllm.args`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **VLLM_ENV, "PYTHONUNBUFFERED": "1"}
    # (the `vllm serve` entry point itself needs a distribution named "vllm"; vllm-cpu has its server module)
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32", *["--enforce-eager"] * eager,
            "--block-size", "32", "--max-model-len", "4096", *extra]
    proc = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_http(f"{url}/health", proc, VLLM_START_S)
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield PlainVllm(url)
    finally:
        stop_group(proc)


def vllm_settled(urls: list[str], timeout: float = 20.0) -> list[dict]:
    """Every vLLM-backed instance back to its baseline: no block held by a request (what
    vLLM's KV usage gauge measures) and no request held; their engine stats then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [HTTP.get(f"{u}/pdd/stats").json()["engine"] for u in urls]
        if all(s.get("used_blocks", 0) == 0 and s.get("held_requests", 0) == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM still holds blocks or requests: "
                                 f"{[(s.get('used_blocks'), s.get('held_requests')) for s in stats]}")
        time.sleep(0.1)


def vllm_mirrored(router_url: str, http: dict[str, str], timeout: float = 20.0) -> None:
    """The router's mirror of each named vLLM-backed instance holds as many blocks as the
    instance knows of from vLLM's events: the events have crossed the line (a prediction
    read before that is of the cache as it was)."""
    def caught_up() -> bool:
        mirrors = HTTP.get(f"{router_url}/pdd/stats").json()["instances"]
        known = {n: HTTP.get(f"{u}/pdd/stats").json()["engine"]["cached_blocks"] for n, u in http.items()}
        return all(mirrors[n]["mirror_pages"] == known[n] for n in http)

    wait_until(caught_up, timeout, "the router's mirrors to hold every block the instances hold")


def session_turns(url: str, first: list[int], added: list[list[int]], max_tokens: int) -> tuple[list, list[dict]]:
    """A session's turns, each sent the moment the one before ends (an agent's): the
    first prompt, then each time the last prompt, its output and the next of `added`.
    (prompts, their streamed completions)."""
    prompts, done = [first], [stream_completion(url, first, max_tokens)]
    for more in added:
        prompts.append(prompts[-1] + done[-1]["ids"] + more)
        done.append(stream_completion(url, prompts[-1], max_tokens))
    return prompts, done


def stream_completion(url: str, prompt: list[int], max_tokens: int, timeout: float = 180,
                      stop_after: int | None = None, **extra: Any) -> dict:
    """One streamed greedy completion: its token ids, finish reason, `pdd` record, error and
    id; with `stop_after`, the client goes away once that many tokens have arrived."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}
    out: dict[str, Any] = {"ids": [], "record": None, "error": None, "id": None, "finish_reason": None,
                           "logprobs": []}
    began = time.monotonic()
    with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            out["error"] = chunk.get("error") or out["error"]
            out["id"] = chunk.get("id") or out["id"]
            for choice in chunk.get("choices") or []:
                out["ids"] += choice.get("token_ids") or []
                out["logprobs"] += (choice.get("logprobs") or {}).get("token_logprobs") or []
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                out["prompt_logprobs"] = choice.get("prompt_logprobs") or out.get("prompt_logprobs")
            out["record"] = chunk.get("pdd") or out["record"]
            if stop_after is not None and len(out["ids"]) >= stop_after:
                break
    out["elapsed_s"] = time.monotonic() - began
    return out


# ---- agents ---------------------------------------------------------------------------------

# a scripted agent's tool: the forecast's arguments, bounded so the random model ends them
FORECAST = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
AGENT_TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "The forecast",
                                                 "parameters": FORECAST}}]


def agent_session(url: str, **sampling) -> list[dict]:
    """A scripted agent's two turns through the official client: the first must call the
    tool (`tool_choice: required`: the grammar forces a valid call whatever the weights),
    its arguments are checked against the schema and its result goes back in the second."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "You plan trips."},
                            {"role": "user", "content": "Will it rain in Paris this week?"}]
    turns = []
    for choice, max_tokens in (("required", 80), ("auto", 24)):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=AGENT_TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=max_tokens, **sampling)
        answer = r.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls or []]
        turns.append({"ids": answer.model_extra["token_ids"], "finish": answer.finish_reason, "calls": calls,
                      "record": r.model_extra["pdd"]})
        if choice == "required":
            assert answer.finish_reason == "tool_calls" and len(calls) == 1, answer
            for name, arguments in calls:
                assert name == "get_forecast"
                jsonschema.validate(arguments, FORECAST)
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": [c.model_dump() for c in answer.message.tool_calls]})
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "rain on Tuesday"}
                         for c in answer.message.tool_calls]
    return turns
