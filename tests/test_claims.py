"""The README's claims about a running deployment, each proved by real processes on
loopback driven over HTTP (and the line emulator's admin API), so that each test fails
if the behaviour it names were missing:

* pd-same-dc returns a colocated instance's greedy tokens;
* a client that disconnects aborts its request on P too, and P's pages come back;
* no first token within `router.token_timeout_s` is a 504 in OpenAI's error shape;
* the router reconnects to an instance that returns, without a restart;
* a decode instance whose pool is full holds a reservation back until pages free up;
* the decode-side cache (DRC) cuts the bytes on the line, by the KV it already holds;
* line faults (stall, drop, blackhole) in the middle of a P/D run end every request
  cleanly, and the deployment serves correct requests once the line is back;
* and, for the suite itself: with CI set, a skip (a missing test extra or data file)
  is a failure (tests/conftest.py).

The oracle for tokens is a standalone (colocated) instance of the same model.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from procs import HTTP, kv_bytes_per_token, metrics, pdd_process, pdd_up, rejected_frames, standalone, wait_until

from pdd.engines.port import EngineConfig

FAST_LINE = {"bandwidth_mbps": 200.0, "delay_ms": 2.0, "jitter_ms": 0.5}
CONTEXT = 4096  # the tiny model's max_position_embeddings


# ---- helpers ---------------------------------------------------------------------------

def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(n)]


def _write_config(path: Path, mode: str, instances: str = "", **sections: dict) -> str:
    lines = [f'mode = "{mode}"']
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    path.write_text("\n".join(lines) + "\n" + instances)
    return str(path)


def _line_args(line: dict) -> list[str]:
    return ["--bandwidth-mbps", str(line["bandwidth_mbps"]), "--delay-ms", str(line["delay_ms"]),
            "--jitter-ms", str(line["jitter_ms"])]


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 60) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, False), timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, prompt: list[int], max_tokens: int, timeout: float = 60,
            first: threading.Event | None = None) -> dict:
    """One streamed completion: status, token ids, `pdd` record, error chunk (if any),
    when its first token and its end reached the client (monotonic seconds), and the
    longest wait between two of its tokens."""
    out: dict = {"ids": [], "record": None, "error": None, "first_at": None, "sent_at": time.monotonic(),
                 "max_gap_s": 0.0}
    last = None
    with HTTP.stream("POST", f"{url}/v1/completions", json=_body(prompt, max_tokens, True), timeout=timeout) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            r.read()
            out["error"] = r.json().get("error")
        else:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    now = time.monotonic()
                    if ids and out["first_at"] is None:
                        out["first_at"] = now
                        if first is not None:
                            first.set()
                    if ids and last is not None:
                        out["max_gap_s"] = max(out["max_gap_s"], now - last)
                    last = now if ids else last
                    out["ids"] += ids
                out["record"] = chunk.get("pdd") or out["record"]
    out["ended_at"] = time.monotonic()
    return out






def _stats(url: str) -> dict:
    return HTTP.get(f"{url}/pdd/stats", timeout=5).json()




def _settled(url: str) -> bool:
    """Nothing held by a request there: every page free or in the prefix cache."""
    kv = _stats(url)["kv"]
    return kv["free"] + kv["cached"] == kv["pages"]




def _health(url: str) -> tuple[int, dict]:
    """The router's /ready: its status and what it says of the deployment (less what it says
    of its process)."""
    try:
        r = HTTP.get(f"{url}/ready", timeout=2)
    except httpx.HTTPError as e:
        return 0, {"error": str(e)}
    return r.status_code, {k: v for k, v in r.json().items() if k not in ("pid", "launch")}


def _assert_openai_error(err: object) -> None:
    """OpenAI's error shape, and an error the server meant: not an unhandled exception."""
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert {"param", "code"} <= set(err), err
    assert "internal error" not in err["message"] and "Traceback" not in err["message"], err


