"""The model is the user's: what pdd reads of any checkpoint without running it, the
checkpoint's own sampling defaults, and `pdd serve` as a vLLM user types it: the model
first, vLLM's flags as vLLM spells them, each mistake one line naming what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.api.protocol import CompletionRequest
from pdd.api.shaping import sampling_params
from pdd.engines.port import AUTO
from pdd.instance.cli import vllm_flags
from pdd.model.config import Declared
from pdd.model.tokenizer import Tokenizer

MLA_MOE = {  # a DeepSeek-V2-style checkpoint's config.json, cut down
    "model_type": "deepseek_v2", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 8192, "n_routed_experts": 8,
    "quantization_config": {"quant_method": "fp8"},
}


def _model(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_what_any_checkpoint_declares(tmp_path, tiny_model_dir):
    mla = Declared.from_dir(_model(tmp_path, MLA_MOE))
    # MLA: one latent vector (kv_lora_rank + the rope key) a layer, no K/V split, no heads
    assert (mla.vocab_size, mla.max_position, mla.kv_values_per_token) == (1000, 8192, 3 * (512 + 64))
    tiny = Declared.from_dir(tiny_model_dir)
    assert (tiny.vocab_size, tiny.max_position, tiny.kv_values_per_token) == (4096, 4096, 4 * 2 * 2 * 64)
    nested = Declared.from_dir(_model(tmp_path, {"model_type": "llava", "text_config": {**MLA_MOE, "vocab_size": 7}}))
    assert nested.vocab_size == 7  # (a multimodal checkpoint's language model)


def test_the_checkpoints_generation_config_sets_what_a_request_leaves_out(tmp_path, tiny_model_dir):
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    gen = json.loads((model / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=77)
    (model / "generation_config.json").write_text(json.dumps(gen))
    defaults = Tokenizer.from_dir(model).generation_defaults
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 77}
    bare = sampling_params(CompletionRequest(model="m", prompt=[1]), 1, None, 16, 4096, defaults)
    assert (bare.temperature, bare.top_p, bare.top_k, bare.max_tokens) == (0.6, 0.9, 20, 77)
    # what the request says wins, its own defaults' values included
    said = CompletionRequest(model="m", prompt=[1], temperature=1.0, top_k=0, max_tokens=5)
    got = sampling_params(said, 1, said.max_tokens, 16, 4096, defaults)
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens) == (1.0, 0.9, 0, 5)
    assert Tokenizer.from_dir(tiny_model_dir).generation_defaults == {}  # the tiny model says none


def test_vllms_flags_as_vllm_spells_them():
    pytest.importorskip("vllm")  # (names are checked against vLLM's own engine arguments)
    assert vllm_flags(["--tensor-parallel-size", "2", "--kv-cache-dtype=fp8", "--enforce-eager",
                       "--no-enable-chunked-prefill", "--gpu-memory-utilization", "0.85"]) == {
        "tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "enforce_eager": True, "enable_chunked_prefill": False,
        "gpu_memory_utilization": 0.85}
    with pytest.raises(ValueError, match=r"unknown engine flag\(s\) \['--tensor-paralel-size'\]"):
        vllm_flags(["--tensor-paralel-size", "2"])


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "pdd.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, says", [
    (["--config", "F", "--instance", "p0", "--page-size", "32", "--tensor-parallel-size", "2"],
     "--page-size --tensor-parallel-size 2 would be ignored with --config"),
    (["MODEL", "--tensor-parallel-size", "2"], "are vLLM's engine arguments: add --engine vllm"),
    (["MODEL", "--engine", "embedded", "--num-pages", "auto"], 'num_pages must be at least 1 or "auto" on vllm'),
    (["MODEL", "--dtype", "auto"], 'dtype "auto" is vLLM\'s'),
    (["MODEL", "--model", "OTHER"], "two models given"),
])
def test_serve_mistakes_are_one_line(args, says, tiny_model_dir):
    args = [str(tiny_model_dir) if a == "MODEL" else a for a in args]
    out = _serve(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("command", [["serve", "MODEL"], ["router", "--config", "F"]])
def test_a_log_level_or_protocol_that_is_none_is_one_line(command, tiny_model_dir):
    """PDD_LOG sets the log level of both servers, PDD_PROTOCOL the newest protocol they
    speak; a value that is none is said as such, before anything starts."""
    import os

    args = [str(tiny_model_dir) if a == "MODEL" else a for a in command]
    for env, said in ((("PDD_LOG", "loud"), "PDD_LOG='loud' is not one of DEBUG, INFO, WARNING, ERROR"),
                      (("PDD_PROTOCOL", "3"), "PDD_PROTOCOL='3': this release speaks protocols 4-7")):
        out = subprocess.run([sys.executable, "-m", "pdd.cli", *args], capture_output=True, text=True, timeout=60,
                             env={**os.environ, env[0]: env[1]})
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"pdd {command[0]}: {said}"], out.stderr


def test_a_port_in_use_fails_before_the_model_loads(tiny_model_dir):
    """The port is bound first: on vLLM, whose start takes tens of seconds and logs at
    length, a port in use is one line and exit 2, and vLLM never starts."""
    import socket

    pytest.importorskip("vllm")
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        out = _serve(str(tiny_model_dir), "--engine", "vllm", "--dtype", "float32", "--port", str(port))
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [f"pdd serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_engine_vllm_without_vllm_names_the_extra(tmp_path, tiny_model_dir):
    hidden = tmp_path / "no-vllm" / "vllm"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    out = _serve(str(tiny_model_dir), "--engine", "vllm", "--port", "0", env={"PYTHONPATH": str(hidden.parent)})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "pdd serve: [engine] backend = \"vllm\" needs vLLM: pip install 'pdd-serving[vllm]' (No module named 'vllm')")


def test_auto_sizes_read_from_a_file_and_the_command_line():
    from pdd import config as cfg
    from pdd.engines.port import EngineConfig

    dep = cfg.parse({"engine": {"backend": "vllm", "max_running": "auto", "max_batch_tokens": 4096}})
    assert (dep.engine.num_pages, dep.engine.max_running, dep.engine.max_batch_tokens) == (AUTO, AUTO, 4096)
    # `pdd up --engine vllm` over a file that chose the dtype keeps it; pdd's defaults become vLLM's
    up = cfg.parse({"engine": {"dtype": "float32"}}, backend="vllm")
    assert (up.engine.backend, up.engine.dtype, up.engine.num_pages) == ("vllm", "float32", AUTO)
    # an instance off a vLLM deployment's backend gets pdd's sizes; one on it keeps a chosen "auto"
    d = EngineConfig()
    mixed = cfg.parse({"engine": {"backend": "vllm", "num_pages": "auto", "dtype": "float32"},
                       "instances": [{"name": "p0", "role": "prefill", "engine": {"backend": "embedded"}},
                                     {"name": "md0", "role": "main", "engine": {"backend": "vllm"}}]})
    p0, md0 = (i.engine for i in mixed.instances)
    assert (p0.num_pages, p0.max_running, p0.max_batch_tokens, p0.dtype) == (d.num_pages, d.max_running,
                                                                             d.max_batch_tokens, "float32")
    assert (md0.num_pages, md0.dtype) == (AUTO, "float32")
    with pytest.raises(cfg.ConfigError, match="runs on one device"):
        cfg.parse({"engine": {"device": "cuda:0,1"}})
    # (a data-parallel group: `test_dp_groups`)
    # pipeline stages pass through to vLLM: on CUDA a GPU for each rank of each stage
    stages = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    pp = cfg.parse({"engine": {"backend": "vllm", "device": "cuda:0,1,2,3", "vllm": stages}})
    assert pp.engine.vllm == stages
    with pytest.raises(cfg.ConfigError, match=r"2 GPU\(s\) for tensor_parallel_size x pipeline_parallel_size = 4"):
        cfg.parse({"engine": {"backend": "vllm", "device": "cuda:0,1", "vllm": stages}})
    with pytest.raises(cfg.ConfigError, match="pipeline_parallel_size must be a whole number of at least 1, not 0"):
        cfg.parse({"engine": {"backend": "vllm", "vllm": {"pipeline_parallel_size": 0}}})


GPU_EXAMPLE = Path(__file__).parent.parent / "deploy" / "two-site-vllm.toml"


def test_the_gpu_example_is_the_one_the_docs_show_and_it_loads(tmp_path):
    """docs/reference.md's and docs/deployment.md's two-site GPU deployment is
    deploy/two-site-vllm.toml, word for word (the README's quick start starts from it), and
    it loads, its secret read from its file: vLLM everywhere, bf16, one GPU per tensor-parallel rank,
    the KV cache sized by vLLM, each instance's vLLM arguments what the file says."""
    from pdd import config as cfg
    from pdd.engines.vllm import args as vargs

    text = GPU_EXAMPLE.read_text()
    body = text[text.index("mode = "):]
    root = GPU_EXAMPLE.parent.parent
    for doc in ("docs/reference.md", "docs/deployment.md"):
        assert body in (root / doc).read_text(), f"{doc} does not show deploy/two-site-vllm.toml as it is"
    assert "deploy/two-site-vllm.toml" in (root / "README.md").read_text()  # its GPU quick start starts from it
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    (tmp_path / "two-site.toml").write_text(text.replace('"/etc/pdd/secret"', f'"{secret}"'))
    dep = cfg.load(tmp_path / "two-site.toml")
    model = _model(tmp_path, {"model_type": "qwen3_moe", "vocab_size": 151936, "num_hidden_layers": 48,
                              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                              "hidden_size": 2048, "max_position_embeddings": 40960})
    seen = {}
    for inst in dep.instances:
        e = inst.engine
        assert (e.backend, e.dtype, e.num_pages, e.page_size) == ("vllm", "bfloat16", AUTO, 32)
        kw = vargs.engine_kwargs(model, e, "/b", "t", "ipc://e", "ipc://r")
        env = vargs.engine_env(e, 1)
        seen[inst.name] = (kw["tensor_parallel_size"], env["CUDA_VISIBLE_DEVICES"], kw["max_model_len"],
                           kw["gpu_memory_utilization"], kw.get("enable_expert_parallel", False))
        assert "num_gpu_blocks_override" not in kw and "kv_cache_memory_bytes" not in kw  # vLLM profiles the GPU
    assert seen == {"p0": (2, "0,1", 32768, 0.9, False), "rld0": (2, "0,1", 32768, 0.9, False),
                    "md0": (4, "0,1,2,3", 32768, 0.9, True)}


def test_the_router_plans_with_what_each_instance_reports():
    """An instance that sizes itself (AUTO pages) has no room until its snapshot says how
    many pages vLLM gave it; then admission counts those, and the context one request may
    hold is the least any instance reported."""
    from types import SimpleNamespace

    from pdd.engines.port import EngineConfig
    from pdd.names import Mode, RoleName
    from pdd.policy.capacity import pages_needed
    from pdd.router.client import InstanceClient
    from pdd.router.planning import Planner
    from pdd.transfer import messages as m

    spec = SimpleNamespace(name="md0", role=RoleName.MAIN,
                           engine=EngineConfig(backend="vllm", page_size=32, num_pages=AUTO, max_requests=8))
    md = InstanceClient(spec, "127.0.0.1", 1, b"k" * 32, "r")
    planner = Planner(SimpleNamespace(mode=Mode.PDD, policy=None), {"md0": md})
    planner.max_context = 40960  # what the model declares
    need = pages_needed(1000, 100, 0, 32)
    md.committed_requests = 1  # (an idle instance takes any one request: the engine refuses what never fits)
    assert (md.pages, planner.max_context, planner._fits("md0", need)) == (0, 40960, False)
    assert md.on_cache_update(m.CacheUpdate("snapshot", 0, [], 32, 8191, 4096))
    assert planner._fits("md0", need) and planner.max_context == 4096
    md.committed_pages = 8191 - need + 1
    assert not planner._fits("md0", need)


def test_an_engine_backend_name_is_registered_once():
    """As vLLM's connector factory: a second registration of a name is refused, naming the
    one it has (a plugin cannot replace a backend in silence)."""
    from pdd.engines.port import register_engine

    with pytest.raises(ValueError, match="'vllm' is registered already"):
        register_engine("vllm", "my_plugin:open_engine")
