/* Drives libstepalloc.so from C through dlopen/dlsym on the simulated device (and, in the
 * scenario threads_cuda, on the CUDA backend with real streams of the driver, libcuda.so.1).
 * Usage: abi_test LIBRARY SCENARIO. Prints "ok SCENARIO" and exits 0 when every check holds.
 * After each misuse the statistics must stay consistent and a further malloc/free must work. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>

#include "common.h"

#define MIB ((size_t)1 << 20)

static int status(void) { return p_stepalloc_last_status(); }

/* ----- many threads, several streams, two devices -------------------------------------- */

enum { THREADS = 8, SLOTS = 48, OPS = 6000, STREAMS = 4 };

/* The streams the threads use; index 0 is the default stream (NULL). Fake handles on the
 * simulated device, which accepts any value; real ones (spread over the devices) on CUDA. */
static cudaStream_t streams[STREAMS + 1];
static int devices = 2;

static void fake_streams(void) {
    for (int i = 0; i <= STREAMS; i++) streams[i] = (cudaStream_t)(uintptr_t)i;
}

/* Non-blocking streams of the driver, made in the devices' primary contexts; leaves no
 * context current (stepalloc must not need one). */
static void real_streams(void) {
    void *cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(cu != NULL, "dlopen(libcuda.so.1): %s", dlerror());
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(cu, "cuInit");
    int (*get)(int *, int) = (int (*)(int *, int))dlsym(cu, "cuDeviceGet");
    int (*retain)(void **, int) = (int (*)(void **, int))dlsym(cu, "cuDevicePrimaryCtxRetain");
    int (*set_current)(void *) = (int (*)(void *))dlsym(cu, "cuCtxSetCurrent");
    int (*create)(void **, unsigned) = (int (*)(void **, unsigned))dlsym(cu, "cuStreamCreate");
    CHECK(init && get && retain && set_current && create, "driver symbols missing");
    CHECK(init(0) == 0, "cuInit");
    streams[0] = NULL;
    for (int i = 1; i <= STREAMS; i++) {
        int dev = 0;
        void *ctx = NULL, *stream = NULL;
        CHECK(get(&dev, i % devices) == 0 && retain(&ctx, dev) == 0 && set_current(ctx) == 0, "context");
        CHECK(create(&stream, 1) == 0, "cuStreamCreate");
        streams[i] = (cudaStream_t)stream;
    }
    CHECK(set_current(NULL) == 0, "cuCtxSetCurrent(NULL)");
}

struct slot {
    void *ptr;
    size_t size;
    int device;
    cudaStream_t stream;
};

static uint64_t next_random(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

static size_t random_size(uint64_t *rng) {
    uint64_t r = next_random(rng) % 100;
    if (r < 70) return next_random(rng) % MIB;                     /* small pool, incl. 0 */
    if (r < 95) return 1 + next_random(rng) % (20 * MIB);          /* large pool */
    return 20 * MIB + next_random(rng) % (180 * MIB);              /* big segments */
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint64_t rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)(id + 1) * 0x100000001B3ull;
    struct slot slots[SLOTS];
    memset(slots, 0, sizeof slots);
    for (int op = 0; op < OPS; op++) {
        struct slot *s = &slots[next_random(&rng) % SLOTS];
        if (s->ptr != NULL) {
            if (next_random(&rng) % 8 == 0) {
                cudaStream_t other = streams[1 + next_random(&rng) % STREAMS];
                p_stepalloc_record_stream(s->ptr, other);
                CHECK(status() == STEPALLOC_OK, "record_stream: %s", last_error());
            }
            p_stepalloc_free(s->ptr, s->size, s->device, s->stream);
            CHECK(status() == STEPALLOC_OK, "thread %d free: %s", id, last_error());
            s->ptr = NULL;
        } else {
            s->size = random_size(&rng);
            s->device = (int)(next_random(&rng) % (uint64_t)devices);
            s->stream = streams[next_random(&rng) % (STREAMS + 1)]; /* 0 = default */
            s->ptr = p_stepalloc_malloc(s->size, s->device, s->stream);
            CHECK(s->ptr != NULL, "thread %d malloc(%zu): %s", id, s->size, last_error());
        }
        if (id == 0 && op % 500 == 0) {
            CHECK(p_stepalloc_step_begin(op % 1000 == 0 ? "rollout" : "train") == STEPALLOC_OK, "step: %s",
                  last_error());
            char *json = fetch_text(stats_of, op % 2);
            free(json);
        }
    }
    for (int i = 0; i < SLOTS; i++) {
        if (slots[i].ptr != NULL) {
            p_stepalloc_free(slots[i].ptr, slots[i].size, slots[i].device, slots[i].stream);
            CHECK(status() == STEPALLOC_OK, "final free: %s", last_error());
        }
    }
    return NULL;
}

static void scenario_threads(const char *conf) {
    CHECK(p_stepalloc_configure(conf) == STEPALLOC_OK, "%s", last_error());
    devices = p_stepalloc_device_count();
    CHECK(devices >= 1, "no device: %s", last_error());
    if (devices > 2) devices = 2;
    if (strstr(conf, "backend:cuda") != NULL) real_streams();
    else fake_streams();
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        CHECK(pthread_create(&threads[i], NULL, worker, (void *)(intptr_t)i) == 0, "pthread_create");
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
    }
    CHECK(p_stepalloc_step_end() == STEPALLOC_OK, "%s", last_error());
    for (int d = 0; d < devices; d++) {
        check_stats(d, 0, 0);
        CHECK(stat(d, "allocated_bytes.all.current") == 0, "device %d leaks", d);
        CHECK(stat(d, "stepalloc.num_mallocs") == stat(d, "stepalloc.num_frees"), "mallocs != frees on %d", d);
        CHECK(stat(d, "stepalloc.num_mallocs") > 1000, "device %d saw few mallocs", d);
        CHECK(stat(d, "num_ooms") == 0, "unexpected OOM");
    }
    p_stepalloc_empty_cache();
    CHECK(status() == STEPALLOC_OK, "empty_cache: %s", last_error());
    for (int d = 0; d < devices; d++) {
        CHECK(stat(d, "reserved_bytes.all.current") == 0, "device %d keeps %.0f bytes after empty_cache", d,
              stat(d, "reserved_bytes.all.current"));
        check_roundtrip(d);
    }
}