@contextlib.contextmanager
def _drained(proc):
    """Keep a child's stdout pipe drained (a full pipe would block its logging)."""
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield proc


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    """A standalone instance of the model every deployment serves: the token oracle."""
    with standalone(tiny_model_dir, pages=512) as url:
        cache: dict[tuple, list[int]] = {}

        def tokens(prompt: list[int], max_tokens: int) -> list[int]:
            key = (tuple(prompt), max_tokens)
            if key not in cache:
                cache[key] = _complete(url, prompt, max_tokens)["choices"][0]["token_ids"]
                assert len(cache[key]) == max_tokens
            return cache[key]

        yield tokens


# ---- 1. pd-same-dc equals colocated ---------------------------------------------------

def test_pd_same_dc_greedy_equals_colocated(colocated):
    """P and MD in one datacenter (no line emulator at all): the KV moves over the fast
    path, and the tokens are a colocated instance's, for cold prompts and for prompts
    whose prefix the decode side already holds."""
    base = _prompt(11, 300)
    prompts = [base, base + _prompt(12, 40), _prompt(13, 200), base[:100] + _prompt(14, 50)]
    want = [colocated(p, 40) for p in prompts]
    with pdd_up("--mode", "pd-same-dc") as dep:
        assert dep.line_admin is None and set(dep.pids) == {"p0", "md0", "router"}
        got = [_complete(dep.url, p, 40) for p in prompts]
    assert [g["choices"][0]["token_ids"] for g in got] == want
    records = [g["pdd"] for g in got]
    assert {r["pipeline"] for r in records} == {"P-MD"}
    assert all(r["instances"] == {"entry": "p0", "relay": None, "main": "md0"} for r in records)
    assert all(r["main_output_tokens"] == 40 and r["line_bytes"] == 0 for r in records), records
    assert records[1]["d_hit_tokens"] >= 288  # the second shares the first's 300 tokens at MD


# ---- 2. a client disconnect aborts the request on P ------------------------------------

def test_client_disconnect_aborts_on_prefill_and_frees_its_pages(tmp_path, colocated):
    """P holds a request's pages from prefill until MD has reserved and the KV is copied
    out (then MD streams; P's part is over). The line is stalled for a minute, so MD's
    reservation cannot come back, and P's liveness limit is two minutes, so P does not
    give the silent MD up meanwhile: only an abort can free P's pages while the stall
    lasts. The client opens the stream (ignore_eos, max_tokens up to the context: it
    cannot end by itself) and leaves; P must count the abort and drop the request and
    its pages, and MD must never run it."""
    prompt = _prompt(21, 1000)
    conf = _write_config(tmp_path / "d.toml", "pd-cross-dc", line=FAST_LINE,
                         liveness={"heartbeat_s": 1.0, "dead_after_s": 120.0})
    with pdd_up("--config", conf) as dep:
        http = dep.http
        warm = _prompt(22, 50)  # opens P's connections to MD before the line stalls
        assert _complete(dep.url, warm, 4)["choices"][0]["token_ids"] == colocated(warm, 4)
        md_before, p_aborted = _stats(http["md0"])["engine"], _stats(http["p0"])["node"]["aborted"]
        assert dep.fault(stall_s=60.0)["stalled_for_s"] > 50
        with HTTP.stream("POST", f"{dep.url}/v1/completions", json=_body(prompt, CONTEXT - len(prompt), True),
                          timeout=30) as r:
            assert r.status_code == 200
            used = wait_until(lambda: metrics(http["p0"])["pdd_kv_used_pages"], 20,
                             "P holds the prefilled request's pages")
        left = time.monotonic()  # the client is gone
        assert used >= len(prompt) // 16
        wait_until(lambda: metrics(http["p0"])["pdd_kv_used_pages"] == 0 and _settled(http["p0"]), 20,
                  "P released the pages of the request whose client left")
        released = time.monotonic() - left
        assert HTTP.get(f"{dep.line_admin}/stats").json()["stalled_for_s"] > 30, "P let go only when the stall ended"
        assert _stats(http["p0"])["node"]["aborted"] == p_aborted + 1  # the router's abort, not a lost peer
        assert metrics(http["p0"])["pdd_requests_running"] == 0
        dep.fault(stall_s=0)  # the line is back: MD gets the late reservation and P's abort
        wait_until(lambda: _settled(http["md0"]), 10, "MD holds nothing")
        md_after = _stats(http["md0"])["engine"]
        assert md_after["decode_tokens"] == md_before["decode_tokens"], "MD ran the abandoned request"
        assert wait_until(lambda: _health(dep.url)[0] == 200, 10, "router healthy")
        after = _prompt(23, 60)
        assert _complete(dep.url, after, 8)["choices"][0]["token_ids"] == colocated(after, 8)
    print(f"\nP released {used:.0f} pages {released:.2f} s after the client left (line stalled)")


