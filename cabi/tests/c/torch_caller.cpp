// Calls libstepalloc.so the way PyTorch's CUDAPluggableAllocator does: symbols looked up by
// name with dlsym, cast to PyTorch's function types and called through std::function.
// Usage: torch_caller LIBRARY. Prints "ok torch" and exits 0 when every check holds.
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

#include "common.h"

using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
using AllocFn = void *(size_t, int, cudaStream_t);
using FreeFn = void(void *, size_t, int, cudaStream_t);
using BeginFn = void(int, MempoolId_t, std::function<bool(cudaStream_t)>);
using EndFn = void(int, MempoolId_t);

static constexpr size_t MIB = size_t(1) << 20;

template <typename F>
static std::function<F> look_up(void *lib, const char *name) {
    void *sym = dlsym(lib, name);
    CHECK(sym != nullptr, "dlsym(%s): %s", name, dlerror());
    return std::function<F>(reinterpret_cast<F *>(sym));
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: %s LIBRARY", argv[0]);
    void *lib = load_library(argv[1]);
    CHECK(p_stepalloc_configure("backend:sim,sim_capacity_mb:64") == STEPALLOC_OK, "%s", last_error());
    auto alloc = look_up<AllocFn>(lib, "stepalloc_torch_malloc");
    auto release = look_up<FreeFn>(lib, "stepalloc_free");
    auto begin_pool = look_up<BeginFn>(lib, "stepalloc_begin_allocate_to_pool");
    auto end_pool = look_up<EndFn>(lib, "stepalloc_end_allocate_to_pool");
    auto release_pool = look_up<EndFn>(lib, "stepalloc_release_pool");

    // Out of memory: a C++ exception whose text starts as PyTorch's, then everything still works.
    void *a = alloc(40 * MIB, 0, nullptr);
    CHECK(a != nullptr, "first 40 MiB");
    bool caught = false;
    try {
        alloc(40 * MIB, 0, nullptr);
    } catch (const std::runtime_error &e) {
        caught = true;
        std::string what = e.what();
        CHECK(what.rfind("CUDA out of memory. Tried to allocate 40", 0) == 0, "exception text: %s", what.c_str());
        CHECK(what.find("device 0") != std::string::npos, "exception text: %s", what.c_str());
    }
    CHECK(caught, "no exception on out-of-memory");
    CHECK(stat(0, "num_ooms") == 1, "num_ooms");
    check_stats(0, 1, 40.0 * MIB);
    release(a, 40 * MIB, 0, nullptr);
    a = alloc(40 * MIB, 0, nullptr);
    CHECK(a != nullptr, "40 MiB after the exception");
    release(a, 40 * MIB, 0, nullptr);
    check_stats(0, 0, 0);

    // Size 0 is never NULL; another failure is an exception too, never NULL.
    void *z = alloc(0, 0, nullptr);
    CHECK(z != nullptr, "size 0");
    release(z, 0, 0, nullptr);
    caught = false;
    try {
        alloc(16, -1, nullptr);
    } catch (const std::runtime_error &e) {
        caught = std::string(e.what()).rfind("stepalloc: invalid argument", 0) == 0;
    }
    CHECK(caught, "device -1 must throw a stepalloc error");
    check_roundtrip(0);

    // CUDA-graph pool hooks: allocations on the capturing stream go to the private pool and
    // stay out of general reuse until the pool is released.
    cudaStream_t capturing = reinterpret_cast<cudaStream_t>(uintptr_t(0x10));
    cudaStream_t other = reinterpret_cast<cudaStream_t>(uintptr_t(0x20));
    const MempoolId_t pool{1, 7};
    double reserved_before = stat(0, "reserved_bytes.all.current");
    begin_pool(0, pool, [capturing](cudaStream_t s) { return s == capturing; });
    void *in_pool = alloc(MIB, 0, capturing);
    void *general = alloc(MIB, 0, other);
    end_pool(0, pool);
    CHECK(in_pool != nullptr && general != nullptr, "allocations during capture");
    size_t seg = 0;
    void *pool_segment = p_stepalloc_base_alloc(in_pool, &seg);
    void *general_segment = p_stepalloc_base_alloc(general, &seg);
    CHECK(pool_segment != general_segment, "the pool shares a segment with the general pool");
    release(in_pool, MIB, 0, capturing);
    release(general, MIB, 0, other);
    void *after = alloc(MIB, 0, capturing);
    CHECK(after != in_pool && p_stepalloc_base_alloc(after, &seg) != pool_segment,
          "a freed pool block was handed out to general use");
    release(after, MIB, 0, capturing);
    double reserved_with_pool = stat(0, "reserved_bytes.all.current");
    CHECK(reserved_with_pool > reserved_before, "the pool holds a segment");
    release_pool(0, pool);
    CHECK(p_stepalloc_last_status() == STEPALLOC_OK, "release_pool: %s", last_error());
    CHECK(stat(0, "reserved_bytes.all.current") < reserved_with_pool, "release_pool returned nothing");
    // An unmatched end and a release of an unknown pool do not throw and change nothing.
    end_pool(0, MempoolId_t{9, 9});
    release_pool(0, MempoolId_t{9, 9});
    CHECK(p_stepalloc_last_status() == STEPALLOC_INVALID_ARGUMENT, "unknown pool: %d", p_stepalloc_last_status());
    caught = false;
    try {
        begin_pool(-1, pool, [](cudaStream_t) { return true; });
    } catch (const std::runtime_error &) {
        caught = true;
    }
    CHECK(caught, "begin on device -1 must throw");
    void *later = alloc(MIB, 0, capturing);
    CHECK(p_stepalloc_base_alloc(later, &seg) != nullptr, "allocation after the failed begin");
    release(later, MIB, 0, capturing);
    check_stats(0, 0, 0);
    check_roundtrip(0);

    // A failed capture: PyTorch's cudaStreamEndCapture fails, so end_pool never comes and the
    // pool is not released. The next capture's begin finds that the failed capture's stream is
    // no longer capturing (the simulated device captures nothing) and drops it, so the
    // out-of-memory path, which a capture underway turns off, works again afterwards.
    const MempoolId_t failed{3, 1};
    begin_pool(0, failed, [capturing](cudaStream_t s) { return s == capturing; });
    void *captured = alloc(MIB, 0, capturing);
    CHECK(captured != nullptr, "allocation in the failed capture");
    const MempoolId_t next{4, 1};
    begin_pool(0, next, [](cudaStream_t) { return false; });
    end_pool(0, next);
    release_pool(0, next);
    // 40 MiB cached, 20 MiB or so left on the device: a 50 MiB request needs the OOM path.
    void *cached = alloc(40 * MIB, 0, other);
    release(cached, 40 * MIB, 0, other);
    void *big = alloc(50 * MIB, 0, other);
    CHECK(big != nullptr, "the OOM path after a failed capture");
    release(big, 50 * MIB, 0, other);
    release(captured, MIB, 0, capturing);
    release_pool(0, failed);
    CHECK(p_stepalloc_last_status() == STEPALLOC_OK, "release of the failed capture's pool: %s", last_error());

    // A failed capture whose pool is released: the release ends it (no further begin needed).
    begin_pool(0, failed, [capturing](cudaStream_t s) { return s == capturing; });
    captured = alloc(MIB, 0, capturing);
    release(captured, MIB, 0, capturing);
    release_pool(0, failed);
    cached = alloc(40 * MIB, 0, other);
    release(cached, 40 * MIB, 0, other);
    big = alloc(50 * MIB, 0, other);
    CHECK(big != nullptr, "the OOM path after releasing a failed capture's pool");
    release(big, 50 * MIB, 0, other);
    check_stats(0, 0, 0);
    printf("ok torch\n");
    return 0;
}
