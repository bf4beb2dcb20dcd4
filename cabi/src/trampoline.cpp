// The C++ part of libstepalloc.so. Layer: the boundary, beside the Rust exports.
//
// Why C++: PyTorch calls these through C++ types. `stepalloc_torch_malloc` must report
// out-of-memory as a C++ exception (PyTorch does not check for NULL in process-wide mode and
// turns a std::exception into a Python RuntimeError), and the CUDA-graph pool hooks take
// `std::pair` and `std::function` by value, which only C++ can receive.
//
// Invariants:
// - Every function has C linkage so PyTorch finds it by name (dlsym); the exports.map version
//   script makes them visible in the cdylib, whose own version script lists only Rust symbols.
// - Only `stepalloc_torch_malloc` and `stepalloc_begin_allocate_to_pool` throw. The function
//   Rust calls (`stepalloc_internal_capture_pool`) never throws; release and end never throw
//   (PyTorch calls release from destructors), they leave a failure in the last error.
// - The capture table is created on first use and never destroyed, and `g_active` counts its
//   entries, read by every malloc (torch.rs) so that no capture costs one atomic load.
// - A filter runs under the table's mutex; PyTorch's filters only query the stream's capture
//   state (or the thread's id) and never call back into the allocator. The newest entry whose
//   filter claims a stream wins, as in PyTorch.
// - The entries unwind as a stack: an end removes the newest entry of its pool that the
//   calling thread began (else the pool's newest), so `use_mem_pool(P1)`, `use_mem_pool(P2)`,
//   `use_mem_pool(P1)` again routes to P2 and then to the outer P1 as the inner two exit, and
//   two threads in one pool may leave in either order. (PyTorch refuses the re-entry with
//   "already recording to mempool_id", after taking a reference it never gives back.)
// - Reconciliation drops only the entries of graph captures (see `Claim`), never routes
//   (`use_mem_pool`'s), whose claimed stream is not capturing.
// - A failed capture never calls end (PyTorch calls `cudaStreamEndCapture` first and stops when
//   it fails), so its entry would stay forever and keep the core's out-of-memory path off.
//   Entries are reconciled at begin and release: a capture's begin drops the pool's older
//   capture entry (the core counts that capture as ended), never its routes; a release drops
//   the pool's capture entries (not its routes) when the core no longer counts a capture into
//   it (its last reference went, so a capture that never ended failed); a begin drops entries
//   of other pools whose claimed stream the device says is no longer capturing. The core is
//   asked without the table's mutex held (it takes the device lock).

#include "stepalloc.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using MempoolId = std::pair<unsigned long long, unsigned long long>;
using StreamFilter = std::function<bool(cudaStream_t)>;

extern "C" {
// Defined in torch.rs; each returns a status and sets the last error on failure.
int stepalloc_internal_pool_begin(int device, unsigned long long id0, unsigned long long id1, int route);
int stepalloc_internal_pool_end(int device, unsigned long long id0, unsigned long long id1, int route);
int stepalloc_internal_pool_release(int device, unsigned long long id0, unsigned long long id1);
int stepalloc_internal_capture_pool(int device, cudaStream_t stream, unsigned long long *pool) noexcept;
int stepalloc_internal_pool_abandon(int device, unsigned long long id0, unsigned long long id1);
int stepalloc_internal_stream_is_capturing(int device, cudaStream_t stream);
int stepalloc_internal_pool_captures(int device, unsigned long long id0, unsigned long long id1);
}

// The capture table's entry count (`g_active` below), read by torch.rs's malloc itself, so
// that with no capture underway a malloc costs one load and no call into this unit. Hidden:
// nothing outside the library sees it.
extern "C" {
__attribute__((visibility("hidden"))) std::atomic<int> stepalloc_internal_captures{0};
}

