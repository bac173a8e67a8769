"""KV inside a datacenter through the Mooncake Transfer Engine (`[line] intra_kv`): P writes
each KV frame into the relay's registered memory and sends only where it is; the tokens
are colocated's in every pipeline the relay takes part in, a slot whose bytes do not
match their digest is refused, and where the engine cannot run the KV goes over TCP
with one line saying why ("auto"), or the instance does not start ("mooncake")."""

from __future__ import annotations

import asyncio

import pytest
import torch
from procs import HTTP, pdd_up
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
    line = {**FAST_LINE, "intra_kv": "mooncake"}
    conf = _write_config(tmp_path / "pdd.toml", line=line, policy={"pipeline": "P-RLD-MD", **HANDOFFS[handoff]})
    with pdd_up("--mode", "pdd", "--config", conf) as dep:
        got = [_stream(dep.url, p, 40) for p in _prompts()]
        relay = HTTP.get(f"{dep.http['rld0']}/pdd/stats", timeout=5).json()["node"]["kv_placed"]
        main = HTTP.get(f"{dep.http['md0']}/pdd/stats", timeout=5).json()["node"]["kv_placed"]
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
    conf = _write_config(tmp_path / "auto.toml", line={**FAST_LINE, "intra_kv": "auto"}, policy=policy)
    with pdd_up("--mode", "pdd", "--config", conf, env=env) as dep:
        got = [_stream(dep.url, p, 40)["ids"] for p in _prompts()[:2]]
        relay = HTTP.get(f"{dep.http['rld0']}/pdd/stats", timeout=5).json()["node"]["kv_placed"]
        said = (dep.run_dir / "p0.log").read_text()
    assert got == greedy[:2] and relay["frames"] == 0
    lines = [line for line in said.splitlines() if "goes over TCP, not the transfer engine" in line]
    assert len(lines) == 1 and "no transfer engine on this host" in lines[0], lines
    conf = _write_config(tmp_path / "named.toml", line={**FAST_LINE, "intra_kv": "mooncake"}, policy=policy)
    with pytest.raises(RuntimeError, match="exited before its router was ready") as refused:
        with pdd_up("--mode", "pdd", "--config", conf, env=env, timeout=60):
            pass
    assert "no transfer engine on this host" in str(refused.value)


class _Conn:
    """Either end of a KV connection, without the socket: what it sends, as frames."""

    version = PROTOCOL_VERSION

    def __init__(self) -> None:
        self.sent: list[Frame] = []

    async def send(self, msg_type: MsgType, payload: bytes) -> None:
        self.post(msg_type, payload)

    def post(self, msg_type: MsgType, payload: bytes) -> None:
        self.sent.append(Frame(msg_type, len(self.sent), payload))

    def subkey(self, label: bytes, sending: bool) -> bytes:  # (one session key, as both ends derive it)
        return b"s" * 32


def test_a_placed_frame_is_the_kv_frame_it_stands_for_and_tampered_bytes_are_refused():
    """Two engines in one process, as two instances: P's `Placement` writes through its
    engine into the region the receiver's `Regions` offered; the receiver hands on the
    KV_LAYER frame (in a writable buffer of its own, which the KV's decode reads in place),
    frees the slot, and refuses a slot written behind the digest's back."""
    from pdd.config import InstanceSpec
    from pdd.instance.placement import Placement, Regions
    from pdd.transfer import mooncake

    spec = InstanceSpec("rld0", "relay", "A", "127.0.0.1")
    receiver, conn = Regions(spec), _Conn()

    async def go() -> None:
        ask = Frame(MsgType.KV_REGION_ASK, 0, m.encode_body(m.KVRegionAsk("mooncake"), PROTOCOL_VERSION))
        assert await receiver.on_frame(conn, ask) is None
        offer = m.decode(conn.sent.pop())
        assert isinstance(offer, m.KVRegion) and not offer.error and offer.slots == mooncake.SLOTS
        sender, out = mooncake.Endpoint("127.0.0.1"), _Conn()  # (another engine: P's)
        placement = Placement.from_offer(sender, offer, out)
        # more frames than slots, each in parts as P sends them
        blobs = [[bytes([i]) * (1 << 20), bytes(range(256)) * i] for i in range(mooncake.SLOTS + 4)]
        payloads = [b"".join(m.kv_payload(f"a.{i}", blob)) for i, blob in enumerate(blobs)]
        received: list[bytes] = []

        async def receive() -> None:  # the relay's node, and P's reader of its KV_SLOT_FREE
            while len(received) < len(payloads):
                if len(out.sent) <= len(received):
                    await asyncio.sleep(0.001)
                    continue
                frame = out.sent[len(received)]
                assert frame.type == MsgType.KV_PLACED
                got = await receiver.on_frame(conn, frame)
                assert got is not None and got.type == MsgType.KV_LAYER
                assert not memoryview(got.payload).readonly  # (the KV's decode views it: no second copy)
                received.append(bytes(got.payload))
                placement.slots.give(m.decode(conn.sent.pop()).slot)

        reader = asyncio.ensure_future(receive())
        for i, blob in enumerate(blobs):  # (more frames than slots: each freed once the receiver has read it)
            await asyncio.wait_for(placement.send(out, m.kv_payload(f"a.{i}", blob)), 30)
        await asyncio.wait_for(placement.flush(), 30)
        await asyncio.wait_for(reader, 30)
        assert received == payloads  # every frame, whole and in order
        assert receiver.placed == {"frames": len(blobs), "bytes": sum(map(len, payloads))}
        # a frame larger than a slot goes over the connection, in its turn behind those placed before it
        big = m.kv_payload("big", bytes(offer.slot_bytes))
        sent = len(out.sent)
        await placement.send(out, payloads[1])
        await placement.send(out, big)
        await placement.flush()
        assert [f.type for f in out.sent[sent:]] == [MsgType.KV_PLACED, MsgType.KV_LAYER]
        assert bytes((await receiver.on_frame(conn, out.sent[sent])).payload) == payloads[1]
        assert out.sent[sent + 1].payload is big
        placement.slots.give(m.decode(conn.sent.pop()).slot)
        await placement.send(out, payloads[0])
        await placement.flush()
        placed = m.decode(out.sent[-1])
        region = receiver._by_conn[conn].buf
        region[placed.slot * offer.slot_bytes + 100] ^= 0xFF  # (someone else wrote into the region)
        with pytest.raises(m.BadMessage, match="does not match its tag"):
            await receiver.on_frame(conn, out.sent[-1])

    asyncio.run(go())


