"""`VllmEngine`: vLLM behind pdd's engine port; `open_vllm` is the "vllm" backend's factory.

It runs vLLM's `AsyncLLM` in the instance's process (vLLM starts its engine core and
workers as processes of its own), loaded with pdd's KV connector
(`pdd.engines.vllm.connector`), pdd's draw (`pdd.engines.vllm.draw`) and vLLM's KV
events; the connector's two halves reach this object over the bridge
(`pdd.engines.vllm.bridge`). The port's promises, on vLLM:

* `reserve` is an asynchronous KV load: vLLM's own prefix-cache hit is the answer, the
  blocks it allocates for the rest are the reservation (`scheduler_side`);
* `import_kv` writes into those blocks (`kvio`, `worker_side`, `layout`);
* `start` continues the same request with the tokens others produced (`streams`);
* `generate(hold=True)` keeps a finished request's blocks for `export_kv`;
* the cache events are vLLM's KV events under pdd's block hashes (`events`);
* `load` and `stats` are vLLM's own scheduler counters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pdd.engine_port import CacheListener, EngineConfig, EngineLoad, RequestError
from pdd.engines.vllm import args as vargs
from pdd.engines.vllm.bridge import BridgeServer
from pdd.engines.vllm.events import EventSubscriber, VllmHashes
from pdd.engines.vllm.kvio import WorkerInfo, WorkerKV
from pdd.engines.vllm.requests import Requests
from pdd.kv import codec
from pdd.kv.blocks import block_hashes
from pdd.model.config import ModelConfig

log = logging.getLogger(__name__)
LAYOUT_TIMEOUT_S = 60.0  # after vLLM is up, every worker has described its cache
MAX_FINISHED = 1024  # per-request compute counts kept for `stats`


class VllmEngine(Requests):
    def __init__(self, model_dir: Path, config: EngineConfig, threads: int, eos_ids: frozenset[int]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.model = ModelConfig.from_dir(model_dir)
        self.page_size = config.page_size
        self.max_context = min(self.model.max_position, config.num_pages * config.page_size)
        self.kv_bytes_per_token = vargs.kv_bytes_per_block(self.model, 1, codec.DTYPES[config.dtype].itemsize)
        self._dir = tempfile.mkdtemp(prefix="pdd-vllm-")
        self.kv = WorkerKV()
        self._layouts_done = threading.Event()
        self._world = 0
        self.hashes = VllmHashes(config.page_size)
        self.counters = {"computed_tokens": 0, "imported_tokens": 0, "exported_tokens": 0, "aborted": 0}
        self.vllm_stats: dict[str, Any] = {
            "kv_cache_usage": 0.0,
            "running": 0,
            "waiting": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prompt_tokens_computed": 0,
            "prompt_tokens_local_hit": 0,
            "prompt_tokens_external": 0,
            "generation_tokens": 0,
        }
        self.computed_by_request: OrderedDict[str, int] = OrderedDict()
        self.used_blocks = 0  # held by requests now (the scheduler side's live count)
        super().__init__(eos_ids, self.model.vocab_size, self.max_context)
        self.bridge = BridgeServer(self._dir, self._on_bridge, self._on_bridge_lost)
        events, replay = f"ipc://{self._dir}/events", f"ipc://{self._dir}/replay"
        kwargs = vargs.engine_kwargs(model_dir, config, self.model, self.bridge.path, self.bridge.token, events, replay)
        for key, value in vargs.engine_env(config, threads).items():
            os.environ.setdefault(key, value)
        self.llm = self.events = self._scheduler_channel = None
        try:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[self._stat_logger])
            self.events = EventSubscriber(events, replay, self.hashes)
            if not self._layouts_done.wait(LAYOUT_TIMEOUT_S):
                raise RuntimeError("vLLM's workers never described their KV caches to pdd's connector")
        except BaseException:
            self.close()
            raise

    # ---- the bridge (its threads) ---------------------------------------------------------
    def _on_bridge(self, peer: dict[str, Any], header: dict[str, Any], payload: bytes) -> None:
        op = header["op"]
        if op == "layout":
            self._world = header["world"]
            self.kv.workers[header["rank"]] = WorkerInfo(
                peer["channel"],
                header["rank"],
                header["heads"],
                header["layers"],
                header["head_dim"],
                header["block_size"],
                header["dtype"],
            )
            if header["block_size"] != self.page_size:
                log.error("vLLM runs blocks of %d tokens, pdd expects %d", header["block_size"], self.page_size)
            if len(self.kv.workers) == self._world:
                self._layouts_done.set()
        elif op in ("written", "data", "failed"):
            self.kv.answer(header, payload)
        elif op in ("reserved", "refused", "finished"):
            self.on_scheduler(header)
        elif op == "load":
            self.used_blocks = header["used_blocks"]
        elif op == "hello" and peer.get("side") == "scheduler":
            self._scheduler_channel = peer["channel"]

    def _on_bridge_lost(self, peer: dict[str, Any]) -> None:
        if self.llm is not None:
            log.error("vLLM's %s side of pdd's connector is gone", peer.get("side"))
            self.kv.fail_all(RuntimeError("vLLM's worker is gone"))

    def tell_scheduler(self, op: str, rid: str) -> None:
        if self._scheduler_channel is None:
            raise RuntimeError("vLLM's scheduler never connected to pdd's connector")
        self._scheduler_channel.send({"op": op, "rid": rid})

    def record_finished(self, rid: str, computed: int) -> None:
        self.counters["computed_tokens"] += computed
        self.computed_by_request[rid] = self.computed_by_request.get(rid, 0) + computed
        while len(self.computed_by_request) > MAX_FINISHED:
            self.computed_by_request.popitem(last=False)

    # ---- vLLM's own counters ---------------------------------------------------------------
    def _stat_logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from pdd.engines.vllm.stats import StatsTap

        return StatsTap(self.vllm_stats)

    # ---- EnginePort: KV --------------------------------------------------------------------
    async def import_kv(self, rid: str, blob: codec.KVBlob) -> None:
        """Checked and claimed at once, so chunks imported back to back (their writes in
        flight together) must follow each other in the order they were issued."""
        req = self.reservation(rid)
        if req.reserved is None or not req.reserved.done():
            raise RequestError(f"request {rid!r} is not reserved yet")
        self.kv.check_import(blob, req.prompt, req.imported, len(req.prompt))
        req.imported = blob.header.token_end
        write = asyncio.ensure_future(self.kv.write(req.blocks, blob))
        req.writes.append(write)
        await write
        self.counters["imported_tokens"] += blob.header.num_tokens

    async def export_kv(self, rid: str, start: int, end: int) -> codec.KVBlob:
        req = self.reqs.get(rid)
        if req is None or req.held is None:
            raise RequestError(f"request {rid!r} is not held for export")
        blocks, computed = await req.held
        if not 0 <= start < end <= computed:
            raise RequestError(f"cannot export [{start}, {end}): {computed} tokens computed")
        blob = await self.kv.read(blocks, req.prompt + req.outputs, start, end)
        self.counters["exported_tokens"] += end - start
        return blob

    # ---- EnginePort: the cache -------------------------------------------------------------
    async def cached_prefix(self, tokens: list[int]) -> int:
        return self.hashes.cached_prefix(block_hashes(tokens[: len(tokens) - 1], self.page_size)) * self.page_size

    async def cache_snapshot(self) -> tuple[int, list[int]]:
        return self.hashes.snapshot()

    def set_cache_listener(self, listener: CacheListener) -> None:
        loop = asyncio.get_running_loop()
        if self.events is None:
            raise RuntimeError("vLLM is closed")

        def on_event(seq: int, kind: str, hashes: list[int]) -> None:  # (a subscriber thread)
            loop.call_soon_threadsafe(listener, seq, kind, hashes)

        self.events.listener = on_event

    # ---- EnginePort: load, stats, close ----------------------------------------------------
    def load(self) -> EngineLoad:
        s = self.vllm_stats
        return EngineLoad(
            running=s["running"],
            waiting=s["waiting"],
            max_running=self.config.max_running,
            pages=self.config.num_pages,
            free_pages=self.config.num_pages - self.used_blocks,
            cached_pages=0,
        )

    def stats(self) -> dict:
        return {
            "backend": "vllm",
            **self.counters,
            **self.vllm_stats,
            "used_blocks": self.used_blocks,
            "held_requests": len(self.reqs),
            "cached_blocks": len(self.hashes.names),
            "computed_by_request": dict(self.computed_by_request),
        }

    def close(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown()
        if self.events is not None:
            self.events.close()
        self.bridge.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def open_vllm(model_dir: Path, config: EngineConfig, threads: int, eos_ids: frozenset[int]) -> VllmEngine:
    """vLLM over `model_dir`, with pdd's connector, events and draw (the `pdd[vllm]` extra)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"[engine] backend = \"vllm\" needs vLLM: pip install 'pdd[vllm]' ({e})") from None
    return VllmEngine(model_dir, config, threads, eos_ids)