/* ----- edge cases and misuse ------------------------------------------------------------ */

static void scenario_edge(void) {
    CHECK(p_stepalloc_configure("backend:sim,sim_devices:2") == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_device_count() == 2, "device_count %d", p_stepalloc_device_count());
    p_stepalloc_init(2);
    CHECK(status() == STEPALLOC_OK, "init(2): %s", last_error());
    p_stepalloc_init(3);
    CHECK(status() == STEPALLOC_INVALID_ARGUMENT, "init(3) with 2 devices: %d", status());
    cudaStream_t s1 = (cudaStream_t)(uintptr_t)1;

    /* Size 0: a valid, unique, freeable pointer. */
    void *z1 = p_stepalloc_malloc(0, 0, NULL);
    void *z2 = p_stepalloc_malloc(0, 0, NULL);
    CHECK(z1 != NULL && z2 != NULL && z1 != z2, "size 0 gave %p and %p", z1, z2);
    check_stats(0, 2, 0);
    p_stepalloc_free(z1, 0, 0, NULL);
    p_stepalloc_free(z2, 0, 0, NULL);
    CHECK(status() == STEPALLOC_OK, "free of size 0: %s", last_error());
    check_stats(0, 0, 0);

    /* SIZE_MAX: NULL with out-of-memory, nothing else changes. */
    CHECK(p_stepalloc_malloc(SIZE_MAX, 0, NULL) == NULL, "SIZE_MAX succeeded");
    CHECK(status() == STEPALLOC_OUT_OF_MEMORY, "SIZE_MAX status %d", status());
    CHECK(strncmp(last_error(), "CUDA out of memory.", 19) == 0, "SIZE_MAX message: %s", last_error());
    check_stats(0, 0, 0);
    check_roundtrip(0);

    void *p = p_stepalloc_malloc(3000, 0, s1);
    CHECK(p != NULL, "%s", last_error());
    check_stats(0, 1, 3000);

    /* Free of an unknown pointer and of an interior pointer. */
    p_stepalloc_free((void *)(uintptr_t)0xdead0000, 16, 0, NULL);
    CHECK(status() == STEPALLOC_UNKNOWN_POINTER, "unknown pointer: %d", status());
    CHECK(strstr(last_error(), "0xdead0000") != NULL, "message names the pointer: %s", last_error());
    p_stepalloc_free((char *)p + 512, 0, 0, s1);
    CHECK(status() == STEPALLOC_UNKNOWN_POINTER, "interior pointer: %d", status());
    check_stats(0, 1, 3000);

    /* Wrong size, wrong device, device out of range, negative device: refused, still live. */
    p_stepalloc_free(p, 2999, 0, s1);
    CHECK(status() == STEPALLOC_INVALID_ARGUMENT, "wrong size: %d", status());
    p_stepalloc_free(p, 3000, 1, s1);
    CHECK(status() == STEPALLOC_UNKNOWN_POINTER, "wrong device: %d", status());
    p_stepalloc_free(p, 3000, 7, s1);
    CHECK(status() == STEPALLOC_INVALID_ARGUMENT, "device 7: %d", status());
    p_stepalloc_free(p, 3000, -1, s1);
    CHECK(status() == STEPALLOC_INVALID_ARGUMENT, "device -1: %d", status());
    CHECK(p_stepalloc_malloc(10, -1, NULL) == NULL && status() == STEPALLOC_INVALID_ARGUMENT, "malloc device -1");
    CHECK(p_stepalloc_malloc(10, 2, NULL) == NULL && status() == STEPALLOC_INVALID_ARGUMENT, "malloc device 2");
    check_stats(0, 1, 3000);
    check_stats(1, 0, 0);

    /* base_alloc: the segment around any interior pointer; NULL size refused. */
    size_t seg_size = 0;
    void *base = p_stepalloc_base_alloc((char *)p + 100, &seg_size);
    CHECK(base != NULL && (char *)base <= (char *)p && (char *)p + 3000 <= (char *)base + seg_size,
          "base_alloc gave %p + %zu for %p", base, seg_size, p);
    CHECK(p_stepalloc_base_alloc(p, NULL) == NULL && status() == STEPALLOC_INVALID_ARGUMENT, "base_alloc NULL");
    CHECK(p_stepalloc_base_alloc((void *)16, &seg_size) == NULL && status() == STEPALLOC_UNKNOWN_POINTER,
          "base_alloc of unknown pointer");
    p_stepalloc_record_stream((void *)16, s1);
    CHECK(status() == STEPALLOC_UNKNOWN_POINTER, "record_stream of unknown pointer: %d", status());

    /* The right free works, then a double free is refused. */
    p_stepalloc_free(p, 3000, 0, s1);
    CHECK(status() == STEPALLOC_OK, "%s", last_error());
    p_stepalloc_free(p, 3000, 0, s1);
    CHECK(status() == STEPALLOC_UNKNOWN_POINTER, "double free: %d", status());
    p_stepalloc_free(NULL, 0, 0, NULL);
    CHECK(status() == STEPALLOC_OK, "free(NULL) is a no-op");
    check_stats(0, 0, 0);
    check_roundtrip(0);
    check_roundtrip(1);

    /* Control misuse. */
    p_stepalloc_set_memory_fraction(1.5, 0);
    CHECK(status() == STEPALLOC_INVALID_ARGUMENT, "fraction 1.5: %d", status());
    CHECK(p_stepalloc_step_begin(NULL) == STEPALLOC_INVALID_ARGUMENT, "step_begin(NULL)");
    CHECK(p_stepalloc_configure("backend:sim") == STEPALLOC_INVALID_ARGUMENT, "configure after first use");
    CHECK(strstr(last_error(), "already initialised") != NULL, "%s", last_error());
    CHECK(p_stepalloc_reset_peak_stats(5) == STEPALLOC_INVALID_ARGUMENT, "reset_peak_stats(5)");
    CHECK(p_stepalloc_reset_peak_stats(0) == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_reset_accumulated_stats(1) == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_stats_json(9, NULL, 0) == 0 && status() == STEPALLOC_INVALID_ARGUMENT, "stats_json(9)");

    /* Text functions: measure, truncate with a NUL, full write. */
    size_t n = p_stepalloc_config_help(NULL, 0);
    CHECK(n > 100, "config_help length %zu", n);
    char small[8];
    memset(small, 'x', sizeof small);
    CHECK(p_stepalloc_config_help(small, sizeof small) == n && small[7] == '\0' && strlen(small) == 7, "truncation");
    char *help = (char *)malloc(n + 1);
    CHECK(p_stepalloc_config_help(help, n + 1) == n && strlen(help) == n, "full write");
    CHECK(strstr(help, "max_split_size_mb") != NULL && strstr(help, "backend") != NULL, "help: %s", help);
    free(help);
    size_t snap = p_stepalloc_snapshot_json(NULL, 0);
    CHECK(snap > 0 && status() == STEPALLOC_OK, "snapshot_json: %s", last_error());
    p_stepalloc_trace_jsonl(NULL, 0);
    CHECK(status() == STEPALLOC_OK, "trace_jsonl: %s", last_error());
    p_stepalloc_metrics_text(NULL, 0);
    CHECK(status() == STEPALLOC_OK, "metrics_text: %s", last_error());
    CHECK(p_stepalloc_metrics_serve("127.0.0.1:notaport") == STEPALLOC_INVALID_ARGUMENT, "bad address: %s",
          last_error());
    CHECK(p_stepalloc_metrics_serve("127.0.0.1:0") == STEPALLOC_OK, "metrics_serve: %s", last_error());
    CHECK(p_stepalloc_metrics_serve("127.0.0.1:0") == STEPALLOC_INVALID_ARGUMENT, "second endpoint");
    CHECK(strstr(last_error(), "already serving on 127.0.0.1:") != NULL, "%s", last_error());
    const char *version = p_stepalloc_version();
    CHECK(version != NULL && version[0] >= '0' && version[0] <= '9', "version %s", version ? version : "NULL");

    /* The last error survives successful calls; the status does not. */
    p_stepalloc_free((void *)(uintptr_t)0xbad000, 0, 0, NULL);
    check_roundtrip(0);
    CHECK(status() == STEPALLOC_OK, "status after success");
    CHECK(strstr(last_error(), "0xbad000") != NULL, "last error kept: %s", last_error());
    check_stats(0, 0, 0);
}

