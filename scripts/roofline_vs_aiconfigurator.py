"""pdd's step model (`pdd.perf.physics`, the roofline) against NVIDIA AIConfigurator's
estimate from its measured per-operation databases, for the same chip, model, batch and
context: a decode step of a batch at a context, and a prefill of one prompt. Prints a
table and the error of each row; BENCHMARKS.md records it.

    PYTHONPATH=$PWD .venv/bin/python scripts/roofline_vs_aiconfigurator.py

Needs the `plan` extra (`pip install -e .[plan]`: aiconfigurator-core). Both sides run
vLLM's layout: tensor parallelism over the instance, MLA's latent on every rank (`tp`),
the experts spread over all its GPUs, BF16 KV and attention.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdd.names import AttentionLayout
from pdd.perf.hardware import CHIPS
from pdd.perf.hf_model import shape_from_config
from pdd.perf.physics import Physics
from pdd.perf.steps import chunk_load

# (AIConfigurator's model, its system, pdd's chip, GPUs)
CASES = [
    ("deepseek-ai/DeepSeek-V3", "h200_sxm", "H200", 8),
    ("deepseek-ai/DeepSeek-V3", "h100_sxm", "H100", 8),
    ("meta-llama/Meta-Llama-3.1-70B", "h200_sxm", "H200", 4),
    ("meta-llama/Meta-Llama-3.1-70B", "h100_sxm", "H100", 4),
]
DECODE = [(1, 4096), (16, 4096), (64, 4096), (16, 32768), (64, 32768)]  # (batch, context)
PREFILL = [2048, 8192, 16384]  # one prompt, one chunk


def main() -> int:
    try:
        import aiconfigurator_core
        from aiconfigurator_core.sdk.engine import EngineHandle
    except ImportError:
        print("needs the plan extra: pip install -e .[plan]", file=sys.stderr)
        return 2
    configs = Path(aiconfigurator_core.__file__).parent / "model_configs"
    print("| model | chip | GPUs | step | batch | context | pdd ms | AIConfigurator ms | pdd / AIC - 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_path, system, chip, gpus in CASES:
        config = json.loads((configs / f"{model_path.replace('/', '--')}_config.json").read_text())
        shape = shape_from_config(config, model_path.split("/")[1])
        physics = Physics(CHIPS[chip], shape, gpus, attention=AttentionLayout.TP)
        moe = {"moe_ep_size": gpus, "moe_tp_size": 1} if shape.experts else {}
        aic = EngineHandle.compile(
            model_path,
            system,
            "vllm",
            tp_size=gpus,
            fmha_quant_mode="bfloat16",
            kvcache_quant_mode="bfloat16",
            **moe,
        )
        rows = [("decode", batch, context) for batch, context in DECODE] + [("prefill", 1, n) for n in PREFILL]
        for step, batch, context in rows:
            if step == "decode":
                ours = float(physics.decode_s(batch * context, batch, 1)[0]) * 1000
                theirs = aic.predict_decode_latency(batch, context)
            else:
                ours = physics.step_s(chunk_load(0, context)) * 1000
                theirs = aic.predict_prefill_latency(batch, context)
            print(
                f"| {shape.name} | {chip} | {gpus} | {step} | {batch} | {context:,} | {ours:.1f} | {theirs:.1f} "
                f"| {ours / theirs - 1:+.0%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
