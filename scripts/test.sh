#!/usr/bin/env bash
# Every test of the project: formatting and lints, the Rust tests of all crates (core, C ABI,
# stress tool), and the Python package's tests against the built library.
# Needs: Rust, cc/c++, python3 with pytest and prometheus_client, Debian's prometheus package.
# No GPU: the CUDA backend runs on the host-memory driver built from testdrv/.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# No two modules use each other (src/, stress/src/, python_shim/stepalloc/), read from the code.
python3 scripts/import_cycles.py
# The documents describe the project as it is: no issue numbers or chronicle words, line limits,
# relative links and anchors that resolve (the checker's own self-test first).
python3 scripts/doc_check.py --self-test
python3 scripts/doc_check.py
# No leftover of a merge or an editor is tracked (*.orig, *.rej, backups, swap files).
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    stray=$(git ls-files | grep -E '\.(orig|rej|bak|swp|swo)$|~$|(^|/)\.#' || true)
    [ -z "$stray" ] || { printf 'tracked leftovers of a merge or an editor:\n%s\n' "$stray"; exit 1; }
fi
# The C ABI and Python tests load the release library; stepalloc.fit's tests run the release
# stress tool (the GPU bundle below needs both anyway).
cargo build --release -p stepalloc-cabi -p stepalloc-stress
cargo test --workspace
# The CUDA backend on the host-memory CUDA driver (testdrv/, no GPU needed): the Rust CUDA
# backend tests (one thread: they change the driver's settings); gpu/validate.sh (capture probe,
# cuda_smoke.py on backend:cuda, C ABI programs) runs from the GPU bundle at the end.
cargo build -p stepalloc-stress
testdrv/build.sh
# Real PyTorch over the host-memory driver (testdrv/README.md): the drift check says what the
# installed torch needs that the stubs lack; stand-ins for the CUDA vendor libraries let a torch
# installed without its CUDA wheels (CI) load. With the wheels there is nothing to stand in for.
TORCH=$(python3 -c 'import importlib.util; print(importlib.util.find_spec("torch") is not None)')
rm -rf target/hostcuda/standins
if [ "$TORCH" = True ]; then
    python3 testdrv/torch_drift.py target/hostcuda
    python3 testdrv/standins.py target/hostcuda/standins
    # PyTorch's own allocator (libc10_cuda.so, default / max_split_size_mb:128 / expandable
    # segments) replays the real-model traces; the stress tool's PyTorch presets must match it,
    # and on a device of 85% of each trace's peak `fit` must fail at the same allocations.
    python3 scripts/torch_replay.py target/debug/stepalloc-stress stress/tests/data/model_*.jsonl \
        stress/tests/data/fit_small.jsonl | tail -n 1
    # `advise` on a real _dump_snapshot with Python frames from PyTorch's own allocator (it
    # skipped in `cargo test --workspace` above, before the stand-in was built).
    cargo test -p stepalloc-stress --test advise -- --exact real_torch_snapshot_with_frames
fi
# vLLM 0.34's own allocator beside stepalloc's (test_cumem_port.py, test_vllm_backend.py) runs in
# vLLM's environment (scripts/vllm_venv.sh, torch 2.14): its stand-ins and drift check here.
# Without it those columns skip; CI always makes it.
rm -rf target/hostcuda/standins-vllm
if [ -x target/vllm-venv/bin/python ]; then
    scripts/vllm_standins.sh target/vllm-venv
elif [ -n "${CI:-}" ]; then
    echo "CI: vLLM's environment target/vllm-venv is missing (.ci/run makes it with scripts/vllm_venv.sh)" >&2
    exit 1
else
    echo "note: no vLLM environment (target/vllm-venv): the tests against vLLM 0.34's own allocator skip; scripts/vllm_venv.sh makes it"
fi
(
    export LD_LIBRARY_PATH="$PWD/target/hostcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export STEPALLOC_HOSTCUDA=1 HOSTCUDA_DEVICES=2 HOSTCUDA_CAPACITY_MB=4096 HOSTCUDA_DELAY_US=2000
    # First, alone: it needs a device no other test has used.
    cargo test --workspace --lib -- --exact backend::cuda::tests::gpu_mem_info_on_an_unused_device_creates_no_context
    cargo test --workspace --lib -- backend::cuda --test-threads=1
    cargo test -p stepalloc-stress --test random_cuda
    # gpu/validate.sh, a real-model trace replayed on backend:cuda with the simulated device's
    # peaks (scripts/cuda_matches_sim.py) and `stepalloc-stress random --backend cuda` with a tag
    # in every block run below, from the GPU bundle (gpu/run_all.sh).
)
# The real-PyTorch tests (test_real_torch.py) preload the stub runtime in their child processes.
LD_LIBRARY_PATH="$PWD/target/hostcuda/standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 -m pytest python_shim/tests -q
# The GPU run kit: the bundle a GPU machine runs without Rust (size limit, manifest,
# glibc needs: gpu/tests), then the whole run from it over the host-memory driver (validation,
# CUDA backend checks, the end-to-end comparison as a CPU dry run) with its JSON summary.
# The bundle's recordings for the prediction (gpu/e2e_predict.py): the dry run's sizes only (a
# GPU bundle, scripts/gpu-bundle.sh without it, also records the 7 B and 1.4 B loops: ~3 min).
STEPALLOC_BUNDLE_FIT_SIZES="tiny7b tiny" scripts/gpu-bundle.sh target/gpu-bundle > /dev/null
STEPALLOC_GPU_BUNDLE=target/gpu-bundle LD_LIBRARY_PATH="$PWD/target/hostcuda/standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    python3 -m pytest gpu/tests -q
(
    # torch in the end-to-end dry run: CPU only (the driver without the stub runtime).
    export LD_LIBRARY_PATH="$PWD/target/hostcuda:$PWD/target/hostcuda/standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export STEPALLOC_HOSTCUDA=1 HOSTCUDA_DEVICES=2 HOSTCUDA_CAPACITY_MB=4096 HOSTCUDA_DELAY_US=2000
    rm -rf target/gpu-run
    target/gpu-bundle/gpu/run_all.sh target/gpu-bundle target/gpu-run > target/gpu-run.log 2>&1 \
        || { tail -n 80 target/gpu-run.log; exit 1; }
    python3 scripts/check_gpu_run.py target/gpu-run
)
