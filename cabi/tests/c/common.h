/* Shared by the C and C++ test programs: load libstepalloc.so by path with dlopen and look up
 * every symbol by name, as PyTorch does; small checks and a stats reader. The header is
 * included for its types and constants and to type-check each looked-up function. */
#ifndef STEPALLOC_TEST_COMMON_H
#define STEPALLOC_TEST_COMMON_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepalloc.h"

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fputc('\n', stderr);                                                           \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* One pointer per C function, typed from the header's declaration. */
#define STEPALLOC_C_FUNCTIONS(X)                                                           \
    X(stepalloc_configure) X(stepalloc_config_help) X(stepalloc_step_begin)                \
    X(stepalloc_step_end) X(stepalloc_reset_peak_stats) X(stepalloc_reset_accumulated_stats) \
    X(stepalloc_device_count) X(stepalloc_stats_json) X(stepalloc_snapshot_json)           \
    X(stepalloc_trace_jsonl) X(stepalloc_metrics_text) X(stepalloc_metrics_serve)          \
    X(stepalloc_last_error) X(stepalloc_last_status) X(stepalloc_version)                  \
    X(stepalloc_malloc) X(stepalloc_free) X(stepalloc_init) X(stepalloc_empty_cache)       \
    X(stepalloc_set_memory_fraction) X(stepalloc_memory_fraction) X(stepalloc_set_expandable_segments) X(stepalloc_attach_oom_observer) X(stepalloc_set_caching_enabled) X(stepalloc_caching_enabled) \
    X(stepalloc_base_alloc) X(stepalloc_record_stream) \
    X(stepalloc_set_mempool_mode) X(stepalloc_configure_len) X(stepalloc_step_begin_len)    \
    X(stepalloc_check_phase) X(stepalloc_is_initialised)                                   \
    X(stepalloc_pool_create) X(stepalloc_pool_use_count)                                   \
    X(stepalloc_pool_set_segment_allocator) X(stepalloc_pool_set_use_on_oom) X(stepalloc_pool_set_no_split) \
    X(stepalloc_pool_checkpoint) X(stepalloc_pool_restore) X(stepalloc_pool_register_segments) \
    X(stepalloc_region_enter) X(stepalloc_region_exit) X(stepalloc_pause) X(stepalloc_resume) \
    X(stepalloc_pause_tags) X(stepalloc_resume_tags) X(stepalloc_tag_keep_cached) \
    X(stepalloc_sleep_report_json) X(stepalloc_release_backup) X(stepalloc_tags_json) \
    X(stepalloc_set_backup_dir) X(stepalloc_backup_dir) \
    X(stepalloc_region_lend) X(stepalloc_region_borrow) X(stepalloc_region_lend_end) \
    X(stepalloc_ipc_share) X(stepalloc_ipc_open) X(stepalloc_ipc_close) X(stepalloc_ipc_unshare)

#define DECLARE_POINTER(name) static __typeof__(name) *p_##name;
STEPALLOC_C_FUNCTIONS(DECLARE_POINTER)

static void *load_library(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen(%s): %s", path, dlerror());
#define LOOK_UP(name)                                                                      \
    p_##name = (__typeof__(name) *)dlsym(lib, #name);                                      \
    CHECK(p_##name != NULL, "dlsym(%s): %s", #name, dlerror());
    STEPALLOC_C_FUNCTIONS(LOOK_UP)
#undef LOOK_UP
    return lib;
}

/* The last error message (static buffer, truncated to 4 KiB). */
static const char *last_error(void) {
    static char buf[4096];
    p_stepalloc_last_error(buf, sizeof buf);
    return buf;
}

/* A text function's whole output in a fresh buffer (caller frees). */
static char *fetch_text(size_t (*measure_and_write)(int, char *, size_t), int device) {
    for (;;) {
        size_t n = measure_and_write(device, NULL, 0);
        char *buf = (char *)malloc(n + 1);
        CHECK(buf != NULL, "malloc");
        size_t m = measure_and_write(device, buf, n + 1);
        if (m <= n) {
            return buf;
        }
        free(buf); /* it grew in between: measure again */
    }
}

static size_t stats_of(int device, char *buf, size_t cap) { return p_stepalloc_stats_json(device, buf, cap); }

/* One numeric field of torch.cuda.memory_stats(device). */
static double stat(int device, const char *key) {
    char *json = fetch_text(stats_of, device);
    CHECK(p_stepalloc_last_status() == STEPALLOC_OK, "stats_json(%d): %s", device, last_error());
    char pattern[256];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(json, pattern);
    CHECK(at != NULL, "no key %s in stats", key);
    double value = strtod(at + strlen(pattern), NULL);
    free(json);
    return value;
}

/* The statistics agree with what the test knows is live, and with each other. */
static void check_stats(int device, double live_allocations, double live_requested) {
    double allocated = stat(device, "allocated_bytes.all.current");
    double small = stat(device, "allocated_bytes.small_pool.current");
    double large = stat(device, "allocated_bytes.large_pool.current");
    double active = stat(device, "active_bytes.all.current");
    double reserved = stat(device, "reserved_bytes.all.current");
    CHECK(allocated == small + large, "allocated %.0f != small %.0f + large %.0f", allocated, small, large);
    CHECK(allocated <= active && active <= reserved, "allocated %.0f active %.0f reserved %.0f", allocated, active,
          reserved);
    CHECK(stat(device, "allocation.all.current") == live_allocations, "allocation.all.current %.0f, expected %.0f",
          stat(device, "allocation.all.current"), live_allocations);
    CHECK(stat(device, "requested_bytes.all.current") == live_requested, "requested_bytes %.0f, expected %.0f",
          stat(device, "requested_bytes.all.current"), live_requested);
    CHECK(allocated >= live_requested, "allocated %.0f < requested %.0f", allocated, live_requested);
}

/* A further malloc/free works. */
static void check_roundtrip(int device) {
    void *p = p_stepalloc_malloc(1000, device, NULL);
    CHECK(p != NULL, "malloc after the previous case: %s", last_error());
    p_stepalloc_free(p, 1000, device, NULL);
    CHECK(p_stepalloc_last_status() == STEPALLOC_OK, "free after the previous case: %s", last_error());
}

#endif