/* ----- configuration errors ------------------------------------------------------------- */

static void scenario_bad_config(void) {
    CHECK(p_stepalloc_configure("max_split_size_mb:abc") == STEPALLOC_CONFIG, "bad value");
    CHECK(strstr(last_error(), "max_split_size_mb") != NULL, "names the key: %s", last_error());
    CHECK(strstr(last_error(), "stepalloc_configure") != NULL, "names the source: %s", last_error());
    CHECK(p_stepalloc_configure("sim_capacity_mb:0") == STEPALLOC_CONFIG, "capacity 0");
    CHECK(strstr(last_error(), "`0`") != NULL && strstr(last_error(), "2..16777216") != NULL, "value and range: %s",
          last_error());
    CHECK(p_stepalloc_configure("no_such_key:1") == STEPALLOC_CONFIG, "unknown key");
    CHECK(strstr(last_error(), "no_such_key") != NULL && strstr(last_error(), "accepted keys") != NULL, "%s",
          last_error());
    CHECK(p_stepalloc_configure("backend") == STEPALLOC_CONFIG, "no value");
    CHECK(p_stepalloc_configure("backend:sim,page_reuse:True") == STEPALLOC_CONFIG, "page_reuse needs expandable segments");
    CHECK(p_stepalloc_configure(NULL) == STEPALLOC_INVALID_ARGUMENT, "NULL");
    CHECK(p_stepalloc_configure("backend:sim,\xff:1") == STEPALLOC_INVALID_ARGUMENT, "not UTF-8");
    /* With a length, an embedded NUL is refused, not read as the end. */
    static const char with_nul[] = "backend:sim\0garbage";
    CHECK(p_stepalloc_configure_len(with_nul, sizeof with_nul - 1) == STEPALLOC_CONFIG, "NUL inside");
    CHECK(strstr(last_error(), "NUL character") != NULL && strstr(last_error(), "garbage") != NULL, "%s",
          last_error());
    CHECK(p_stepalloc_configure_len(NULL, 0) == STEPALLOC_INVALID_ARGUMENT, "NULL with a length");
    /* Nothing was applied: a good configuration still can be. */
    static const char good[] = "backend:sim,sim_capacity_mb:1024,trailing bytes not read";
    CHECK(p_stepalloc_configure_len(good, 32) == STEPALLOC_OK, "%s", last_error());
    static const char phase[] = "ab\0cd";
    /* A phase is checked without creating the allocator. */
    CHECK(p_stepalloc_check_phase(phase, sizeof phase - 1) == STEPALLOC_INVALID_ARGUMENT, "NUL in a phase");
    CHECK(p_stepalloc_check_phase("train!", 6) == STEPALLOC_INVALID_ARGUMENT, "'!' in a phase");
    CHECK(strstr(last_error(), "train!") != NULL, "%s", last_error());
    CHECK(p_stepalloc_check_phase("train!", 5) == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_check_phase(NULL, 0) == STEPALLOC_INVALID_ARGUMENT, "NULL phase");
    CHECK(p_stepalloc_is_initialised() == 0, "checking a phase created the allocator");
    CHECK(p_stepalloc_step_begin_len(phase, sizeof phase - 1) == STEPALLOC_INVALID_ARGUMENT, "NUL in a phase");
    CHECK(strstr(last_error(), "ab\\0cd") != NULL, "the whole name, escaped: %s", last_error());
    CHECK(p_stepalloc_step_begin_len("train!", 5) == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_step_end() == STEPALLOC_OK, "%s", last_error());
    check_roundtrip(0);
    CHECK(stat(0, "stepalloc.device_total_bytes") == 1024.0 * MIB, "capacity");
    check_stats(0, 0, 0);
}

