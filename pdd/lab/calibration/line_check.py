"""`pdd sim line`: the line model against the spec's handoff microbenchmark, and against
this machine's `pdd line` emulator.

The emulator is a userspace relay: the sender's TCP connection ends at the relay, on
loopback, so no congestion window ever ramps across the emulated delay; it shapes a
fluid pipe with a delay and jitter. So the model is compared with it in the
emulator's own terms (a fluid line of the same rate and delay), and the TCP model's
figure for the same line is printed beside them: the slow start the emulator cannot
show, which is what the spec's 185 ms mean is made of.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from typing import Any

import simpy

from pdd.lab.line import EmulatedLine, LineRelay, Route
from pdd.lab.sim.line import SharedLine
from pdd.lab.sim.tcp import HANDOFF_BYTES, HANDOFF_MEAN_S, HANDOFF_PEAK_S, Tcp, handoff_times_s
from pdd.perf.hardware import LINE_ONE_WAY_MS, Line


async def _emulated(mbps: float, delay_ms: float, runs: int, nbytes: int) -> list[float]:
    """`runs` transfers of `nbytes` through a `pdd line` relay on loopback, each on a
    fresh connection: when the far side has them all (its one-byte reply, less one
    one-way delay)."""

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(nbytes)
        writer.write(b"k")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = LineRelay(EmulatedLine(mbps, delay_ms), [Route("127.0.0.1", 0, "127.0.0.1", port)])
    await relay.start()
    payload, times = b"\0" * nbytes, []
    try:
        for _ in range(runs):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.listen_ports[0])
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = time.perf_counter()
            writer.write(payload)
            await writer.drain()
            await reader.readexactly(1)
            times.append(time.perf_counter() - started - delay_ms / 1000)
            writer.close()
    finally:
        await relay.stop()
        server.close()
        await server.wait_closed()
    return times


def _fluid_s(mbps: float, delay_ms: float, nbytes: int) -> float:
    env = simpy.Environment()
    line = SharedLine(env, Line(mbps / 1000, delay_ms, 0.0))
    done = line.send(nbytes)
    env.run(done)
    return env.now


def _stats(times: list[float]) -> dict[str, float]:
    return {
        "mean_ms": 1000 * statistics.mean(times),
        "peak_ms": 1000 * max(times),
        "std_ms": 1000 * statistics.pstdev(times),
    }


def line_check(mbps: float = 1000.0, runs: int = 20, emulator: bool = True, tcp: Tcp = Tcp()) -> dict[str, Any]:
    """The spec's microbenchmark on the calibrated line, and the emulator comparison."""
    result: dict[str, Any] = {
        "spec": {"mean_ms": 1000 * HANDOFF_MEAN_S, "peak_ms": 1000 * HANDOFF_PEAK_S},
        "tcp_model_25g": _stats(handoff_times_s(Line(25.0, LINE_ONE_WAY_MS, 0.0), tcp)),
        "tcp_model_at_emulator_rate": _stats(handoff_times_s(Line(mbps / 1000, LINE_ONE_WAY_MS, 0.0), tcp)),
        "fluid_model_at_emulator_rate_ms": 1000 * _fluid_s(mbps, LINE_ONE_WAY_MS, HANDOFF_BYTES),
        "emulator": {"mbps": mbps, "one_way_ms": LINE_ONE_WAY_MS, "runs": runs},
    }
    if emulator:
        result["emulator"] |= _stats(asyncio.run(_emulated(mbps, LINE_ONE_WAY_MS, runs, HANDOFF_BYTES)))
    return result
