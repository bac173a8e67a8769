"""The OpenAI front end's backend for one colocated instance."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pdd import heap
from pdd.api.backend import BackendError, GenEvent, GenRequest, Load
from pdd.engine_port import EnginePort, RequestError
from pdd.names import Pipeline
from pdd.record import RequestRecord
from pdd.transfer.wire import REJECTS


class LocalBackend:
    def __init__(self, engine: EnginePort, node_stats: Callable[[], dict] | None = None) -> None:
        self.engine = engine
        self.max_context = engine.max_context
        self._node_stats = node_stats  # the framed node's counts (a P/D instance)

    async def generate(self, req: GenRequest) -> AsyncGenerator[GenEvent, None]:
        try:
            async for event in self._generate(req):
                yield event
        except RequestError as e:
            raise BackendError(str(e), 400) from None
        except RuntimeError as e:  # the engine failed mid-request
            raise BackendError(str(e), 500) from None

    async def _generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        produced = 0
        async for out in self.engine.generate(req.rid, req.prompt, req.params):
            tokens = [] if out.token is None else [out.token]
            produced += len(tokens)
            event = GenEvent(tokens, out.finish_reason, out.cached_tokens)
            if req.params.logprobs is not None and tokens:
                event.logprobs = [out.logprob]
            event.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason:
                event.record = RequestRecord(
                    pipeline=Pipeline.COLOCATED,
                    p_hit_tokens=out.cached_tokens,
                    d_hit_tokens=out.cached_tokens,
                    main_output_tokens=produced,
                    seed=req.params.seed,
                )
            yield event

    def load(self) -> Load:
        load = self.engine.load()
        used = load.pages - load.free_pages - load.cached_pages
        return Load(
            running=load.running,
            waiting=load.waiting,
            kv_usage=used / load.pages,
            cached_pages=load.cached_pages,
            free_pages=load.free_pages,
            used_pages=used,
        )

    def health(self) -> dict:
        return {"status": "ok"}

    async def stats(self) -> dict:
        load = self.engine.load()
        return {
            "wan_bytes": 0,
            "engine": self.engine.stats(),
            "kv": {"pages": load.pages, "free": load.free_pages, "cached": load.cached_pages},
            "rejected_frames": REJECTS.snapshot(),
            # what the cyclic collector no longer walks (`pdd.heap`): 0 means every full collection walks it all
            "gc_frozen_objects": heap.frozen_objects(),
            **({"node": self._node_stats()} if self._node_stats else {}),
        }