/* memory_snapshot in one pass: the fill that follows a measuring call
 * writes the text measured then, so the snapshot is built once even if the state changed. */
static void scenario_snapshot_once(void) {
    CHECK(p_stepalloc_configure("backend:sim") == STEPALLOC_OK, "%s", last_error());
    void *a = p_stepalloc_malloc(4096, 0, NULL);
    CHECK(a != NULL, "malloc: %s", last_error());
    size_t n = p_stepalloc_snapshot_json(NULL, 0);
    CHECK(n > 0, "measure: %s", last_error());
    void *b = p_stepalloc_malloc(3 << 20, 0, NULL); /* a new segment after the measure */
    CHECK(b != NULL, "malloc: %s", last_error());
    char *buf = (char *)malloc(n + 1);
    CHECK(p_stepalloc_snapshot_json(buf, n + 1) == n, "the fill writes the measured text");
    CHECK(strlen(buf) == n && buf[0] == '{' && buf[n - 1] == '}', "whole JSON object");
    /* Without a measure first, a fill renders afresh: now longer (the new segment). */
    CHECK(p_stepalloc_snapshot_json(buf, n + 1) > n, "fresh text includes the new segment");
    free(buf);
    p_stepalloc_free(a, 4096, 0, NULL);
    p_stepalloc_free(b, 3 << 20, 0, NULL);
}

/* STEPALLOC_CONF is bad (set by the caller): use fails with a clear error until configured. */
static void scenario_bad_env(void) {
    CHECK(p_stepalloc_malloc(100, 0, NULL) == NULL, "malloc with a bad STEPALLOC_CONF");
    CHECK(status() == STEPALLOC_CONFIG, "status %d", status());
    CHECK(strstr(last_error(), "max_split_size_mb") != NULL, "%s", last_error());
    CHECK(strstr(last_error(), "STEPALLOC_CONF") != NULL, "names the source: %s", last_error());
    CHECK(p_stepalloc_device_count() == -1, "device_count");
    CHECK(p_stepalloc_configure("backend:sim") == STEPALLOC_OK, "recover: %s", last_error());
    check_roundtrip(0);
    check_stats(0, 0, 0);
}

/* backend:auto without a CUDA driver: a clear error, no crash. */
static void scenario_no_backend(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL) cuda = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (cuda != NULL) {
        printf("skip no_backend: a CUDA driver is installed\n");
        return;
    }
    CHECK(p_stepalloc_configure("backend:auto") == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_malloc(100, 0, NULL) == NULL, "malloc without a driver");
    CHECK(status() == STEPALLOC_UNAVAILABLE, "status %d", status());
    CHECK(strstr(last_error(), "backend:sim") != NULL && strstr(last_error(), "libcuda") != NULL, "%s",
          last_error());
    p_stepalloc_free((void *)(uintptr_t)0x1000, 0, 0, NULL);
    CHECK(status() == STEPALLOC_UNAVAILABLE, "free status %d", status());
}

/* ----- out of memory through stepalloc_malloc ------------------------------------------- */

/* The observer's calls (torch._C._cuda_attach_out_of_memory_observer). */
static int g_observed;
static int64_t g_observed_device;
static size_t g_observed_alloc, g_observed_limit, g_observed_free;

static void oom_observer(int64_t device, size_t alloc, size_t limit, size_t free_bytes) {
    g_observed++;
    g_observed_device = device;
    g_observed_alloc = alloc;
    g_observed_limit = limit;
    g_observed_free = free_bytes;
}

static void scenario_oom(void) {
    CHECK(p_stepalloc_configure("backend:sim,sim_capacity_mb:64") == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_attach_oom_observer(NULL) == STEPALLOC_INVALID_ARGUMENT, "a NULL observer");
    CHECK(p_stepalloc_attach_oom_observer(oom_observer) == STEPALLOC_OK, "%s", last_error());
    void *a = p_stepalloc_malloc(40 * MIB, 0, NULL);
    CHECK(a != NULL, "first 40 MiB: %s", last_error());
    CHECK(g_observed == 0, "observer called %d times without an out-of-memory", g_observed);
    void *b = p_stepalloc_malloc(40 * MIB, 0, NULL);
    CHECK(b == NULL, "second 40 MiB fits in 64 MiB?");
    CHECK(status() == STEPALLOC_OUT_OF_MEMORY, "status %d", status());
    CHECK(strncmp(last_error(), "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 64.00 MiB",
                  88) == 0,
          "message: %s", last_error());
    CHECK(g_observed == 1 && g_observed_device == 0 && g_observed_alloc == 40 * MIB && g_observed_limit == 64 * MIB &&
              g_observed_free == 24 * MIB,
          "observer: %d calls, device %lld, %zu asked, %zu limit, %zu free", g_observed, (long long)g_observed_device,
          g_observed_alloc, g_observed_limit, g_observed_free);
    CHECK(stat(0, "num_ooms") == 1, "num_ooms %.0f", stat(0, "num_ooms"));
    check_stats(0, 1, 40.0 * MIB);
    p_stepalloc_free(a, 40 * MIB, 0, NULL);
    CHECK(status() == STEPALLOC_OK, "%s", last_error());
    b = p_stepalloc_malloc(40 * MIB, 0, NULL);
    CHECK(b != NULL, "40 MiB after the free: %s", last_error());
    p_stepalloc_free(b, 40 * MIB, 0, NULL);
    check_stats(0, 0, 0);
    /* caching_allocator_enable(False): a segment of its own, back to the device at the free;
       the 40 MiB cached stays cached. */
    double cached = stat(0, "reserved_bytes.all.current");
    CHECK(cached == 40.0 * MIB, "cached %.0f", cached);
    CHECK(p_stepalloc_caching_enabled() == 1, "caching enabled at start");
    CHECK(p_stepalloc_set_caching_enabled(0) == STEPALLOC_OK && p_stepalloc_caching_enabled() == 0, "%s", last_error());
    void *uncached = p_stepalloc_malloc(100, 0, NULL);
    CHECK(uncached != NULL && stat(0, "reserved_bytes.all.current") == cached + 2 * MIB, "uncached: %s", last_error());
    p_stepalloc_free(uncached, 100, 0, NULL);
    CHECK(stat(0, "reserved_bytes.all.current") == cached, "uncached block kept: %.0f", stat(0, "reserved_bytes.all.current"));
    CHECK(p_stepalloc_set_caching_enabled(1) == STEPALLOC_OK && p_stepalloc_caching_enabled() == 1, "%s", last_error());
    check_roundtrip(0);
}

