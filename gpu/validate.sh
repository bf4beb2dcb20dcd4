#!/usr/bin/env bash
# GPU validation of stepalloc: run once on a machine with an NVIDIA GPU, in the repository
# root or anywhere (it finds the root from its own path). Builds nothing heavy: it uses the
# prebuilt library (default target/release/libstepalloc.so; or pass a path / set
# STEPALLOC_LIB). Needs python3; uses torch, cc/c++ and cargo when present, skips what is
# missing and says so. Bounded: every step runs under `timeout`; about 3-6 minutes in all.
#
# Steps:
#   1. environment: GPU, driver, python, torch, compilers, cargo
#   2. the library exports every symbol PyTorch and the Python package look up
#   3. capture_probe.py: which driver calls are legal during stream capture (open question 1)
#   4. cuda_smoke.py: stepalloc on the CUDA backend without torch
#   5. torch_check.py: process-wide mode under PyTorch; whether an exception thrown from the
#      alloc function leaves the pluggable allocator usable (open question 2); CUDA graphs
#   6. the C / C++ ABI test programs against this library (simulated device, and the threads
#      scenario on backend:cuda when a driver loads), if cc/c++ exist
#   7. the Rust CUDA backend tests (STEPALLOC_GPU_TESTS=1): the prebuilt test binaries of a GPU
#      bundle (scripts/gpu-bundle.sh: testbin/ beside gpu/), else cargo if it and the crates are there
# Ends with a summary; exit status 0 when nothing failed.
#
# Usage: gpu/validate.sh [LIBRARY [OUTPUT_DIR]]. Logs and the summary (summary.txt) go to
# OUTPUT_DIR, else $STEPALLOC_GPU_OUT, else $OUT (the folder a GPU run returns), else a new
# folder under /tmp. Without the library, the steps that need it are skipped with a message and
# the rest (the capture probe) still runs. On a machine without a GPU, point LD_LIBRARY_PATH at
# the host-memory driver (testdrv/build.sh) to run the driver-level steps.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Paths given on the command line are relative to the caller's directory, not to ROOT.
absolute() { case "$1" in /* | "") echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
LIB=$(absolute "${1:-${STEPALLOC_LIB:-}}")
OUT_DIR=$(absolute "${2:-${STEPALLOC_GPU_OUT:-${OUT:-}}}")
cd "$ROOT"
LIB=${LIB:-target/release/libstepalloc.so}
if [ -n "$OUT_DIR" ]; then
    WORK="$OUT_DIR/validate"
    mkdir -p "$WORK"
    WORK=$(cd "$WORK" && pwd)
else
    WORK=$(mktemp -d /tmp/stepalloc-gpu.XXXXXX)
fi
SUMMARY="$WORK/summary"
: > "$SUMMARY"
START=$(date +%s)
# The whole run stays within this many seconds: a step gets at most what is left.
BUDGET=${STEPALLOC_GPU_BUDGET:-450}

section() { printf '\n========== %s ==========\n' "$*"; }
record() { echo "RESULT $*" >> "$SUMMARY"; echo "RESULT $*"; }
# run_step NAME LIMIT_SECONDS COMMAND...: runs under timeout, shows the output, keeps the
# RESULT / ANSWER lines for the summary, and records a failure if the step itself failed.
run_step() {
    local name=$1 limit=$2
    shift 2
    local log="$WORK/$name.log"
    local left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt 30 ]; then
        record "SKIP $name the time budget (${BUDGET}s) is spent"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    cat "$log"
    grep -E '^(RESULT|ANSWER) ' "$log" >> "$SUMMARY"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        record "FAIL $name timed out after ${limit}s"
    elif [ $rc -ne 0 ] && ! grep -q '^RESULT FAIL' "$log"; then
        record "FAIL $name exited with status $rc"
    fi
    echo "# step $name: status $rc, $(( $(date +%s) - START ))s since start"
    return 0
}

section "1. environment"
date -u
uname -a
if command -v nvidia-smi > /dev/null; then
    timeout 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv || true
    timeout 30 nvidia-smi -q | grep -E 'CUDA Version|MIG Mode' -A1 | head -8 || true
else
    echo "nvidia-smi: not found"
fi
PYTHON=$(command -v python3 || true)
echo "python3: ${PYTHON:-not found} $( [ -n "$PYTHON" ] && "$PYTHON" --version 2>&1)"
if [ -n "$PYTHON" ]; then
    timeout 120 "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1
fi
for tool in cc c++ cargo nm; do echo "$tool: $(command -v $tool || echo not found)"; done

section "2. library"
HAVE_LIB=1
if [ ! -f "$LIB" ]; then
    HAVE_LIB=0
    record "FAIL library $LIB not found (build it with: cargo build --release -p stepalloc-cabi); the steps that need it are skipped"
else
    LIB=$(readlink -f "$LIB")
    ls -l "$LIB"
fi
if [ -n "$PYTHON" ] && [ $HAVE_LIB -eq 1 ]; then
    run_step symbols 60 "$PYTHON" - "$LIB" <<'PY'
import ctypes, sys
sys.path.insert(0, "gpu")
from stepalloc_ctypes import EXPORTS, Stepalloc
lib = ctypes.CDLL(sys.argv[1])
missing = [s for s in EXPORTS if not hasattr(lib, s)]
if missing:
    print("RESULT FAIL symbols missing:", " ".join(missing))
    sys.exit(1)
print(f"RESULT PASS symbols all {len(EXPORTS)} exports found; version {Stepalloc(sys.argv[1]).version().decode()}")
PY
elif [ -z "$PYTHON" ]; then
    record "FAIL python3 is required for the GPU checks"
fi

if [ -n "$PYTHON" ]; then
    section "3. driver calls during stream capture (open question 1)"
    run_step capture_probe 120 "$PYTHON" gpu/capture_probe.py

    section "4. stepalloc on the CUDA backend, no torch"
    if [ $HAVE_LIB -eq 1 ]; then
        run_step cuda_smoke 150 "$PYTHON" gpu/cuda_smoke.py "$LIB"
    else
        record "SKIP cuda_smoke no library"
    fi

    section "5. stepalloc under PyTorch (open question 2)"
    if [ $HAVE_LIB -eq 1 ]; then
        run_step torch_check 330 "$PYTHON" gpu/torch_check.py "$LIB"
    else
        record "SKIP torch_check no library"
    fi
fi

section "6. C / C++ ABI programs against this library (simulated device; threads also on CUDA)"
if [ $HAVE_LIB -eq 0 ]; then
    record "SKIP c_abi no library"
elif [ -x bin/abi_test ] && [ -x bin/torch_caller ] || { command -v cc > /dev/null && command -v c++ > /dev/null; }; then
    C_OK=1
    if [ -x bin/abi_test ] && [ -x bin/torch_caller ]; then
        # A GPU bundle carries them prebuilt (the GPU machine may have no compiler).
        echo "C ABI programs: prebuilt in $ROOT/bin"
        cp bin/abi_test bin/torch_caller "$WORK/"
    else
        cc -std=gnu11 -O1 -pthread -Icabi/include cabi/tests/c/abi_test.c -o "$WORK/abi_test" -ldl > "$WORK/cc.log" 2>&1 || C_OK=0
        c++ -std=c++17 -O1 -pthread -Icabi/include cabi/tests/c/torch_caller.cpp -o "$WORK/torch_caller" -ldl >> "$WORK/cc.log" 2>&1 || C_OK=0
    fi
    if [ $C_OK -eq 1 ]; then
        for scenario in threads edge bad_config oom; do
            if timeout 60 "$WORK/abi_test" "$LIB" "$scenario" > "$WORK/c_$scenario.log" 2>&1; then
                record "PASS c_abi_$scenario"
            else
                cat "$WORK/c_$scenario.log"
                record "FAIL c_abi_$scenario (status $?)"
            fi
        done
        # The threads scenario on backend:cuda with real streams, when a driver loads (a GPU's,
        # or testdrv's through LD_LIBRARY_PATH).
        if [ -n "$PYTHON" ] && "$PYTHON" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' > /dev/null 2>&1; then
            if timeout 120 "$WORK/abi_test" "$LIB" threads_cuda > "$WORK/c_threads_cuda.log" 2>&1; then
                record "PASS c_abi_threads_cuda"
            else
                cat "$WORK/c_threads_cuda.log"
                record "FAIL c_abi_threads_cuda (status $?)"
            fi
        else
            record "SKIP c_abi_threads_cuda no CUDA driver library (libcuda.so.1) loads here"
        fi
        if timeout 60 env STEPALLOC_CONF="backend:sim,max_split_size_mb:abc" "$WORK/abi_test" "$LIB" bad_env > "$WORK/c_bad_env.log" 2>&1; then
            record "PASS c_abi_bad_env"
        else
            cat "$WORK/c_bad_env.log"; record "FAIL c_abi_bad_env"
        fi
        if timeout 60 "$WORK/torch_caller" "$LIB" > "$WORK/cxx.log" 2>&1; then
            record "PASS cxx_torch_caller C++ exception through std::function, pool hooks"
        else
            cat "$WORK/cxx.log"; record "FAIL cxx_torch_caller"
        fi
    else
        cat "$WORK/cc.log"
        record "SKIP c_abi the test programs did not compile here (see above)"
    fi
else
    record "SKIP c_abi no cc/c++ on this machine"
fi

section "7. Rust CUDA backend tests"
# judge_rust_tests NAME: PASS / FAIL / SKIP from the log of a libtest run (NAME.log).
judge_rust_tests() {
    local name=$1 log="$WORK/$1.log"
    if grep -q 'test result: ok' "$log" && ! grep -q 'test result: FAILED' "$log"; then
        local skipped ran
        skipped=$(grep -c 'skipped gpu_' "$log")
        ran=$(grep -oE 'test result: ok\. [0-9]+ passed' "$log" | grep -oE '[0-9]+' | awk '{s += $1} END {print s + 0}')
        if [ "$skipped" -gt 0 ] && command -v nvidia-smi > /dev/null; then
            record "FAIL $name $skipped GPU tests skipped themselves on a GPU machine: $(grep -m1 -o 'skipped gpu_.*' "$log")"
        else
            record "PASS $name $ran tests passed, of which $skipped skipped themselves (no GPU)"
        fi
    elif grep -qiE 'offline|failed to download|no matching package|failed to load source' "$log"; then
        sed -i "/^RESULT FAIL $name/d" "$SUMMARY"
        record "SKIP $name cargo cannot build offline here (crates not available)"
    elif ! grep -q "^RESULT FAIL $name" "$SUMMARY"; then
        record "FAIL $name no 'test result: ok' (see the log above)"
    fi
}
FIRST_TEST=backend::cuda::tests::gpu_mem_info_on_an_unused_device_creates_no_context
if [ -x testbin/stepalloc-lib-tests ]; then
    # From a GPU bundle: no cargo needed. The first test needs a device no other test has used,
    # so it runs alone first; one thread (the tests change the driver's settings).
    run_step bundle_gpu_tests 240 sh -c "
        env STEPALLOC_GPU_TESTS=1 testbin/stepalloc-lib-tests --exact $FIRST_TEST --nocapture &&
        env STEPALLOC_GPU_TESTS=1 testbin/stepalloc-lib-tests backend::cuda --skip $FIRST_TEST --nocapture --test-threads=1 &&
        env STEPALLOC_GPU_TESTS=1 testbin/random_cuda --nocapture --test-threads=1"
    judge_rust_tests bundle_gpu_tests
elif command -v cargo > /dev/null && [ "${STEPALLOC_GPU_CARGO:-1}" != 0 ]; then
    run_step cargo_gpu_tests 240 env STEPALLOC_GPU_TESTS=1 cargo test --offline -p stepalloc --lib backend::cuda -- --nocapture --test-threads=1
    judge_rust_tests cargo_gpu_tests
else
    record "SKIP cargo_gpu_tests no cargo here (or STEPALLOC_GPU_CARGO=0), and no bundle test binaries in $ROOT/testbin"
fi

{
section "SUMMARY ($(( $(date +%s) - START ))s)"
grep '^ANSWER ' "$SUMMARY" | sed 's/^ANSWER /  * /'
echo
if [ -f "$WORK/capture_probe.log" ]; then
    echo "  driver calls during stream capture (mode, call, verdict):"
    grep '^CAPTURE ' "$WORK/capture_probe.log" | awk '{printf "    %-20s %-62s %s\n", $2, $3, $NF}'
fi
echo
PASS=$(grep -c '^RESULT PASS' "$SUMMARY")
FAIL=$(grep -c '^RESULT FAIL' "$SUMMARY")
SKIP=$(grep -c '^RESULT SKIP' "$SUMMARY")
grep '^RESULT ' "$SUMMARY" | sed 's/^RESULT /  /'
echo
echo "stepalloc GPU validation: $PASS passed, $FAIL failed, $SKIP skipped (logs in $WORK)"
} | tee "$WORK/summary.txt"
[ "$(grep -c '^RESULT FAIL' "$SUMMARY")" -eq 0 ]
