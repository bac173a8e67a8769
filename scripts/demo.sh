#!/usr/bin/env bash
# Set up, then run the main job: `pdd demo` on the embedded tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pdd demo "$@"
