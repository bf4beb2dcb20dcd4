#!/usr/bin/env bash
# The whole GPU run from a bundle (scripts/gpu-bundle.sh), in one call, without cargo. The
# stages run most valuable figures first, so that what the time budget cuts off is what earlier
# runs already answered; a stage that starts with too little time left is skipped with the
# reason. Times are estimates for an H100 / H200: the H200 run of 2026-12-04 (docs/performance.md)
# had 1.4 B steps of 1.5-2.1 s and its PyTorch runs stopped after 4 of 6 iterations at a 420 s
# budget, so the 1.4 B comparison alone wants about 250 s; a 7 B step at batch 2 is about 5x
# the FLOPs a token at half the batch (2-3 s), a 7 B process about 15 s to start and make its
# 13.2 GiB of weights on the device, 4 iterations and 2-3 headroom probes about 30 s more:
#   0. the bundle's MANIFEST.json checked (files, hashes, glibc needs)                  ~1 s
#   1. gpu/e2e_compare.py --size 7b: the 7 B LLaVA-style agent loop (13.2 GiB of bf16
#      weights made on the device) under PyTorch, stepalloc, expandable segments and
#      stepalloc.mempool(), in that order: peaks, step times, the largest batch that fits
#      the device (at most STEPALLOC_E2E7B_BUDGET, default 240 s: PyTorch's and stepalloc's
#      runs about 65 s each, the others about 45 s; one left no time is skipped, said so);
#      beside each measured peak reserved, the prediction made on the CPU (the same loop
#      recorded by stepalloc.fit when the bundle was built, fit/, replayed at this device's
#      memory: ~2 s) and what it assumes, measured (gpu/e2e_predict.py)
#   2. gpu/sleep_check.py: stepalloc.pause / resume under PyTorch against a pinned copy_() of
#      the same bytes (GiB/s, share of copy_'s), data_ptr and bytes kept, memory given back, a
#      CUDA graph captured before a pause replayed after the resume, the colocated-loop
#      example, the switch's component costs on the device beside the cost model's
#      constants, the colocated loop with a 7 B engine and trainer against the pinned-copy
#      floor, and torch_memory_saver on the same tensors where it imports (OUT/checks/
#      sleep.json, sleep.txt; small sizes over testdrv, whose stub runtime its children
#      preload)                               ~90 s on a GPU (an estimate), at most 150 s
#   3. gpu/validate.sh on the bundle's library: symbols, capture probe, cuda_smoke,
#      torch_check, the prebuilt C ABI programs and Rust CUDA test binaries (at most
#      STEPALLOC_VALIDATE_BUDGET, default 150 s, less when less is left)
#   4. checks on the CUDA backend with the bundle's stepalloc-stress: a model trace replayed on
#      backend:cuda gives the simulated device's peaks; the random workload with device tags
#      (~20 s)
#   5. gpu/ipc_check.py: a CUDA tensor shared between stepalloc and stock-PyTorch processes and
#      back, bytes compared, plain and expandable segments (over testdrv with its stub runtime,
#      gpu/testdrv_env.py)                                                           ~30 s
#  5b. gpu/graph_pool_check.py: CUDA-graph pool checkpoints (the bindings, torch.compile's
#      cudagraphs backend) and NCCL pool registration on a one-rank group, under stock PyTorch
#      and under stepalloc, answers compared                                         ~40 s
#   6. gpu/e2e_compare.py: the 1.4 B comparison, the replay of its snapshot and the prediction
#      (what is left; skipped under 90 s: its figures are on record from the H200 run)
#   7. gpu/summarize.py: OUT/summary.json and OUT/summary.txt (printed at the end)
# A CPU dry run (no GPU) runs both comparisons at their tiny sizes (tiny7b, tiny) through the
# same code. Every step runs under `timeout`; the whole run stays within STEPALLOC_RUN_BUDGET
# seconds (default 470, under 8 minutes; 900 over testdrv, STEPALLOC_HOSTCUDA=1, where the sleep
# stage may take 300 s). Without a GPU, point LD_LIBRARY_PATH at testdrv's host-memory driver to
# run the driver-level steps (scripts/test.sh does).
#
# Usage: gpu/run_all.sh [BUNDLE [OUT]]   (BUNDLE: default the folder above this script;
#        OUT: default $OUT, the folder a GPU run brings back). Exit status 0 when no check failed
#        and the comparisons that ran ran every configuration (missed targets are reported, not
#        failed).
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
# Over testdrv's host-memory driver (the CPU dry run) every queued operation waits
# HOSTCUDA_DELAY_US and torch runs on the CPU: the stages take longer there, and the budget is
# a GPU's only on a GPU.
HOST_DRIVER=0
case "${STEPALLOC_HOSTCUDA:-0}" in ""|0) ;; *) HOST_DRIVER=1 ;; esac
TOTAL=${STEPALLOC_RUN_BUDGET:-$([ $HOST_DRIVER = 1 ] && echo 900 || echo 470)}
VALIDATE_BUDGET=${STEPALLOC_VALIDATE_BUDGET:-150}
E2E7B_BUDGET=${STEPALLOC_E2E7B_BUDGET:-240}
case "$TOTAL$VALIDATE_BUDGET$E2E7B_BUDGET" in *[!0-9]*)
    echo "error: STEPALLOC_RUN_BUDGET=$TOTAL / STEPALLOC_VALIDATE_BUDGET=$VALIDATE_BUDGET /" \
        "STEPALLOC_E2E7B_BUDGET=$E2E7B_BUDGET must be whole seconds" >&2; exit 2 ;;
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
# bounded LIMIT: LIMIT seconds, or less when less is left (15 s kept for the summary).
bounded() { local l=$(( $(left) - 15 )); echo $(( $1 < l ? $1 : l )); }