# ---- 3. 504 after token_timeout_s -----------------------------------------------------

def test_no_first_token_within_token_timeout_is_a_504(tmp_path, colocated):
    conf = _write_config(tmp_path / "d.toml", "pd-cross-dc", line=FAST_LINE, router={"token_timeout_s": 2.0})
    prompt = _prompt(31, 200)
    with pdd_up("--config", conf) as dep, ThreadPoolExecutor(1) as pool:
        warm = _prompt(32, 50)
        assert _complete(dep.url, warm, 4)["choices"][0]["token_ids"] == colocated(warm, 4)
        dep.fault(stall_s=60.0)  # MD's reservation (and any token) waits behind the stalled line
        streamed = pool.submit(_stream, dep.url, prompt, 50, 30)
        t0 = time.monotonic()
        r = HTTP.post(f"{dep.url}/v1/completions", json=_body(prompt, 50, False), timeout=30)
        took = time.monotonic() - t0
        s = streamed.result(timeout=30)
        dep.fault(stall_s=0)
        assert r.status_code == 504, r.text
        _assert_openai_error(r.json()["error"])
        assert r.json()["error"]["type"] == "server_error" and "2 s" in r.json()["error"]["message"]
        assert 2.0 <= took < 6.0, took
        # a stream has sent its 200 already: the same error comes as its last event
        assert s["status"] == 200 and s["ids"] == [] and "2 s" in s["error"]["message"]
        _assert_openai_error(s["error"])
        assert s["ended_at"] - s["sent_at"] < 6.0
        # once the line moves again, the deployment serves (the timed-out requests were aborted)
        wait_until(lambda: _health(dep.url) == (200, {"status": "ok"}), 20, "router healthy")
        assert _complete(dep.url, prompt, 20)["choices"][0]["token_ids"] == colocated(prompt, 20)
        for name, url in dep.http.items():
            wait_until(lambda url=url: _settled(url), 10, f"{name} holds nothing")
    print(f"\nno first token: 504 after {took:.2f} s (token_timeout_s = 2)")


# ---- 4. the router reconnects to an instance that returns -------------------------------

def test_router_reconnects_when_a_killed_instance_returns(colocated):
    """Kill -9 MD, then P, of a running deployment; start each again from the
    deployment file `pdd up` wrote, under the same name. The same router (never
    restarted) reports the loss on /health, then ok again, and serves exact tokens."""
    prompt = _prompt(41, 150)
    run_dir = None
    try:
        with pdd_up("--mode", "pd-cross-dc", "--keep", *_line_args(FAST_LINE)) as dep, \
                contextlib.ExitStack() as restarted:
            run_dir = dep.run_dir
            conf = f"{run_dir}/deployment.toml"
            http = dep.http
            assert _complete(dep.url, prompt, 20)["choices"][0]["token_ids"] == colocated(prompt, 20)
            for k, (name, role, field) in enumerate((("md0", "main", "main"), ("p0", "prefill", "entry"))):
                os.kill(dep.pids[name], signal.SIGKILL)
                missing = (503, {"status": "unavailable", "missing": [role]})
                wait_until(lambda missing=missing: _health(dep.url) == missing, 10, f"router reports {role} missing")
                r = HTTP.post(f"{dep.url}/v1/completions", json=_body(prompt, 4, False), timeout=30)
                assert r.status_code == 503, r.text
                _assert_openai_error(r.json()["error"])
                proc = restarted.enter_context(pdd_process(["serve", "--config", conf, "--instance", name],
                                                           f"{http[name]}/health"))
                restarted.enter_context(_drained(proc))
                t0 = time.monotonic()
                wait_until(lambda: _health(dep.url) == (200, {"status": "ok"}), 20, "router healthy again")
                back = time.monotonic() - t0
                prompts = [prompt, prompt[::-1] if k else prompt + [17, 18]]
                got = [_complete(dep.url, p, 20) for p in prompts]
                assert [g["choices"][0]["token_ids"] for g in got] == [colocated(p, 20) for p in prompts]
                assert all(g["pdd"]["instances"][field] == name for g in got)
                assert proc.poll() is None
                print(f"\nrouter back to ok {back:.2f} s after the new {name} answered its /health")
            os.kill(dep.pids["router"], 0)  # the same router process throughout
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)  # it holds the deployment's secret


