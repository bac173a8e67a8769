"""`pdd soak` end to end, and the classifier it stands on.

A soak through a real pdd-mode deployment, struck by every fault kind (each role killed
-9 and restarted, each line fault), must lose no request, fail no more than each fault
had in flight, and leak no page. The verdict
is read from the numbers in its JSON report, not its exit code alone, so a soak that
sent nothing or injected nothing cannot pass; and each fault must have struck while
requests were in flight. "Lost == 0" means something only if the classifier says LOST
when a stream is lost: it is driven here against a fake server that truncates, resets
and hangs. The chaos matrix runs end to end at its smallest, and a soak that loses a
request exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from procs import pdd_process

from pdd.lab.soak.client import COMPLETED, FAILED, LOST, send
from pdd.lab.soak.faults import KINDS
from pdd.lab.soak.workload import SoakRequest

MAX_TOKENS = 4


def _overlapping(fault: dict, requests: list[dict]) -> int:
    return sum(1 for r in requests if r["start"] < fault["clear"] and r["end"] > fault["start"])


CONCURRENCY = 4


def test_a_soak_through_every_fault_kind_loses_nothing_and_fails_only_what_was_in_flight(tmp_path):
    """Every fault kind strikes once (a kill of each role, and each line fault) in a soak
    of two prefill instances (one killed, the other takes the load). Per kind: it struck
    while requests ran, lost none, and failed at most the requests in flight when it
    struck (the concurrency): every request after it completed."""
    conf = tmp_path / "soak.toml"
    # a request with no first token fails fast; a second P, so a killed one has a successor
    conf.write_text("[router]\ntoken_timeout_s = 10.0\n[topology]\nprefill = 2\n")
    out = tmp_path / "soak.json"
    args = ["soak", "--config", str(conf), "--duration-s", "60", "--concurrency", str(CONCURRENCY), "--seed", "1",
            "--faults", "all", "--fault-every-s", "1.5", "--timeout-s", "30", "--settle-s", "20",
            "--out", str(out), "--quiet"]
    with pdd_process(args) as proc:
        output, _ = proc.communicate(timeout=240)
    report = json.loads(out.read_text())
    totals, rows = report["totals"], {row["fault"]: row for row in report["matrix"]}
    print(f"\nsoak: {totals}, {report['wall_s']:.0f} s\n{report['matrix_markdown']}")
    assert set(rows) == set(KINDS) and all(rows[k]["injections"] >= 1 for k in KINDS), report["faults"]
    assert all(f["ok"] for f in report["faults"]), "a killed instance did not rejoin"
    # a fault that struck an idle deployment proved nothing
    assert all(_overlapping(f, report["requests"]) for f in report["faults"]), report["faults"]
    for row in rows.values():
        assert row["requests"] > 0 and row["lost"] == 0, row
        assert row["failed"] <= CONCURRENCY * row["injections"], (row, report["failed_reasons"])
    assert totals["sent"] > 0 and totals["completed"] > 0
    assert totals["lost"] == 0, report["lost_requests"]
    assert report["leaked_pages"] == 0, report["pages"]
    assert report["probes"]["completed"] == report["probes"]["sent"]
    assert proc.returncode == 0, output[-3000:]


def test_the_matrix_runs_a_fault_alone_and_reports_its_row(tmp_path):
    out = tmp_path / "matrix.json"
    args = ["soak", "--matrix", "--mode", "pd-cross-dc", "--faults", "drop", "--repeats", "1", "--concurrency", "2",
            "--seed", "3", "--timeout-s", "30", "--settle-s", "20", "--out", str(out), "--quiet"]
    with pdd_process(args) as proc:
        output, _ = proc.communicate(timeout=150)
    report = json.loads(out.read_text())
    [row] = report["matrix"]
    print(f"\nmatrix: {row}")
    assert proc.returncode == 0, output[-3000:]
    assert row["fault"] == "drop" and row["injections"] == 1 and [f["kind"] for f in report["faults"]] == ["drop"]
    assert row["requests"] > 0 and row["lost"] == 0 and row["leaked_pages"] == 0
    assert row["recovery_s_p50"] is not None
    assert "| drop | 1 |" in report["matrix_markdown"] and "| drop | 1 |" in output


def test_a_lost_request_fails_the_soak(tmp_path):
    """Requests given 1 ms to finish cannot: each is a hang past `--timeout-s`, lost, and
    the soak says so and exits 1."""
    out = tmp_path / "lost.json"
    args = ["soak", "--mode", "colocated", "--faults", "none", "--requests", "2", "--concurrency", "1",
            "--timeout-s", "0.001", "--settle-s", "10", "--out", str(out), "--quiet"]
    with pdd_process(args) as proc:
        output, _ = proc.communicate(timeout=120)
    report = json.loads(out.read_text())
    assert report["totals"]["sent"] == 2 and report["totals"]["lost"] == 2, report["totals"]
    assert {r["detail"] for r in report["lost_requests"]} == {"no end within 0.001 s"}
    assert "pdd soak: FAILED: 2 requests lost" in output, output[-3000:]
    assert proc.returncode == 1


# ---- the classifier, against a server that misbehaves on purpose -----------------------

def _sse(*chunks: dict | str) -> list[bytes]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]


def _tokens(ids: list[int], finish: str | None = None) -> dict:
    return {"id": "cmpl-fake", "choices": [{"token_ids": ids, "finish_reason": finish}]}


WHOLE = _sse(_tokens([1, 2]), _tokens([3, 4], "length"), "[DONE]")
ERROR = {"error": {"message": "md0 was lost", "type": "server_error", "param": None, "code": None}}
# what the fake server does, by the request's "model": (events, how the response ends)
BEHAVIOURS = {
    "whole": (WHOLE, "end"),
    "truncated": (_sse(_tokens([1, 2])), "end"),  # the stream ends cleanly, without finish_reason
    "short": (_sse(_tokens([1, 2], "length"), "[DONE]"), "end"),  # "finished" with 2 of 4 tokens
    "reset": (_sse(_tokens([1, 2])), "reset"),  # the connection is reset mid-stream
    "hang": (_sse(_tokens([1])), "hang"),  # tokens stop coming, the connection stays open
    "error_event": (_sse(_tokens([1]), ERROR, "[DONE]"), "end"),
    "error_then_reset": (_sse(_tokens([1]), ERROR), "reset"),  # the server said why before the break
    "whole_then_hang": (WHOLE[:2], "hang"),  # every token and the finish came; no [DONE]
}
EXPECTED = {"whole": COMPLETED, "truncated": LOST, "short": LOST, "reset": LOST, "hang": LOST,
            "error_event": FAILED, "error_then_reset": FAILED, "whole_then_hang": COMPLETED, "busy": FAILED}


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    model = json.loads(await reader.readexactly(length))["model"]
    if model == "busy":
        body = json.dumps(ERROR).encode()
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()
        return
    events, end = BEHAVIOURS[model]
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for event in events:
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
    await writer.drain()
    if end == "end":
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
    elif end == "reset":  # RST, not FIN: SO_LINGER with a zero timeout, then close
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        await asyncio.sleep(30)  # silent; the client's timeout ends it


@contextlib.asynccontextmanager
async def _fake_server() -> AsyncIterator[str]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.parametrize("behaviour", list(EXPECTED))
def test_the_soak_classifier_tells_completed_failed_and_lost_apart(behaviour):
    async def go():
        async with _fake_server() as url, httpx.AsyncClient(timeout=10) as client:
            req = SoakRequest(0, "fake", (5, 6, 7), MAX_TOKENS)
            # (1 s ends a hang; a stream that ends is given 10 s: on two loaded cores, a fresh
            # client's first answer from a local server has taken longer than 1 s)
            hangs = BEHAVIOURS.get(behaviour, ((), "end"))[1] == "hang"
            return await send(client, url, behaviour, req, timeout_s=1.0 if hangs else 10.0, t0=time.monotonic())

    out = asyncio.run(go())
    assert out.outcome == EXPECTED[behaviour], (out.outcome, out.detail)
    if behaviour == "busy":
        assert out.status == 503 and out.retry_after_s == 1.0
    if behaviour == "hang":
        assert out.detail == "no end within 1 s"
    if behaviour == "reset":
        assert out.detail.startswith("connection broke without an error event")
