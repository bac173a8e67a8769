"""A checkpoint that transformers itself wrote (5.x layout, tied embeddings, GQA, its own
tokenizer files), served where the tiny model is: `pdd serve` finds it by hub name in a
Hugging Face cache and its greedy tokens equal transformers' own; `pdd up --model DIR` in
pdd mode (relay, catch-up handoff, MD) gives the same tokens; `pdd bench` fits its
workload to it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from checkpoints import hf_greedy, hf_model, put_in_hub_cache, save_decisive_llama
from procs import HTTP, free_port, pdd_process, pdd_up

from pdd.cli import main
from pdd.model.tokenizer import Tokenizer

HUB_NAME = "acme/synth-chat"
STEPS = 120
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France? Answer in one word, s'il vous plaît."}]


def _prompts() -> list[list[int]]:
    rng = random.Random(42)
    return [[rng.randrange(16, 4096) for _ in range(n)] for n in (150, 260, 333, 410)]


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict:
    """The checkpoint in a directory and, by hub name, in a private HF_HOME; transformers'
    greedy continuations of the test prompts and of the chat prompt."""
    root = tmp_path_factory.mktemp("synth")
    model_dir = save_decisive_llama(root / "synth", tiny_model_dir)
    hf_home = root / "hf"
    put_in_hub_cache(model_dir, hf_home / "hub", HUB_NAME)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    chat_ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])
    hf = hf_model(model_dir)
    runs = [hf_greedy(hf, p, STEPS) for p in [*_prompts(), chat_ids]]
    print(f"\ntransformers: smallest top1-top2 logit gap over {len(runs) * STEPS} greedy decisions: "
          f"{min(gap for _, _, gap in runs):.2f}")
    return {"dir": model_dir, "hf_home": hf_home, "chat_ids": chat_ids, "greedy": [t for t, _, _ in runs[:-1]],
            "chat": runs[-1][0], "min_gap": min(gap for _, _, gap in runs)}


def test_the_checkpoint_is_as_transformers_5_writes_it_and_decisive(synth: dict) -> None:
    files = sorted(p.name for p in synth["dir"].iterdir())
    assert "chat_template.jinja" in files and "rope_theta" not in json.loads((synth["dir"] / "config.json").read_text())
    tokenizer = Tokenizer.from_dir(synth["dir"])  # the template lives in chat_template.jinja (5.x)
    assert tokenizer.encode(tokenizer.apply_chat_template(CHAT)) == synth["chat_ids"]
    # 10x the largest top1 - top2 move between computation paths measured on the tiny model
    assert synth["min_gap"] > 0.1


def _complete(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    r = HTTP.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(url: str, model: str) -> dict:
    body = {"model": model, "messages": CHAT, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    r = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_pdd_mode_on_the_checkpoint_equals_one_instance_and_transformers(synth: dict, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(synth["hf_home"]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    # one instance does it all, as in colocated mode; found by hub name, and served under it
    url = f"http://127.0.0.1:{free_port()}"
    with pdd_process(["serve", "--model", HUB_NAME, "--port", url.rsplit(":", 1)[1]], f"{url}/health"):
        models = HTTP.get(f"{url}/v1/models").json()["data"]
        colocated = [_complete(url, HUB_NAME, p)["choices"][0]["token_ids"] for p in _prompts()]
        colocated_chat = _chat(url, HUB_NAME)
        bench = tmp_path / "bench.json"
        assert main(["bench", "--url", url, "--scenario", "short", "--requests", "3", "--quiet",
                     "--out", str(bench)]) == 0
    assert [(m["id"], m["max_model_len"], m["vocab_size"]) for m in models] == [(HUB_NAME, 2048, 4096)]
    report = json.loads(bench.read_text())  # fitted to the served context: the short scenario's lengths x 0.5
    assert report["summary"]["completed"] == 3 and report["config"]["model"] == HUB_NAME
    assert report["config"]["workload"]["max_context"] == 1250
    assert colocated == synth["greedy"]
    assert colocated_chat["choices"][0]["token_ids"] == synth["chat"]
    assert colocated_chat["usage"]["prompt_tokens"] == len(synth["chat_ids"])

    # through the relay, then handed over to MD by catch-up: three producers' tokens merged
    conf = tmp_path / "pdd.toml"
    conf.write_text('[line]\nbandwidth_mbps = 200.0\ndelay_ms = 2.0\njitter_ms = 0.5\n[policy]\n'
                    'pipeline = "P-RLD-MD"\nhandoff = "catch_up"\ncatch_up_chunk = 7\nhandoff_threshold = 4\n')
    with pdd_up("--mode", "pdd", "--config", str(conf), "--model", str(synth["dir"])) as dep:
        runs = [_complete(dep.url, "synth", p) for p in _prompts()]
        chat = _chat(dep.url, "synth")
    print("\n(relay tokens, MD tokens, handoff) per request:",
          [(r["pdd"]["relay_output_tokens"], r["pdd"]["main_output_tokens"], r["pdd"]["handoff"])
           for r in runs + [chat]])
    assert [r["choices"][0]["token_ids"] for r in runs] == colocated
    assert chat["choices"][0]["token_ids"] == colocated_chat["choices"][0]["token_ids"]
    # every request through the relay; those MD took over (on a loaded machine the relay may
    # finish one alone first) by catch-up, and at least one was
    assert all(r["pdd"]["pipeline"] == "P-RLD-MD" for r in runs + [chat])
    handed = [r["pdd"]["handoff"] for r in runs + [chat] if r["pdd"]["main_output_tokens"] > 0]
    assert handed and set(handed) == {"catch_up"}, handed
    assert all(r["pdd"]["relay_output_tokens"] > 0 for r in runs + [chat])


def test_a_model_not_cached_or_not_supported_stops_up_and_serve_with_the_reason(
        synth: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(synth["hf_home"]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    for f in synth["dir"].iterdir():
        (unsupported / f.name).symlink_to(f)
    cfg = json.loads((synth["dir"] / "config.json").read_text())
    (unsupported / "config.json").unlink()
    (unsupported / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "dynamic",
                                                                                      "factor": 2.0}}))
    for command in (["up", "--mode", "colocated", "--port", "0"], ["serve", "--port", "0"]):
        missing = _pdd(*command, "--model", "acme/not-here")
        assert missing.returncode != 0 and "acme/not-here" in missing.stderr, missing.stderr
        assert str(synth["hf_home"]) in missing.stderr and "Traceback" not in missing.stderr
        refused = _pdd(*command, "--model", str(unsupported))
        assert refused.returncode != 0 and "`rope_parameters.rope_type`" in refused.stderr, refused.stderr
        assert "'dynamic'" in refused.stderr and "Traceback" not in refused.stderr


def _pdd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdd.cli", *args], capture_output=True, text=True, timeout=60)
