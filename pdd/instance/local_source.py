"""The OpenAI front end's token source for one colocated instance."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pdd import heap
from pdd.api.source import GenerationError, GenEvent, GenRequest, Load
from pdd.engines.port import EnginePort, RequestError
from pdd.instance.liveness import engine_failure
from pdd.names import Pipeline
from pdd.record import RequestRecord
from pdd.transfer.wire import REJECTS


class LocalSource:
    def __init__(
        self,
        engine: EnginePort,
        node_stats: Callable[[], dict] | None = None,
        node_refuses: Callable[[], str] = lambda: "",
    ) -> None:
        self.engine = engine
        self.max_context = engine.max_context
        self._node_stats = node_stats  # the framed node's counts (a P/D instance)
        self._node_refuses = node_refuses  # why the node takes no new work ("" while it does)
        self.closing = ""  # why this server takes no new request (`close_admission`)
        self.expired = ""  # why the requests still streaming end now (`expire`: the grace ran out)
        self.in_flight = 0  # requests of its own API, streaming now

    async def generate(self, req: GenRequest) -> AsyncGenerator[GenEvent, None]:
        if self.closing:
            raise GenerationError(f"this instance is {self.closing}: send the request to another", 503)
        self.in_flight += 1
        try:
            async for event in self._generate(req):
                yield event
        except RequestError as e:
            raise GenerationError(str(e), 400) from None
        except RuntimeError as e:  # the engine failed mid-request
            raise GenerationError(str(e), 500) from None
        finally:
            self.in_flight -= 1

    async def _generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        produced = 0
        async for out in self.engine.generate(req.rid, req.prompt, req.params):
            if self.expired:
                raise GenerationError(self.expired, 503)
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
        """Alive unless its engine died: then an orchestrator should restart the process."""
        why = engine_failure(self.engine)
        return {"status": "unavailable", "reason": why} if why else {"status": "ok"}

    def ready(self) -> dict:
        why = engine_failure(self.engine) or self.closing or self._node_refuses()
        return {"status": "unavailable", "reason": why} if why else {"status": "ok"}

    def close_admission(self) -> None:
        """SIGTERM (`pdd.shutdown`): /ready fails and new requests of its own API get a 503;
        those in flight go on."""
        self.closing = "shutting down"

    def expire(self, why: str) -> None:
        """The shutdown's grace ran out: each stream still running ends with `why`, an error
        its client reads, at its next token (closing the stream aborts it in the engine)."""
        self.expired = why

    async def stats(self) -> dict:
        load = self.engine.load()
        return {
            "line_bytes": 0,
            "engine": self.engine.stats(),
            "kv": {"pages": load.pages, "free": load.free_pages, "cached": load.cached_pages},
            "rejected_frames": REJECTS.snapshot(),
            # what the cyclic collector no longer walks (`pdd.heap`): 0 means every full collection walks it all
            "gc_frozen_objects": heap.frozen_objects(),
            **({"node": self._node_stats()} if self._node_stats else {}),
        }
