#!/usr/bin/env bash
# Download the wheels scripts/gpu-check.sh needs on a lent GPU machine into .gpu-wheels/ (ignored).
# That machine has Python 3.12, torch, numpy, safetensors, tokenizers, httpx, rich and pytest but no
# network, and lacks these of pdd's dependencies: they travel as cp312 manylinux wheels, pinned to
# the versions .venv tests with, their own dependencies resolved by pip. (No pytest: what it would
# run there, tests/test_vllm_layouts.py, needs vLLM, which no lent machine has.)
# Everything a device call sends counts against 64 MiB: fail over 60 MiB (9 MiB when this was written).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
packages=(fastapi uvicorn pydantic msgspec tomli-w cryptography simpy)
read -ra pins < <(.venv/bin/python -c \
  'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${packages[@]}")
rm -rf .gpu-wheels
.venv/bin/python -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-wheels "${pins[@]}"
size=$(du -sm .gpu-wheels | cut -f1)
echo "gpu-wheels: $(find .gpu-wheels -name '*.whl' | wc -l) wheels, ${size} MiB in .gpu-wheels/"
if [ "$size" -gt 60 ]; then
  echo "gpu-wheels: over 60 MiB: a device call sends at most 64 MiB, the repository included" >&2
  exit 1
fi
