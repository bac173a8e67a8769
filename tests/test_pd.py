"""Prefill and decode in two emulated datacenters, as real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import struct
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from procs import HTTP, pdd_up, rejected_frames

from pdd.lab.bench.client import run_bench
from pdd.lab.bench.summary import summarize
from pdd.lab.workload.agentic import AgenticConfig, plan_sessions
from pdd.transfer import wire

KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads, head dim 64, fp32


def _requests(seed: int = 0) -> list[list[int]]:
    """Four prompts sharing a prefix, then three unrelated 200-token ones."""
    rng = random.Random(seed)
    base = [rng.randrange(16, 4096) for _ in range(300)]
    shared = [base[:n] + [rng.randrange(16, 4096) for _ in range(k)]
              for n, k in ((300, 5), (40, 0), (300, 90), (17, 3))]
    return shared + [[rng.randrange(16, 4096) for _ in range(200)] for _ in range(3)]


def _complete(url: str, prompt: list[int], max_tokens: int = 12) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def colocated_tokens():
    with pdd_up("--mode", "colocated") as dep:
        return [_complete(dep.url, p)["choices"][0]["token_ids"] for p in _requests()]


@pytest.mark.parametrize("drc", ["on", "off"])
def test_cross_dc_greedy_equals_colocated(colocated_tokens, drc):
    with pdd_up("--mode", "pd-cross-dc", "--drc", drc) as dep:
        got = [_complete(dep.url, p) for p in _requests()]
    assert [g["choices"][0]["token_ids"] for g in got] == colocated_tokens
    assert {g["pdd"]["pipeline"] for g in got} == {"P-MD"}
    assert all(g["pdd"]["line_bytes"] > 0 for g in got)
    if drc == "off":  # the baseline ships every prompt token's KV
        assert all(g["pdd"]["d_hit_tokens"] == 0 for g in got)
    else:  # the third request shares 300 tokens with the first: the decode side has them
        assert got[2]["pdd"]["d_hit_tokens"] >= 288


def test_agentic_run_sends_only_the_missing_kv():
    sessions = plan_sessions(AgenticConfig(seed=3, max_context=1500), 24)
    with pdd_up("--mode", "pd-cross-dc", "--drc", "on") as dep:
        line_before = HTTP.get(f"{dep.line_admin}/stats").json()
        run = run_bench(dep.url, sessions, quiet=True)
        stats = HTTP.get(f"{dep.url}/pdd/stats").json()
        line_after = HTTP.get(f"{dep.line_admin}/stats").json()
    s = summarize(run.records, line_bytes=run.line_bytes, slo_ttft_ms=2000, slo_tpot_ms=200)
    bound = (s["prompt_tokens"] - s["d_hit_tokens"]) * KV_BYTES_PER_TOKEN * 1.05
    line = sum(line_after[k] - line_before[k] for k in ("bytes_a_to_b", "bytes_b_to_a"))
    print(f"\nline bytes {s['line_bytes']:,} <= bound {bound:,.0f}; the emulator's count {line:,}; "
          f"decode-side hit rate {s['d_hit_tokens'] / s['prompt_tokens']:.1%}")
    # the instances' count (the KV payload P sent across) against the emulator's (every byte, both ways)
    assert s["line_bytes"] <= line <= s["line_bytes"] * 1.05 + 24 * 16384
    assert s["completed"] == 24
    assert 0 < s["line_bytes"] <= bound
    assert s["d_hit_tokens"] / s["prompt_tokens"] > 0.5
    assert stats["mirror_drift_abs_tokens"] == 0, "a steady run's mirror must predict every reservation"


def test_lossy_kv_crosses_the_line_in_int8_and_lives_in_its_own_namespace(tmp_path, colocated_tokens):
    """`[line] lossy_kv = "int8"`: P's KV crosses the line at about a quarter of its fp32
    bytes; MD keeps it in a namespace of its own, which a later request in the same form
    reuses (the third shares 300 tokens with the first) and the router's mirror predicts
    exactly. Lossy: the tokens are counted against colocated's, not required equal."""
    conf = tmp_path / "lossy.toml"
    conf.write_text('mode = "pd-cross-dc"\n[line]\nlossy_kv = "int8"\n')
    with pdd_up("--config", str(conf)) as dep:
        got = [_complete(dep.url, p) for p in _requests()[:3]]
    int8_bytes_per_token = 2 * 4 * 2 * (64 + 4)  # an int8 a value and an fp32 scale a head and token
    for g, prompt in zip(got, _requests(), strict=False):
        choice, rec = g["choices"][0], g["pdd"]
        assert len(choice["token_ids"]) == 12 and choice["finish_reason"] == "length"
        missed = len(prompt) - rec["d_hit_tokens"]
        # (exact fp32 KV would take KV_BYTES_PER_TOKEN, 3.8x as much, a missed token)
        assert missed * int8_bytes_per_token <= rec["line_bytes"] <= missed * int8_bytes_per_token * 1.25, rec
    assert got[2]["pdd"]["d_hit_tokens"] >= 288  # lossy pages reused in their namespace...
    assert got[2]["pdd"]["d_hit_predicted"] == got[2]["pdd"]["d_hit_tokens"]  # ...which the mirror follows
    equal = sum(g["choices"][0]["token_ids"] == c for g, c in zip(got, colocated_tokens, strict=False))
    print(f"\nint8 KV over the line: {equal} of {len(got)} requests' greedy tokens equal colocated's; "
          f"line bytes {[g['pdd']['line_bytes'] for g in got]}")