/* ----- MemPool mode and a memory fraction of 0 ------------------------------------------ */

static void scenario_mempool(void) {
    CHECK(p_stepalloc_configure("backend:sim,sim_capacity_mb:256") == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_set_mempool_mode(1) == STEPALLOC_OK, "%s", last_error());
    /* torch.cuda.MemPool asks for whole segments and frees one only to give it back. */
    void *a = p_stepalloc_malloc(2 * MIB, 0, NULL);
    void *b = p_stepalloc_malloc(20 * MIB, 0, NULL);
    void *c = p_stepalloc_malloc(64 * MIB, 0, NULL);
    CHECK(a != NULL && b != NULL && c != NULL, "segments: %s", last_error());
    p_stepalloc_free(c, 64 * MIB, 0, NULL);
    p_stepalloc_free(b, 20 * MIB, 0, NULL);
    p_stepalloc_free(a, 2 * MIB, 0, NULL);
    CHECK(status() == STEPALLOC_OK, "%s", last_error());
    CHECK(stat(0, "reserved_bytes.all.current") == 0, "MemPool mode keeps %.0f bytes after the frees",
          stat(0, "reserved_bytes.all.current"));
    /* set_per_process_memory_fraction(0.0), as PyTorch accepts it: nothing may be reserved. */
    CHECK(p_stepalloc_memory_fraction(0) == 1.0, "fraction before any set: %f", p_stepalloc_memory_fraction(0));
    p_stepalloc_set_memory_fraction(0.0, 0);
    CHECK(status() == STEPALLOC_OK, "fraction 0: %s", last_error());
    CHECK(p_stepalloc_memory_fraction(0) == 0.0, "fraction read back: %f", p_stepalloc_memory_fraction(0));
    CHECK(p_stepalloc_memory_fraction(99) == -1.0 && status() == STEPALLOC_INVALID_ARGUMENT, "device 99: %d", status());
    CHECK(p_stepalloc_malloc(4096, 0, NULL) == NULL && status() == STEPALLOC_OUT_OF_MEMORY, "fraction 0 allows %d",
          status());
    p_stepalloc_set_memory_fraction(1.0, 0);
    check_stats(0, 0, 0);
    check_roundtrip(0);
}

/* ----- expandable segments: no base allocation; address space, not memory, runs out ----- */

static void scenario_expandable(void) {
    /* 1 GiB device, 3 GiB of address space: two PyTorch-size ranges (1.125 GiB) fit. */
    CHECK(p_stepalloc_configure("backend:sim,sim_capacity_mb:1024,sim_address_space_mb:3072,expandable_segments:True")
              == STEPALLOC_OK,
          "%s", last_error());
    void *p = p_stepalloc_malloc(3 * MIB, 0, NULL);
    CHECK(p != NULL, "3 MiB: %s", last_error());
    /* As PyTorch's getBaseAllocation: refused, not the whole reserved range. */
    size_t seg_size = 12345;
    CHECK(p_stepalloc_base_alloc((char *)p + 100, &seg_size) == NULL, "base_alloc of an expandable block");
    CHECK(status() == STEPALLOC_INVALID_ARGUMENT, "status %d", status());
    CHECK(strstr(last_error(), "expandable") != NULL && strstr(last_error(), "cannot be shared") != NULL, "%s",
          last_error());
    CHECK(seg_size == 12345, "size written on refusal: %zu", seg_size);
    /* One 4 KiB block per stream: past two streams the ranges are sized to their pages; the
       address space runs out after about 3 GiB / 2 MiB of them, with memory to spare, and the
       error says so. */
    void *blocks[2048];
    int n = 0;
    for (; n < 2048; n++) {
        blocks[n] = p_stepalloc_malloc(4096, 0, (void *)(uintptr_t)(0x100 + n));
        if (blocks[n] == NULL) break;
    }
    CHECK(n > 300 && n < 2048, "%d streams got a block", n);
    CHECK(status() == STEPALLOC_OUT_OF_MEMORY, "status %d", status());
    CHECK(strncmp(last_error(), "CUDA out of memory.", 19) == 0 && strstr(last_error(), "address space ran out") != NULL,
          "message: %s", last_error());
    for (int i = 0; i < n; i++) p_stepalloc_free(blocks[i], 4096, 0, (void *)(uintptr_t)(0x100 + i));
    p_stepalloc_free(p, 3 * MIB, 0, NULL);
    CHECK(status() == STEPALLOC_OK, "%s", last_error());
    check_stats(0, 0, 0);
    check_roundtrip(0);
}

/* ----- CUDA IPC at the boundary (the simulated device names handles, opens none) ---------- */

