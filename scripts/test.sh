#!/usr/bin/env bash
# Set up, check the code (lint, format, types, layering: seconds), then run the whole test suite,
# the vLLM backend's tests included: PDD_VLLM=0 leaves vLLM uninstalled and its tests out (a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PDD_VLLM=${PDD_VLLM:-1}
scripts/setup.sh
.venv/bin/ruff check pdd tests scripts
.venv/bin/ruff format --check pdd
.venv/bin/mypy pdd
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
