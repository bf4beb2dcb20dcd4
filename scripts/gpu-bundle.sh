#!/usr/bin/env bash
# Builds the GPU bundle: everything a GPU machine without Rust (and without network) needs to
# run gpu/run_all.sh — the release library, the release stepalloc-stress, the Rust test
# binaries that exercise the CUDA backend, the C ABI test programs, the Python package (with
# the colocated-loop example), the gpu/ scripts, the trace the run replays and stepalloc.fit's
# recordings of the end-to-end loops (fit/, made here with torch and transformers) — in one folder
# of at most 40 MiB with a MANIFEST.json (files, sizes, sha256, git commit, the glibc /
# libstdc++ symbol versions the binaries need, checked against Ubuntu 24.04's; see
# scripts/gpu_manifest.py).
#
# Usage: scripts/gpu-bundle.sh [OUTDIR]   (default target/gpu-bundle; a new or empty folder or an
#        earlier bundle, emptied first)
# Then, on the GPU machine: OUTDIR/gpu/run_all.sh OUTDIR "$OUT"
# Needs: cargo, cc, c++, python3, objdump, strip; torch and transformers for fit/ (without them the
# bundle has no recordings, said so; they record over testdrv's stand-in, built when missing). Exit status non-zero on any failure,
# including a bundle over STEPALLOC_BUNDLE_LIMIT_MIB (40) or a binary needing a newer glibc.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$ROOT/target/gpu-bundle}
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # relative to the caller, not to ROOT
cd "$ROOT"
LIMIT_MIB=${STEPALLOC_BUNDLE_LIMIT_MIB:-40}
# The folder is emptied first: only a new or empty folder, or an earlier bundle, is accepted.
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && [ ! -f "$OUT/MANIFEST.json" ]; then
    echo "error: bundle folder $OUT is not empty and holds no earlier bundle (no MANIFEST.json); it would be emptied, so it is refused" >&2
    exit 2
fi
for tool in cargo cc c++ python3 objdump strip; do
    command -v "$tool" > /dev/null || { echo "error: $tool not found; gpu-bundle.sh needs cargo, cc, c++, python3, objdump, strip" >&2; exit 2; }
done

echo "== release library and stepalloc-stress"
cargo build --release -p stepalloc-cabi -p stepalloc-stress

echo "== Rust test binaries that exercise the CUDA backend"
# `cargo test --no-run --message-format=json` names each test executable it built; --workspace,
# as scripts/test.sh builds them, so nothing is compiled twice.
TESTS_JSON=$(cargo test --workspace --no-run --message-format=json)
test_executable() { # TARGET-NAME KIND -> the path of that test executable
    python3 -c '
import json, sys
name, kind = sys.argv[1], sys.argv[2]
paths = set()
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable") \
            and t.get("name") == name and kind in t.get("kind", []):
        paths.add(m["executable"])
if len(paths) != 1:
    sys.exit(f"gpu-bundle.sh: expected one test executable for {kind} target {name}, cargo built {sorted(paths)}")
print(paths.pop())' "$1" "$2" <<< "$TESTS_JSON"
}
LIB_TESTS=$(test_executable stepalloc lib)
RANDOM_CUDA=$(test_executable random_cuda test)

rm -rf "$OUT"
mkdir -p "$OUT"/{lib,bin,testbin,python,gpu,scripts,traces,cabi/include,cabi/tests/c}
strip -o "$OUT/lib/libstepalloc.so" target/release/libstepalloc.so
strip -o "$OUT/bin/stepalloc-stress" target/release/stepalloc-stress
# backend::cuda tests of the core (filter backend::cuda) and the random workload on CUDA.
strip -o "$OUT/testbin/stepalloc-lib-tests" "$LIB_TESTS"
strip -o "$OUT/testbin/random_cuda" "$RANDOM_CUDA"

