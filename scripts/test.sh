#!/usr/bin/env bash
# Installs everything the tests need (pip packages, redis-server) and runs the whole suite.
# .ci/run calls exactly this script.  pytest's exit 5 (no tests ran) fails here too.
set -euo pipefail
cd "$(dirname "$0")/.."
CARPOOL_EXTRAS=test bash scripts/install.sh
if ! command -v redis-server >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m ruff check --quiet .
python3 -m mypy
python3 -m pytest -q -rfEs "$@"
