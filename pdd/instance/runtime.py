"""Runs an `Engine` on its own thread and lets asyncio code drive it.

The engine is single-threaded by design; everything that touches it (adding requests,
aborting, reserving, importing KV) is shipped to the engine thread as a command and
executed between steps. Sampled tokens travel back to each request's asyncio queue,
one hop per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from pdd.engine.engine import Engine, StepOutput
from pdd.engine.sequence import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
STALL_WAIT_S = 0.005  # nothing schedulable: wait this long for a command (abort, release) to change that


class EngineRuntime:
    def __init__(self, engine: Engine, threads: int = 1) -> None:
        self.engine = engine
        self._threads = threads
        self._cmds: queue.SimpleQueue[tuple[Callable[[Engine], Any], asyncio.Future, asyncio.AbstractEventLoop]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put((lambda e: None, None, None))
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put((fn, fut, loop))
        return await fut

    def watch(self, rid: str) -> asyncio.Queue:
        """Deliver the step outputs of `rid` to a queue on the calling loop."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        return q

    def unwatch(self, rid: str) -> None:
        self._streams.pop(rid, None)

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams, hold: bool = False) -> AsyncIterator[StepOutput]:
        """Stream a request's sampled tokens; leaving early (or being cancelled) aborts it."""
        q = self.watch(rid)
        done = False
        try:
            await self.call(lambda e: e.add_request(rid, prompt, params, hold))
            async for out in self.stream(q):
                yield out
                done = out.finish_reason is not None
                if done:
                    return
        finally:
            self.unwatch(rid)
            if not done:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        """Abort from any thread; a watcher of `rid` sees a final "abort" output."""
        self._cmds.put((lambda e: self._abort_now(rid), None, None))

    def _abort_now(self, rid: str) -> None:
        if rid in self.engine.seqs:
            self.engine.abort(rid)
            self._dispatch([StepOutput(rid, None, "abort")])

    @staticmethod
    async def stream(q: asyncio.Queue) -> AsyncIterator[StepOutput]:
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.token is not None or item.finish_reason is not None:
                yield item
                if item.finish_reason is not None:
                    return

    # ---- engine thread -------------------------------------------------------------------
    def _run_command(self, fn: Callable[[Engine], Any], fut: asyncio.Future | None, loop: asyncio.AbstractEventLoop | None) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:  # reported to the caller, never kills the engine thread
            result, error = None, e
        if fut is None:
            if error:
                log.warning("engine command failed: %s", error)
            return
        loop.call_soon_threadsafe(_settle, fut, result, error)

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
                outputs = self.engine.step()
            except Exception as e:
                log.exception("engine step failed; failing its requests")
                self._fail_all(e)
                continue
            stalled = not outputs
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.rid)
            if target:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
            target = self._streams.get(rid)
            if target:
                target[0].call_soon_threadsafe(target[1].put_nowait, RuntimeError(f"engine failure: {error}"))


def _settle(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
