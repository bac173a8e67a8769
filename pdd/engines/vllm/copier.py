"""KV between a worker's staging region and its caches, beside the forward passes.

A vLLM worker's model thread is vLLM's: pdd's connector gets it only between steps, and
a copy made there holds every request batched on that worker for as long as it takes (a
64K-token import of a large model's KV is gigabytes). So the copies run on a thread of
their own, one slice (one staging slot, `pdd.engines.vllm.staging`) at a time, in the
order the instance asked for them:

* on CUDA on a stream of their own, from and to the page-locked region, after an event
  the model thread records every step (what earlier forward passes wrote is in place
  before it is read, and a block freed by them is no longer read when it is written);
  the copy thread, never the model thread, waits for the copy's own event;
* on the CPU on the thread alone: large tensor copies release the GIL, so the forward
  pass and the copy run on cores of their own.

Nothing a forward pass reads is touched: an import writes the blocks of a reservation
(vLLM keeps its request in WAITING_FOR_REMOTE_KVS until the instance reports the load,
which it does only once every slice's answer is in), an export reads the blocks of a
finished request that vLLM holds for it, or one layer of a prefill's blocks that the
step under way has computed already (a streamed prefill: the read waits until this
worker's model thread has marked that layer of that step, `computed`). A slice is
answered only when its last value is in place.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from pdd.engines.vllm.layout import Layout
from pdd.engines.vllm.split import TokenSplit
from pdd.engines.vllm.staging import Region
from pdd.kv.copy_stream import CopyStream, rest, yield_cpu

log = logging.getLogger(__name__)
LAYER_WAIT_S = 30.0  # a read of a layer the step under way computes waits this long for it at most


class Copier:
    """Slices of KV in and out of one worker's caches, on the thread `start` starts."""

    def __init__(
        self,
        layers: list[Layout],
        sides: int,
        storage: torch.dtype,
        block_size: int,
        region: Region,
        answer: Callable[[dict[str, Any]], None],
        device: torch.device,
        split: TokenSplit = TokenSplit(),
    ) -> None:
        self.layers, self.sides, self.storage, self.block_size = layers, sides, storage, block_size
        self.split = split  # the tokens this rank holds (all, but under decode context parallelism)
        self.region, self.answer, self.device = region, answer, device
        self.stream = CopyStream(device)
        self.jobs: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.done = threading.Event()  # set whenever a slice is answered (an idle step waits on it)
        self.busy = False  # whether the last step computed something (a slice then leaves it room)
        self._thread = threading.Thread(target=self._run, name="pdd-kv-copy", daemon=True)
        self._layers_done = threading.Condition()
        self._layer_step: dict[int, tuple[int, Any]] = {}  # layer -> (the last step it was computed in, its event)

    def computed(self, layer: int, step: int) -> None:
        """The model thread: `layer` of step `step` is computed (queued, on CUDA)."""
        event = None
        if self.stream.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._layers_done:
            self._layer_step[layer] = (step, event)
            self._layers_done.notify_all()

    def _after(self, layer: int, step: int) -> Any:
        """Wait until `layer` of step `step` (or a later one) is computed; its event."""
        with self._layers_done:
            if not self._layers_done.wait_for(lambda: self._layer_step.get(layer, (-1, None))[0] >= step, LAYER_WAIT_S):
                raise RuntimeError(f"layer {layer} of step {step} was never computed here")
            return self._layer_step[layer][1]

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        yield_cpu()
        while True:
            header = self.jobs.get()
            began = time.perf_counter()
            try:
                if header["op"] == "write":
                    self.write(header)
                    self.answer({"op": "written", "seq": header["seq"]})
                else:
                    self.read(header)
                    self.answer({"op": "data", "seq": header["seq"]})
            except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
                log.warning("pdd KV %s failed: %s", header.get("op"), e)
                self.answer({"op": "failed", "seq": header.get("seq"), "error": f"{type(e).__name__}: {e}"})
            except OSError as e:  # the instance is gone; vLLM is being shut down with it
                log.warning("pdd KV copy's answer not delivered: %s", e)
            self.done.set()
            if self.busy:
                rest(time.perf_counter() - began)

    def slots(self, header: dict[str, Any]) -> torch.Tensor:
        """The cache slots of this rank's tokens of [token_start, token_end) (all of them
        but under decode context parallelism, `split`) in the scheduler's `blocks`, the
        first of which begins at token `base` (a layout indexes them in its own, possibly
        smaller, kernel blocks: vLLM splits each scheduler block into equal consecutive ones)."""
        blocks = torch.tensor(header["blocks"], dtype=torch.long)
        positions = self.split.positions(header["token_start"], header["token_end"]) - header["base"]
        return self.split.slots(blocks, positions, self.block_size).to(self.device)

    def staged(self, header: dict[str, Any], tokens: int) -> torch.Tensor:
        """The slice's staging slot as [sides, layers, tokens, heads, head_dim] of the cache's storage dtype."""
        first, last = header.get("layers", (0, len(self.layers)))
        shape = (self.sides, last - first, tokens, header["heads"], header["head_dim"])
        return self.region.slot(header["slot"], self.storage, shape)

    def write(self, header: dict[str, Any]) -> None:
        slots = self.slots(header)
        staged = self.staged(header, len(slots))
        with self.stream.copying():
            kv = staged.to(self.device, non_blocking=True)  # (the slot itself, on a CPU)
            for i, layer in enumerate(self.layers):
                layer.write(slots, kv[0, i], kv[-1, i])  # (a latent's layout takes K alone)

    def read(self, header: dict[str, Any]) -> None:
        """All layers, or `layers` [first, last) (after the step that computes them, `after`)."""
        slots = self.slots(header)
        staged = self.staged(header, len(slots))
        first, last = header.get("layers", (0, len(self.layers)))
        after = self._after(*header["after"]) if "after" in header else None
        with self.stream.copying(after):
            for i, layer in enumerate(self.layers[first:last]):
                for side, part in enumerate(layer.read(slots)[: self.sides]):
                    staged[side, i].copy_(part, non_blocking=True)
