"""The scheduler-side half of pdd's vLLM KV connector (it runs in vLLM's engine core).

It sees what only the scheduler sees, and tells the pdd instance:

* a reservation: a request pdd submitted for import (`"op": "import"` in its
  `kv_transfer_params`) asks, at admission, for every prompt token past vLLM's own
  local prefix hit as an asynchronous load. vLLM then allocates the blocks and parks
  the request in WAITING_FOR_REMOTE_KVS, holding them: that is the reservation, and
  the hit it answers is vLLM's own. The block ids go to the instance, which has the
  workers write the imported KV into them. When the instance says the KV is complete
  ("loaded"), the next step's metadata tells every worker to report the load done.
  A pool that cannot hold the prompt now refuses (the instance answers OutOfPages)
  instead of queueing.
* a hold: a finished request pdd will export from (P) keeps its blocks (the connector
  frees them asynchronously) until the instance releases it.
* a stream: a prefill P sends layer by layer (`"stream"`) has, in each step's
  metadata, the prompt tokens the step computes and the blocks that hold them, for the
  workers to report each layer as it is computed (`worker_side.WorkerSide.save_layer`).
* the tokens vLLM's scheduler computed for each request (its `num_scheduled_tokens`),
  reported when the request ends: the instance's proof of what was recomputed.

A worker reports each load and free exactly once: vLLM asserts on a report for a
request it no longer holds, so aborted loads are reported here (the scheduler delays
freeing their blocks until then), and loads already reported are never reported again.
"""

from __future__ import annotations

import logging
import queue
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdd.engines.vllm import bridge

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
MAX_RELEASED = 4096  # releases that came before their request finished (a race): remembered this long


def pdd_params(request: Request) -> dict[str, Any] | None:
    """What pdd attached to a request (None: not one of pdd's)."""
    params = request.kv_transfer_params
    p = params.get("pdd") if isinstance(params, dict) else None
    return p if isinstance(p, dict) else None


@dataclass
class SchedulerMeta(KVConnectorMetadata):
    """What one step's workers must report: loads done (or abandoned), holds released."""

    loaded: list[str] = field(default_factory=list)  # vLLM request ids
    freed: list[str] = field(default_factory=list)
    idle: bool = False  # nothing is computed this step: a worker may wait a little for work
    # prompt tokens streamed requests compute this step: [pdd id, start, end, base, blocks of
    # tokens [start, end), the first of which begins at token base]
    streams: list[list[Any]] = field(default_factory=list)


