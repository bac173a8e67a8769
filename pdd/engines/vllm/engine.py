"""`VllmEngine`: vLLM behind pdd's engine port (built by `pdd.engines.vllm.open_vllm`, the "vllm" backend).

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

from pdd.engines.port import CacheListener, EngineConfig, EngineLoad, RequestError
from pdd.engines.vllm import args as vargs
from pdd.engines.vllm.bridge import BridgeServer
from pdd.engines.vllm.events import EventSubscriber, VllmHashes
from pdd.engines.vllm.kvio import WorkerInfo, WorkerKV
from pdd.engines.vllm.layer_reads import LayerReads
from pdd.engines.vllm.parallel import check_parallel
from pdd.engines.vllm.requests import Requests
from pdd.kv import codec
from pdd.kv.blocks import PrefixHashes, block_hashes
from pdd.model.config import Declared

log = logging.getLogger(__name__)
LAYOUT_TIMEOUT_S = 60.0  # after vLLM is up, every worker has described its cache
MAX_FINISHED = 1024  # per-request compute counts kept for `stats`


class VllmEngine(Requests):
    def __init__(self, model_dir: Path, config: EngineConfig, threads: int, eos_ids: frozenset[int]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.page_size = config.page_size
        self._dir = tempfile.mkdtemp(prefix="pdd-vllm-")
        self.kv = WorkerKV()
        self.layer_reads = LayerReads(self.kv, lambda rid: self.reqs.get(rid))
        self._layouts_done = threading.Event()
        self._world = 0
        self.hashes = VllmHashes(config.page_size)
        self.counters = {"computed_tokens": 0, "imported_tokens": 0, "exported_tokens": 0, "aborted": 0}
        self.vllm_stats: dict[str, Any] = {
            "kv_cache_usage": 0.0,
            "running": 0,
            "waiting": 0,
            "deferred": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prompt_tokens_computed": 0,
            "prompt_tokens_local_hit": 0,
            "prompt_tokens_external": 0,
            "generation_tokens": 0,
        }
        self.computed_by_request: OrderedDict[str, int] = OrderedDict()
        self.used_blocks = 0  # held by requests now (the scheduler side's live count)
        self.bridge = BridgeServer(self._dir, self._on_bridge, self._on_bridge_lost)
        events, replay = f"ipc://{self._dir}/events", f"ipc://{self._dir}/replay"
        for note in check_parallel(config, Declared.from_dir(model_dir)):  # (refused here, before any weight loads)
            log.warning("%s", note)
        kwargs = vargs.engine_kwargs(model_dir, config, self.bridge.path, self.bridge.token, events, replay)
        for key, value in vargs.engine_env(config, threads).items():
            os.environ.setdefault(key, value)
        self.llm = self.events = self._scheduler_channel = None
        self.refused = ""  # a worker's reason for refusing its cache
        try:
            # vLLM's config first (its reading of the checkpoint, its platform's changes), checked
            # before any weight loads; then the engine on exactly that config
            args = AsyncEngineArgs(**kwargs)
            if args.data_parallel_size > 1:  # a rank of a data-parallel group (`pdd.config.groups`)
                if args.create_model_config().is_moe:
                    kwargs, events, replay = vargs.lockstep_rank_events(kwargs, args.data_parallel_rank or 0)
                else:
                    kwargs = vargs.independent_rank(kwargs)
                args = AsyncEngineArgs(**kwargs)
            vllm_config = args.create_engine_config()
            _check_vllm_kept_pdds_terms(vllm_config, config.page_size)
            self.llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[self._stat_logger])
            self.events = EventSubscriber(events, replay, self.hashes)
            if not self._layouts_done.wait(LAYOUT_TIMEOUT_S):
                raise RuntimeError("vLLM's workers never described their KV caches to pdd's connector")
            self.kv.check_stages()
            _check_vllm_kept_pdds_terms(self.llm.vllm_config, config.page_size)  # (a worker may change blocks)
        except BaseException as e:
            self.close()
            if self.refused and isinstance(e, Exception):
                raise RuntimeError(f"pdd's KV connector refused vLLM's KV cache ({self.refused})") from e
            raise
        # the sizes are vLLM's: what it read from the checkpoint and chose for this machine
        vc = self.llm.vllm_config
        self.sizes = {
            "num_blocks": vc.cache_config.num_gpu_blocks - 1,  # (less vLLM's null block)
            "block_size": vc.cache_config.block_size * vc.parallel_config.decode_context_parallel_size,
            "max_model_len": vc.model_config.max_model_len,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "dtype": str(vc.model_config.dtype).removeprefix("torch."),
            "kv_cache_dtype": vc.cache_config.cache_dtype,
        }
        self.pages = self.sizes["num_blocks"]
        self.max_context = min(self.sizes["max_model_len"], self.pages * self.page_size)
        self.kv_bytes_per_token = self.kv.bytes_per_token
        super().__init__(eos_ids, vc.model_config.get_vocab_size(), self.max_context)
        log.info("vLLM sized this instance: %s", self.sizes)

    # ---- the bridge (its threads) ---------------------------------------------------------
    def _on_bridge(self, peer: dict[str, Any], header: dict[str, Any]) -> None:
        op = header["op"]
        if op == "layout":
            self._world = header["world"]
            self.kv.workers[header["rank"]] = WorkerInfo.from_layout(peer["channel"], header)
            if len(self.kv.workers) == self._world:
                self._layouts_done.set()
        elif op == "cache_refused":  # a worker cannot carry its KV: vLLM fails to start, this says why
            self.refused = f"rank {header['rank']}: {header['error']}"
        elif op in ("written", "data", "failed"):
            self.kv.answer(header)
        elif op in ("streaming", "computed") and self.loop is not None:
            self.loop.call_soon_threadsafe(self.layer_reads.on_report, header)
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
    def metric_collectors(self) -> list[Any]:
        from pdd.engines.vllm.stats import VllmMetrics

        return [VllmMetrics()]

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
        if req.prompt_hashes is None:
            req.prompt_hashes = PrefixHashes(req.prompt)
        self.kv.check_import(blob, req.prompt_hashes, req.imported, len(req.prompt))
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
    async def cached_prefix(self, tokens: list[int], salt: str = "") -> int:
        pages = block_hashes(tokens[: len(tokens) - 1], self.page_size, salt)
        return self.hashes.cached_prefix(pages) * self.page_size

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
            max_running=self.sizes["max_num_seqs"],
            pages=self.pages,
            free_pages=self.pages - self.used_blocks,
            cached_pages=0,
        )

    def stats(self) -> dict:
        return {
            "backend": "vllm",
            **self.sizes,
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
        self.kv.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _check_vllm_kept_pdds_terms(vc: Any, page_size: int) -> None:
    """vLLM may change what pdd asked for, model by model (MLA on CPU with its reference
    CPU_MLA backend, the one it runs where the CPU has no AMX: prefix caching off, 16-token
    blocks, with a warning in its log); pdd cannot run on what it changed."""
    if not vc.cache_config.enable_prefix_caching:
        raise RuntimeError(
            "vLLM turned its prefix cache off for this model (it does for MLA models on CPU without AMX), and "
            "pdd's decode-side cache, reservations and cache events are vLLM's prefix cache: serve it on a GPU"
        )
    block = vc.cache_config.block_size * vc.parallel_config.decode_context_parallel_size  # (the scheduler's)
    if block != page_size:
        raise RuntimeError(
            f"vLLM runs this model in blocks of {block} tokens, not pdd's page_size {page_size}: "
            f"set [engine] page_size = {block}"
        )