# ---- 5. a full decode pool holds reservations back ---------------------------------------

SMALL_MD = """
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
[[instances]]
name = "md0"
role = "main"
dc = "B"
[instances.engine]
num_pages = 36
"""


def test_full_decode_pool_holds_a_reservation_until_pages_free(tmp_path, colocated):
    """MD has 36 pages of 16 tokens. A (200-token prompt, 13 pages, growing to 35 with
    its 350 tokens) runs; B (400 tokens, 25 pages) cannot be reserved next to it. B
    must wait, not fail, and start once A's pages are free: its first token reaches
    the client after A's last, and its tokens are exact."""
    conf = _write_config(tmp_path / "d.toml", "pd-cross-dc", SMALL_MD, line=FAST_LINE)
    a, b = _prompt(51, 200), _prompt(52, 400)
    want_a, want_b = colocated(a, 350), colocated(b, 60)
    with pdd_up("--config", conf) as dep, ThreadPoolExecutor(2) as pool:
        md = dep.http["md0"]
        assert _stats(md)["kv"]["pages"] == 36
        a_started = threading.Event()
        first = pool.submit(_stream, dep.url, a, 350, 60, a_started)
        assert a_started.wait(30)
        second = pool.submit(_stream, dep.url, b, 60, 60)
        # B is seen held back while A runs: in the router's line of requests waiting for room
        # at their decode instance, or in MD's own line of reservations
        held_in = wait_until(lambda: first.done() or _held_back(dep.url, md), 30, "B is held back")
        assert held_in is not True and not first.done(), "B was not seen held back while A ran"
        got_a, got_b = first.result(timeout=60), second.result(timeout=60)
        wait_until(lambda: _settled(md), 10, "MD holds nothing")
    assert got_a["error"] is None and got_a["ids"] == want_a
    assert got_b["error"] is None and got_b["ids"] == want_b, got_b["error"]
    print(f"\nB held back in {held_in}; its first token {got_b['first_at'] - got_a['ended_at']:.3f} s after A's last")
    assert got_b["first_at"] > got_a["ended_at"], "B started while A held the pool: nothing was held back"
    assert got_b["record"]["d_hit_tokens"] == 0 and got_b["record"]["retries"] == 0


def _held_back(router: str, md: str) -> str | None:
    """Where a request waits for room at MD now, if anywhere."""
    if _stats(router)["dispatch_waiting"]:
        return "the router's dispatch queue"
    if _stats(md)["node"]["reservations_waiting"]:
        return "MD's reservation queue"
    return None


# ---- 6. DRC cuts the bytes on the line ---------------------------------------------------


def _sessions(colocated) -> list[tuple[list[int], int]]:
    """Two three-turn agent sessions, interleaved: each next turn is the previous
    prompt, its (colocated) output and a new tool result. (prompt, max_tokens) pairs."""
    turns: list[tuple[list[int], int]] = []
    contexts = {s: _prompt(60 + s, 300) for s in range(2)}
    for t in range(3):
        for s in range(2):
            prompt = contexts[s]
            out = colocated(prompt, 30)
            turns.append((prompt, 30))
            contexts[s] = prompt + out + _prompt(70 + 10 * s + t, 50 + 7 * t)
    return turns


def _run_turns(url: str, line_admin: str, turns: list[tuple[list[int], int]]) -> tuple[list[dict], int]:
    before = HTTP.get(f"{line_admin}/stats").json()["bytes_a_to_b"]
    got = [_complete(url, p, n) for p, n in turns]
    return got, HTTP.get(f"{line_admin}/stats").json()["bytes_a_to_b"] - before