def test_compressed_kv_crosses_the_line_in_fewer_bytes_and_changes_no_token(tmp_path, colocated_tokens):
    """`[line] compress_kv = "zstd"`: lossless, so every token equals colocated's, in the
    shared cache namespace; the line carries fewer bytes than the fp32 KV it holds (the
    random model's KV compresses by about 8 %: BENCHMARKS.md)."""
    conf = tmp_path / "zstd.toml"
    conf.write_text('mode = "pd-cross-dc"\n[line]\ncompress_kv = "zstd"\n')
    with pdd_up("--config", str(conf)) as dep:
        got = [_complete(dep.url, p) for p in _requests()[:3]]
    assert [g["choices"][0]["token_ids"] for g in got] == colocated_tokens[:3]
    for g, prompt in zip(got, _requests(), strict=False):
        missed = len(prompt) - g["pdd"]["d_hit_tokens"]
        assert 0 < g["pdd"]["line_bytes"] < 0.97 * missed * KV_BYTES_PER_TOKEN, g["pdd"]
    assert got[2]["pdd"]["d_hit_tokens"] >= 288  # exact pages: the shared namespace, reused


def test_small_decode_pool_evicts_and_stays_correct(tmp_path, colocated_tokens):
    """A decode pool smaller than the working set: MD evicts behind the router's back;
    the reservation (not the mirror) decides what P sends, so outputs stay exact. MD's
    pages are twice P's (32 vs 16 tokens): KV is re-paged on import."""
    conf = tmp_path / "small.toml"
    conf.write_text("""
mode = "pd-cross-dc"
[policy]
decode_radix_cache = true
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
[[instances]]
name = "md0"
role = "main"
dc = "B"
[instances.engine]
page_size = 32
num_pages = 15
""")
    prompts, want = _requests()[4:], colocated_tokens[4:]
    with pdd_up("--config", str(conf)) as dep:
        first = [_complete(dep.url, p) for p in prompts]
        with ThreadPoolExecutor(3) as pool:  # concurrent reservations race the mirror
            second = list(pool.map(lambda p: _complete(dep.url, p), prompts))
        drift = HTTP.get(f"{dep.url}/pdd/stats").json()["mirror_drift_abs_tokens"]
    assert [g["choices"][0]["token_ids"] for g in first] == want
    assert [g["choices"][0]["token_ids"] for g in second] == want
    print(f"\nsecond-round decode-side hits {[g['pdd']['d_hit_tokens'] for g in second]}, mirror drift {drift}")
    assert any(g["pdd"]["d_hit_tokens"] < 192 for g in second), "the small pool should have evicted"
    for g, p in zip(first + second, prompts + prompts, strict=True):  # bytes follow the reservation
        kv = (len(p) - g["pdd"]["d_hit_tokens"]) * KV_BYTES_PER_TOKEN
        assert kv <= g["pdd"]["line_bytes"] <= kv * 1.05 + 4096


