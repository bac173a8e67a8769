"""A prefill P streams, read out of vLLM's blocks layer by layer while the step goes on.

For a request `generate` was given a `LayerStream` for, the scheduler side puts in each
step's metadata the prompt tokens the step computes and the blocks that hold them;
the first worker tells the instance (`"streaming"`), then, during the forward pass,
each pipeline stage's rank 0 the end of each of its layers (`"computed"`, from
`save_kv_layer`). Each such layer is read at once
through the staging slots (`kvio.WorkerKV.read`; every rank's read waits for its own
model thread to have computed that layer) and put on the request's stream, in the
order the layers were computed. The request's last output is held back until every
layer of its prompt is on the stream (the reports come on the bridge, the outputs on
vLLM's own path: either may come first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pdd.engines.vllm.kvio import WorkerKV
from pdd.engines.vllm.streams import Request

log = logging.getLogger(__name__)
STEPS_KEPT = 4  # steps whose streamed tokens are kept for their layers' reports
WHOLE_WAIT_S = 30.0  # a finished prefill waits this long at most for its last layers' reads


class LayerReads:
    def __init__(self, kv: WorkerKV, request: Callable[[str], Request | None]) -> None:
        self.kv, self.request = kv, request
        self.steps: dict[int, list[list[Any]]] = {}  # step -> [pdd id, start, end, base, blocks]

    def on_report(self, header: dict[str, Any]) -> None:
        """A worker's "streaming" or "computed" report (on the requests' loop)."""
        step = header["step"]
        if header["op"] == "streaming":
            self.steps[step] = header["streams"]
            for old in [s for s in self.steps if s <= step - STEPS_KEPT]:
                del self.steps[old]
            return
        for rid, start, end, base, blocks in self.steps.get(step, ()):
            req = self.request(rid)
            if req is None or req.stream is None:
                continue
            req.stream.begin(start)
            before = req.stream_reads[-1] if req.stream_reads else None
            read = self._read(req, header["layer"], step, start, end, [0] * (base // self._block_size) + blocks, before)
            req.stream_reads.append(asyncio.ensure_future(read))

    @property
    def _block_size(self) -> int:
        return self.kv.ranks[0].block_size

    async def _read(
        self, req: Request, layer: int, step: int, start: int, end: int, blocks: list[int], before: Any
    ) -> None:
        """Read one layer of tokens [start, end) and put it on the stream after the read
        issued before it (reads may finish out of order; a stream takes a layer in order)."""
        try:
            blob = await self.kv.read(blocks, req.prompt, start, end, range(layer, layer + 1), (layer, step))
        except Exception:
            req.stream_whole.set()  # (it never will be: nothing need wait for it)
            raise
        finally:
            if before is not None:
                await asyncio.wait([before])
        assert req.stream is not None  # (only a streamed request's layers are read)
        req.stream.put(blob)
        req.streamed[layer] = end
        layers = self.kv.num_layers
        if len(req.streamed) == layers and min(req.streamed.values()) >= len(req.prompt):
            req.stream_whole.set()

    @staticmethod
    async def whole(req: Request) -> None:
        """Before a streamed prefill's last output: every layer of its prompt is on the
        stream (or the wait ran out, and P's senders find the stream short)."""
        if req.stream is None or req.stream.first is None and not req.stream_reads:
            return
        try:
            await asyncio.wait_for(req.stream_whole.wait(), WHOLE_WAIT_S)
        except TimeoutError:
            failed = [r.exception() for r in req.stream_reads if r.done() and not r.cancelled() and r.exception()]
            log.warning("%s: its prefill's layers did not all reach its stream: %s", req.rid, failed[:1])