static void scenario_ipc(void) {
    CHECK(p_stepalloc_configure("backend:sim,sim_capacity_mb:256") == STEPALLOC_OK, "%s", last_error());
    void *pad = p_stepalloc_malloc(2 * MIB, 0, NULL);
    void *x = p_stepalloc_malloc(3 * MIB, 0, NULL);
    CHECK(pad != NULL && x != NULL, "%s", last_error());
    /* Measure, then fill: PyTorch's legacy format, version 3, type 'c', 64 handle bytes. */
    uint64_t offset = 7;
    size_t n = p_stepalloc_ipc_share(x, 0, NULL, 0, &offset);
    CHECK(n == 66 && offset == (uint64_t)((char *)x - (char *)pad), "share: %zu bytes, offset %llu: %s", n,
          (unsigned long long)offset, last_error());
    char handle[66];
    CHECK(p_stepalloc_ipc_share(x, 0, handle, sizeof handle, &offset) == 66 && handle[0] == 3 && handle[1] == 'c',
          "handle %d %c", handle[0], handle[1]);
    /* For a receiver's torch before 2.13: version 2, the same payload; the same bytes again. */
    char v2[66];
    CHECK(p_stepalloc_ipc_share(x, 2, v2, sizeof v2, &offset) == 66 && v2[0] == 2 && memcmp(v2 + 1, handle + 1, 65) == 0,
          "version 2 handle %d %c", v2[0], v2[1]);
    CHECK(p_stepalloc_ipc_share(x, 7, v2, sizeof v2, &offset) == 0 && status() == STEPALLOC_INVALID_ARGUMENT &&
              strstr(last_error(), "handle version 7") != NULL,
          "version 7: %s", last_error());
    /* Misuse: a NULL offset, an interior pointer, NULL arguments, a malformed handle. */
    CHECK(p_stepalloc_ipc_share(x, 3, handle, sizeof handle, NULL) == 0 && status() == STEPALLOC_INVALID_ARGUMENT,
          "NULL offset: %d", status());
    CHECK(p_stepalloc_ipc_share((char *)x + 512, 3, handle, sizeof handle, &offset) == 0 &&
              status() == STEPALLOC_UNKNOWN_POINTER,
          "interior pointer: %d", status());
    void *opened = NULL;
    CHECK(p_stepalloc_ipc_open(0, NULL, 66, 0, 1, &opened) == STEPALLOC_INVALID_ARGUMENT, "NULL handle");
    CHECK(p_stepalloc_ipc_open(0, handle, 66, 0, 1, NULL) == STEPALLOC_INVALID_ARGUMENT, "NULL out");
    CHECK(p_stepalloc_ipc_open(0, handle, 5, 0, 1, &opened) == STEPALLOC_INVALID_ARGUMENT &&
              strstr(last_error(), "CUDA IPC handle") != NULL,
          "short handle: %s", last_error());
    CHECK(p_stepalloc_ipc_open(0, handle, 66, 0, 1, &opened) != STEPALLOC_OK && opened == NULL, "the sim opened a handle");
    CHECK(p_stepalloc_ipc_close(0, x) == STEPALLOC_UNKNOWN_POINTER, "close of a range never opened: %d", status());
    p_stepalloc_free(x, 3 * MIB, 0, NULL);
    p_stepalloc_free(pad, 2 * MIB, 0, NULL);
    check_stats(0, 0, 0);
}

/* ----- sleep and wake: regions, pause, resume, their outcomes ---------------------------- */

/* The last pause/resume report (static buffer). */
static const char *report(void) {
    static char buf[4096];
    size_t n = p_stepalloc_sleep_report_json(buf, sizeof buf);
    CHECK(n > 0 && n < sizeof buf, "report of %zu bytes", n);
    return buf;
}

static const char *tags_json(void) {
    static char buf[1 << 16];
    size_t n = p_stepalloc_tags_json(buf, sizeof buf);
    CHECK(n > 0 && n < sizeof buf, "tags json of %zu bytes: %s", n, last_error());
    return buf;
}

