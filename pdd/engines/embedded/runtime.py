"""`EngineRuntime`: the embedded `Engine` on its own thread, behind `EnginePort`
(`pdd.engines.port`); `open_embedded` is the "embedded" backend's factory.

The engine is single-threaded by design; everything that touches it (adding requests,
aborting, reserving, importing KV) is shipped to the engine thread as a command and
executed between steps. Step outputs travel back to each watcher's asyncio queue, one
hop per step. Cache events are numbered on the engine thread, so a snapshot taken
there holds exactly the events up to its number.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from pdd.engines.embedded.copies import Copies
from pdd.engines.embedded.engine import Engine
from pdd.engines.embedded.pacing import StepPacer
from pdd.engines.port import CacheListener, EngineConfig, EngineLoad, StepOutput
from pdd.kv.codec import KVBlob
from pdd.kv.layer_stream import LayerStream
from pdd.names import NATIVE
from pdd.perf.emulated import token_scale
from pdd.sampling.params import SamplingParams
from pdd.tasks import settle

log = logging.getLogger(__name__)
T = TypeVar("T")
STALL_WAIT_S = 0.005  # nothing schedulable: wait this long for a command (abort, release) to change that
# Where a command's result goes: a future and the loop that owns it (None: nobody waits for it).
_Reply = tuple[asyncio.Future[Any], asyncio.AbstractEventLoop]
_Command = tuple[Callable[[Engine], Any], _Reply | None]


class _Watch:
    """A request's outputs on the watching loop: tokens, its finish, catch-up progress."""

    def __init__(self, runtime: EngineRuntime, rid: str) -> None:
        self._runtime, self._rid = runtime, rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.token is not None or item.finish_reason is not None or item.caught_up is not None:
                yield item
                if item.finish_reason is not None:
                    return

    def close(self) -> None:
        if self._runtime._watches.get(self._rid) is self:
            del self._runtime._watches[self._rid]


