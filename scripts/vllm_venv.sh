#!/usr/bin/env bash
# Makes the environment where vLLM's own sleep-mode allocator runs as the control beside
# stepalloc's (python_shim/tests/test_cumem_port.py, test_vllm_backend.py): vLLM 0.34 needs
# torch 2.14, so it gets a virtual environment of its own (default target/vllm-venv) with
# - torch 2.14 without its CUDA wheels (.ci/pip-light.py; testdrv's stub runtime and driver
#   stand in for CUDA, as for the system torch);
# - vLLM 0.34 from its wheel, without its dependencies (~70 packages, most for serving);
# - only what vLLM's device_allocator (cumem.py, sleep_mode_backend.py) and plugin loader need
#   to import: packaging, regex, psutil, numpy, pyzmq, urllib3.
# scripts/test.sh then writes testdrv's stand-ins for it (scripts/vllm_standins.sh).
# Usage: scripts/vllm_venv.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-target/vllm-venv}
PIP=(-m pip install -q --disable-pip-version-check)
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" .ci/pip-light.py torch==2.14.0
"$VENV/bin/python" "${PIP[@]}" --no-deps vllm==0.34.0 packaging==26.4 regex==2026.12.2 psutil==7.2.2 \
    numpy==2.4.6 pyzmq==27.3.0 urllib3==2.8.0
