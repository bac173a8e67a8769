"""vLLM's parallel settings as pdd passes them through and checks them at start
(`pdd.engines.vllm.parallel`, `pdd.engines.vllm.args`): what vLLM's CPU build fails at on
the first request is refused before any weight loads, naming vLLM's reason; the same
settings on a GPU pass; an MLA model's latent copies under TP are warned of."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.engines.port import EngineConfig
from pdd.engines.vllm import args as vargs
from pdd.engines.vllm.parallel import attention_layout, check_parallel
from pdd.model.config import Declared
from pdd.names import AttentionLayout

DENSE = {"vocab_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 4096}  # fmt: skip
QWEN3_MOE = {**DENSE, "num_experts": 8}
KIMI = {**DENSE, "n_routed_experts": 384, "kv_lora_rank": 512, "qk_rope_head_dim": 64}  # (DeepSeek V3's MLA)


def declared(tmp_path: Path, cfg: dict) -> Declared:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return Declared.from_dir(tmp_path)


def engine(device: str = "cpu", **vllm: object) -> EngineConfig:
    return EngineConfig(backend="vllm", page_size=32, device=device, vllm=dict(vllm))


def test_a_moe_under_data_parallelism_on_cpu_is_refused_saying_vllms_reason_and_passes_on_a_gpu(tmp_path):
    moe = declared(tmp_path, QWEN3_MOE)
    assert (moe.experts, moe.latent) == (8, False)
    for settings in ({"data_parallel_size": 2}, {"data_parallel_size": 2, "enable_expert_parallel": True}):
        with pytest.raises(ValueError) as refused:
            check_parallel(engine(**settings), moe)
        assert str(refused.value) == (
            "[engine.vllm] data_parallel_size = 2 with a MoE of 8 experts on CPU: vLLM's CPU build cannot run a MoE "
            "across data-parallel ranks: its CPU communicator has no all_gatherv, which the MoE layers' dispatch to "
            "the ranks calls (NotImplementedError at the first request, "
            'vllm/distributed/device_communicators/all2all.py:148): serve it on GPUs (device = "cuda")'
        )
        assert check_parallel(engine("cuda", **settings), moe) == []
        assert check_parallel(engine("cuda:0,1", **settings), moe) == []
    dense = declared(tmp_path, DENSE)  # the plumbing a dense model runs on CPU
    assert check_parallel(engine(data_parallel_size=2), dense) == [] and dense.experts == 0
    assert check_parallel(engine(tensor_parallel_size=2, enable_expert_parallel=True), moe) == []
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false, not 'yes'"):
        check_parallel(engine(enable_expert_parallel="yes"), moe)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a whole number of at least 1, not 0"):
        check_parallel(engine(pipeline_parallel_size=0), dense)


def test_an_mla_model_under_tensor_parallelism_is_warned_how_many_latent_copies_it_keeps(tmp_path):
    kimi = declared(tmp_path, KIMI)
    assert (kimi.experts, kimi.latent) == (384, True)
    (eight,) = check_parallel(engine("cuda", tensor_parallel_size=8), kimi)
    assert eight.startswith(
        "attention layout tp: each of the 8 tensor-parallel ranks keeps the whole MLA latent cache, so this "
        "instance holds 8 copies of it; decode_context_parallel_size = 8 splits it"
    )
    (two,) = check_parallel(engine("cuda", tensor_parallel_size=8, decode_context_parallel_size=4), kimi)
    assert two.startswith("attention layout tp-dcp: each of the 8 tensor-parallel ranks keeps 1/4 of the MLA latent "
                          "cache, so this instance holds 2 copies of it")  # fmt: skip
    assert check_parallel(engine("cuda", tensor_parallel_size=8, decode_context_parallel_size=8), kimi) == []
    assert check_parallel(engine("cuda", data_parallel_size=8, enable_expert_parallel=True), kimi) == []
    assert check_parallel(engine("cuda", tensor_parallel_size=8), declared(tmp_path, DENSE)) == []  # heads split


def test_the_attention_layout_is_named_as_the_planner_names_it():
    assert attention_layout(engine()) == AttentionLayout.TP
    assert attention_layout(engine(tensor_parallel_size=8, decode_context_parallel_size=8)) == AttentionLayout.TP_DCP
    assert attention_layout(engine(data_parallel_size=8, enable_expert_parallel=True)) == AttentionLayout.DP_EP
    assert attention_layout(engine(data_parallel_size=8)) == AttentionLayout.TP  # (the experts sliced on each rank)


def test_pipeline_stages_and_context_parallelism_as_vllms_arguments(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DENSE))
    one = vargs.engine_kwargs(model, engine(), "/b", "t", "ipc://e", "ipc://r")
    assert one["enforce_eager"] and one["distributed_executor_backend"] == "uni"
    assert vargs.engine_env(engine(), 1)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # vLLM-CPU allocates a later stage's input buffers only while compiling: two stages compile
    two = vargs.engine_kwargs(model, engine(pipeline_parallel_size=2), "/b", "t", "ipc://e", "ipc://r")
    assert not two["enforce_eager"] and "distributed_executor_backend" not in two
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vargs.engine_env(engine(pipeline_parallel_size=2), 1)
    assert two["pipeline_parallel_size"] == 2
    # under DCP a page is vLLM's scheduler block, D of a rank's blocks
    dcp = vargs.engine_kwargs(model, engine("cuda", tensor_parallel_size=2, decode_context_parallel_size=2),
                              "/b", "t", "ipc://e", "ipc://r")  # fmt: skip
    assert dcp["block_size"] == 16 and dcp["decode_context_parallel_size"] == 2
    with pytest.raises(ValueError, match="page_size 32 is vLLM's scheduler block.*give a multiple of 3"):
        vargs.engine_kwargs(model, engine("cuda", decode_context_parallel_size=3), "/b", "t", "", "")
