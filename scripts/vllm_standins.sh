#!/usr/bin/env bash
# testdrv's stand-ins for the CUDA vendor libraries that vLLM's environment (scripts/vllm_venv.sh)
# links: its torch 2.14's, and the vendor functions vLLM's extensions import beyond them
# (standins.py --extra), in target/hostcuda/standins-vllm; and the drift check of that torch
# against testdrv's stubs. Usage: scripts/vllm_standins.sh [VENV]   (after testdrv/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-target/vllm-venv}
PY="$VENV/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf target/hostcuda/standins-vllm
"$PY" testdrv/torch_drift.py target/hostcuda
"$PY" testdrv/standins.py target/hostcuda/standins-vllm --extra "$SITE"/vllm/*.so > /dev/null
