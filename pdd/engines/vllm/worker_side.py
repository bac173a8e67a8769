"""The worker-side half of pdd's vLLM KV connector (it runs in each vLLM worker).

The pdd instance sends it KV to write into a reservation's blocks and asks it for KV
to read out of a held request's blocks, over the bridge: its tensor-parallel shard
of the heads only (an MLA latent is whole on every rank), in the cache's own storage
dtype (an fp8 cache's bytes), through `layout`. Both run on the model thread,
between forward passes (vLLM calls `start_load_kv` every step, forward or not): never concurrently with a forward that
could be reading or writing the same cache, and in the device's own stream order on
CUDA. What the scheduler decided (loads complete, holds released) arrives in the
step's metadata and is reported back in `get_finished`, as vLLM expects.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from typing import Any

import torch

from pdd.engines.vllm import bridge
from pdd.engines.vllm.layout import Layout, check_against_vllm, describe
from pdd.kv.codec import dtype_name

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # no forward this step: wait this long for KV work before handing back to vLLM


class WorkerSide:
    def __init__(self, vllm_config: Any, extra: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.config = vllm_config
        self.rank, self.world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.channel = bridge.connect(
            extra["bridge"], extra["token"], {"side": "worker", "rank": self.rank, "world": self.world}
        )
        self.jobs: queue.SimpleQueue[tuple[dict[str, Any], bytes]] = queue.SimpleQueue()
        self.wake = threading.Event()
        bridge.serve_forever(self.channel, self._on_message, f"pdd-worker{self.rank}-bridge")
        self.layers: list[Layout] = []
        self.sides = 2  # K and V, or the latent alone
        self.storage = torch.uint8  # the caches' dtype as vLLM allocated them
        self.block_size = vllm_config.cache_config.block_size  # the scheduler's blocks (a layout's may be smaller)

    def _on_message(self, header: dict[str, Any], payload: bytes) -> None:
        self.jobs.put((header, payload))
        self.wake.set()

    # ---- start-up ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each layer's cache in the layout vLLM's description of it calls for, after
        checking that layout against vLLM's own cache write; tell the instance what this
        worker holds. Anything pdd cannot carry exactly is refused here, by name, and the
        reason goes to the instance too (from a worker process of its own, vLLM reports
        only that its engine core failed)."""
        try:
            self._register(kv_caches)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            self.channel.send({"op": "cache_refused", "error": str(e), "rank": self.rank})
            raise

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        context = self.config.compilation_config.static_forward_context
        # a layer reading another's cache (vLLM's KV sharing) is carried once, as that one
        names = sorted(
            (n for n in kv_caches if getattr(context.get(n), "kv_sharing_target_layer_name", None) is None),
            key=extract_layer_index,
        )
        missing = [n for n in names if n not in context]
        if missing:
            raise RuntimeError(f"pdd's KV connector cannot carry caches vLLM describes no layer for: {missing[:3]}")
        layers = [context[n] for n in names]
        shape = describe(self.config, layers, self.rank, self.world)
        first = kv_caches[names[0]]
        check_against_vllm(shape, layers[0], first, self.config.model_config.dtype)
        self.layers = [shape.layout_of(kv_caches[n]) for n in names]
        self.sides = 1 if shape.latent else 2
        self.storage = first.dtype
        held = (
            f"a latent of {shape.head_dim}"
            if shape.latent
            else f"heads [{shape.head_start}, +{shape.heads}) of {shape.head_dim}"
        )
        log.info(
            "pdd KV connector: %d layers of %s (%s%s), %d blocks of %d tokens, %s (%s), rank %d of %d",
            len(names),
            shape.backend,
            shape.layout,
            f", {shape.isa}" if shape.isa else "",
            first.shape[0],
            first.shape[2],
            held,
            dtype_name(shape.dtype),
            self.rank,
            self.world,
        )
        self.channel.send(
            {
                "op": "layout",
                "layers": len(names),
                "blocks": first.shape[0] * first.shape[2] // self.block_size,
                "block_size": self.block_size,
                "heads": shape.heads,
                "head_start": shape.head_start,
                "head_dim": shape.head_dim,
                "latent": shape.latent,
                "dtype": dtype_name(shape.dtype),
                "scales": list(shape.scales),
                "backend": shape.backend,
                "layout": shape.layout,
                "isa": shape.isa,
                "rank": self.rank,
                "world": self.world,
            }
        )

    # ---- every step --------------------------------------------------------------------
    def serve_jobs(self, idle: bool) -> None:
        """Do the KV writes and reads the instance asked for; with nothing to compute this
        step, wait briefly for some (vLLM's loop would otherwise spin while KV crawls in)."""
        if idle and self.jobs.empty():
            self.wake.wait(IDLE_WAIT_S)
        self.wake.clear()
        while True:
            try:
                header, payload = self.jobs.get_nowait()
            except queue.Empty:
                return
            try:
                if header["op"] == "write":
                    self._write(header, payload)
                    self.channel.send({"op": "written", "seq": header["seq"]})
                elif header["op"] == "read":
                    self.channel.send({"op": "data", "seq": header["seq"]}, self._read(header))
            except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
                log.warning("pdd KV %s failed: %s", header.get("op"), e)
                self.channel.send({"op": "failed", "seq": header.get("seq"), "error": f"{type(e).__name__}: {e}"})

    def _slots(self, header: dict[str, Any]) -> torch.Tensor:
        """The cache slots of tokens [token_start, token_end) in the scheduler's `blocks`
        (a layout indexes them in its own, possibly smaller, kernel blocks: vLLM splits
        each scheduler block into equal consecutive ones)."""
        bs = self.block_size
        blocks = torch.tensor(header["blocks"], dtype=torch.long)
        positions = torch.arange(header["token_start"], header["token_end"], dtype=torch.long)
        return blocks[positions // bs] * bs + positions % bs

    def _write(self, header: dict[str, Any], payload: bytes) -> None:
        slots = self._slots(header)
        shape = (self.sides, len(self.layers), len(slots), header["heads"], header["head_dim"])
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.storage)
        if flat.numel() != math.prod(shape):
            raise ValueError(f"KV payload of {flat.numel()} values does not fill {shape}")
        kv = flat.view(shape)
        for i, layer in enumerate(self.layers):
            layer.write(slots, kv[0, i], kv[-1, i])  # (a latent's layout takes K alone)

    def _read(self, header: dict[str, Any]) -> bytes:
        """[sides, layers, tokens, heads, head_dim] of the cache's storage dtype, as bytes."""
        slots = self._slots(header)
        parts = [layer.read(slots)[: self.sides] for layer in self.layers]
        kv = torch.stack([torch.stack([p[s] for p in parts]) for s in range(self.sides)])
        return kv.contiguous().view(torch.uint8).numpy().tobytes()