def test_kill_decode_mid_stream_fails_cleanly():
    with pdd_up("--mode", "pd-cross-dc") as dep:
        body = {"model": "tiny", "prompt": list(range(100, 400)), "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events, t0 = [], time.monotonic()
        with HTTP.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(dep.pids["md0"], signal.SIGKILL)
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-3:]
        assert time.monotonic() - t0 < 30
        # No decode instance left: /ready says so (a load balancer stops sending here), and requests get 503;
        # /health says the router itself is alive (restarting it would mend nothing).
        assert HTTP.get(f"{dep.url}/health").status_code == 200
        health = HTTP.get(f"{dep.url}/ready")
        said = health.json()
        assert health.status_code == 503 and (said["status"], said["missing"]) == ("unavailable", ["main"])
        r = HTTP.post(f"{dep.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 503 and "error" in r.json()


def test_client_disconnect_aborts_the_decode_side():
    """MD counts an abort (a request that ran to its end would not) and stopped far
    short of the 3,000 tokens asked for."""
    with pdd_up("--mode", "pd-cross-dc") as dep:
        md_http = dep.http["md0"]
        body = {"model": "tiny", "prompt": list(range(100, 300)), "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        before = HTTP.get(f"{md_http}/pdd/stats").json()["engine"]
        with HTTP.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
                if n == 3:
                    break
        _wait_settled(md_http)
        after = HTTP.get(f"{md_http}/pdd/stats").json()["engine"]
    assert after["aborted"] == before["aborted"] + 1
    assert after["decode_tokens"] - before["decode_tokens"] < 3000


def test_decode_stops_when_its_router_is_gone():
    with pdd_up("--mode", "pd-cross-dc") as dep:
        md_http = next(line for line in dep.lines if line.startswith("instance md0")).split()[-1]
        assert HTTP.get(f"{md_http}/v1/models").status_code == 404  # a P/D instance is reached through the router
        body = {"model": "tiny", "prompt": list(range(100, 300)), "max_tokens": 3000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        streamed = 0
        with pytest.raises(httpx.HTTPError):
            with HTTP.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streamed += 1
                    if streamed == 4:
                        os.kill(dep.pids["router"], signal.SIGKILL)
        assert streamed >= 4  # tokens flowed before the router died...
        with pytest.raises(ProcessLookupError):  # ...and it really is gone (reaped by pdd up)
            _gone_within(dep.pids["router"], 5.0)
        before = HTTP.get(f"{md_http}/pdd/stats").json()["engine"]
        _wait_settled(md_http)
        after = HTTP.get(f"{md_http}/pdd/stats").json()["engine"]
        assert after["decode_tokens"] < 3000 and after["aborted"] >= 1 and before["aborted"] <= after["aborted"]


def _gone_within(pid: int, timeout: float) -> None:
    """Raise ProcessLookupError once `pid` no longer exists; return if it outlives `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, 0)
        time.sleep(0.05)


def _wait_settled(instance_http: str, timeout: float = 30.0) -> None:
    """Every page free or cached: nothing runs there. (That a request stopped early is
    proved by the abort counter, not by how soon its pages came back.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = HTTP.get(f"{instance_http}/pdd/stats").json()["kv"]
        if kv["free"] + kv["cached"] == kv["pages"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"pages still in use: {kv}")


def _instance_port(dep, name: str) -> int:
    """The instance's framed port, from the deployment file `pdd up --keep` left; the
    file (it holds the deployment's secret) is removed once read."""
    run_dir = dep.run_dir
    try:
        with open(f"{run_dir}/deployment.toml", "rb") as f:
            data = tomllib.load(f)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return next(i["kv_port"] for i in data["instances"] if i["name"] == name)


def test_bad_frames_are_rejected_and_counted():
    with pdd_up("--mode", "pd-cross-dc", "--keep") as dep:
        port = _instance_port(dep, "md0")
        md_http = next(line for line in dep.lines if line.startswith("instance md0")).split()[-1]

        async def attack() -> None:
            bad_key = wire.FrameCodec(b"not the deployment secret")
            for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: pdd\r\n\r\n",
                            bad_key.encode(wire.MsgType.HELLO, b'{"role":"router"}'),
                            b"PD" + struct.pack("!BBBQII", wire.PROTOCOL_VERSION, 1, 1, 0, 1 << 31, 0)):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(payload)
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 10) == b""  # dropped
                writer.close()

        asyncio.run(attack())
        rejected = HTTP.get(f"{md_http}/pdd/stats").json()["rejected_frames"]
        assert rejected == {"BadMagic": 2, "BadMac": 1, "TooLarge": 1}
        metrics = HTTP.get(f"{md_http}/metrics").text  # the same counts, one series per reason
        for reason, n in rejected.items():
            assert f'pdd_rejected_frames_total{{reason="{reason}"}} {float(n)}' in metrics
        assert _complete(dep.url, [9, 8, 7, 6, 5], 4)["choices"][0]["token_ids"]
        # /metrics says the same: four at MD, none where no bad frame went (a request's frames are no rejects)
        counted = {name: rejected_frames(url) for name, url in {**dep.http, "router": dep.url}.items()}
        assert counted == {"p0": 0, "md0": 4, "router": 0}, counted


@pytest.mark.parametrize("sig,mode,processes", [(signal.SIGTERM, "pd-cross-dc", {"line", "p0", "md0", "router"}),
                                                (signal.SIGINT, "pdd", {"line", "p0", "rld0", "md0", "router"})],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_every_process(sig, mode, processes):
    """SIGTERM to the launcher alone (a service manager's stop); SIGINT to its whole
    process group, as a terminal's Ctrl-C sends it."""
    with pdd_up("--mode", mode) as dep:
        assert set(dep.pids) == processes
        if sig == signal.SIGINT:
            os.killpg(dep.proc.pid, sig)
        else:
            dep.proc.send_signal(sig)
        assert dep.proc.wait(30) == 0
        for pid in dep.pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # gone (and reaped), not orphaned
