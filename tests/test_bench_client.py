"""The bench client end to end, against a fake OpenAI-compatible server.

The fake runs as a real uvicorn process on 127.0.0.1 and implements the stream
contract the PDD router implements: token-ID prompts, `token_ids` in every chunk, a
usage chunk with the `pdd` record, `/pdd/stats`. Some max_tokens values make it fail
in the ways a real server can, so the tests see failures recorded rather than raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from procs import HTTP, free_port

from pdd.cli import main
from pdd.lab.bench.client import replay
from pdd.lab.workload.types import Session, Turn
from pdd.policy.prefix import common_prefix

# A prompt ending in one of these IDs (below the workloads' low_id, so never generated)
# makes the fake fail.
FAIL_HTTP = 1  # answer HTTP 500
FAIL_STREAM = 2  # stream 3 tokens, then an error event
HANG = 3  # stall longer than any test's timeout
LINE_BYTES_PER_TOKEN = 10
REPO = Path(__file__).resolve().parent.parent


def fake_output(prompt: list[int], n: int) -> list[int]:
    """The fake model: deterministic output IDs that depend on the whole prompt."""
    return [(sum(prompt) * 31 + 7 * i) % 4000 + 16 for i in range(n)]


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def make_app() -> FastAPI:
    """The fake server; a prefix cache of every prompt + output it has produced."""
    app = FastAPI()
    cache: list[list[int]] = []
    prompts: list[list[int]] = []
    line = {"bytes": 1_000}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/pdd/stats")
    async def stats() -> dict:
        return {"line_bytes": line["bytes"]}

    @app.get("/fake/prompts")
    async def received() -> list[list[int]]:
        return prompts

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        prompts.append(prompt)
        if prompt[-1] == FAIL_HTTP:
            return JSONResponse({"error": {"message": "injected overload", "type": "server_error",
                                           "code": 500}}, status_code=500)
        cached = max((common_prefix(prompt, seq) for seq in cache), default=0)
        output = fake_output(prompt, n)
        cache.append(prompt + output)
        relayed = cached * 2 < len(prompt)
        line_bytes = (len(prompt) - cached) * LINE_BYTES_PER_TOKEN
        line["bytes"] += line_bytes

        async def events():
            if prompt[-1] == HANG:
                await asyncio.sleep(30)
            for i, token in enumerate(output):
                if prompt[-1] == FAIL_STREAM and i == 3:
                    yield _sse({"error": {"message": "injected decode failure", "code": 500}})
                    yield _sse("[DONE]")
                    return
                await asyncio.sleep(0.001)
                yield _sse({"id": "cmpl-1", "object": "text_completion", "choices": [
                    {"index": 0, "text": f" w{token}", "token_ids": [token],
                     "finish_reason": "length" if i == n - 1 else None}]})
            rld = min(2, n) if relayed else 0
            yield _sse({"id": "cmpl-1", "object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                  "total_tokens": len(prompt) + n,
                                  "prompt_tokens_details": {"cached_tokens": cached}},
                        "pdd": {"pipeline": "P-RLD-MD" if relayed else "P-MD",
                                "p_hit_tokens": cached, "d_hit_tokens": cached,
                                "line_bytes": line_bytes, "relay_output_tokens": rld,
                                "main_output_tokens": n - rld,
                                "handoff": "one_shot" if relayed else None}})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "test_bench_client:make_app",
         "--app-dir", str(Path(__file__).parent), "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "fake server exited during start-up"
            try:
                if HTTP.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "fake server did not start in 30 s"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prompts(url: str) -> list[list[int]]:
    return HTTP.get(f"{url}/fake/prompts").json()


def _session(sid: int, *turns: tuple[int, int, int | None]) -> Session:
    """Turns of (new tokens, max_tokens, failure trigger appended or None)."""
    base = 100 + 1000 * sid
    return Session(sid, tuple(
        Turn.of(tuple(range(base, base + size)) + ((trigger,) if trigger else ()), n)
        for size, n, trigger in turns))


def test_replay_builds_turns_from_returned_ids_and_records_failures(server_url):
    sessions = [
        _session(0, (300, 6, None), (5, 4, None), (7, 5, None)),  # three good turns
        _session(1, (200, 5, None), (5, 5, FAIL_HTTP), (5, 5, None)),  # 500, then never sent
        _session(2, (150, 8, FAIL_STREAM)),  # error event mid-stream
        _session(3, (120, 8, HANG)),  # the server stalls past the timeout
    ]
    run = asyncio.run(replay(server_url + "/v1", sessions, timeout_s=2.0))
    by_id = {r.id: r for r in run.records}
    assert run.model == "fake-model"
    assert sorted(by_id) == ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2", "2-0", "3-0"]

    # Turn k's prompt is turn k-1's prompt + the IDs the server returned + the new tokens,
    # so the server's prefix cache hits everything the previous turn left behind.
    sent = _prompts(server_url)
    first = next(p for p in sent if p[0] == 100)
    second = first + fake_output(first, 6) + list(range(100, 105))
    third = second + fake_output(second, 4) + list(range(100, 107))
    assert second in sent and third in sent
    s0 = [by_id[f"0-{k}"] for k in range(3)]
    assert all(r.error is None for r in s0)
    assert [r.prompt_tokens for r in s0] == [300, len(second), len(third)]
    assert [r.output_tokens for r in s0] == [6, 4, 5]
    assert [r.cached_tokens for r in s0] == [0, 306, len(second) + 4]
    assert [r.pipeline for r in s0] == ["P-RLD-MD", "P-MD", "P-MD"]
    assert [r.handoff for r in s0] == ["one_shot", None, None]
    assert s0[0].relay_output_tokens + s0[0].main_output_tokens == 6
    for r in s0:
        assert 0 < r.ttft_ms <= r.e2e_ms
        assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1))
        assert r.max_itl_ms is not None and r.max_itl_ms <= r.e2e_ms
        assert r.start_s is not None and r.start_s >= 0
    assert s0[1].start_s >= s0[0].start_s + s0[0].e2e_ms / 1000 - 1e-3

    assert "HTTP 500" in by_id["1-1"].error and "injected overload" in by_id["1-1"].error
    assert by_id["1-2"].error.startswith("not sent") and by_id["1-2"].start_s is None
    assert "injected decode failure" in by_id["2-0"].error
    assert "timeout" in by_id["3-0"].error and by_id["3-0"].e2e_ms >= 2000

    # The server's counter also moved for the two requests that failed after their
    # KV was sent: that is why the summary prefers it to the per-request sum.
    failed_after_transfer = (151 + 121) * LINE_BYTES_PER_TOKEN
    assert run.line_bytes == sum(r.line_bytes for r in run.records) + failed_after_transfer


def test_a_turn_is_sent_after_its_tool_time(server_url):
    """`pause_s`: the client waits that long after the previous answer before it sends."""
    first, second = _session(5, (40, 3, None), (5, 3, None)).turns
    session = Session(5, (first, dataclasses.replace(second, pause_s=0.6)))
    records = sorted(asyncio.run(replay(server_url + "/v1", [session], timeout_s=5.0)).records, key=lambda r: r.turn)
    assert all(r.error is None for r in records)
    assert records[1].start_s >= records[0].start_s + records[0].e2e_ms / 1000 + 0.6 - 1e-3


def _bench(server_url: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(["bench", "--url", server_url, "--out", str(out), "--quiet", *extra])
    return code, json.loads(out.read_text())


def test_cli_agentic_writes_report_and_table(server_url, tmp_path, capsys):
    code, report = _bench(server_url, tmp_path, "--workload", "agentic", "--requests", "24",
                          "--seed", "5", "--rate", "50")
    assert code == 0
    summary, records = report["summary"], report["requests"]
    assert len(records) == summary["requests"] == summary["completed"] == 24
    assert summary["failed"] == 0
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in records)
    # Later turns re-send the context the fake cached, so most prompt tokens are hits.
    assert summary["d_hit_rate"] > 0.5
    assert summary["line_bytes"] == sum(r["line_bytes"] for r in records)
    assert summary["pipelines"]["P-MD"] + summary["pipelines"]["P-RLD-MD"] == 24
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    assert report["config"]["model"] == "fake-model"
    assert report["config"]["workload"]["kind"] == "agentic"
    assert report["config"]["rate"] == 50
    assert "TTFT p99" in capsys.readouterr().out


def test_cli_mooncake_keeps_shared_prefixes(server_url, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": 1500, "output_length": 200, "hash_ids": [7, 8, 9]},
             {"timestamp": 50, "input_length": 1100, "output_length": 90, "hash_ids": [7, 8, 11]},
             {"timestamp": 90, "input_length": 600, "output_length": 30, "hash_ids": [12, 13]}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, report = _bench(server_url, tmp_path, "--workload", f"mooncake:{trace}",
                          "--scale", "16", "--time-scale", "10")
    assert code == 0
    records = {r["session"]: r for r in report["requests"]}
    assert [records[i]["prompt_tokens"] for i in range(3)] == [94, 69, 38]
    assert [records[i]["output_tokens"] for i in range(3)] == [12, 6, 2]
    # Request 1 shares two 32-token blocks with request 0, and (sent later) hits them.
    assert records[1]["cached_tokens"] >= 64
    assert records[2]["start_s"] >= 0.009
    assert report["config"]["workload"]["scale"] == 16


def test_cli_exit_code_1_when_every_request_fails(server_url, tmp_path):
    # A wrong URL prefix: every completion is a 404 (the model is named, so no listing).
    code, report = _bench(server_url + "/wrong", tmp_path, "--model", "fake-model",
                          "--requests", "5")
    assert code == 1
    summary = report["summary"]
    assert summary["requests"] == 5 and summary["completed"] == 0
    assert summary["slo_attainment"] == 0 and summary["ttft_ms"]["p50"] is None
    assert all("HTTP 404" in r["error"] or r["error"].startswith("not sent")
               for r in report["requests"])


def test_cli_unreachable_server_is_an_error_not_a_crash(tmp_path, capsys):
    code = main(["bench", "--url", f"http://127.0.0.1:{free_port()}", "--requests", "2",
                 "--quiet", "--out", str(tmp_path / "r.json")])
    assert code == 1
    assert "/v1/models" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_workload_follows_the_served_model(monkeypatch, capsys):
    from pdd.cli import build_parser
    from pdd.lab.bench import cli as bench_cli

    def plan(*extra: str) -> tuple[list, dict]:
        argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--requests", "30", *extra]
        return bench_cli.plan_workload(build_parser(argv).parse_args(argv))

    # what /v1/models says of a model with a 1,024-token context and a 300-token vocabulary
    monkeypatch.setattr(bench_cli, "served_model", lambda url: {"max_model_len": 1024, "vocab_size": 300})
    sessions, workload = plan()
    ids = [i for s in sessions for t in s.turns for i in t.append_ids]
    assert max(ids) < 300 and workload["vocab_size"] == 300
    assert workload["max_context"] == 1000 and "x 0.25" in capsys.readouterr().err  # the paper scenario's 4,000
    given = plan("--vocab-size", "200", "--max-context", "3000")[1]  # the options win
    assert (given["vocab_size"], given["max_context"]) == (200, 3000)
    monkeypatch.setattr(bench_cli, "served_model", lambda url: {})  # a server that does not say
    assert plan()[1]["vocab_size"] == 4096 and plan()[1]["max_context"] == 4000


def test_each_bench_target_has_its_own_help(capsys):
    """`pdd bench TARGET --help` lists that target's options, none of another's; a bare
    `pdd bench --url ...` is the serve target."""
    from pdd.cli import build_parser, main

    own = {"serve": "--workload", "engine": "--skip-http", "handoff": "--handoff-tokens", "flood": "--stream-share",
           "overhead": "--pairs", "transfer": "--rtt-ms"}
    for target, option in own.items():
        with pytest.raises(SystemExit):
            main(["bench", target, "--help"])
        text = capsys.readouterr().out
        assert option in text, target
        assert not [o for t, o in own.items() if t != target and o in text and not (target == "overhead" and
                                                                                      o == "--workload")], target
    argv = ["bench", "--url", "http://127.0.0.1:9"]
    assert build_parser(argv).parse_args(["bench", "serve", "--url", "http://127.0.0.1:9"]).target == "serve"
    with pytest.raises(SystemExit):
        main(["bench", "--url", "http://127.0.0.1:9", "--requests", "0"])
    assert "--requests must be >= 1" in capsys.readouterr().err  # it reached serve's own checks
