#!/usr/bin/env bash
# The whole GPU run from a bundle (scripts/gpu-bundle.sh), in one call, without cargo:
#   0. the bundle's MANIFEST.json checked (files, hashes, glibc needs)
#   1. gpu/validate.sh on the bundle's library: symbols, capture probe, cuda_smoke, torch_check,
#      the prebuilt C ABI programs and Rust CUDA test binaries
#   2. checks on the CUDA backend with the bundle's stepalloc-stress: a model trace replayed on
#      backend:cuda gives the simulated device's peaks; the random workload with device tags
#   2b. gpu/ipc_check.py: a CUDA tensor shared between stepalloc and stock-PyTorch processes and
#      back, bytes compared, plain and expandable segments (over testdrv with its stub runtime,
#      gpu/testdrv_env.py)
#   2c. gpu/sleep_check.py: stepalloc.pause / resume under PyTorch against a pinned copy_() of the
#      same bytes (GiB/s, share of copy_'s), data_ptr and bytes kept, memory given back, a CUDA
#      graph captured before a pause replayed after the resume, the colocated-loop example, and
#      torch_memory_saver on the same tensors where it imports (OUT/checks/sleep.json, sleep.txt;
#      small sizes over testdrv, whose stub runtime its children preload)
#   3. gpu/e2e_compare.py: the end-to-end comparison on a 1.4 B multimodal model (a CPU dry run
#      with a tiny model when no GPU is there)
#   4. gpu/summarize.py: OUT/summary.json and OUT/summary.txt (printed at the end)
# Every step runs under `timeout`; the whole run stays within STEPALLOC_RUN_BUDGET seconds
# (default 470, under 8 minutes). Without a GPU, point LD_LIBRARY_PATH at testdrv's host-memory
# driver to run the driver-level steps (scripts/test.sh does).
#
# Usage: gpu/run_all.sh [BUNDLE [OUT]]   (BUNDLE: default the folder above this script;
#        OUT: default $OUT, the folder a GPU run brings back). Exit status 0 when no check failed
#        and every configuration of the comparison ran (missed targets are reported, not failed).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUNDLE=${1:-$HERE/..}
OUT_DIR=${2:-${OUT:-}}
if [ ! -d "$BUNDLE" ] || [ ! -f "$BUNDLE/lib/libstepalloc.so" ]; then
    echo "error: $BUNDLE is not a GPU bundle (no lib/libstepalloc.so); build one with scripts/gpu-bundle.sh" >&2
    exit 2
fi
if [ -z "$OUT_DIR" ]; then
    echo "error: no output folder: give it as the second argument or set \$OUT" >&2
    exit 2
fi
BUNDLE=$(cd "$BUNDLE" && pwd)
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
START=$(date +%s)
TOTAL=${STEPALLOC_RUN_BUDGET:-470}
VALIDATE_BUDGET=${STEPALLOC_VALIDATE_BUDGET:-170}
case "$TOTAL$VALIDATE_BUDGET" in *[!0-9]*)
    echo "error: STEPALLOC_RUN_BUDGET=$TOTAL / STEPALLOC_VALIDATE_BUDGET=$VALIDATE_BUDGET must be whole seconds" >&2; exit 2 ;;
esac
PYTHON=$(command -v python3 || true)
[ -n "$PYTHON" ] || { echo "error: python3 is required" >&2; exit 2; }
export STEPALLOC_LIBRARY="$BUNDLE/lib/libstepalloc.so" STEPALLOC_STRESS="$BUNDLE/bin/stepalloc-stress"
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(elapsed) )); }
CHECKS="$OUT_DIR/checks"
mkdir -p "$CHECKS"
: > "$CHECKS/results"
result() { echo "RESULT $*" | tee -a "$CHECKS/results"; }

echo "== 0. bundle ($BUNDLE)"
if timeout 60 "$PYTHON" "$BUNDLE/scripts/gpu_manifest.py" check "$BUNDLE" > "$CHECKS/manifest.log" 2>&1; then
    result "PASS bundle_manifest $(tail -n 1 "$CHECKS/manifest.log")"
else
    cat "$CHECKS/manifest.log"
    result "FAIL bundle_manifest (see checks/manifest.log)"
fi

echo "== 1. validation (gpu/validate.sh, at most ${VALIDATE_BUDGET}s)"
STEPALLOC_GPU_BUDGET=$VALIDATE_BUDGET timeout -k 10 $((VALIDATE_BUDGET + 40)) \
    "$BUNDLE/gpu/validate.sh" "$STEPALLOC_LIBRARY" "$OUT_DIR" > "$OUT_DIR/validate.log" 2>&1