def test_the_engine_writer_waits_for_its_writes_without_spinning(monkeypatch):
    """The writer thread submits each queued write at once (several in flight together)
    and sleeps `POLL_S` between looks at their status, where the engine's own sync waits
    spin on it: with a 10 ms poll, writes the engine holds for 0.3 s are looked at some 30
    times each, not thousands. A failed write, or one the engine refuses, fails its future
    with a ConnectionError (the frame then goes over the connection)."""
    import queue
    import threading
    import time

    from pdd.transfer import mooncake

    monkeypatch.setattr(mooncake, "POLL_S", 0.01)

    class Engine:  # (the engine's own calls, as `Endpoint` uses them)
        def __init__(self) -> None:
            self.checks, self.submitted, self.began = 0, [], time.monotonic()

        def transfer_submit_write(self, session: str, src: int, dst: int, nbytes: int) -> int:
            self.submitted.append(dst)
            return -1 if dst == 3 else len(self.submitted)

        def transfer_check_status(self, batch: int) -> int:
            self.checks += 1
            if time.monotonic() - self.began < 0.3:
                return 0
            return -1 if batch == 2 else 1

    endpoint = mooncake.Endpoint.__new__(mooncake.Endpoint)
    endpoint._engine, endpoint._writes = Engine(), queue.SimpleQueue()
    threading.Thread(target=endpoint._write_all, daemon=True).start()
    region = mooncake.RemoteRegion("peer", 0, 1, 4)
    local = torch.zeros(16, dtype=torch.uint8)
    writes = [endpoint.write(local, region, slot, 8) for slot in range(4)]
    outcomes = []
    for w in writes:
        try:
            outcomes.append(w.result(timeout=10))
        except ConnectionError as e:
            outcomes.append(str(e))
    assert outcomes[0] is None and outcomes[2] is None  # done
    assert "failed (-1)" in outcomes[1] and "could not write" in outcomes[3]
    assert endpoint._engine.submitted == [0, 1, 2, 3]  # (each submitted before the first was done)
    assert endpoint._engine.checks <= 3 * (0.3 / 0.01 + 10), f"{endpoint._engine.checks} looks at 3 writes: spinning"


def test_a_slot_whose_write_timed_out_is_never_written_again_and_frames_still_go():
    """A write the engine timed out may still land in the relay's slot: that slot is
    retired, not given back, and its frame goes over the connection. Once every slot is,
    each frame goes over the connection, in order, and none waits for a slot."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from pdd.instance.placement import Placement
    from pdd.transfer import mooncake

    class Endpoint:  # (P's engine, whose writes to slots 1 and 3 time out, and all after 6 writes)
        def __init__(self) -> None:
            self.stager, self.slots_written = ThreadPoolExecutor(1), []

        def write(self, local: torch.Tensor, remote: mooncake.RemoteRegion, slot: int, nbytes: int) -> Future:
            self.slots_written.append(slot)
            done: Future[None] = Future()
            if slot in (1, 3) or len(self.slots_written) > 6:
                done.set_exception(mooncake.TimedOut("timed out"))
            else:
                done.set_result(None)
            return done

    async def go() -> None:
        endpoint, out = Endpoint(), _Conn()
        remote = mooncake.RemoteRegion("peer", 0, 1 << 16, 4)
        placement = Placement(endpoint, remote, torch.zeros(4 << 16, dtype=torch.uint8))  # type: ignore[arg-type]
        payloads = [m.kv_payload(f"r{i}", bytes([i]) * 1000) for i in range(12)]
        for payload in payloads:
            await asyncio.wait_for(placement.send(out, payload), 10)
            await placement.flush()
            if out.sent[-1].type == MsgType.KV_PLACED:  # (the relay has read it: its slot is free)
                placement.slots.give(m.decode(out.sent[-1]).slot)
        assert len(out.sent) == len(payloads)  # every frame, once, in order
        placed = [m.decode(f) for f in out.sent if f.type == MsgType.KV_PLACED]
        over = [f.payload for f in out.sent if f.type == MsgType.KV_LAYER]
        assert [p.slot for p in placed] == [2] * 5 and placement.retired == 4  # (slots are taken last-freed first)
        assert len(placed) + len(over) == len(payloads) and over[-1] is payloads[-1]
        assert 1 not in endpoint.slots_written[endpoint.slots_written.index(1) + 1 :]  # never written again
        assert 3 not in endpoint.slots_written[endpoint.slots_written.index(3) + 1 :]
        endpoint.stager.shutdown()

    asyncio.run(go())


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    from procs import standalone

    with standalone(tiny_model_dir, pages=512) as url:
        yield lambda prompt, max_tokens: _stream(url, prompt, max_tokens)["ids"]
