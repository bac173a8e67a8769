"""The user's own model: a mixture-of-experts checkpoint (Mixtral, written by transformers),
which pdd's embedded engine cannot run, served by `pdd up --mode pdd` with P, RLD and MD
all on vLLM. vLLM reads the checkpoint, sizes each instance's KV cache itself from a
memory budget (no `num_pages`: "auto"), and pdd takes the KV geometry and the sizes from it; the router
plans with the block counts the instances report. Greedy output equals a plain
`vllm serve` on the same weights through P -> MD and P -> RLD -> MD, one-shot and
catch-up; a second turn moves only the KV MD lacks and MD computes only its new tail.
An MLA model (DeepSeek-style) is refused on CPU, where vLLM runs it without a prefix cache."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from checkpoints import save_moe_of, save_random_mla
from procs import kv_bytes_per_token, plain_vllm, vllm_settled
from vllm_scenarios import (
    assert_pdd_shapes,
    assert_second_turns_move_only_what_md_lacks,
    deployment,
    engine_stats,
    pipelines,
)

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_model_dir):
    return save_moe_of(tiny_model_dir, tmp_path_factory.mktemp("moe") / "tiny-moe")


@pytest.fixture(scope="module")
def moe_reference(moe_dir):
    with plain_vllm(moe_dir) as ref:
        yield ref


@pytest.fixture(scope="module")
def dep(tmp_path_factory, moe_dir):
    model = f'[model]\npath = "{moe_dir}"\nname = "tiny"\n'
    with deployment(tmp_path_factory, "pdd", "--engine", "vllm", instances=model, name="moe") as d:
        yield d


def test_the_embedded_engine_refuses_the_moe_by_name(moe_dir):
    """The checkpoint gate is the embedded engine's alone: there it names the field."""
    out = subprocess.run([sys.executable, "-m", "pdd.cli", "serve", str(moe_dir), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "model_type" in out.stderr and "'mixtral' is not supported" in out.stderr


def test_an_mla_model_on_cpu_is_refused_at_start_saying_why(tmp_path, tiny_model_dir):
    """A DeepSeek-V2-style checkpoint (latent attention, routed experts), which plain vLLM
    on CPU serves without its prefix cache: pdd's decode side is that cache, so pdd on
    vLLM refuses it at start, before any weight loads, in one line that says why."""
    mla = save_random_mla(tmp_path / "tiny-mla", tiny_model_dir)
    out = subprocess.run([sys.executable, "-m", "pdd.cli", "serve", str(mla), "--engine", "vllm", "--dtype",
                          "float32", "--port", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"pdd serve: vLLM cannot serve {mla}: vLLM turned its prefix cache off for this model (it does for MLA "
        "models on CPU), and pdd's decode-side cache, reservations and cache events are vLLM's prefix cache: "
        "serve it on a GPU")


def test_vllm_sizes_each_instance_and_the_router_plans_with_it(dep):
    stats = {n: engine_stats(dep, n) for n in ("p0", "rld0", "md0")}
    router = httpx.get(f"{dep.url}/pdd/stats").json()
    for name, s in stats.items():
        # vLLM's own count from the budget it was given (256 MiB: `vllm_scenarios.ENGINE`), less its null block
        assert s["num_blocks"] == 2047 and s["max_model_len"] == 4096 and s["dtype"] == "float32", s
        assert router["instances"][name]["pages"] == s["num_blocks"]
        assert router["instances"][name]["max_context"] == s["max_model_len"]
    assert router["max_context"] == 4096


def test_a_moe_through_every_pipeline_equals_plain_vllm(dep, moe_reference, moe_dir):
    hits_before = engine_stats(dep, "md0")["prefix_cache_hits"]
    prompts, done = pipelines(dep, moe_reference, seed=100)
    assert_pdd_shapes(done)
    assert_second_turns_move_only_what_md_lacks(dep, prompts, done, kv_bytes_per_token(moe_dir), hits_before)
    vllm_settled([dep.http[n] for n in ("p0", "rld0", "md0")])