class EngineRuntime:
    def __init__(self, engine: Engine, threads: int = 1, pacer: StepPacer | None = None) -> None:
        self.engine = engine
        self.pacer = pacer  # emulated accelerator: every step takes at least its time
        self.page_size = engine.pool.page_size
        self.max_context = min(engine.model_cfg.max_position, engine.pool.num_pages * engine.pool.page_size)
        self.kv_bytes_per_token = engine.pool.bytes_per_token()
        self._threads = threads
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._watches: dict[str, _Watch] = {}
        self._listener: tuple[CacheListener, asyncio.AbstractEventLoop] | None = None
        self._event_seq = 0
        engine.cache.on_event = self._on_cache_event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.copies = engine.copies = Copies(busy=lambda: bool(engine.scheduler.running))

    def start_thread(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.copies.close()
        self._stop.set()
        self._cmds.put((lambda e: None, None))
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put((fn, (fut, loop)))
        return await fut

    # ---- EnginePort --------------------------------------------------------------------
    def watch(self, rid: str) -> _Watch:
        w = _Watch(self, rid)
        self._watches[rid] = w
        return w

    async def generate(
        self, rid: str, prompt: list[int], params: SamplingParams, hold: bool = False, stream: LayerStream | None = None
    ) -> AsyncIterator[StepOutput]:
        """Stream a request's sampled tokens; leaving early (or being cancelled) aborts it."""
        w = self.watch(rid)
        done = False
        try:
            await self.call(lambda e: e.add_request(rid, prompt, params, hold, stream))
            async for out in w:
                yield out
                done = out.finish_reason is not None
                if done:
                    return
        finally:
            w.close()
            if not done:
                self.abort(rid)

    async def reserve(self, rid: str, prompt: list[int], params: SamplingParams, use_cache: bool = True) -> int:
        return await self.call(lambda e: e.reserve(rid, prompt, params, use_cache))

    async def cached_prefix(self, tokens: list[int], salt: str = "") -> int:
        return await self.call(
            lambda e: (
                e.cache.match_prefix(tokens[: len(tokens) - 1], touch=False, salt=salt).num_pages * e.pool.page_size
            )
        )

    async def import_kv(self, rid: str, blob: KVBlob) -> None:
        """Checked and claimed on the engine thread, copied beside its steps (`pdd.engines.embedded.copies`)."""
        copy = await self.call(lambda e: e.claim_import(rid, blob))
        await self.copies.run(copy, lambda: self._cmds.put((lambda e: e.copied(copy), None)))

    async def export_kv(self, rid: str, start: int, end: int) -> KVBlob:
        copy = await self.call(lambda e: e.claim_export(rid, start, end))
        return await self.copies.run(copy, lambda: self._cmds.put((lambda e: e.copied(copy), None)))

    async def start(self, rid: str, tokens: list[int], shadow: bool = False, step_cap: int = 0) -> int:
        return await self.call(lambda e: e.start(rid, tokens, shadow, step_cap).cached_tokens)

    async def cut(self, rid: str) -> list[int]:
        def cut(e: Engine) -> list[int]:
            output = e.cut(rid)
            self._dispatch([StepOutput(rid, None, "abort")])
            return output

        return await self.call(cut)

    async def release(self, rid: str) -> None:
        await self.call(lambda e: e.release(rid))

    def abort(self, rid: str) -> None:
        self._cmds.put((lambda e: self._abort_now(rid), None))

    async def cache_snapshot(self) -> tuple[int, list[int]]:
        return await self.call(lambda e: (self._event_seq, e.cache.hashes()))

    def set_cache_listener(self, listener: CacheListener) -> None:
        self._listener = (listener, asyncio.get_running_loop())

    def load(self) -> EngineLoad:
        e = self.engine
        return EngineLoad(
            running=len(e.scheduler.running),
            waiting=len(e.scheduler.waiting),
            max_running=e.scheduler.max_running,
            pages=e.pool.num_pages,
            free_pages=e.pool.free_pages,
            cached_pages=e.cache.cached_pages - e.cache.locked_pages,  # (evictable: those no request holds)
        )

    def metric_collectors(self) -> list:
        return []  # every series of the embedded engine is pdd's own

    def stats(self) -> dict:
        e = self.engine
        s = e.stats
        return {
            "steps": s.steps,
            "computed_tokens": s.computed_tokens,
            "prefill_tokens": s.prefill_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens,
            "decode_tokens": s.decode_tokens,
            "aborted": s.aborted,
            "preemptions": e.kv.preemptions,
            "pacing": {"hardware": NATIVE}
            if self.pacer is None
            else {**self.pacer.describe, **self.pacer.stats.to_dict()},
        }

    # ---- engine thread -------------------------------------------------------------------
    def _on_cache_event(self, event: tuple[str, list[int]]) -> None:
        self._event_seq += 1
        if self._listener is not None:
            listener, loop = self._listener
            loop.call_soon_threadsafe(listener, self._event_seq, event[0], event[1])

    def _abort_now(self, rid: str) -> None:
        if rid in self.engine.seqs:
            self.engine.abort(rid)
            self._dispatch([StepOutput(rid, None, "abort")])

    def _run_command(self, fn: Callable[[Engine], Any], reply: _Reply | None) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:  # reported to the caller, never kills the engine thread
            result, error = None, e
        if reply is None:
            if error:
                log.warning("engine command failed: %s", error)
            return
        fut, loop = reply
        loop.call_soon_threadsafe(settle, fut, result, error)

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        stalled = False  # work exists but nothing could be scheduled (e.g. the pool is full)
        while not self._stop.is_set():
            idle = not self.engine.has_work()
            try:
                block = idle or stalled
                while True:
                    timeout = (0.5 if idle else STALL_WAIT_S) if block else None
                    self._run_command(*self._cmds.get(block=block, timeout=timeout))
                    block = False
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_work():
                continue
            try:
                started = time.perf_counter()
                outputs = self.engine.step()
                self.engine.copy_stream.mark_step()
                self._pace(time.perf_counter() - started)
            except Exception as e:
                log.exception("engine step failed; failing its requests")
                self._fail_all(e)
                continue
            stalled = not outputs
            self._dispatch(outputs)

    def _pace(self, real_s: float) -> None:
        """Hold the step until the emulated chip would have finished it (its outputs
        leave only then, as from an accelerator that is still busy)."""
        computed = self.engine.last_step
        if self.pacer is None or not computed:
            return
        emulated = self.pacer.step_s(computed)
        self.pacer.tally(computed, emulated, real_s)
        if emulated > real_s:
            self._stop.wait(emulated - real_s)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            w = self._watches.get(out.rid)
            if w:
                by_loop.setdefault(w.loop, []).append((w.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
            w = self._watches.get(rid)
            if w:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, RuntimeError(f"engine failure: {error}"))


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def open_embedded(model_dir: Path, config: EngineConfig, threads: int, eos_ids: frozenset[int]) -> EngineRuntime:
    """The embedded engine over `model_dir`, stepping on its own thread (paced as the
    configured hardware when it is emulated)."""
    engine = Engine(model_dir, config, eos_ids=eos_ids)
    pacer = (
        None
        if config.hardware == NATIVE
        else StepPacer(config.hardware, token_scale(engine.model_cfg.max_position), config.dilation)
    )
    runtime = EngineRuntime(engine, threads, pacer)
    runtime.start_thread()
    return runtime
