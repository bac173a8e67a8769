#!/usr/bin/env bash
# Create .venv and install pdd with its test dependencies (idempotent).
# torch is pinned to 2.13.0: the CPU build of that release is what these machines carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.pdd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch "$stamp"
fi