def test_decode_side_cache_cuts_line_bytes_against_drc_off(colocated, tiny_model_dir):
    """The same multi-turn workload through pd-cross-dc, DRC on and off, counted at the
    line emulator (P -> MD direction: the KV, the reservations). Off ships every prompt
    token's KV; on, a later turn ships only what follows the previous turn's prompt and
    output, to the page (MD caches whole pages; the last output token has no KV yet).
    Both are bounded from the model's KV size per token, with 3 % + 16 KiB a request
    for framing and the reservations' token ids."""
    bpt = kv_bytes_per_token(tiny_model_dir)
    page = EngineConfig().page_size
    turns = _sessions(colocated)
    off_tokens = sum(len(p) for p, _ in turns)
    on_lo = on_hi = 0
    for i, (p, _) in enumerate(turns):
        if i < 2:  # first turn of a session: nothing of it is at MD
            on_lo, on_hi = on_lo + len(p), on_hi + len(p)
        else:
            prev_p, prev_n = turns[i - 2]
            held = len(prev_p) + prev_n  # the previous turn's prompt and output
            on_lo, on_hi = on_lo + len(p) - held, on_hi + len(p) - held + page
    slack = len(turns) * 16384
    measured = {}
    for drc in ("off", "on"):
        with pdd_up("--mode", "pd-cross-dc", "--drc", drc, *_line_args(FAST_LINE)) as dep:
            got, measured[drc] = _run_turns(dep.url, dep.line_admin, turns)
        assert [g["choices"][0]["token_ids"] for g in got] == [colocated(p, n) for p, n in turns], drc
    print(f"\nKV {bpt} B/token; line bytes P->MD: DRC off {measured['off']:,} (KV of {off_tokens} tokens), "
          f"on {measured['on']:,} (KV of {on_lo}..{on_hi} tokens)")
    assert off_tokens * bpt <= measured["off"] <= off_tokens * bpt * 1.03 + slack
    assert on_lo * bpt <= measured["on"] <= on_hi * bpt * 1.03 + slack
    assert measured["on"] < measured["off"]
    assert measured["off"] - measured["on"] >= (off_tokens - on_hi) * bpt  # what MD held did not cross


# ---- 7. line faults in the middle of a P/D run --------------------------------------------

FAULT_BOUND_S = 30.0
FAULTS = {"stall": {"stall_s": 3.0}, "drop": {"drop": True}, "blackhole": {"blackhole": True}}


def _attempt(url: str, prompt: list[int], max_tokens: int, stream: bool,
             first: threading.Event | None = None) -> dict:
    """A request that may fail: its outcome, never an exception from the client (other
    than a silence past the bound, which the caller turns into a failure)."""
    t0 = time.monotonic()
    if stream:
        out = _stream(url, prompt, max_tokens, FAULT_BOUND_S, first)
    else:
        r = HTTP.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, False), timeout=FAULT_BOUND_S)
        out = {"status": r.status_code, "ids": [], "error": None}
        if r.status_code == 200:
            out["ids"] = r.json()["choices"][0]["token_ids"]
        else:
            out["error"] = r.json().get("error")
    out["took"] = time.monotonic() - t0
    return out


