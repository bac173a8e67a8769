"""The embedded engine's KV imports and exports run beside its steps, slice by slice, on a
copy thread (`pdd.engines.embedded.copies`): a running stream keeps stepping while a long import
lands, a request never starts on KV that is not all in place, and a request dropped
while its KV is being copied stops the copy before its pages go."""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time

import pytest

from pdd.engines.embedded import copies
from pdd.engines.embedded.engine import Engine
from pdd.engines.embedded.runtime import EngineRuntime
from pdd.engines.port import EngineConfig, RequestError
from pdd.kv import codec
from pdd.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture
def runtime(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(copies, "SLICE_BYTES", 16 << 10)  # (the tiny model's 800 tokens become many slices)
    rt = EngineRuntime(Engine(tiny_model_dir, EngineConfig(page_size=16, num_pages=256)))
    rt.start_thread()
    yield rt
    rt.close()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(n)]


def _reference(tiny_model_dir, prompt: list[int]) -> tuple[list[int], codec.KVBlob]:
    """A colocated run's greedy output, and the prompt's KV as P exports it after its first token."""
    e = Engine(tiny_model_dir, EngineConfig(page_size=16, num_pages=256))
    want = e.generate([prompt], GREEDY)[0]
    e.add_request("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold=True)
    while e.has_work():
        e.step()
    assert e.seqs["p"].output == want[:1]
    return want, codec.decode(codec.encode(e.export_kv("p", 0, len(prompt))))


def _slowed(monkeypatch, runtime: EngineRuntime, hold: threading.Event | None = None) -> list[tuple[int, int]]:
    """Every import slice takes 20 ms (as a large model's would), the last one waits for
    `hold`; returns (engine step count, slice end) as each slice runs."""
    seen: list[tuple[int, int]] = []
    claim = copies.import_copy

    def slow_copy(*args, **kwargs) -> copies.Copy:
        copy = claim(*args, **kwargs)
        last = copy.slices[-1][1]

        def slow(end: int, run) -> None:
            seen.append((runtime.engine.stats.steps, end))
            time.sleep(0.02)
            if hold is not None and end == last:
                assert hold.wait(20)
            run()

        copy.slices = [(a, b, functools.partial(slow, b, run)) for a, b, run in copy.slices]
        return copy

    monkeypatch.setattr("pdd.engines.embedded.kv_moves.import_copy", slow_copy)
    return seen


def test_a_long_import_runs_in_slices_while_a_stream_keeps_decoding(tiny_model_dir, runtime, monkeypatch):
    prompt = _prompt(1, 800)
    want, blob = _reference(tiny_model_dir, prompt)
    seen = _slowed(monkeypatch, runtime)

    async def go() -> tuple[list[int], list[int]]:
        stream = asyncio.ensure_future(_collect(runtime, "busy", _prompt(2, 40), SamplingParams(max_tokens=200)))
        await asyncio.sleep(0.2)  # (the stream is decoding)
        await runtime.reserve("d", prompt, GREEDY, use_cache=False)
        await runtime.import_kv("d", blob)
        watch = runtime.watch("d")
        await runtime.start("d", [want[0]])
        got = [want[0]] + [out.token async for out in watch if out.token is not None]
        return got, await stream

    got, busy = asyncio.run(go())
    assert got == want and len(busy) == 200
    assert len(seen) > 4  # many slices
    assert seen[-1][0] > seen[0][0], f"no step ran between the import's first and last slice: {seen}"


def test_a_start_waits_for_the_last_slice_of_its_import(tiny_model_dir, runtime, monkeypatch):
    """Held back, the last slice keeps a started request from running: no token is
    computed on KV that is not all in place; once it lands, the tokens are colocated's."""
    prompt = _prompt(3, 300)
    want, blob = _reference(tiny_model_dir, prompt)
    hold = threading.Event()
    _slowed(monkeypatch, runtime, hold)

    async def go() -> list[int]:
        await runtime.reserve("d", prompt, GREEDY, use_cache=False)
        importing = asyncio.ensure_future(runtime.import_kv("d", blob))
        await asyncio.sleep(0.3)
        assert not importing.done()
        watch = runtime.watch("d")
        await runtime.start("d", [want[0]])  # (the receiver starts once the KV has arrived)
        await asyncio.sleep(0.3)
        seq = runtime.engine.seqs["d"]
        assert seq.start_deferred and seq not in runtime.engine.scheduler.running and seq.num_output == 1
        hold.set()
        await importing
        outs = [out async for out in watch]
        return [want[0]] + [o.token for o in outs if o.token is not None]

    assert asyncio.run(go()) == want


def test_a_request_dropped_mid_import_stops_its_copy_and_caches_only_what_landed(tiny_model_dir, runtime, monkeypatch):
    prompt = _prompt(4, 300)
    _, blob = _reference(tiny_model_dir, prompt)
    hold = threading.Event()
    seen = _slowed(monkeypatch, runtime, hold)

    async def go() -> None:
        await runtime.reserve("d", prompt, GREEDY, use_cache=False)
        importing = asyncio.ensure_future(runtime.import_kv("d", blob))
        await asyncio.sleep(0.3)
        runtime.abort("d")
        await asyncio.sleep(0.1)
        hold.set()
        with pytest.raises(RequestError, match="ended while its KV was being copied"):
            await importing

    asyncio.run(go())
    landed = seen[-1][1]  # the slice under way when the drop came finished; none ran after it
    assert landed < len(prompt) and time.sleep(0.2) is None and seen[-1][1] == landed
    cached = asyncio.run(runtime.cached_prefix(prompt))
    assert 0 < cached <= landed  # the pages it filled are cached, the rest is not
    e = runtime.engine
    e.flush_cache()
    assert e.pool.free_pages == e.pool.num_pages  # no page kept, none freed twice


def test_an_export_through_the_copy_thread_is_the_engines_own(tiny_model_dir, runtime):
    prompt = _prompt(5, 500)

    async def go() -> codec.KVBlob:
        async for _ in runtime.generate("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold=True):
            pass
        return await runtime.export_kv("p", 7, 500)

    out = asyncio.run(go())
    want = runtime.engine.export_kv("p", 7, 500)  # (here and now, on this thread: the engine is idle)
    assert out.header == want.header and out.k.equal(want.k) and out.v.equal(want.v)
    assert runtime.copies.slices_done > 4


async def _collect(runtime: EngineRuntime, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return [out.token async for out in runtime.generate(rid, prompt, params) if out.token is not None]
