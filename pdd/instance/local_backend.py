"""The OpenAI front end's backend for one colocated instance."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdd.api.backend import BackendError, GenEvent, GenRequest, Load
from pdd.engine.engine import RequestError
from pdd.instance.runtime import EngineRuntime
from pdd.transfer.wire import REJECTS


class LocalBackend:
    def __init__(self, runtime: EngineRuntime) -> None:
        self.runtime = runtime
        engine = runtime.engine
        self.max_context = min(engine.model_cfg.max_position, engine.pool.num_pages * engine.pool.page_size)

    async def generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        try:
            async for event in self._generate(req):
                yield event
        except RequestError as e:
            raise BackendError(str(e), 400) from None
        except RuntimeError as e:  # the engine failed mid-request
            raise BackendError(str(e), 500) from None

    async def _generate(self, req: GenRequest) -> AsyncIterator[GenEvent]:
        produced = 0
        async for out in self.runtime.generate(req.rid, req.prompt, req.params):
            tokens = [] if out.token is None else [out.token]
            produced += len(tokens)
            event = GenEvent(tokens, out.finish_reason, out.cached_tokens)
            if out.finish_reason:
                event.record = {
                    "pipeline": "colocated", "p_hit_tokens": out.cached_tokens, "d_hit_tokens": out.cached_tokens,
                    "wan_bytes": 0, "rld_output_tokens": 0, "md_output_tokens": produced, "handoff": None,
                }
            yield event

    def load(self) -> Load:
        e = self.runtime.engine
        pool = e.pool
        return Load(
            running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
            kv_usage=1.0 - pool.free_pages / pool.num_pages,
            cached_pages=e.cache.cached_pages,
        )

    async def stats(self) -> dict:
        e = self.runtime.engine
        s = e.stats
        return {
            "wan_bytes": 0,
            "engine": {"steps": s.steps, "computed_tokens": s.computed_tokens, "prefill_tokens": s.prefill_tokens,
                       "cached_prompt_tokens": s.cached_prompt_tokens, "decode_tokens": s.decode_tokens,
                       "preemptions": e.scheduler.preemptions},
            "kv": {"pages": e.pool.num_pages, "free": e.pool.free_pages, "cached": e.cache.cached_pages},
            "rejected_frames": REJECTS.snapshot(),
        }