static void scenario_sleep(void) {
    CHECK(p_stepalloc_configure("backend:sim,sim_capacity_mb:1024,sim_devices:2") == STEPALLOC_OK, "%s",
          last_error());
    CHECK(p_stepalloc_region_enter("weights", 1) == STEPALLOC_OK, "%s", last_error());
    void *w0 = p_stepalloc_malloc(100 * MIB, 0, NULL);
    void *w1 = p_stepalloc_malloc(10 * MIB, 1, NULL);
    CHECK(p_stepalloc_region_enter("kv_cache", 0) == STEPALLOC_OK, "nested: %s", last_error());
    void *kv = p_stepalloc_malloc(300 * MIB, 0, NULL);
    CHECK(p_stepalloc_region_exit() == STEPALLOC_OK && p_stepalloc_region_exit() == STEPALLOC_OK, "exits");
    void *plain = p_stepalloc_malloc(50 * MIB, 0, NULL);
    CHECK(w0 && w1 && kv && plain, "tagged mallocs: %s", last_error());
    /* Misuse: no region left, bad names and flags, a tag never seen, "default". */
    CHECK(p_stepalloc_region_exit() == STEPALLOC_INVALID_ARGUMENT, "exit without a region");
    CHECK(p_stepalloc_region_enter("bad tag", 0) == STEPALLOC_INVALID_ARGUMENT, "a space in a tag");
    CHECK(p_stepalloc_region_enter(NULL, 0) == STEPALLOC_INVALID_ARGUMENT, "NULL tag");
    CHECK(p_stepalloc_region_enter("weights", 4) == STEPALLOC_INVALID_ARGUMENT, "backup 4");
    /* keep_cached: a setting of a name, refused for "default" and bad names. */
    CHECK(p_stepalloc_tag_keep_cached("default", 1) == STEPALLOC_INVALID_ARGUMENT, "keep_cached of default");
    CHECK(p_stepalloc_tag_keep_cached(NULL, 1) == STEPALLOC_INVALID_ARGUMENT, "keep_cached of NULL");
    CHECK(p_stepalloc_tag_keep_cached("bad tag", 1) == STEPALLOC_INVALID_ARGUMENT, "keep_cached of a bad name");
    CHECK(p_stepalloc_tag_keep_cached("kv_cache", 1) == STEPALLOC_OK &&
              p_stepalloc_tag_keep_cached("kv_cache", 0) == STEPALLOC_OK,
          "keep_cached on and off: %s", last_error());
    CHECK(p_stepalloc_region_enter("weights", -1) == STEPALLOC_INVALID_ARGUMENT, "backup -1");
    CHECK(p_stepalloc_set_backup_dir(NULL) == STEPALLOC_INVALID_ARGUMENT, "NULL backup dir");
    CHECK(p_stepalloc_set_backup_dir("/proc/version/sub") == STEPALLOC_INVALID_ARGUMENT &&
              strstr(last_error(), "/proc/version/sub"),
          "a backup dir under a file: %s", last_error());
    CHECK(p_stepalloc_pause("never_seen", -1) == STEPALLOC_INVALID_ARGUMENT && strstr(last_error(), "never_seen"),
          "unknown tag: %s", last_error());
    CHECK(p_stepalloc_pause("default", -1) == STEPALLOC_INVALID_ARGUMENT, "pause of default");
    CHECK(p_stepalloc_pause("weights", 3) == STEPALLOC_INVALID_ARGUMENT, "backup 3");
    double reserved0 = stat(0, "reserved_bytes.all.current");
    /* Pause every tag: weights backed up (policy), kv discarded. */
    CHECK(p_stepalloc_pause(NULL, -1) == STEPALLOC_OK, "pause: %s", last_error());
    const char *r = report();
    CHECK(strstr(r, "\"op\":\"pause\"") && strstr(r, "\"tags\":[\"weights\",\"kv_cache\"]"), "%s", r);
    CHECK(strstr(r, "\"copied_bytes\":115343360,") && strstr(r, "\"discarded_bytes\":314572800,"), "%s", r);
    double reserved1 = stat(0, "reserved_bytes.all.current");
    CHECK(reserved0 - reserved1 >= 400.0 * MIB, "pause released %.0f bytes", reserved0 - reserved1);
    CHECK(stat(1, "reserved_bytes.all.current") == 0, "device 1 keeps %.0f", stat(1, "reserved_bytes.all.current"));
    CHECK(stat(0, "stepalloc.tag.weights.paused_bytes") == 100.0 * MIB, "paused bytes");
    CHECK(stat(0, "stepalloc.backup_host_bytes") >= 100.0 * MIB, "host backup bytes");
    check_stats(0, 1, 50.0 * MIB);
    /* Pause again: skipped. An allocation in a paused tag's region: STEPALLOC_PAUSED. */
    CHECK(p_stepalloc_pause("weights", -1) == STEPALLOC_OK && strstr(report(), "\"skipped\":[\"weights\"]"), "%s",
          report());
    CHECK(p_stepalloc_region_enter("kv_cache", 0) == STEPALLOC_OK, "enter");
    CHECK(p_stepalloc_malloc(MIB, 0, NULL) == NULL && status() == STEPALLOC_PAUSED && strstr(last_error(), "kv_cache"),
          "malloc in a paused region: %d %s", status(), last_error());
    CHECK(p_stepalloc_region_exit() == STEPALLOC_OK, "exit");
    /* A free while paused drops the block; empty_cache touches nothing paused. */
    p_stepalloc_free(kv, 300 * MIB, 0, NULL);
    CHECK(status() == STEPALLOC_OK, "free while paused: %s", last_error());
    p_stepalloc_free(kv, 300 * MIB, 0, NULL);
    CHECK(status() == STEPALLOC_UNKNOWN_POINTER, "double free while paused: %d", status());
    p_stepalloc_empty_cache();
    CHECK(status() == STEPALLOC_OK, "empty_cache while paused: %s", last_error());
    const char *t = tags_json();
    CHECK(strstr(t, "\"weights\":{") && strstr(t, "\"paused\":true") && strstr(t, "\"default\":{"), "%s", t);
    /* Resume under memory pressure: out of memory naming the tag; retry after a free. */
    void *hog = p_stepalloc_malloc(900 * MIB, 0, NULL);
    CHECK(hog != NULL, "hog: %s", last_error());
    CHECK(p_stepalloc_resume(NULL) == STEPALLOC_OUT_OF_MEMORY && strstr(last_error(), "weights"), "resume: %d %s",
          status(), last_error());
    CHECK(stat(0, "stepalloc.tag.weights.paused_bytes") == 100.0 * MIB, "still paused after the failure");
    p_stepalloc_free(hog, 900 * MIB, 0, NULL);
    CHECK(p_stepalloc_resume(NULL) == STEPALLOC_OK, "resume: %s", last_error());
    r = report();
    CHECK(strstr(r, "\"op\":\"resume\"") && strstr(r, "\"copied_bytes\":115343360,"), "%s", r);
    CHECK(p_stepalloc_resume("weights") == STEPALLOC_OK && strstr(report(), "\"skipped\":[\"weights\"]"), "%s",
          report());
    check_stats(0, 2, 150.0 * MIB);
    /* A list of tags in one call: a bad list changes nothing; a good one pauses and resumes both. */
    CHECK(p_stepalloc_pause_tags("weights,,kv_cache", -1) == STEPALLOC_INVALID_ARGUMENT, "empty name: %s", last_error());
    CHECK(p_stepalloc_pause_tags(NULL, -1) == STEPALLOC_INVALID_ARGUMENT, "NULL list");
    CHECK(p_stepalloc_pause_tags("weights,never_seen", -1) == STEPALLOC_INVALID_ARGUMENT &&
              strstr(last_error(), "never_seen") && stat(0, "stepalloc.tag.weights.paused_bytes") == 0,
          "a list with an unknown tag: %s", last_error());
    CHECK(p_stepalloc_pause_tags("weights=2,kv_cache", -1) == STEPALLOC_INVALID_ARGUMENT, "backup =2");
    CHECK(p_stepalloc_pause_tags("weights=1,kv_cache=0", 0) == STEPALLOC_OK &&
              strstr(report(), "\"tags\":[\"weights\",\"kv_cache\"]") && strstr(report(), "\"copied_bytes\":115343360,"),
          "pause_tags: %s %s", last_error(), report());
    CHECK(stat(0, "stepalloc.tag.weights.paused_bytes") == 100.0 * MIB, "paused by the list");
    CHECK(p_stepalloc_resume_tags("kv_cache,weights") == STEPALLOC_OK && strstr(report(), "\"copied_bytes\":115343360,"),
          "resume_tags: %s %s", last_error(), report());
    p_stepalloc_free(w0, 100 * MIB, 0, NULL);
    p_stepalloc_free(w1, 10 * MIB, 1, NULL);
    p_stepalloc_free(plain, 50 * MIB, 0, NULL);
    CHECK(p_stepalloc_release_backup() == STEPALLOC_OK, "%s", last_error());
    CHECK(stat(0, "stepalloc.backup_host_bytes") == 0, "backup kept after release_backup");
    /* The mmap store (backup 2): the bytes go to pageable host memory, none to pinned. */
    CHECK(p_stepalloc_region_enter("weights", 2) == STEPALLOC_OK, "%s", last_error());
    void *m0 = p_stepalloc_malloc(8 * MIB, 0, NULL);
    CHECK(m0 && p_stepalloc_region_exit() == STEPALLOC_OK, "mmap region: %s", last_error());
    CHECK(p_stepalloc_pause("weights", -1) == STEPALLOC_OK && strstr(report(), "\"copied_bytes\":8388608,"), "%s",
          report());
    CHECK(stat(0, "stepalloc.backup_host_bytes") == 0, "the mmap store pinned %.0f bytes",
          stat(0, "stepalloc.backup_host_bytes"));
    t = tags_json();
    CHECK(strstr(t, "\"mmap_bytes\":67108864") && strstr(t, "\"host_bytes\":0,"), "mmap bytes: %s", t);
    CHECK(p_stepalloc_resume("weights") == STEPALLOC_OK && strstr(report(), "\"copied_bytes\":8388608,"), "%s",
          report());
    p_stepalloc_free(m0, 8 * MIB, 0, NULL);
    CHECK(p_stepalloc_release_backup() == STEPALLOC_OK && strstr(tags_json(), "\"mmap_bytes\":0,"), "%s", tags_json());
    char dir[512];
    size_t dir_len = p_stepalloc_backup_dir(dir, sizeof dir);
    CHECK(dir_len > 0 && dir_len < sizeof dir, "backup dir: %zu", dir_len);
    /* A tag lent for a while (autograd's thread during a backward called inside a region): the
       borrower allocates under it until the lender ends the lease; an ended lease is refused. */
    uint64_t lease = 1;
    CHECK(p_stepalloc_region_lend(&lease) == STEPALLOC_OK && lease == 0, "outside a region nothing is lent");
    CHECK(p_stepalloc_region_lend(NULL) == STEPALLOC_INVALID_ARGUMENT, "NULL lease");
    CHECK(p_stepalloc_region_enter("weights", 1) == STEPALLOC_OK, "%s", last_error());
    CHECK(p_stepalloc_region_lend(&lease) == STEPALLOC_OK && lease != 0, "lend: %s", last_error());
    CHECK(p_stepalloc_region_exit() == STEPALLOC_OK, "exit");
    double lent0 = stat(0, "stepalloc.tag.weights.live_bytes");
    CHECK(p_stepalloc_region_borrow(lease) == STEPALLOC_OK, "borrow: %s", last_error());
    void *borrowed = p_stepalloc_malloc(4 * MIB, 0, NULL);
    CHECK(borrowed && stat(0, "stepalloc.tag.weights.live_bytes") == lent0 + 4.0 * MIB, "borrowed tag: %.0f",
          stat(0, "stepalloc.tag.weights.live_bytes"));
    CHECK(p_stepalloc_region_lend_end(lease) == STEPALLOC_OK, "end: %s", last_error());
    void *after_lease = p_stepalloc_malloc(4 * MIB, 0, NULL);
    CHECK(after_lease && stat(0, "stepalloc.tag.weights.live_bytes") == lent0 + 4.0 * MIB, "the lease ended");
    CHECK(p_stepalloc_region_lend_end(lease) == STEPALLOC_INVALID_ARGUMENT, "a lease ends once");
    CHECK(p_stepalloc_region_borrow(lease) == STEPALLOC_INVALID_ARGUMENT, "an ended lease is not borrowed");
    p_stepalloc_free(borrowed, 4 * MIB, 0, NULL);
    p_stepalloc_free(after_lease, 4 * MIB, 0, NULL);
    /* At most 32 tags besides "default": two so far, 30 more, then the next is refused. */
    for (int i = 0; i < 31; i++) {
        char name[32];
        snprintf(name, sizeof name, "tag_%d", i);
        int rc = p_stepalloc_region_enter(name, 0);
        if (i < 30) {
            CHECK(rc == STEPALLOC_OK && p_stepalloc_region_exit() == STEPALLOC_OK, "tag %d: %s", i, last_error());
        } else {
            CHECK(rc == STEPALLOC_INVALID_ARGUMENT, "the 33rd tag was accepted");
        }
    }
    check_stats(0, 0, 0);
    check_roundtrip(0);
}