@pytest.mark.parametrize("fault", list(FAULTS))
def test_line_fault_mid_run_ends_requests_cleanly_and_the_deployment_recovers(fault, tmp_path, colocated):
    """Requests stream through pd-cross-dc when the line stalls (3 s, under the
    liveness limit of 5 s), drops every connection, or silently swallows everything.
    Each request, in flight or arriving during the fault, ends within 30 s either with
    the colocated tokens or with a clean OpenAI error: a 502/503/504 status, or a
    stream's error event; never a 500 nor an unhandled exception. Once the fault is
    cleared, the deployment serves exact tokens again."""
    conf = _write_config(tmp_path / "d.toml", "pd-cross-dc", line={**FAST_LINE, "bandwidth_mbps": 50.0},
                         router={"stall_timeout_s": 5.0, "token_timeout_s": 10.0})
    prompts = [_prompt(80 + i, 250 + 30 * i) for i in range(4)]
    n = 300
    want = [colocated(p, n) for p in prompts]
    with pdd_up("--config", conf) as dep, ThreadPoolExecutor(4) as pool:
        http = dep.http
        started = threading.Event()
        running = [pool.submit(_attempt, dep.url, prompts[0], n, True, started),
                   pool.submit(_attempt, dep.url, prompts[1], n, True),
                   pool.submit(_attempt, dep.url, prompts[2], n, False)]
        assert started.wait(20), "no token streamed before the fault"
        injected = time.monotonic()
        state = dep.fault(**FAULTS[fault])
        late = pool.submit(_attempt, dep.url, prompts[3], n, False)  # arrives during the fault
        outcomes = []
        for f in [*running, late]:
            try:
                outcomes.append(f.result(timeout=FAULT_BOUND_S + 5))
            except (httpx.TimeoutException, TimeoutError) as e:
                raise AssertionError(f"a request hung past {FAULT_BOUND_S:g} s under {fault}") from e
        resolved = time.monotonic() - injected
        if fault == "blackhole":
            dep.fault(blackhole=False)
        wait_until(lambda: _health(dep.url) == (200, {"status": "ok"}), 30, "router healthy after the fault")
        after = [_complete(dep.url, p, n) for p in prompts[:2]]
        for name, url in http.items():
            wait_until(lambda url=url: _settled(url), 30, f"{name} holds nothing after the fault")
        rejected = {name: rejected_frames(url) for name, url in http.items()}
    summary = [("ok" if o["error"] is None else f"{o.get('status')} {o['error']['message'][:60]}") for o in outcomes]
    print(f"\n{fault} ({state['connections']} connections on the line): all ended {resolved:.1f} s after it; "
          f"{summary}; longest waits between tokens {[round(o.get('max_gap_s', 0), 1) for o in outcomes]} s")
    assert [a["choices"][0]["token_ids"] for a in after] == want[:2]
    # connections broken by the line are network events, not rejected (hostile) frames
    assert set(rejected.values()) == {0}, rejected
    if fault == "stall":  # under the liveness limit: late, never lost
        assert [o["ids"] for o in outcomes] == want, summary
        assert outcomes[0]["max_gap_s"] >= 0.8 * FAULTS["stall"]["stall_s"], "the stall delayed nothing"
    for o, w in zip(outcomes, want, strict=True):
        assert o["took"] < FAULT_BOUND_S, o
        if o["error"] is None:
            assert o["status"] == 200 and o["ids"] == w, "a request that completed must have exact tokens"
        else:
            _assert_openai_error(o["error"])
            # 200: a stream's error event after its start. Never 500: a lost instance or line is a 503
            # (README), a timeout a 504; a 500 says the server broke
            assert o["status"] in (200, 502, 503, 504), o
            assert o["ids"] == w[: len(o["ids"])], "tokens sent before the failure must be exact"


# ---- 8. no silent skips in CI ------------------------------------------------------------

