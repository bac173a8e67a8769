"""The worker-side half of pdd's vLLM KV connector (it runs in each vLLM worker).

The pdd instance sends it KV to write into a reservation's blocks and asks it for KV
to read out of a held request's blocks, over the bridge; its tensor-parallel shard
of the heads only. Both run on the model thread, between forward passes (vLLM calls
`start_load_kv` every step, forward or not): never concurrently with a forward that
could be reading or writing the same cache, and in the device's own stream order on
CUDA. What the scheduler decided (loads complete, holds released) arrives in the
step's metadata and is reported back in `get_finished`, as vLLM expects.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch

from pdd.engines.vllm import bridge
from pdd.engines.vllm.layout import CpuPackedLayout, TokenMajorLayout, cpu_isa
from pdd.kv.codec import DTYPES, dtype_name

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
        self.layers: list[Any] = []

    def _on_message(self, header: dict[str, Any], payload: bytes) -> None:
        self.jobs.put((header, payload))
        self.wake.set()

    # ---- start-up ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each layer's cache in its layout, after checking the layout is one pdd
        reads exactly; tell the instance what this worker holds."""
        from vllm.model_executor.models.utils import extract_layer_index

        model = self.config.model_config
        head_dim = model.get_head_size()
        names = sorted(kv_caches, key=extract_layer_index)
        caches = [kv_caches[n] for n in names]
        first = caches[0]
        if len({tuple(c.shape) for c in caches}) != 1 or first.dim() != 4:
            raise RuntimeError(
                f"pdd's KV connector needs one [blocks, heads, block, 2 * head_dim] cache per layer, "
                f"got {sorted({tuple(c.shape) for c in caches})}"
            )
        blocks, heads, block_size, _ = first.shape
        if first.device.type == "cpu":
            cache_dtype = self.config.cache_config.cache_dtype
            isa = cpu_isa(first.dtype, block_size, head_dim, cache_dtype)
            CpuPackedLayout.self_check(heads, head_dim, block_size, first.dtype, isa)
            self.layers = [CpuPackedLayout(c, head_dim, isa) for c in caches]
        else:
            isa = "token-major"
            self.layers = [TokenMajorLayout(c, head_dim) for c in caches]
        log.info(
            "pdd KV connector: %d layers, %d blocks of %d tokens, %d heads of %d (%s, %s), rank %d of %d",
            len(caches),
            blocks,
            block_size,
            heads,
            head_dim,
            dtype_name(first.dtype),
            isa,
            self.rank,
            self.world,
        )
        self.channel.send(
            {
                "op": "layout",
                "layers": len(caches),
                "blocks": blocks,
                "block_size": block_size,
                "heads": heads,
                "head_dim": head_dim,
                "dtype": dtype_name(first.dtype),
                "isa": isa,
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
        bs = self.layers[0].block_size
        blocks = torch.tensor(header["blocks"], dtype=torch.long)
        positions = torch.arange(header["token_start"], header["token_end"], dtype=torch.long)
        return blocks[positions // bs] * bs + positions % bs

    def _write(self, header: dict[str, Any], payload: bytes) -> None:
        slots = self._slots(header)
        shape = (len(self.layers), len(slots), header["heads"], header["head_dim"])
        flat = torch.frombuffer(bytearray(payload), dtype=DTYPES[header["dtype"]])
        if flat.numel() != 2 * shape[0] * shape[1] * shape[2] * shape[3]:
            raise ValueError(f"KV payload of {flat.numel()} values does not fill {shape} twice")
        k, v = flat.view(2, *shape)
        for layer, lk, lv in zip(self.layers, k, v, strict=True):
            layer.write(slots, lk, lv)

    def _read(self, header: dict[str, Any]) -> bytes:
        slots = self._slots(header)
        parts = [layer.read(slots) for layer in self.layers]
        k = torch.stack([p[0] for p in parts])
        v = torch.stack([p[1] for p in parts])
        return torch.stack([k, v]).contiguous().view(torch.uint8).numpy().tobytes()