echo "== C ABI test programs (prebuilt: the GPU machine may have no compiler)"
cc -std=gnu11 -O1 -pthread -Icabi/include cabi/tests/c/abi_test.c -o "$OUT/bin/abi_test" -ldl
c++ -std=c++17 -O1 -pthread -Icabi/include cabi/tests/c/torch_caller.cpp -o "$OUT/bin/torch_caller" -ldl
strip "$OUT/bin/abi_test" "$OUT/bin/torch_caller"
cp cabi/include/stepalloc.h "$OUT/cabi/include/"
cp cabi/tests/c/*.c cabi/tests/c/*.h cabi/tests/c/*.cpp "$OUT/cabi/tests/c/"

echo "== Python package, gpu/ scripts, trace"
mkdir -p "$OUT/python/stepalloc" "$OUT/python/examples"
# oom_error.cpp: compiled on first use so that out-of-memory raises torch.OutOfMemoryError.
cp python_shim/stepalloc/*.py python_shim/stepalloc/py.typed python_shim/stepalloc/oom_error.cpp "$OUT/python/stepalloc/"
# stepalloc.fit: its target model (_kernels.py) is what gpu/e2e_predict.py compares on the GPU.
mkdir -p "$OUT/python/stepalloc/fit/configs"
cp python_shim/stepalloc/fit/*.py "$OUT/python/stepalloc/fit/"
cp python_shim/stepalloc/fit/configs/*.json "$OUT/python/stepalloc/fit/configs/"
# The colocated loop, run end to end by gpu/sleep_check.py.
cp python_shim/examples/colocated_loop.py "$OUT/python/examples/"
cp gpu/*.py gpu/*.sh "$OUT/gpu/"
# The colocated cost model's constants, which gpu/switch_costs.py sets beside its measurements.
mkdir -p "$OUT/model"
cp stress/src/workload/colocated/cost.rs src/backend/sim.rs src/config.rs "$OUT/model/"
cp scripts/cuda_matches_sim.py scripts/gpu_manifest.py "$OUT/scripts/"
cp stress/tests/data/model_vlm_agent.jsonl "$OUT/traces/"
# torch_memory_saver's wheel (abi3, CUDA 12 and 13), which gpu/sleep_check.py runs beside
# stepalloc where it loads: from STEPALLOC_TMS_WHEEL, else from PyPI; without either, a note.
mkdir -p "$OUT/wheels"
if [ -n "${STEPALLOC_TMS_WHEEL:-}" ]; then
    cp "$STEPALLOC_TMS_WHEEL" "$OUT/wheels/"
elif ! timeout 120 python3 -m pip download --quiet --timeout 20 --retries 1 --no-deps --only-binary :all: --platform manylinux2014_x86_64 \
        --python-version 3.10 -d "$OUT/wheels" torch_memory_saver==0.0.10 > /dev/null 2>&1; then
    echo "note: torch_memory_saver's wheel could not be fetched (set STEPALLOC_TMS_WHEEL); the GPU run skips it"
fi
echo "== stepalloc.fit's recordings of the end-to-end loops (the prediction beside the measurement)"
# Recorded here, not on the GPU: a 7 B loop takes about 70 s of one CPU (1.3 MB gzipped). Kept in
# target/fit-cache under a key of their inputs (gpu/e2e_predict.py), so a rebuild reuses them.
# STEPALLOC_BUNDLE_FIT_SIZES: the sizes (default: the two a GPU runs and their dry-run twins).
FIT_SIZES=${STEPALLOC_BUNDLE_FIT_SIZES-7b full tiny7b tiny}
mkdir -p "$OUT/fit"
if [ -z "$FIT_SIZES" ]; then
    echo "note: STEPALLOC_BUNDLE_FIT_SIZES is empty: no recording; the GPU run prints no prediction"
elif ! python3 -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("transformers")))'; then
    echo "note: torch and transformers are not installed here: no recording; the GPU run prints no prediction"
else
    [ -f target/hostcuda/runtime/libcudart.so.13 ] || testdrv/build.sh > /dev/null
    fit_args=()
    for size in $FIT_SIZES; do fit_args+=(--size "$size"); done
    python3 gpu/e2e_predict.py record "${fit_args[@]}" --out "$OUT/fit" --cache target/fit-cache
fi
cat > "$OUT/README.txt" <<'EOF'
stepalloc GPU bundle (built by scripts/gpu-bundle.sh; see MANIFEST.json).
Run on the GPU machine, no Rust needed:   gpu/run_all.sh . "$OUT"   (within 470 s, about 8 minutes)
Stages, most valuable figures first (a stage the time budget cuts off is skipped and says so):
  1. the 7 B comparison (gpu/e2e_compare.py --size 7b): a LLaVA-1.5-7B-shaped model, random bf16
     weights made on the device, batch 2, under PyTorch, stepalloc, expandable segments and
     stepalloc.mempool(): peaks, step times, the largest batch that fits the device, and the
     answer to "does it fit under stepalloc where it runs out of memory under PyTorch?"; full
     fine-tuning where its state fits 75% of the device (H100 80 GB, H200), else LoRA
  2. sleep and wake (gpu/sleep_check.py): pause/resume against a pinned copy_(), the colocated
     loop with a 7 B engine and trainer against the pinned-copy floor, and the switch's
     component costs (gpu/switch_costs.py) beside the cost model's constants (model/*.rs)
  3. validation (gpu/validate.sh), 4. the CUDA backend checks, 5. CUDA IPC with stock PyTorch,
  6. the 1.4 B comparison with its snapshot replay (with what is left)
Both comparisons print the prediction made on the CPU beside the measured peak reserved (the
loop recorded by stepalloc.fit when this bundle was built: fit/, replayed at this device's
memory) and what it assumes measured here: memory outside PyTorch, the SDPA backend of each
attention call, the attention backward's scratch.
Output: $OUT/summary.txt and $OUT/summary.json (every check, both comparison tables, the
sleep/wake figures), logs under $OUT/validate, $OUT/checks, $OUT/e2e_7b and $OUT/e2e.
Budgets: STEPALLOC_RUN_BUDGET (470), STEPALLOC_E2E7B_BUDGET (240), STEPALLOC_VALIDATE_BUDGET (150).
Runtime: MANIFEST.json "runtime_needs" (glibc / libstdc++ symbol versions), checked against
"target_runtime" when the bundle was built.
EOF
python3 scripts/gpu_manifest.py write "$OUT" --limit-mib "$LIMIT_MIB"