SKIPPING_TESTS = '''
import pytest

def test_needs_a_test_extra():
    pytest.importorskip("pdd_no_such_module")

@pytest.mark.skipif(True, reason="data file not present")
def test_needs_a_data_file():
    pass

@pytest.mark.ci_may_skip
def test_needs_a_gpu():
    pytest.skip("no GPU here")

@pytest.mark.xfail(reason="a known bug")
def test_known_bug():
    assert False

def test_plain():
    pass
'''


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_skip_is_a_failure_in_ci(tmp_path, ci):
    """tests/conftest.py's rule, run by pytest on a scratch suite: without CI, what is
    missing skips; with CI=true, a skipped test (importorskip, skipif) fails and a
    module whose import skips is a collection error; @ci_may_skip and xfail stay."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_scratch.py").write_text(SKIPPING_TESTS)
    (tmp_path / "test_extra_module.py").write_text('import pytest\n\npytest.importorskip("pdd_no_such_module")\n\n\n'
                                                   'def test_never_collected():\n    pass\n')
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")} | ({"CI": ci} if ci else {})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          "--continue-on-collection-errors", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    out = run.stdout
    assert "PASSED test_scratch.py::test_plain" in out and "XFAIL test_scratch.py::test_known_bug" in out, out
    assert "SKIPPED [1] test_scratch.py:13: no GPU here" in out, out  # @ci_may_skip: a skip, CI or not
    if ci:
        assert run.returncode == 1, out
        # a skip inside the test fails it; one at setup (skipif) or collection is an error: all fail the run
        assert "FAILED test_scratch.py::test_needs_a_test_extra - skipped in CI (could not import" in out, out
        assert "ERROR test_scratch.py::test_needs_a_data_file - skipped in CI (data file not present)" in out, out
        assert "ERROR test_extra_module.py - skipped in CI (could not import" in out, out
    else:
        assert run.returncode == 0, out
        assert out.splitlines()[-1].startswith("1 passed, 4 skipped, 1 xfailed"), out


@pytest.mark.parametrize("wanted", ["", "0"])
def test_vllm_tests_fail_without_vllm_unless_left_out(tmp_path, wanted):
    """The vLLM tests run by default (CI's run included) and fail, CI set or not, where
    vLLM is missing, here a module whose import skips; PDD_VLLM=0 leaves them out, and
    the summary says so."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_vllm_scratch.py").write_text('import pytest\n\npytest.importorskip("pdd_no_such_module")\n\n\n'
                                                   'def test_never_collected():\n    pass\n')
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PDD_VLLM")}
    env |= {"PDD_VLLM": wanted} if wanted else {}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          "--continue-on-collection-errors", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    out = run.stdout
    assert "PASSED test_plain.py::test_plain" in out, out
    if wanted == "0":
        assert run.returncode == 0, out
        assert "vLLM backend tests not run (1 modules): PDD_VLLM=0 leaves them out" in out, out
    else:
        assert run.returncode == 1, out
        assert "ERROR test_vllm_scratch.py - vLLM backend test skipped (could not import" in out, out


def test_prefill_losing_its_decode_peer_is_a_503_not_a_500(colocated):
    """What the blackhole case above hits when P's heartbeat to MD gives up before the
    router's does (a race there), made certain: P runs with a shorter liveness limit
    than the router (hosts read their own copy of the deployment file). A request that
    waits at P for MD's reservation when the line goes silent fails when P drops MD:
    the decode instance is unreachable, a 503 (README: a dead instance's connection
    ends its requests with HTTP 503), not a 500."""
    run_dir = None
    try:
        with pdd_up("--mode", "pd-cross-dc", "--keep", *_line_args(FAST_LINE)) as dep, contextlib.ExitStack() as stack:
            run_dir = dep.run_dir
            conf = Path(run_dir, "deployment.toml").read_text()
            assert "heartbeat_s = 1.0\ndead_after_s = 5.0" in conf
            p0_conf = Path(run_dir, "p0.toml")
            p0_conf.write_text(conf.replace("heartbeat_s = 1.0\ndead_after_s = 5.0",
                                            "heartbeat_s = 0.5\ndead_after_s = 2.0"))
            p0_conf.chmod(0o600)
            os.kill(dep.pids["p0"], signal.SIGKILL)
            wait_until(lambda: _health(dep.url)[0] == 503, 10, "router reports prefill missing")
            proc = stack.enter_context(pdd_process(["serve", "--config", str(p0_conf), "--instance", "p0"],
                                                   f"{dep.http['p0']}/health"))
            stack.enter_context(_drained(proc))
            wait_until(lambda: _health(dep.url) == (200, {"status": "ok"}), 20, "router healthy")
            warm = _prompt(91, 100)
            assert _complete(dep.url, warm, 4)["choices"][0]["token_ids"] == colocated(warm, 4)  # P -> MD is open
            dep.fault(blackhole=True)
            t0 = time.monotonic()
            r = HTTP.post(f"{dep.url}/v1/completions", json=_body(_prompt(92, 200), 8, False), timeout=30)
            took = time.monotonic() - t0
            dep.fault(blackhole=False)
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    print(f"\nP gave up on MD after {took:.1f} s: HTTP {r.status_code} {r.text}")
    assert took < 5.0  # P's 2 s limit ended it, before the router's 5 s
    _assert_openai_error(r.json()["error"])
    assert r.status_code == 503, r.text
