#!/usr/bin/env bash
# Set up, check the code (lint, format, types, layering: seconds), then run the whole test suite,
# the vLLM backend's tests included: PDD_VLLM=0 leaves vLLM uninstalled and its tests out (a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PDD_VLLM=${PDD_VLLM:-1}
scripts/setup.sh
# Debian's packages that tests run: a real Prometheus and its promtool (the monitoring files),
# systemd-analyze (the units), ping (the namespace lab's delayed line), libibverbs1 (the
# transfer engine's). Installed as root where
# missing; elsewhere those tests skip (and a skip fails CI).
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v ping >/dev/null || missing+=(iputils-ping)
# the Mooncake Transfer Engine (the mooncake extra) loads libibverbs even over TCP
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
fi
.venv/bin/ruff check pdd tests scripts
.venv/bin/ruff format --check pdd
.venv/bin/mypy pdd
.venv/bin/lint-imports
# two workers (PDD_TEST_WORKERS), a test module each at a time: most of the suite waits on its
# deployments' timers and lines, not on the cores (BENCHMARKS.md, "The suite's time"); the
# slowest tests are listed at the end: where the suite's time goes, run by run
exec .venv/bin/python -m pytest -n "${PDD_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