echo "== 0. bundle ($BUNDLE)"
if timeout 60 "$PYTHON" "$BUNDLE/scripts/gpu_manifest.py" check "$BUNDLE" > "$CHECKS/manifest.log" 2>&1; then
    result "PASS bundle_manifest $(tail -n 1 "$CHECKS/manifest.log")"
else
    cat "$CHECKS/manifest.log"
    result "FAIL bundle_manifest (see checks/manifest.log)"
fi

echo "== 1. end-to-end comparison at 7 B (gpu/e2e_compare.py --size 7b, at most ${E2E7B_BUDGET}s)"
comparison() {  # NAME OUT_SUBDIR BUDGET SIZE
    timeout -k 10 $(($3 + 10)) "$PYTHON" "$BUNDLE/gpu/e2e_compare.py" --out "$OUT_DIR/$2" --size "$4" \
        --budget "$3" --stress "$STEPALLOC_STRESS" > "$OUT_DIR/$2.log" 2>&1
    rc=$?
    tail -n 40 "$OUT_DIR/$2.log"
    if [ $rc -eq 0 ]; then
        result "PASS $1 $(grep -E '^e2e: ' "$OUT_DIR/$2.log" | tail -n 1 | cut -c6-200)"
    else
        result "FAIL $1 status $rc (see $2.log)"
    fi
}
comparison e2e_7b e2e_7b "$(bounded "$E2E7B_BUDGET")" 7b

SLEEP_LIMIT=$(bounded $([ $HOST_DRIVER = 1 ] && echo 300 || echo 150))
echo "== 2. sleep and wake under PyTorch (gpu/sleep_check.py, at most ${SLEEP_LIMIT}s; $(elapsed)s since start)"
timeout -k 5 "$SLEEP_LIMIT" "$PYTHON" "$BUNDLE/gpu/sleep_check.py" --budget $((SLEEP_LIMIT - 10)) \
    --json "$CHECKS/sleep.json" > "$CHECKS/sleep_check.log" 2>&1
rc=$?
grep -E '^RESULT ' "$CHECKS/sleep_check.log" | sed 's/^RESULT //' | while read -r line; do result "$line"; done
if [ $rc -ne 0 ] && ! grep -q '^RESULT FAIL' "$CHECKS/sleep_check.log"; then
    tail -n 20 "$CHECKS/sleep_check.log"
    result "FAIL sleep_check status $rc (see checks/sleep_check.log)"
fi

# What is left after the stages below, at their usual times, bounds the validation.
VALIDATE_BUDGET=$(( VALIDATE_BUDGET < $(left) - 80 ? VALIDATE_BUDGET : $(left) - 80 ))
[ "$VALIDATE_BUDGET" -ge 30 ] || VALIDATE_BUDGET=30  # its steps skip themselves when it is spent
echo "== 3. validation (gpu/validate.sh, at most ${VALIDATE_BUDGET}s; $(elapsed)s since start)"
STEPALLOC_GPU_BUDGET=$VALIDATE_BUDGET timeout -k 10 $((VALIDATE_BUDGET + 40)) \
    "$BUNDLE/gpu/validate.sh" "$STEPALLOC_LIBRARY" "$OUT_DIR" > "$OUT_DIR/validate.log" 2>&1
