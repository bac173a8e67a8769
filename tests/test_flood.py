"""Under a flood, an admitted request completes, or it is refused up front (429/503 with
Retry-After); no tier turns back-pressure into a 5xx, and nothing is held afterwards.

Each deployment here is small (a decode pool of 48 pages holds four of these
requests at once; the router drives 8 and holds 8 in line), and the flood is ten
times what it runs at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from procs import HTTP, metrics, pdd_up, wait_until

from pdd.lab.bench.flood import flood
from pdd.transfer import messages as m
from pdd.transfer import wire

PROMPT_TOKENS, MAX_TOKENS = 150, 16  # 11 pages of 16 tokens at a decode instance
SMALL = {"engine": {"num_pages": 48}, "router": {"max_running": 8, "max_waiting": 8},
         "line": {"bandwidth_mbps": 100.0, "delay_ms": 5.0, "jitter_ms": 1.0}}


def _config(path: Path, mode: str, sections: dict, instances: str = "") -> str:
    lines = [f'mode = "{mode}"']
    for name, table in sections.items():
        lines += [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
    path.write_text("\n".join(lines) + "\n" + instances)
    return str(path)


def _held_pages(url: str) -> int:
    kv = HTTP.get(f"{url}/pdd/stats", timeout=5).json()["kv"]
    return kv["pages"] - kv["free"] - kv["cached"]


def _settled(dep, timeout_s: float = 30.0) -> float:
    """Wait until no request holds a page anywhere; how long that took."""
    started = time.monotonic()
    wait_until(lambda: all(_held_pages(u) == 0 for u in dep.http.values()), timeout_s, "every pool free")
    return time.monotonic() - started


def _node(dep, name: str) -> dict:
    return HTTP.get(f"{dep.http[name]}/pdd/stats", timeout=5).json()["node"]


@pytest.mark.parametrize("mode", ["colocated", "pd-same-dc", "pd-cross-dc", "pdd"])
def test_a_flood_is_answered_whole_or_refused_up_front(tmp_path, mode):
    with pdd_up("--config", _config(tmp_path / "d.toml", mode, SMALL)) as dep:
        shed = metrics(dep.url).get("pdd_admission_shed_total", 0.0)
        out = asyncio.run(flood(dep.url, 40, PROMPT_TOKENS, MAX_TOKENS))
        print(f"\n{mode}: sent {out.sent}, whole {out.whole}, refused {out.refused}, other {len(out.other)} "
              f"in {out.wall_s:.1f} s; statuses {dict(out.statuses)}")
        assert out.ok, out.other[:5]
        assert out.whole >= 16 and out.refused > 0  # the router's 8 + 8 ran; the rest was told to come back
        # every refusal came before admission: a 503 with Retry-After after it would count here, and must not
        assert out.refused == metrics(dep.url)["pdd_admission_shed_total"] - shed, dict(out.statuses)
        _settled(dep)
        again = asyncio.run(flood(dep.url, 2, PROMPT_TOKENS, MAX_TOKENS, seed=1))
        assert again.whole == 2  # the refusals were back-pressure, not a broken deployment


SMALL_RELAY = """
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
[[instances]]
name = "rld0"
role = "relay"
dc = "A"
[instances.engine]
num_pages = 48
max_running = 2
[[instances]]
name = "md0"
role = "main"
dc = "B"
[instances.engine]
num_pages = 512
"""


def test_a_small_relay_is_never_overrun_and_md_takes_the_rest(tmp_path):
    """A relay a tenth of MD's size (2 sequences, 48 pages) under a flood: it takes what
    it can decode at once, and P sends the rest P -> MD, counted as a fallback."""
    sections = {"router": {"max_running": 32, "max_waiting": 64}, "line": SMALL["line"]}
    with pdd_up("--config", _config(tmp_path / "d.toml", "pdd", sections, SMALL_RELAY)) as dep:
        out = asyncio.run(flood(dep.url, 48, PROMPT_TOKENS, MAX_TOKENS))
        stats = HTTP.get(f"{dep.url}/pdd/stats", timeout=5).json()
        print(f"\nsmall relay: whole {out.whole}, refused {out.refused}, other {len(out.other)}; "
              f"relay peak {_node(dep, 'rld0')['peak_held']}; router {stats}")
        assert out.ok, out.other[:5]
        assert out.whole == 48
        assert _node(dep, "rld0")["peak_held"] <= 2
        assert stats.get("fallback:relay_busy", 0) > 0
        assert stats.get("pipeline:P-MD", 0) >= stats["fallback:relay_busy"]
        _settled(dep)


def test_a_slow_line_is_progress_not_a_timeout(tmp_path):
    """The KV of an 800-token prompt takes about 7 s over a 4 Mbps line, more than
    twice the first-token timeout: the request completes, since the KV keeps moving."""
    sections = {"router": {"token_timeout_s": 3.0}, "line": {"bandwidth_mbps": 4.0, "delay_ms": 5.0, "jitter_ms": 0.0}}
    with pdd_up("--config", _config(tmp_path / "d.toml", "pd-cross-dc", sections)) as dep:
        out = asyncio.run(flood(dep.url, 1, 800, 4, stream_share=0.0))
        assert out.ok and out.whole == 1, out.other
        assert out.wall_s > 2 * 3.0, out.wall_s  # the premise: slower than the timeout


# ---- the decode instance's own line of reservations ----------------------------------

LINE_MD = """
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
[[instances]]
name = "md0"
role = "main"
dc = "A"
[instances.engine]
num_pages = 36
"""


def test_a_full_decode_pool_serves_reservations_first_come_first_served(tmp_path):
    """Talking to MD as a prefill instance would: A takes 32 of its 36 pages; B (30
    pages) and then C (2 pages, which would fit beside A) wait, and neither is
    refused; once A is dropped, B is granted before C."""
    conf = _config(tmp_path / "d.toml", "pd-same-dc", {}, LINE_MD)
    with pdd_up("--config", conf) as dep:
        deployment = (dep.run_dir / "deployment.toml").read_text()
        secret = next(line.split('"')[1] for line in deployment.splitlines() if line.startswith("secret"))
        port = next(int(line.split("=")[1]) for line in _instance_lines(deployment, "md0") if
                    line.startswith("kv_port"))
        order = asyncio.run(_reserve_three(port, wire.connection_key(secret, "instances")))
    assert order[:2] == [("A", 0), ("wait", None)]
    assert [name for name, _ in order[2:]] == ["B", "C"]


def _instance_lines(toml: str, name: str) -> list[str]:
    blocks = toml.split("[[instances]]")
    block = next(b for b in blocks if f'name = "{name}"' in b)
    return [line.strip().replace(" ", "") for line in block.splitlines()]


async def _reserve_three(port: int, key: bytes) -> list[tuple[str, int | None]]:
    from pdd.sampling.params import SamplingParams

    conn = await wire.open_connection("127.0.0.1", port, key)
    await wire.client_handshake(conn, {"role": "prefill", "name": "fake-p", "channel": "control"})
    params = SamplingParams(max_tokens=4)
    prompts = {"A": list(range(1, 32 * 16 + 1)), "B": list(range(2000, 2000 + 30 * 16)), "C": [7] * 20}
    got: list[tuple[str, int | None]] = []

    async def answer(timeout: float) -> m.ReserveAck | None:
        while True:
            try:
                body = m.decode(await asyncio.wait_for(conn.next_frame(), timeout))
            except TimeoutError:
                return None
            if isinstance(body, m.ReserveAck):
                return body

    for name in "ABC":
        await m.send(conn, m.Reserve(name, prompts[name], params, "no-router"))
        if name == "A":
            ack = await answer(10)
            got.append(("A", ack.hit if ack and not ack.error else None))
    ack = await answer(2.0)  # B and C wait: neither granted nor refused
    got.append(("wait", None) if ack is None else (ack.rid, ack.error))
    await m.send(conn, m.Abort("A"))
    for _ in range(2):
        ack = await answer(10)
        assert ack is not None and not ack.error, ack
        got.append((ack.rid, ack.hit))
    for name in "BC":
        await m.send(conn, m.Abort(name))
    conn.close()
    return got


# ---- background copies behind a stalled line ------------------------------------------

SMALL_P = """
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
[instances.engine]
max_requests = 4
[[instances]]
name = "rld0"
role = "relay"
dc = "A"
[[instances]]
name = "md0"
role = "main"
dc = "B"
"""


def test_background_copies_behind_a_stalled_line_leave_p_its_places(tmp_path):
    """P holds at most 4 requests. While the line is stalled, MD's copies of the relay's
    requests wait at P behind it; they are not foreground work, so P keeps taking new
    requests (the relay serves them) instead of refusing them as busy; and once the
    line is back, MD's pages come back within seconds."""
    sections = {"liveness": {"heartbeat_s": 1.0, "dead_after_s": 30.0}, "line": SMALL["line"]}
    with pdd_up("--config", _config(tmp_path / "d.toml", "pdd", sections, SMALL_P)) as dep:
        assert asyncio.run(flood(dep.url, 1, PROMPT_TOKENS, MAX_TOKENS, seed=9)).whole == 1  # connected
        dep.fault(stall_s=8.0)
        waves = [asyncio.run(flood(dep.url, 3, PROMPT_TOKENS, 8, seed=10 + w)) for w in range(4)]
        p = _node(dep, "p0")
        print(f"\nduring the stall: {[w.whole for w in waves]} whole of 3 a wave; P holds {p['held']} foreground, "
              f"{p['background_held']} background")
        assert all(w.ok and w.whole == 3 for w in waves), [w.other for w in waves]
        # the premise: MD's copies did pile up at P behind the stall, more than P's places,
        # so counted as foreground they would have refused the later waves
        assert p["held"] + p["background_held"] > 4 and p["background_held"] > 0, p
        dep.fault(stall_s=0)
        back_s = _settled(dep, 10.0)
        print(f"MD's pages all back {back_s:.1f} s after the line was")


def test_flood_prompts_are_distinct_token_ids_of_the_vocabulary():
    from pdd.lab.bench.flood import _prompt

    prompts = [_prompt(i, 150, 4096) for i in range(40)]
    assert len({tuple(p) for p in prompts}) == 40  # nothing shared: each costs its full KV
    assert all(0 < t < 4096 for p in prompts for t in p) and len(set(prompts[0])) > 100
