#!/usr/bin/env bash
# Builds the host-memory CUDA driver (testdrv/hostcuda*.c: hostcuda.c says which part owns what)
# as target/hostcuda/libcuda.so and libcuda.so.1 (the same file: cudarc opens libcuda.so first,
# ctypes scripts libcuda.so.1). Its parts share hostcuda_internal.h, whose helpers are hidden:
# the library exports the CUDA calls and the hostcuda_* controls only.
# Use it with LD_LIBRARY_PATH=target/hostcuda. Needs only cc.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/hostcuda}
mkdir -p "$OUT"
${CC:-cc} -std=gnu11 -O1 -g -Wall -Wextra -Werror -fPIC -shared -pthread \
    -Wl,-soname,libcuda.so.1 -o "$OUT/libcuda.so.1" testdrv/hostcuda.c testdrv/hostcuda_account.c \
    testdrv/hostcuda_mem.c testdrv/hostcuda_vmm.c testdrv/hostcuda_stream.c testdrv/hostcuda_copy.c \
    testdrv/hostcuda_ipc.c
ln -sf libcuda.so.1 "$OUT/libcuda.so"
# The stub CUDA runtime and NVML for real PyTorch (testdrv/README.md, "Real PyTorch"), in their
# own folder: LD_LIBRARY_PATH=$OUT gives programs only the driver; real PyTorch over the driver
# preloads $OUT/runtime/libcudart.so.13 and adds $OUT/runtime for NVML.
mkdir -p "$OUT/runtime"
${CC:-cc} -std=gnu11 -O1 -g -Wall -Wextra -Werror -fPIC -shared -pthread \
    -Wl,-soname,libcudart.so.13 -Wl,--version-script=testdrv/cudart.map \
    -o "$OUT/runtime/libcudart.so.13" testdrv/hostcudart.c -L"$OUT" -l:libcuda.so.1 -ldl -Wl,-rpath,'$ORIGIN/..'
${CC:-cc} -std=gnu11 -O1 -g -Wall -Wextra -Werror -fPIC -shared \
    -Wl,-soname,libnvidia-ml.so.1 -o "$OUT/runtime/libnvidia-ml.so.1" testdrv/hostnvml.c \
    -L"$OUT" -l:libcuda.so.1 -Wl,-rpath,'$ORIGIN/..'
