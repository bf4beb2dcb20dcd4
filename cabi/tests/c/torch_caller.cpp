// Calls libstepalloc.so the way PyTorch's CUDAPluggableAllocator does: symbols looked up by
// name with dlsym, cast to PyTorch's function types and called through std::function.
// Usage: torch_caller LIBRARY. Prints "ok torch" and exits 0 when every check holds.
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "common.h"

using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
using AllocFn = void *(size_t, int, cudaStream_t);
using FreeFn = void(void *, size_t, int, cudaStream_t);
using BeginFn = void(int, MempoolId_t, std::function<bool(cudaStream_t)>);
using EndFn = void(int, MempoolId_t);

static constexpr size_t MIB = size_t(1) << 20;

// Another library's segment allocator for a MemPool: addresses from its own range.
static int g_foreign_allocs, g_foreign_frees;
static size_t g_foreign_outstanding;
static void *foreign_alloc(size_t size, int, cudaStream_t) {
    g_foreign_outstanding += size;
    return reinterpret_cast<void *>(uintptr_t(0x700000000000) + uintptr_t(g_foreign_allocs++) * (uintptr_t(1) << 30));
}
static void foreign_free(void *, size_t size, int, cudaStream_t) {
    g_foreign_frees++;
    g_foreign_outstanding -= size;
}

