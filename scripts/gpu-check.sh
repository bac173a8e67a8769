#!/usr/bin/env bash
# pdd's checks for a lent GPU machine (scripts/gpu_check.py says what each one does): one
# PASS / FAIL / SKIP line per check, exit 1 on any FAIL. Without CUDA it runs what it can
# and says what it skipped. `--only ab` runs those checks alone; PDD_GPU_CHECK_INJECT=logit-offset
# (check a), corrupt-page (b), lost-slice (e) or stale-piece (f) plants a fault its check must FAIL on, CPU too. pdd runs from
# source; the wheels scripts/gpu-wheels.sh put in .gpu-wheels/ are installed into a temporary
# folder when this python lacks their modules.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
modules=fastapi,uvicorn,pydantic,msgspec,tomli_w,cryptography,simpy
if [ -d .gpu-wheels ] && ! "$PY" -c "import $modules" 2>/dev/null; then
  echo "gpu-check: installing .gpu-wheels/ (this python lacks one of $modules)"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu-wheels/*.whl
fi
export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH}
"$PY" scripts/gpu_check.py "$@"
