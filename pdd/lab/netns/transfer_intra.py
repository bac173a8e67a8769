"""`pdd bench transfer --loopback --intra mooncake`: KV inside a site through the transfer engine.

Two processes on this machine, as P and its relay: P places KV frames (`--frame-kib`
payloads, `--mbytes` in all) through the Mooncake Transfer Engine into the slots the
relay's node offered on an authenticated connection (`pdd.instance.placement`: the
frame's bytes into P's registered slot, the engine's write, KV_PLACED with the SHA-256;
the relay's copy out of its slot, the digest checked, KV_SLOT_FREE back), and the relay
counts the KV_LAYER bytes it would hand its role. Beside it, the engine's own benchmark
(`transfer_engine_bench`, shipped in its wheel) writes blocks of the same size between
two processes of its own: what the engine moves with nothing of pdd's around it.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

KEY = b"k" * 32
LISTENING = re.compile(r"listening on ([0-9.]+:[0-9]+)")
THROUGHPUT = re.compile(r"throughput ([0-9.]+) MB/s")


def engine_tool_mb_per_s(frame_bytes: int, seconds: float = 4.0) -> float:
    """The engine's own `transfer_engine_bench`: a target and an initiator writing
    `frame_bytes` blocks (16 a batch, one thread) over TCP for `seconds`; its MB/s."""
    import mooncake

    tool = Path(mooncake.__file__).parent / "transfer_engine_bench"
    common = ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--local_server_name=127.0.0.1"]
    log = tempfile.NamedTemporaryFile("w+", prefix="pdd-te-target-", suffix=".log")  # (polled: a pipe may hold it)
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}  # (its INFO line says where it listens)
    target = subprocess.Popen(
        [str(tool), "--mode=target", *common, "--buffer_size=268435456"], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        deadline, segment = time.monotonic() + 30, None
        while segment is None and time.monotonic() < deadline and target.poll() is None:
            time.sleep(0.1)
            found = LISTENING.search(Path(log.name).read_text(errors="replace"))
            segment = found.group(1) if found else None
        if segment is None:
            raise RuntimeError("transfer_engine_bench's target never said where it listens")
        initiator = subprocess.run(
            [
                str(tool),
                "--mode=initiator",
                *common,
                f"--segment_id={segment}",
                "--operation=write",
                "--buffer_size=268435456",
                "--threads=1",
                "--batch_size=16",
                f"--block_size={frame_bytes}",
                f"--duration={seconds:g}",
                "--report_unit=MB",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            env=env,
        )
        found = THROUGHPUT.search(initiator.stdout + initiator.stderr)
        if found is None:
            raise RuntimeError(f"transfer_engine_bench printed no throughput: {initiator.stderr[-500:]}")
        return float(found.group(1))
    finally:
        target.kill()
        target.wait()
        log.close()


def placed_mb_per_s(mbytes: int, frame_bytes: int) -> float:
    """pdd's KV frames placed through the engine into a relay's node in another process;
    MB/s of KV_LAYER payload the relay got, checked, from its first frame to its last."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready, result = ctx.Queue(), ctx.Queue()
    frames = max(2, mbytes * 1_000_000 // frame_bytes)
    proc = ctx.Process(target=_relay, args=(frames, ready, result))
    proc.start()
    try:
        port = int(ready.get(timeout=60))
        asyncio.run(_place(port, frames, frame_bytes))
        return float(result.get(timeout=300))
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


async def _place(port: int, frames: int, frame_bytes: int) -> None:
    from pdd.instance.placement import Placement
    from pdd.transfer import messages as m
    from pdd.transfer import mooncake, wire

    conn = await wire.open_connection("127.0.0.1", port, KEY)
    await wire.client_handshake(conn, {"role": "prefill", "name": "bench"})
    await m.send(conn, m.KVRegionAsk("mooncake"))
    offer = m.decode_as(await conn.recv(), m.KVRegion)
    endpoint = mooncake.endpoint("127.0.0.1")
    placement = Placement.from_offer(endpoint, offer, conn)

    async def freed() -> None:
        try:
            while True:
                placement.slots.give(m.decode_as(await conn.recv(), m.KVSlotFree).slot)
        except ConnectionError as e:  # the relay refused what it was sent: say so, not hang
            placement.slots.close(e)

    reader = asyncio.ensure_future(freed())
    payload = m.kv_payload("bench", os.urandom(frame_bytes - 64))
    for _ in range(frames):
        await placement.send(conn, payload)
    await placement.flush()
    await conn.drain()
    await asyncio.sleep(1.0)  # (the relay reads the last ones)
    reader.cancel()
    conn.close()


def _relay(frames: int, ready: Any, result: Any) -> None:
    from pdd.config import InstanceSpec
    from pdd.instance.placement import Regions
    from pdd.transfer import wire

    regions = Regions(InstanceSpec("rld0", "relay", "A", "127.0.0.1"))

    async def main() -> None:
        done, got, began = asyncio.Event(), [0], [0.0]

        async def serve(conn: wire.FramedConnection) -> None:
            await wire.server_handshake(conn)
            while not done.is_set():
                frame = await regions.on_frame(conn, await conn.recv())
                if frame is None:
                    continue
                got[0] += 1
                if got[0] == 1:
                    began[0] = time.monotonic()
                if got[0] == frames:
                    result.put((frames - 1) * len(frame.payload) / (time.monotonic() - began[0]) / 1e6)
                    done.set()

        server = await wire.serve(serve, "127.0.0.1", 0, KEY)
        ready.put(server.sockets[0].getsockname()[1])
        await done.wait()
        server.close()

    asyncio.run(main())


def intra(args: Any) -> int:
    """`--repeats` pairs: pdd's frames placed, then the engine's own tool, each printed as it comes."""
    from pdd.transfer.mooncake import SLOT_BYTES

    frame_bytes = min(args.frame_kib * 1024, SLOT_BYTES)  # (a placed frame fits one slot)
    for i in range(args.repeats):
        placed = placed_mb_per_s(args.mbytes, frame_bytes)
        tool = engine_tool_mb_per_s(frame_bytes)
        print(
            f"run {i + 1}: pdd's KV frames through mooncake {placed:.0f} MB/s, "
            f"its transfer_engine_bench {tool:.0f} MB/s: {placed / tool:.2f}x",
            flush=True,
        )
    return 0
