#!/usr/bin/env bash
# stepalloc against PyTorch's own CUDA caching allocator on the random-victim churn, in one
# process and interleaved (cabi/benches/random_victim.rs): builds testdrv's driver and stub
# runtime, the stand-ins for torch's vendor libraries, and the shim that puts
# c10::cuda::CUDACachingAllocator behind the C ABI's malloc/free (cabi/benches/victim/
# torch_alloc.cpp, against the installed torch's headers), then runs the bench on core 1 with
# the stub runtime preloaded. No GPU needed. Arguments go to the bench (criterion's options).
# Prints each case's best of five medians and stepalloc / pytorch per case (the hot path's target:
# at most 0.25 at 1 k, 10 k and 100 k live blocks).
#   scripts/torch_victim.sh --warm-up-time 1 --measurement-time 2
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_DIR=$(python3 -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')
testdrv/build.sh
[ -d target/hostcuda/standins ] || python3 testdrv/standins.py target/hostcuda/standins > /dev/null
SHIM=target/release/libtorch_victim.so
if [ ! -e "$SHIM" ] || [ cabi/benches/victim/torch_alloc.cpp -nt "$SHIM" ]; then
    mkdir -p target/release
    ${CXX:-c++} -O2 -std=c++20 -shared -fPIC -I"$TORCH_DIR/include" -o "$SHIM" \
        cabi/benches/victim/torch_alloc.cpp -L"$TORCH_DIR/lib" -Wl,--no-as-needed \
        -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -Wl,-rpath,"$TORCH_DIR/lib"
fi
cargo build --release -p stepalloc-cabi
# The bench's executable, built outside the stub runtime's environment.
BENCH=$(cargo bench -p stepalloc-cabi --bench random_victim --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "random_victim" and m.get("executable"):
        print(m["executable"])')
[ -n "$BENCH" ] || { echo "torch_victim.sh: the random_victim bench did not build (cargo bench -p stepalloc-cabi --bench random_victim --no-run)" >&2; exit 1; }
H=$PWD/target/hostcuda
env LD_PRELOAD="$H/runtime/libcudart.so.13" \
    LD_LIBRARY_PATH="$H/runtime:$H:$H/standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    HOSTCUDA_DEVICES=1 HOSTCUDA_CAPACITY_MB=16777216 HOSTCUDA_DELAY_US=0 \
    STEPALLOC_TORCH_VICTIM="$PWD/$SHIM" \
    taskset -c 1 "$BENCH" --bench "$@"