int main(int argc, char **argv) {
    CHECK(argc == 3, "usage: %s LIBRARY SCENARIO", argv[0]);
    load_library(argv[1]);
    const char *scenario = argv[2];
    if (strcmp(scenario, "threads") == 0) scenario_threads("backend:sim,sim_devices:2");
    else if (strcmp(scenario, "threads_cuda") == 0) scenario_threads("backend:cuda");
    else if (strcmp(scenario, "edge") == 0) scenario_edge();
    else if (strcmp(scenario, "bad_config") == 0) scenario_bad_config();
    else if (strcmp(scenario, "bad_env") == 0) scenario_bad_env();
    else if (strcmp(scenario, "snapshot_once") == 0) scenario_snapshot_once();
    else if (strcmp(scenario, "no_backend") == 0) scenario_no_backend();
    else if (strcmp(scenario, "oom") == 0) scenario_oom();
    else if (strcmp(scenario, "mempool") == 0) scenario_mempool();
    else if (strcmp(scenario, "expandable") == 0) scenario_expandable();
    else if (strcmp(scenario, "sleep") == 0) scenario_sleep();
    else if (strcmp(scenario, "ipc") == 0) scenario_ipc();
    else CHECK(0, "unknown scenario %s", scenario);
    printf("ok %s\n", scenario);
    return 0;
}
