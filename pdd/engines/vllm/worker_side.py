"""The worker-side half of pdd's vLLM KV connector (it runs in each vLLM worker).

The pdd instance asks it, over the bridge, to write KV into a reservation's blocks and
to read KV out of a held request's blocks: its tensor-parallel shard of the heads only
(an MLA latent is whole on every rank), of the layers its pipeline stage holds only, of
the tokens decode context parallelism gives its rank only (`split`), in the cache's own
storage dtype (an fp8 cache's bytes), through `layout`. The KV itself crosses through a
staging region both processes map (`staging`), one slice a slot; the copies between
that region and the cache run on a thread of their own, beside the forward passes
(`copier`), so the model thread never waits for them. What the scheduler decided (loads
complete, holds released) arrives in the step's metadata and is reported back in
`get_finished`, as vLLM expects.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pdd.engines.vllm import bridge
from pdd.engines.vllm.copier import Copier
from pdd.engines.vllm.layout import check_against_vllm, describe
from pdd.engines.vllm.split import TokenSplit
from pdd.engines.vllm.staging import Region
from pdd.kv.codec import dtype_name

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  # no forward this step: wait this long for a copy to land before handing back to vLLM


class WorkerSide:
    stage, stages = 0, 1  # this worker's pipeline-parallel stage, of how many
    split = TokenSplit()  # the tokens its cache holds: all, but under decode context parallelism

    def __init__(self, vllm_config: Any, extra: dict[str, Any]) -> None:
        from vllm.distributed.parallel_state import (
            get_dcp_group,
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.config = vllm_config
        self.rank, self.world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.stage, self.stages = get_pp_group().rank_in_group, get_pp_group().world_size
        dcp = get_dcp_group()
        self.split = TokenSplit(
            dcp.rank_in_group, dcp.world_size, vllm_config.parallel_config.cp_kv_cache_interleave_size
        )
        self.region = Region.create()
        self.copier: Copier | None = None  # once the caches are registered
        self.channel = bridge.connect(extra["bridge"], extra["token"], {"side": "worker", "rank": self.index})
        bridge.serve_forever(self.channel, self._on_message, f"pdd-worker{self.index}-bridge")
        # its blocks: the scheduler's (a layout's may be smaller), or under DCP 1/D of one (`split`)
        self.block_size = vllm_config.cache_config.block_size
        self.layer_index: dict[str, int] = {}  # a carried layer's name -> its place among them
        self.layer_start = 0  # the model's index of the first of them (its stage's first layer)
        self.step = 0  # steps begun (every rank counts the same)
        self.streams = False  # whether this step computes a streamed prefill

    @property
    def index(self) -> int:
        """This worker among all of the instance's: stage by stage, tensor-parallel rank by rank."""
        return self.stage * self.world + self.rank

    def _on_message(self, header: dict[str, Any]) -> None:
        if header["op"] not in ("write", "read"):
            return
        if self.copier is None:  # (the instance asks only after this worker's layout)
            self.channel.send({"op": "failed", "seq": header.get("seq"), "error": "no KV cache registered yet"})
        else:
            self.copier.jobs.put(header)

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
            self.channel.send({"op": "cache_refused", "error": str(e), "rank": self.index})
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
        self.layer_start = _layer_start(names, self.stages)
        shape = describe(self.config, layers, self.rank, self.world)
        first = kv_caches[names[0]]
        check_against_vllm(shape, layers[0], first, self.config.model_config.dtype)
        layers_out = [shape.layout_of(kv_caches[n]) for n in names]
        self.layer_index = {n: i for i, n in enumerate(names)}
        if first.device.type == "cuda":
            self.region.pin()
        self.copier = Copier(
            layers_out,
            1 if shape.latent else 2,
            first.dtype,
            self.block_size,
            self.region,
            self.channel.send,
            first.device,
            self.split,
        )
        self.copier.start()
        self._announce(len(names), shape, first)

    def _announce(self, layers: int, shape: Any, first: torch.Tensor) -> None:
        """Log what this worker carries, and tell the instance (with its staging region)."""
        held = (
            f"a latent of {shape.head_dim}"
            if shape.latent
            else f"heads [{shape.head_start}, +{shape.heads}) of {shape.head_dim}"
        )
        log.info(
            "pdd KV connector: layers [%d, +%d) of %s (%s%s), %d blocks of %d tokens, %s (%s), rank %d of %d, "
            "stage %d of %d, DCP rank %d of %d",
            self.layer_start,
            layers,
            shape.backend,
            shape.layout,
            f", {shape.isa}" if shape.isa else "",
            first.shape[0],
            first.shape[2],
            held,
            dtype_name(shape.dtype),
            self.rank,
            self.world,
            self.stage,
            self.stages,
            self.split.rank,
            self.split.world,
        )
        self.channel.send(
            {
                "op": "layout",
                "layers": layers,
                "layer_start": self.layer_start,
                "blocks": first.shape[0] * first.shape[2] // self.block_size,
                "block_size": self.block_size * self.split.world,  # the scheduler's, which DCP's ranks share
                "dcp": [self.split.rank, self.split.world, self.split.interleave],
                "heads": shape.heads,
                "head_start": shape.head_start,
                "head_dim": shape.head_dim,
                "latent": shape.latent,
                "dtype": dtype_name(shape.dtype),
                "scales": list(shape.scales),
                "backend": shape.backend,
                "layout": shape.layout,
                "isa": shape.isa,
                "rank": self.index,
                "world": self.world * self.stages,
                "slot_bytes": self.region.slot_bytes,
                "slots": self.region.slots,
            },
            fds=(self.region.fd,),
        )

    # ---- every step --------------------------------------------------------------------
    def begin_step(self, streams: list[list[Any]]) -> None:
        """The model thread, before each step's forward pass: count it; rank 0 tells the
        instance what streamed prefills it computes (`save_layer` tells it each layer's end)."""
        self.step += 1
        self.streams = bool(streams)
        if streams and self.index == 0:
            self.channel.send({"op": "streaming", "step": self.step, "streams": streams})

    def on_step(self, idle: bool) -> None:
        """The model thread, at each step (vLLM calls it after launching the forward pass):
        mark where its stream is (the copies wait for it on CUDA); with nothing to compute,
        wait briefly for a copy to land (vLLM's loop would otherwise spin while KV crawls in)."""
        if self.copier is None:
            return
        self.copier.stream.mark_step()
        self.copier.busy = not idle
        if idle:
            self.copier.done.wait(IDLE_WAIT_S)
        self.copier.done.clear()

    def save_layer(self, layer_name: str) -> None:
        """The model thread, once a layer of the step is computed: where the step computes a
        streamed prefill, mark the layer for this worker's reads of it (`Copier.computed`)
        and, on each stage's rank 0, tell the instance which of the model's layers it is;
        the instance reads it at once (a read on any rank waits for that rank's own mark)."""
        index = self.layer_index.get(layer_name)
        if not self.streams or self.copier is None or index is None:
            return
        self.copier.computed(index, self.step)
        if self.rank == 0:
            self.channel.send({"op": "computed", "step": self.step, "layer": self.layer_start + index})


def _layer_start(names: list[str], stages: int) -> int:
    """The model's index of the first layer a stage carries (0 with one stage). A
    pipeline stage holds consecutive layers (vLLM's `get_pp_indices`); one whose carried
    layers are not consecutive (a model sharing caches between layers) is refused."""
    if stages == 1:
        return 0
    from vllm.model_executor.models.utils import extract_layer_index

    indices = [extract_layer_index(n) for n in names]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise RuntimeError(f"pdd's KV connector carries consecutive layers a pipeline stage; this one holds {indices}")
    return indices[0]
