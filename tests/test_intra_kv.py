"""KV inside a datacenter through the Mooncake Transfer Engine (`[link] intra_kv`): P writes
each KV frame into the relay's registered memory and sends only where it is; the tokens
are colocated's in every pipeline the relay takes part in, a slot whose bytes do not
match their digest is refused, and where the engine cannot run the KV goes over TCP
with one line saying why ("auto"), or the instance does not start ("mooncake")."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest
from procs import pdd_up
from test_pdd import FAST_LINE, _prompts, _stream, _write_config

from pdd.transfer import messages as m
from pdd.transfer.wire import PROTOCOL_VERSION, Frame, MsgType

mooncake_engine = pytest.importorskip("mooncake.engine", reason="pdd[mooncake] is not installed")

HANDOFFS = {"one-shot": {"handoff": "one_shot"}, "catch-up": {"handoff": "catch_up", "catch_up_chunk": 7}}


@pytest.fixture(scope="module")
def greedy(colocated) -> list[list[int]]:
    return [colocated(p, 40) for p in _prompts()]


@pytest.mark.parametrize("handoff", list(HANDOFFS))
def test_kv_to_the_relay_through_the_transfer_engine_gives_colocateds_tokens(handoff, greedy, tmp_path):
    link = {**FAST_LINE, "intra_kv": "mooncake"}
    conf = _write_config(tmp_path / "pdd.toml", link=link, policy={"pipeline": "P-RLD-MD", **HANDOFFS[handoff]})
    with pdd_up("--mode", "pdd", "--config", conf) as dep:
        got = [_stream(dep.url, p, 40) for p in _prompts()]
        relay = httpx.get(f"{dep.http['rld0']}/pdd/stats", timeout=5).json()["node"]["kv_placed"]
        main = httpx.get(f"{dep.http['md0']}/pdd/stats", timeout=5).json()["node"]["kv_placed"]
    for g in got:
        assert g["finish_reason"] == "length" and len(g["ids"]) == 40 and not g.get("error"), g
    assert sum(g["record"]["relay_output_tokens"] for g in got) > 0  # (the relay decoded on that KV)
    assert [g["ids"] for g in got] == greedy
    # every prompt's KV reached the relay through the engine; MD's crossed the line as frames
    assert relay["frames"] >= len(_prompts()) and relay["bytes"] > 0 and main == {"frames": 0, "bytes": 0}


def test_without_the_engine_auto_says_why_and_sends_over_tcp_and_mooncake_does_not_start(greedy, tmp_path):
    missing = tmp_path / "site"
    (missing / "mooncake").mkdir(parents=True)
    (missing / "mooncake" / "__init__.py").write_text("raise ImportError('no transfer engine on this host')\n")
    env = {"PYTHONPATH": f"{missing}"}
    policy = {"pipeline": "P-RLD-MD", "handoff": "one_shot"}
    conf = _write_config(tmp_path / "auto.toml", link={**FAST_LINE, "intra_kv": "auto"}, policy=policy)
    with pdd_up("--mode", "pdd", "--config", conf, env=env) as dep:
        got = [_stream(dep.url, p, 40)["ids"] for p in _prompts()[:2]]
        relay = httpx.get(f"{dep.http['rld0']}/pdd/stats", timeout=5).json()["node"]["kv_placed"]
        said = (dep.run_dir / "p0.log").read_text()
    assert got == greedy[:2] and relay["frames"] == 0
    lines = [line for line in said.splitlines() if "goes over TCP, not the transfer engine" in line]
    assert len(lines) == 1 and "no transfer engine on this host" in lines[0], lines
    conf = _write_config(tmp_path / "named.toml", link={**FAST_LINE, "intra_kv": "mooncake"}, policy=policy)
    with pytest.raises(RuntimeError, match="exited before its router was ready") as refused:
        with pdd_up("--mode", "pdd", "--config", conf, env=env, timeout=60):
            pass
    assert "no transfer engine on this host" in str(refused.value)


class _Conn:
    """What `Regions` sends on: the bodies, decoded."""

    version = PROTOCOL_VERSION

    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, msg_type: MsgType, payload: bytes) -> None:
        self.sent.append(m.decode(Frame(msg_type, 0, payload)))


def test_a_placed_frame_is_the_kv_frame_it_stands_for_and_tampered_bytes_are_refused():
    """Two engines in one process, as two instances: P's `Placement` writes through its
    engine into the region the receiver's `Regions` offered; the receiver hands on the
    KV_LAYER frame, frees the slot, and refuses a slot written behind the digest's back."""
    from pdd.config import InstanceSpec
    from pdd.instance.placement import Placement, Regions
    from pdd.transfer import mooncake

    spec = InstanceSpec("rld0", "relay", "A", "127.0.0.1")
    receiver, conn = Regions(spec), _Conn()

    async def go() -> None:
        ask = Frame(MsgType.KV_REGION_ASK, 0, m.encode_body(m.KVRegionAsk("mooncake"), PROTOCOL_VERSION))
        assert await receiver.on_frame(conn, ask) is None
        offer = conn.sent.pop()
        assert isinstance(offer, m.KVRegion) and not offer.error and offer.slots == mooncake.SLOTS
        sender = mooncake.Endpoint("127.0.0.1")  # (another engine: P's)
        remote = mooncake.RemoteRegion(offer.session, offer.address, offer.slot_bytes, offer.slots)
        placement = Placement(sender, remote, sender.region(offer.slot_bytes, offer.slots))
        payload = m.kv_payload("a.0", bytes(range(256)) * 4000)
        placed = await placement.place(payload)
        assert placed.sha256 == hashlib.sha256(payload).hexdigest()
        frame = await receiver.on_frame(conn, Frame(MsgType.KV_PLACED, 5, m.encode_body(placed, PROTOCOL_VERSION)))
        assert frame is not None and frame.type == MsgType.KV_LAYER and bytes(frame.payload) == payload
        assert conn.sent == [m.KVSlotFree(placed.slot)] and receiver.placed == {"frames": 1, "bytes": len(payload)}
        again = await placement.place(payload)
        region = receiver._by_conn[conn][1]
        region[again.slot * offer.slot_bytes + 100] ^= 0xFF  # (someone else wrote into the region)
        with pytest.raises(m.BadMessage, match="does not match its SHA-256"):
            await receiver.on_frame(conn, Frame(MsgType.KV_PLACED, 6, m.encode_body(again, PROTOCOL_VERSION)))

    asyncio.run(go())


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    from procs import standalone

    with standalone(tiny_model_dir, pages=512) as url:
        yield lambda prompt, max_tokens: _stream(url, prompt, max_tokens)["ids"]
