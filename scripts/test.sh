#!/usr/bin/env bash
# Every test of the project: formatting and lints, the Rust tests of all crates (core, C ABI,
# stress tool), and the Python package's tests against the built library.
# Needs: Rust, cc/c++, python3 with pytest and prometheus_client, Debian's prometheus package.
# No GPU: the CUDA backend runs on the host-memory driver built from testdrv/.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The C ABI and Python tests load the release library.
cargo build --release -p stepalloc-cabi
cargo test --workspace
# The CUDA backend on the host-memory CUDA driver (testdrv/, no GPU needed): the Rust CUDA
# backend tests (one thread: they change the driver's settings), then gpu/validate.sh (capture
# probe, cuda_smoke.py on backend:cuda, C ABI programs) with its logs in target/hostcuda-validate.
cargo build -p stepalloc-stress
testdrv/build.sh
(
    export LD_LIBRARY_PATH="$PWD/target/hostcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export STEPALLOC_HOSTCUDA=1 HOSTCUDA_DEVICES=2 HOSTCUDA_CAPACITY_MB=4096 HOSTCUDA_DELAY_US=2000
    # First, alone: it needs a device no other test has used.
    cargo test --workspace --lib -- --exact backend::cuda::tests::gpu_mem_info_on_an_unused_device_creates_no_context
    cargo test --workspace --lib -- backend::cuda --test-threads=1
    # A real-model trace replayed on backend:cuda gives the simulated device's peaks exactly,
    # expandable segments and page reuse included (the VMM calls of cuda.rs, for real).
    python3 scripts/cuda_matches_sim.py target/debug/stepalloc-stress stress/tests/data/model_vlm_agent.jsonl
    # The random workload on backend:cuda: real driver streams, threads freeing each other's
    # blocks, and a tag in every block (cuMemsetD32Async) checked before its free (cuMemcpyDtoH);
    # exit status 1 on an overlap or a corrupted tag. Then its Rust tests on the driver.
    target/debug/stepalloc-stress random --backend cuda --threads 2 --streams 2 --ops 2000 \
        --compare pytorch pytorch_expandable stepalloc | tee target/hostcuda-random.txt | tail -n 3
    test "$(grep -c ' 0 corrupted tags of [1-9][0-9]* tagged blocks' target/hostcuda-random.txt)" = 3
    cargo test -p stepalloc-stress --test random_cuda
    rm -rf target/hostcuda-validate
    STEPALLOC_GPU_CARGO=0 gpu/validate.sh target/release/libstepalloc.so target/hostcuda-validate > /dev/null \
        || { cat target/hostcuda-validate/validate/summary.txt; exit 1; }
    tail -n 1 target/hostcuda-validate/validate/summary.txt
)
python3 -m pytest python_shim/tests -q
# The GPU run kit (issue 11): the bundle a GPU machine runs without Rust (size limit, manifest,
# glibc needs: gpu/tests), then the whole run from it over the host-memory driver (validation,
# CUDA backend checks, the end-to-end comparison as a CPU dry run) with its JSON summary.
scripts/gpu-bundle.sh target/gpu-bundle > /dev/null
STEPALLOC_GPU_BUNDLE=target/gpu-bundle python3 -m pytest gpu/tests -q
(
    export LD_LIBRARY_PATH="$PWD/target/hostcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export STEPALLOC_HOSTCUDA=1 HOSTCUDA_DEVICES=2 HOSTCUDA_CAPACITY_MB=4096 HOSTCUDA_DELAY_US=2000
    rm -rf target/gpu-run
    target/gpu-bundle/gpu/run_all.sh target/gpu-bundle target/gpu-run > target/gpu-run.log 2>&1 \
        || { tail -n 80 target/gpu-run.log; exit 1; }
    python3 scripts/check_gpu_run.py target/gpu-run
)