echo "validate.sh: status $?, $(elapsed)s since start; $(tail -n 1 "$OUT_DIR/validate/summary.txt" 2> /dev/null)"

echo "== 4. CUDA backend checks with the bundle's stepalloc-stress ($(elapsed)s since start)"
if [ "$(bounded 90)" -lt 10 ]; then
    result "SKIP cuda_matches_sim the time budget (${TOTAL}s) is spent"
    result "SKIP random_cuda the time budget (${TOTAL}s) is spent"
elif "$PYTHON" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' > /dev/null 2>&1; then
    timeout -k 5 "$(bounded 90)" "$PYTHON" "$BUNDLE/scripts/cuda_matches_sim.py" "$STEPALLOC_STRESS" \
        "$BUNDLE/traces/model_vlm_agent.jsonl" > "$CHECKS/cuda_matches_sim.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        result "PASS cuda_matches_sim $(tail -n 1 "$CHECKS/cuda_matches_sim.log")"
    else
        tail -n 20 "$CHECKS/cuda_matches_sim.log"
        result "FAIL cuda_matches_sim status $rc (see checks/cuda_matches_sim.log)"
    fi
    timeout -k 5 "$(bounded 90)" "$STEPALLOC_STRESS" random --backend cuda --threads 2 --streams 2 --ops 2000 \
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

echo "== 5. CUDA IPC between stepalloc and stock PyTorch (gpu/ipc_check.py; $(elapsed)s since start)"
if [ "$(bounded 150)" -lt 20 ]; then
    echo "RESULT SKIP ipc_check the time budget (${TOTAL}s) is spent" > "$CHECKS/ipc_check.log"
    rc=0
else
    timeout -k 5 "$(bounded 150)" "$PYTHON" "$BUNDLE/gpu/ipc_check.py" --json "$CHECKS/ipc_check.json" \
        > "$CHECKS/ipc_check.log" 2>&1
    rc=$?
fi
grep -E '^RESULT ' "$CHECKS/ipc_check.log" | sed 's/^RESULT //' | while read -r line; do result "$line"; done
if [ $rc -ne 0 ] && ! grep -q '^RESULT FAIL' "$CHECKS/ipc_check.log"; then
    tail -n 20 "$CHECKS/ipc_check.log"
    result "FAIL ipc_check status $rc (see checks/ipc_check.log)"
fi

echo "== 5b. CUDA-graph pool checkpoints and NCCL pool registration beside stock PyTorch (gpu/graph_pool_check.py; $(elapsed)s since start)"
if [ "$(bounded 120)" -lt 30 ]; then
    echo "RESULT SKIP graph_pool_check the time budget (${TOTAL}s) is spent" > "$CHECKS/graph_pool_check.log"
    rc=0
else
    timeout -k 5 "$(bounded 120)" "$PYTHON" "$BUNDLE/gpu/graph_pool_check.py" --json "$CHECKS/graph_pool_check.json" \
        > "$CHECKS/graph_pool_check.log" 2>&1
    rc=$?
fi
grep -E '^RESULT ' "$CHECKS/graph_pool_check.log" | sed 's/^RESULT //' | while read -r line; do result "$line"; done
if [ $rc -ne 0 ] && ! grep -q '^RESULT FAIL' "$CHECKS/graph_pool_check.log"; then
    tail -n 20 "$CHECKS/graph_pool_check.log"
    result "FAIL graph_pool_check status $rc (see checks/graph_pool_check.log)"
fi

E2E_LEFT=$(( $(left) - 20 ))
echo "== 6. end-to-end comparison at 1.4 B (at most ${E2E_LEFT}s; $(elapsed)s since start)"
if [ "$E2E_LEFT" -lt 90 ]; then
    result "SKIP e2e the time budget (${TOTAL}s) is spent: ${E2E_LEFT}s left"
else
    comparison e2e e2e "$E2E_LEFT" full
fi

echo "== 7. summary ($(elapsed)s since start)"
timeout 60 "$PYTHON" "$BUNDLE/gpu/summarize.py" "$OUT_DIR" --bundle "$BUNDLE" --seconds "$(elapsed)"