// NCCL's register / deregister, recording what they were given (the communicator is `ctx`).
static int g_registered, g_deregistered;
static size_t g_registered_bytes;
static int fake_register(void *ctx, void *addr, size_t size, void **handle) {
    if (ctx != &g_registered) return 5;
    g_registered++;
    g_registered_bytes += size;
    *handle = addr;
    return 0;
}
static int fake_deregister(void *ctx, void *handle) {
    if (ctx != &g_registered || handle == nullptr) return 5;
    g_deregistered++;
    return 0;
}

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

    // A MemPool (stepalloc_pool_create) whose segments come from another allocator, entered as
    // use_mem_pool does (a filter that claims every stream of the thread). A capture begun and
    // failed meanwhile must not drop it, and the newest entry wins.
    const MempoolId_t mem{0, 42};
    CHECK(p_stepalloc_pool_create(0, mem.first, mem.second) == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_pool_use_count(0, mem.first, mem.second) == 1, "use count after create");
    CHECK(p_stepalloc_pool_set_segment_allocator(0, mem.first, mem.second, foreign_alloc, nullptr) ==
              STEPALLOC_INVALID_ARGUMENT,
          "half an allocator must be refused");
    CHECK(p_stepalloc_pool_set_segment_allocator(0, 9, 9, foreign_alloc, foreign_free) == STEPALLOC_INVALID_ARGUMENT,
          "an allocator for a missing pool must be refused");
    CHECK(p_stepalloc_pool_set_segment_allocator(0, mem.first, mem.second, foreign_alloc, foreign_free) ==
              STEPALLOC_OK,
          "%s", last_error());
    CHECK(p_stepalloc_pool_set_use_on_oom(0, mem.first, mem.second, 1) == STEPALLOC_OK, "%s", last_error());
    begin_pool(0, mem, [](cudaStream_t) { return true; });
    CHECK(p_stepalloc_pool_use_count(0, mem.first, mem.second) == 2, "use count inside");
    void *m1 = alloc(4096, 0, other);
    const MempoolId_t graph{5, 0};
    begin_pool(0, graph, [capturing](cudaStream_t s) { return s == capturing; });
    void *g1 = alloc(MIB, 0, capturing);  // the newest entry whose filter claims it: the graph's
    void *m2 = alloc(4096, 0, other);
    begin_pool(0, MempoolId_t{6, 0}, [](cudaStream_t) { return false; });  // drops the failed graph
    void *m3 = alloc(4096, 0, other);
    CHECK(g_foreign_allocs == 1 && m1 != nullptr && m2 != nullptr && m3 != nullptr, "foreign allocs %d", g_foreign_allocs);
    p_stepalloc_base_alloc(m1, &seg);
    CHECK(seg == 2 * MIB && p_stepalloc_base_alloc(m3, &seg) == p_stepalloc_base_alloc(m1, &seg),
          "use_mem_pool's entry was dropped: %zu", seg);
    CHECK(p_stepalloc_base_alloc(g1, &seg) != p_stepalloc_base_alloc(m1, &seg), "the capture allocated to the MemPool");
    end_pool(0, mem);
    release_pool(0, mem);
    CHECK(p_stepalloc_pool_use_count(0, mem.first, mem.second) == 1, "use count after");
    for (void *p : {m1, m2, m3}) release(p, 4096, 0, other);
    release(g1, MIB, 0, capturing);
    release_pool(0, graph);
    release_pool(0, MempoolId_t{6, 0});
    // No graph captured into the MemPool, so its free segment may go back before the pool goes
    // (issue 33: releases reach an active pool's free memory); once, either way.
    CHECK(g_foreign_frees <= 1, "foreign frees %d", g_foreign_frees);
    release_pool(0, mem);
    CHECK(g_foreign_frees == 1 && g_foreign_outstanding == 0, "the pool's segment went back: %d", g_foreign_frees);
    CHECK(p_stepalloc_pool_use_count(0, mem.first, mem.second) == 0, "the pool is gone");
    check_stats(0, 0, 0);

    // A pool checkpoint (CUDA-graph trees): recorded, then the pool changes, then restored: the
    // block freed since comes back at its address and goes to the pool's next allocation
    // (STEPALLOC_RESTORE_ADOPT), the block allocated since is freed; a dry run and a restore
    // whose lists do not fit change nothing.
    {
        const MempoolId_t cp{0, 77};
        CHECK(p_stepalloc_pool_create(0, cp.first, cp.second) == STEPALLOC_OK, "%s", last_error());
        begin_pool(0, cp, [](cudaStream_t) { return true; });
        void *x = alloc(MIB, 0, other);
        void *y = alloc(3 * MIB, 0, other);
        uint64_t state[64];
        size_t words = p_stepalloc_pool_checkpoint(0, cp.first, cp.second, state, 64);
        CHECK(words > 0 && words <= 64, "checkpoint: %zu words: %s", words, last_error());
        CHECK(p_stepalloc_pool_checkpoint(0, 5, 5, state, 64) == 0 && p_stepalloc_last_status() == STEPALLOC_INVALID_ARGUMENT,
              "a checkpoint of a missing pool must be refused");
        release(y, 3 * MIB, 0, other);
        void *z = alloc(5 * MIB, 0, other);
        uint64_t freed[8], allocd[8];
        size_t counts[2] = {9, 9};
        CHECK(p_stepalloc_pool_restore(0, state, words, STEPALLOC_RESTORE_DRY_RUN, freed, 2, allocd, 2, counts) ==
                  STEPALLOC_OK,
              "%s", last_error());
        CHECK(counts[0] == 1 && counts[1] == 1 && freed[0] == (uint64_t)(uintptr_t)z &&
                  allocd[0] == (uint64_t)(uintptr_t)y && allocd[1] >= 3 * MIB && allocd[2] == 3 * MIB,
              "dry run: %zu freed, %zu allocated", counts[0], counts[1]);
        CHECK(p_stepalloc_pool_restore(0, state, words, STEPALLOC_RESTORE_ADOPT, freed, 0, allocd, 2, counts) ==
                  STEPALLOC_INVALID_ARGUMENT,
              "a restore whose list does not fit must be refused");
        CHECK(p_stepalloc_pool_restore(0, state, words - 1, 0, freed, 2, allocd, 2, counts) == STEPALLOC_INVALID_ARGUMENT,
              "a truncated checkpoint must be refused");
        CHECK(p_stepalloc_pool_restore(0, state, words, STEPALLOC_RESTORE_ADOPT, freed, 2, allocd, 2, counts) ==
                  STEPALLOC_OK,
              "%s", last_error());
        CHECK(counts[0] == 1 && counts[1] == 1, "restore: %zu freed, %zu allocated", counts[0], counts[1]);
        void *y2 = alloc(3 * MIB, 0, other);
        CHECK(y2 == y, "the pool's next allocation adopts the restored block: %p, %p", y2, y);
        end_pool(0, cp);
        release(x, MIB, 0, other);
        release(y2, 3 * MIB, 0, other);
        release_pool(0, cp);
        release_pool(0, cp);
        check_stats(0, 0, 0);
    }

    // A pool's segments registered as NCCL's register_mem_pool does: the one it holds, then the
    // one it creates; deregistered when released and when the registration stops.
    {
        const MempoolId_t np{0, 88};
        CHECK(p_stepalloc_pool_create(0, np.first, np.second) == STEPALLOC_OK, "%s", last_error());
        begin_pool(0, np, [](cudaStream_t) { return true; });
        void *x = alloc(3 * MIB, 0, other);
        CHECK(p_stepalloc_pool_register_segments(0, np.first, np.second, &g_registered, fake_register, nullptr) ==
                  STEPALLOC_INVALID_ARGUMENT,
              "half a registrar must be refused");
        CHECK(p_stepalloc_pool_register_segments(0, np.first, np.second, &g_registered, fake_register, fake_deregister) ==
                  STEPALLOC_OK,
              "%s", last_error());
        CHECK(g_registered == 1 && g_registered_bytes == 20 * MIB, "registered %d, %zu bytes", g_registered, g_registered_bytes);
        void *y = alloc(30 * MIB, 0, other);
        CHECK(g_registered == 2 && g_registered_bytes == 50 * MIB, "a new segment: %d", g_registered);
        release(y, 30 * MIB, 0, other);
        end_pool(0, np);
        p_stepalloc_empty_cache();
        CHECK(g_deregistered == 1, "a released segment is deregistered first: %d", g_deregistered);
        CHECK(p_stepalloc_pool_register_segments(0, np.first, np.second, &g_registered, nullptr, nullptr) == STEPALLOC_OK,
              "%s", last_error());
        CHECK(g_deregistered == 2, "stopping deregisters the rest: %d", g_deregistered);
        CHECK(p_stepalloc_pool_register_segments(0, np.first, np.second, &g_registered, nullptr, nullptr) ==
                  STEPALLOC_INVALID_ARGUMENT,
              "stopping twice must be refused");
        release(x, 3 * MIB, 0, other);
        release_pool(0, np);
        release_pool(0, np);
        check_stats(0, 0, 0);
    }
    // use_mem_pool re-entered on one thread (PyTorch's filter: the calling thread's streams):
    // P1, P2, P1 again. The routes unwind as a stack: after the inner P1 the thread allocates
    // to P2, after P2 to the outer P1 again, after that to the general pool; each pool's use
    // count is back to its MemPool's one reference.
    {
        const MempoolId_t p1{0, 91}, p2{0, 92};
        CHECK(p_stepalloc_pool_create(0, p1.first, p1.second) == STEPALLOC_OK, "%s", last_error());
        CHECK(p_stepalloc_pool_create(0, p2.first, p2.second) == STEPALLOC_OK, "%s", last_error());
        const std::thread::id me = std::this_thread::get_id();
        auto mine = [me](cudaStream_t) { return std::this_thread::get_id() == me; };
        auto segment = [&](void *p) { return p_stepalloc_base_alloc(p, &seg); };
        begin_pool(0, p1, mine);
        void *a1 = alloc(4096, 0, other);
        begin_pool(0, p2, mine);
        void *b1 = alloc(4096, 0, other);
        begin_pool(0, p1, mine);
        void *a2 = alloc(4096, 0, other);
        CHECK(p_stepalloc_pool_use_count(0, p1.first, p1.second) == 3, "P1 entered twice");
        end_pool(0, p1);
        release_pool(0, p1);
        void *b2 = alloc(4096, 0, other);
        end_pool(0, p2);
        release_pool(0, p2);
        void *a3 = alloc(4096, 0, other);
        end_pool(0, p1);
        release_pool(0, p1);
        void *g = alloc(4096, 0, other);
        CHECK(segment(a2) == segment(a1), "the inner P1 did not allocate to P1");
        CHECK(segment(b2) == segment(b1), "after the inner P1 the thread left P2");
        CHECK(segment(a3) == segment(a1), "after P2 the outer P1 no longer routes");
        CHECK(segment(g) != segment(a1) && segment(g) != segment(b1), "a route outlived its use_mem_pool");
        CHECK(p_stepalloc_pool_use_count(0, p1.first, p1.second) == 1 &&
                  p_stepalloc_pool_use_count(0, p2.first, p2.second) == 1,
              "use counts %d %d", p_stepalloc_pool_use_count(0, p1.first, p1.second),
              p_stepalloc_pool_use_count(0, p2.first, p2.second));
        for (void *p : {a1, a2, a3, b1, b2, g}) release(p, 4096, 0, other);

        // Two threads in one pool; the first to enter leaves first: each end removes its own
        // thread's route, so the other thread still allocates to the pool and this one no longer.
        std::mutex m;
        std::condition_variable cv;
        int stage = 0;
        void *from_other = nullptr;
        auto wait_for = [&](int s) {
            std::unique_lock<std::mutex> lock(m);
            cv.wait(lock, [&] { return stage >= s; });
        };
        auto advance = [&](int s) {
            std::lock_guard<std::mutex> lock(m);
            stage = s;
            cv.notify_all();
        };
        begin_pool(0, p1, mine);
        void *c1 = alloc(4096, 0, other);
        std::thread second([&] {
            const std::thread::id id = std::this_thread::get_id();
            begin_pool(0, p1, [id](cudaStream_t) { return std::this_thread::get_id() == id; });
            advance(1);
            wait_for(2);
            from_other = alloc(4096, 0, other);
            end_pool(0, p1);
            release_pool(0, p1);
        });
        wait_for(1);
        end_pool(0, p1);
        release_pool(0, p1);
        void *c2 = alloc(4096, 0, other);
        advance(2);
        second.join();
        CHECK(segment(from_other) == segment(c1), "the second thread lost its route when the first left");
        CHECK(segment(c2) != segment(c1), "the first thread's route outlived its end");
        CHECK(p_stepalloc_pool_use_count(0, p1.first, p1.second) == 1, "use count after the threads");
        for (void *p : {c1, c2, from_other}) release(p, 4096, 0, other);
        release_pool(0, p1);
        release_pool(0, p2);
        check_stats(0, 0, 0);
    }
    printf("ok torch\n");
    return 0;
}