namespace {

// What an entry is, learnt when its filter first claims a stream. A graph capture's filter
// claims only its capturing stream, never the legacy default stream (NULL), which cannot be
// captured; `use_mem_pool`'s (`beginAllocateCurrentThreadToPool`) claims every stream of its
// thread, NULL included. Only captures may be dropped by reconciliation (their stream stopped
// capturing: the capture failed); a `use_mem_pool` entry lasts until its end.
enum class Claim { None, Capture, Other };

struct Capture {
    int device;
    MempoolId pool;
    StreamFilter filter;
    // The first stream the filter claimed, once it claimed one.
    cudaStream_t stream;
    Claim claim;
    // A route, not a capture: the filter claimed the default stream at begin, which no graph
    // capture can (`use_mem_pool`, `_cuda_beginAllocateToPool`). The core counts no capture
    // for it, so events, releases and `empty_cache` go on while it lasts.
    bool route;
    // The thread that began it: an end from that thread removes it first.
    std::thread::id owner;
};

std::atomic<int> &g_active = stepalloc_internal_captures;

// Throws PyTorch's c10::OutOfMemoryError with the given message (registered by the Python
// package, built against the installed torch's headers); null: std::runtime_error instead.
std::atomic<void (*)(const char *)> g_oom_thrower{nullptr};

std::mutex &table_mutex() {
    static std::mutex *m = new std::mutex();  // never destroyed: callers may outlive statics
    return *m;
}

std::vector<Capture> &table() {
    static std::vector<Capture> *t = new std::vector<Capture>();  // never destroyed, as above
    return *t;
}

// Removes the entries of `device` that `drop` selects. Caller holds the table's mutex.
template <typename Pred>
void erase_entries(int device, Pred drop) {
    std::vector<Capture> &t = table();
    for (auto it = t.begin(); it != t.end();) {
        if (it->device == device && drop(*it)) {
            it = t.erase(it);
            g_active.fetch_sub(1, std::memory_order_relaxed);
        } else {
            ++it;
        }
    }
}

// Drops the entries of captures that ended without `end`: at a capture's begin, a capture
// entry of the same pool (PyTorch never captures into one pool twice at once; a route's begin
// leaves it, as the core does); and entries whose claimed stream the device no longer reports
// as capturing. The core counts each as ended.
void reconcile_at_begin(int device, MempoolId pool, bool route) {
    std::vector<std::pair<MempoolId, cudaStream_t>> claimed;
    {
        std::lock_guard<std::mutex> lock(table_mutex());
        if (!route) {
            erase_entries(device, [&](const Capture &c) { return c.pool == pool && !c.route; });
        }
        for (const Capture &c : table()) {
            if (c.device == device && c.claim == Claim::Capture) {
                claimed.emplace_back(c.pool, c.stream);
            }
        }
    }
    for (const auto &entry : claimed) {
        if (stepalloc_internal_stream_is_capturing(device, entry.second) != 0) {
            continue;  // still capturing, or unknown: keep it
        }
        bool dropped = false;
        {
            std::lock_guard<std::mutex> lock(table_mutex());
            erase_entries(device, [&](const Capture &c) {
                bool match = !dropped && c.pool == entry.first && c.claim == Claim::Capture && c.stream == entry.second;
                dropped = dropped || match;
                return match;
            });
        }
        if (dropped) {
            stepalloc_internal_pool_abandon(device, entry.first.first, entry.first.second);
        }
    }
}

std::string last_error_text() {
    size_t n = stepalloc_last_error(nullptr, 0);
    std::string text(n, '\0');
    if (n > 0) {
        stepalloc_last_error(&text[0], n + 1);
    }
    return text;
}

}  // namespace

extern "C" void *stepalloc_torch_malloc(size_t size, int device, cudaStream_t stream) {
    void *ptr = stepalloc_malloc(size, device, stream);
    if (ptr != nullptr) {
        return ptr;  // size 0 included: it gets a unique 512-byte block, never NULL
    }
    if (stepalloc_last_status() == STEPALLOC_OUT_OF_MEMORY) {
        // The report already begins "CUDA out of memory." as PyTorch's own message does.
        std::string text = last_error_text();
        if (void (*thrower)(const char *) = g_oom_thrower.load(std::memory_order_acquire)) {
            thrower(text.c_str());  // throws c10::OutOfMemoryError: torch.OutOfMemoryError in Python
        }
        throw std::runtime_error(text);
    }
    throw std::runtime_error("stepalloc: " + last_error_text());
}