class SchedulerSide:
    def __init__(self, block_size: int, extra: dict[str, Any]) -> None:
        self.block_size = block_size
        self.channel = bridge.connect(extra["bridge"], extra["token"], {"side": "scheduler"})
        self.inbox: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        bridge.serve_forever(self.channel, self._on_message, "pdd-scheduler-bridge")
        self.block_pool: Any = None
        self.local_hit: dict[str, int] = {}  # vLLM id -> local hit offered at admission
        self.planned: set[str] = set()  # imports whose load vLLM allocated (never planned twice)
        self.refused: set[str] = set()
        self.loading: dict[str, str] = {}  # vLLM id -> pdd id: allocated loads not yet reported
        self.held: dict[str, str] = {}  # pdd id -> vLLM id: finished, blocks kept for export
        self.released: OrderedDict[str, None] = OrderedDict()  # pdd ids released before they were held
        self.computed: dict[str, int] = {}  # vLLM id -> tokens scheduled so far
        self.streamed: dict[str, tuple[str, int, list[int]]] = {}  # vLLM id -> pdd id, prompt length, blocks
        self.abandoned: list[str] = []  # loads of requests aborted while their KV was on the way
        self.used_blocks = -1  # last reported to the instance

    def _on_message(self, header: dict[str, Any]) -> None:
        if header["op"] in ("loaded", "free") and isinstance(header.get("rid"), str):
            self.inbox.put((header["op"], header["rid"]))

    def _send(self, **header: Any) -> None:
        try:
            self.channel.send(header)
        except OSError as e:  # the instance is gone; vLLM is being shut down with it
            log.warning("pdd bridge send failed: %s", e)

    # ---- admission ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = pdd_params(request)
        rid = request.request_id
        if p is not None and p.get("stream") and rid not in self.streamed:
            self.streamed[rid] = (p["rid"], request.num_prompt_tokens, [])
        if p is None or p.get("op") != "import" or rid in self.planned:
            return 0, False  # (planned: a preempted import is recomputed, its imported KV is gone)
        if rid in self.refused:
            return None, False  # the instance aborts it
        need = -(-request.num_tokens // self.block_size) - num_computed_tokens // self.block_size
        if self.block_pool is not None and need > self.block_pool.get_num_free_blocks():
            self.refused.add(rid)
            self._send(op="refused", rid=p["rid"], need=need, free=self.block_pool.get_num_free_blocks())
            return None, False
        self.local_hit[rid] = num_computed_tokens
        return request.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        p = pdd_params(request)
        rid = request.request_id
        if p is None or num_external_tokens == 0 or rid in self.planned:
            return
        self.planned.add(rid)
        self.loading[rid] = p["rid"]
        self._send(op="reserved", rid=p["rid"], hit=self.local_hit.pop(rid, 0), blocks=list(blocks.get_block_ids()[0]))

    # ---- every step ----------------------------------------------------------------------
    def build_meta(self, scheduler_output: SchedulerOutput) -> SchedulerMeta:
        meta = SchedulerMeta(loaded=self.abandoned, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self.abandoned = []
        while True:
            try:
                op, pdd_rid = self.inbox.get_nowait()
            except queue.Empty:
                break
            if op == "loaded":
                meta.loaded += [vid for vid, prid in self.loading.items() if prid == pdd_rid]
            elif pdd_rid in self.held:
                meta.freed.append(self.held.pop(pdd_rid))
            else:
                self.released[pdd_rid] = None
                while len(self.released) > MAX_RELEASED:
                    self.released.popitem(last=False)
        for vid in meta.loaded:
            self.loading.pop(vid, None)
        for vid, n in scheduler_output.num_scheduled_tokens.items():
            self.computed[vid] = self.computed.get(vid, 0) + n
        if self.streamed:
            meta.streams = self._streams(scheduler_output)
        return meta

    def _streams(self, out: SchedulerOutput) -> list[list[Any]]:
        """The prompt tokens each streamed request computes this step, and their blocks
        (a request's blocks are kept here as the steps hand them out; a preempted one
        starts its list again)."""
        at: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            if new.req_id in self.streamed:
                rid, n, _ = self.streamed[new.req_id]
                self.streamed[new.req_id] = (rid, n, list(new.block_ids[0]))
                at[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, vid in enumerate(cached.req_ids):
            if vid in self.streamed:
                rid, n, blocks = self.streamed[vid]
                more = cached.new_block_ids[i]
                if vid in cached.resumed_req_ids:
                    blocks = []
                self.streamed[vid] = (rid, n, blocks + list(more[0] if more else []))
                at[vid] = cached.num_computed_tokens[i]
        streams = []
        for vid, start in at.items():
            rid, prompt_len, blocks = self.streamed[vid]
            end = min(start + out.num_scheduled_tokens.get(vid, 0), prompt_len)
            if start < end:
                first, last = start // self.block_size, -(-end // self.block_size)
                streams.append([rid, start, end, first * self.block_size, blocks[first:last]])
        return streams

    def report_usage(self) -> None:
        """Blocks held by requests (what vLLM's KV usage gauge measures), sent when it
        changes; called at the end of every step (vLLM collects the connector's events
        there, after freeing what the workers released). vLLM publishes its own stats
        only with outputs, and a reservation waiting for its KV produces none."""
        if self.block_pool is None:
            return
        used = self.block_pool.num_gpu_blocks - 1 - self.block_pool.get_num_free_blocks()  # (block 0: vLLM's null)
        if used != self.used_blocks:
            self.used_blocks = used
            self._send(op="load", used_blocks=used)

    # ---- the end of a request ------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Whether the blocks stay (a hold)."""
        vid = request.request_id
        self.local_hit.pop(vid, None)
        self.planned.discard(vid)
        self.refused.discard(vid)
        computed = self.computed.pop(vid, 0)
        self.streamed.pop(vid, None)
        p = pdd_params(request)
        if p is None:
            return False
        if vid in self.loading:  # aborted while its KV was on the way: the workers report it, vLLM frees
            del self.loading[vid]
            self.abandoned.append(vid)
        from vllm.v1.request import RequestStatus

        hold = bool(p.get("hold")) and request.status != RequestStatus.FINISHED_ABORTED
        if hold and p["rid"] in self.released:  # released while it ran: nothing will export it
            del self.released[p["rid"]]
            hold = False
        if hold:
            self.held[p["rid"]] = vid
        self._send(
            op="finished",
            rid=p["rid"],
            computed=computed,
            held=list(block_ids) if hold else None,
            tokens=request.num_computed_tokens,
        )
        return hold