echo "validate.sh: status $?, $(elapsed)s since start; $(tail -n 1 "$OUT_DIR/validate/summary.txt" 2> /dev/null)"

echo "== 2. CUDA backend checks with the bundle's stepalloc-stress"
if "$PYTHON" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' > /dev/null 2>&1; then
    timeout -k 5 90 "$PYTHON" "$BUNDLE/scripts/cuda_matches_sim.py" "$STEPALLOC_STRESS" \
        "$BUNDLE/traces/model_vlm_agent.jsonl" > "$CHECKS/cuda_matches_sim.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        result "PASS cuda_matches_sim $(tail -n 1 "$CHECKS/cuda_matches_sim.log")"
    else
        tail -n 20 "$CHECKS/cuda_matches_sim.log"
        result "FAIL cuda_matches_sim status $rc (see checks/cuda_matches_sim.log)"
    fi
    timeout -k 5 90 "$STEPALLOC_STRESS" random --backend cuda --threads 2 --streams 2 --ops 2000 \
        --compare pytorch pytorch_expandable stepalloc > "$CHECKS/random_cuda.log" 2>&1
    rc=$?
    tags=$(grep -c ' 0 corrupted tags of [1-9][0-9]* tagged blocks' "$CHECKS/random_cuda.log")
    if [ $rc -eq 0 ] && [ "$tags" = 3 ]; then
        result "PASS random_cuda 3 configurations, 0 corrupted tags, no overlap"
    else
        tail -n 8 "$CHECKS/random_cuda.log"
        result "FAIL random_cuda status $rc, $tags of 3 configurations with intact tags (see checks/random_cuda.log)"
    fi
else
    result "SKIP cuda_matches_sim no CUDA driver library (libcuda.so.1) loads here"
    result "SKIP random_cuda no CUDA driver library (libcuda.so.1) loads here"
fi

echo "== 2b. CUDA IPC between stepalloc and stock PyTorch (gpu/ipc_check.py)"
timeout -k 5 150 "$PYTHON" "$BUNDLE/gpu/ipc_check.py" --json "$CHECKS/ipc_check.json" > "$CHECKS/ipc_check.log" 2>&1
rc=$?
grep -E '^RESULT ' "$CHECKS/ipc_check.log" | sed 's/^RESULT //' | while read -r line; do result "$line"; done
if [ $rc -ne 0 ] && ! grep -q '^RESULT FAIL' "$CHECKS/ipc_check.log"; then
    tail -n 20 "$CHECKS/ipc_check.log"
    result "FAIL ipc_check status $rc (see checks/ipc_check.log)"
fi

echo "== 2c. sleep and wake under PyTorch (gpu/sleep_check.py; $(elapsed)s since start)"
timeout -k 5 150 "$PYTHON" "$BUNDLE/gpu/sleep_check.py" --budget 140 --json "$CHECKS/sleep.json" \
    > "$CHECKS/sleep_check.log" 2>&1
rc=$?
grep -E '^RESULT ' "$CHECKS/sleep_check.log" | sed 's/^RESULT //' | while read -r line; do result "$line"; done
if [ $rc -ne 0 ] && ! grep -q '^RESULT FAIL' "$CHECKS/sleep_check.log"; then
    tail -n 20 "$CHECKS/sleep_check.log"
    result "FAIL sleep_check status $rc (see checks/sleep_check.log)"
fi

E2E_LEFT=$(( $(left) - 20 ))
echo "== 3. end-to-end comparison (at most ${E2E_LEFT}s; $(elapsed)s since start)"
if [ "$E2E_LEFT" -lt 30 ]; then
    result "SKIP e2e the time budget (${TOTAL}s) is spent"
else
    timeout -k 10 $((E2E_LEFT + 10)) "$PYTHON" "$BUNDLE/gpu/e2e_compare.py" --out "$OUT_DIR/e2e" \
        --budget "$E2E_LEFT" --stress "$STEPALLOC_STRESS" > "$OUT_DIR/e2e.log" 2>&1
    rc=$?
    tail -n 40 "$OUT_DIR/e2e.log"
    if [ $rc -eq 0 ]; then
        result "PASS e2e every configuration ran"
    else
        result "FAIL e2e status $rc (see e2e.log)"
    fi
fi

echo "== 4. summary ($(elapsed)s since start)"
timeout 60 "$PYTHON" "$BUNDLE/gpu/summarize.py" "$OUT_DIR" --bundle "$BUNDLE" --seconds "$(elapsed)"