extern "C" void stepalloc_set_oom_thrower(void (*thrower)(const char *message)) noexcept {
    g_oom_thrower.store(thrower, std::memory_order_release);
}

extern "C" void stepalloc_begin_allocate_to_pool(int device, MempoolId mempool_id, StreamFilter filter) {
    // Asked on the calling thread before any capture began (PyTorch begins before
    // cudaStreamBeginCapture): a capture's filter queries the stream's capture state, false
    // for the default stream; a thread's or the device's route says true.
    bool route = false;
    try {
        route = filter && filter(nullptr);
    } catch (...) {
        route = false;  // treated as a capture: the cautious side
    }
    reconcile_at_begin(device, mempool_id, route);
    if (stepalloc_internal_pool_begin(device, mempool_id.first, mempool_id.second, route ? 1 : 0) != STEPALLOC_OK) {
        throw std::runtime_error("stepalloc: beginAllocateToPool failed: " + last_error_text());
    }
    std::lock_guard<std::mutex> lock(table_mutex());
    table().push_back(Capture{device, mempool_id, std::move(filter), nullptr, route ? Claim::Other : Claim::None, route,
                              std::this_thread::get_id()});
    g_active.fetch_add(1, std::memory_order_relaxed);
}

extern "C" void stepalloc_end_allocate_to_pool(int device, MempoolId mempool_id) {
    bool found = false;
    bool route = false;
    {
        std::lock_guard<std::mutex> lock(table_mutex());
        std::vector<Capture> &t = table();
        // Newest first: the entry of the pool this thread began, else the pool's newest (an end
        // from another thread, as stepalloc.follow ends autograd's thread's route).
        auto newest = t.rend();
        for (auto it = t.rbegin(); it != t.rend(); ++it) {
            if (it->device != device || it->pool != mempool_id) {
                continue;
            }
            if (newest == t.rend()) {
                newest = it;
            }
            if (it->owner == std::this_thread::get_id()) {
                newest = it;
                break;
            }
        }
        if (newest != t.rend()) {
            route = newest->route;
            t.erase(std::next(newest).base());
            g_active.fetch_sub(1, std::memory_order_relaxed);
            found = true;
        }
    }
    // Only a capture that began is ended in the core; an unmatched end changes nothing.
    if (found) {
        stepalloc_internal_pool_end(device, mempool_id.first, mempool_id.second, route ? 1 : 0);
    }
}

extern "C" void stepalloc_release_pool(int device, MempoolId mempool_id) {
    if (stepalloc_internal_pool_release(device, mempool_id.first, mempool_id.second) != STEPALLOC_OK) {
        return;  // the failure stays in the last error
    }
    if (stepalloc_internal_pool_captures(device, mempool_id.first, mempool_id.second) == 0) {
        // No capture into this pool is underway any more: one that never ended is over. A
        // route is no capture; its own end removes it.
        std::lock_guard<std::mutex> lock(table_mutex());
        erase_entries(device, [&](const Capture &c) { return c.pool == mempool_id && !c.route; });
    }
}

extern "C" int stepalloc_internal_capture_pool(int device, cudaStream_t stream, unsigned long long *pool) noexcept {
    if (g_active.load(std::memory_order_relaxed) == 0) {
        return 0;
    }
    try {
        std::lock_guard<std::mutex> lock(table_mutex());
        // The newest entry first, as PyTorch: `use_mem_pool` inside a capture allocates to its
        // pool, a capture inside `use_mem_pool` to the graph's.
        std::vector<Capture> &t = table();
        for (auto it = t.rbegin(); it != t.rend(); ++it) {
            Capture &c = *it;
            if (c.device == device && c.filter && c.filter(stream)) {
                if (c.claim == Claim::None) {
                    c.stream = stream;
                    // Asking a capture's filter about the default stream is what PyTorch does
                    // for every allocation on it during a capture: a capture-safe query.
                    c.claim = (stream != nullptr && !c.filter(nullptr)) ? Claim::Capture : Claim::Other;
                }
                pool[0] = c.pool.first;
                pool[1] = c.pool.second;
                return 1;
            }
        }
    } catch (...) {
        // A throwing filter claims nothing; the allocation goes to the general pool.
    }
    return 0;
}
