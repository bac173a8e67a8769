#!/usr/bin/env bash
# Set up, check the code (lint, format, types, layering: seconds), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check pdd tests scripts
.venv/bin/ruff format --check pdd
.venv/bin/mypy pdd
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
