/* hostcuda_copy.c: memsets, copies and pinned host memory, for the host-memory CUDA driver
 * (hostcuda.c lists its parts). It owns the synchronous memsets and copies (potentially unsafe
 * during a capture), their forms queued on a stream (run at once, complete after the stream's
 * earlier work; recorded, not run, during a capture: hostcuda_stream.c replays them), and
 * cuMemHostAlloc / cuMemFreeHost. */
#include "hostcuda_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* memsets and synchronous copies */

CUresult cuMemsetD8_v2(CUdeviceptr ptr, unsigned char value, size_t n) {
    BEGIN(cuMemsetD8_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemsetD8_v2");
    if (r) RETURN(r);
    if (!hc_device_range(ptr, n, 1)) RETURN(E_INVALID_VALUE);
    memset((void *)(uintptr_t)ptr, value, n);
    RETURN(OK);
}

CUresult cuMemsetD8Async(CUdeviceptr ptr, unsigned char value, size_t n, void *sh) {
    BEGIN(cuMemsetD8Async);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(sh, &s);
    if (r) RETURN(r);
    if (!hc_device_range(ptr, n, 1)) RETURN(E_INVALID_VALUE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) { hc_capture_record(s, OP_SET8, ptr, value, n); RETURN(OK); } /* runs when the graph runs */
    if ((r = hc_legacy_during_capture(s))) RETURN(r);
    memset((void *)(uintptr_t)ptr, value, n);
    hc_note_use(ptr, n, hc_enqueue(s));
    RETURN(OK);
}

void hc_fill32(unsigned long long ptr, unsigned value, size_t words) {
    unsigned *p = (unsigned *)(uintptr_t)ptr;
    for (size_t i = 0; i < words; i++) p[i] = value;
}

CUresult cuMemsetD32_v2(CUdeviceptr ptr, unsigned value, size_t words) {
    BEGIN(cuMemsetD32_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemsetD32_v2");
    if (r) RETURN(r);
    if (ptr % 4 || words > (~0ull >> 2) || !hc_device_range(ptr, 4ull * words, 1)) RETURN(E_INVALID_VALUE);
    hc_fill32(ptr, value, words);
    RETURN(OK);
}

CUresult cuMemsetD32Async(CUdeviceptr ptr, unsigned value, size_t words, void *sh) {
    BEGIN(cuMemsetD32Async);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(sh, &s);
    if (r) RETURN(r);
    if (ptr % 4 || words > (~0ull >> 2) || !hc_device_range(ptr, 4ull * words, 1)) RETURN(E_INVALID_VALUE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) { hc_capture_record(s, OP_SET32, ptr, value, words); RETURN(OK); } /* runs when the graph runs */
    if ((r = hc_legacy_during_capture(s))) RETURN(r);
    hc_fill32(ptr, value, words);
    hc_note_use(ptr, 4ull * words, hc_enqueue(s));
    RETURN(OK);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    BEGIN(cuMemcpyDtoH_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemcpyDtoH_v2");
    if (r) RETURN(r);
    if (!dst || !hc_device_range(src, n, 0)) RETURN(E_INVALID_VALUE);
    memcpy(dst, (void *)(uintptr_t)src, n);
    RETURN(OK);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    BEGIN(cuMemcpyHtoD_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemcpyHtoD_v2");
    if (r) RETURN(r);
    if (!src || !hc_device_range(dst, n, 1)) RETURN(E_INVALID_VALUE);
    memcpy((void *)(uintptr_t)dst, src, n);
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* copies on streams, and between device ranges (what a CUDA runtime needs on top,
 * testdrv/hostcudart.c). Copies run at once, in call order, and complete (for events and
 * synchronize) after the stream's earlier work, like the async memsets above. */

/* Whether [ptr, ptr+n) is device memory; used by the copies in both directions. */
static CUresult copy_check(void *sh, struct stream **s, unsigned long long dev_a, int write_a,
                           unsigned long long dev_b, int has_b, size_t n) {
    CUresult r = hc_stream_of(sh, s);
    if (r) return r;
    if (n == 0) return OK;
    if (!hc_device_range(dev_a, n, write_a)) return E_INVALID_VALUE;
    if (has_b && !hc_device_range(dev_b, n, 0)) return E_INVALID_VALUE;
    if ((*s)->cap_status == CAP_INVALIDATED) return E_CAPTURE_INVALIDATED;
    return OK;
}

/* Runs a checked copy on `s`: captured (not run) during an active capture, else now. */
static CUresult copy_run(struct stream *s, void *dst, const void *src, size_t n) {
    if (s->cap_status == CAP_ACTIVE) { /* runs when the graph runs */
        hc_capture_record(s, OP_COPY, (uintptr_t)dst, (uintptr_t)src, n);
        return OK;
    }
    CUresult r = hc_legacy_during_capture(s);
    if (r) return r;
    if (n) memmove(dst, src, n);
    unsigned long long done = hc_enqueue(s);
    /* Host ranges never overlap device ranges: noting both sides is noting the device side(s). */
    hc_note_use((uintptr_t)dst, n, done);
    hc_note_use((uintptr_t)src, n, done);
    return OK;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *sh) {
    BEGIN(cuMemcpyHtoDAsync_v2);
    NEED_INIT();
    struct stream *s;
    if (!src && n) RETURN(E_INVALID_VALUE);
    CUresult r = copy_check(sh, &s, dst, 1, 0, 0, n);
    if (r) RETURN(r);
    RETURN(copy_run(s, (void *)(uintptr_t)dst, src, n));
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *sh) {
    BEGIN(cuMemcpyDtoHAsync_v2);
    NEED_INIT();
    struct stream *s;
    if (!dst && n) RETURN(E_INVALID_VALUE);
    CUresult r = copy_check(sh, &s, src, 0, 0, 0, n);
    if (r) RETURN(r);
    RETURN(copy_run(s, dst, (const void *)(uintptr_t)src, n));
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *sh) {
    BEGIN(cuMemcpyDtoDAsync_v2);
    NEED_INIT();
    struct stream *s;
    CUresult r = copy_check(sh, &s, dst, 1, src, 1, n);
    if (r) RETURN(r);
    RETURN(copy_run(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n));
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    BEGIN(cuMemcpyDtoD_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemcpyDtoD_v2");
    if (r) RETURN(r);
    if (n && (!hc_device_range(dst, n, 1) || !hc_device_range(src, n, 0))) RETURN(E_INVALID_VALUE);
    if (n) memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* pinned host memory (stepalloc's host backups, src/backend/cuda/host.rs): cuMemHostAlloc is an
 * anonymous mmap populated at once (pinned memory is resident: its first copy must not pay page
 * faults), counted against no device; cuMemFreeHost takes exactly a pointer cuMemHostAlloc gave.
 * Flags: PORTABLE (1), DEVICEMAP (2), WRITECOMBINED (4); others are CUDA_ERROR_INVALID_VALUE. */

struct host_alloc {
    void *p;
    size_t bytes;
};
static struct reg host_allocs;

CUresult cuMemHostAlloc(void **out, size_t bytes, unsigned flags) {
    BEGIN(cuMemHostAlloc);
    NEED_CTX();
    if (!out || bytes == 0 || (flags & ~7u)) RETURN(E_INVALID_VALUE);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) RETURN(E_OUT_OF_MEMORY);
    struct host_alloc *h = malloc(sizeof *h);
    if (!h || hc_reg_add(&host_allocs, h)) { free(h); munmap(p, bytes); RETURN(E_OUT_OF_MEMORY); }
    *h = (struct host_alloc){p, bytes};
    *out = p;
    RETURN(OK);
}

CUresult cuMemFreeHost(void *p) {
    BEGIN(cuMemFreeHost);
    NEED_INIT();
    for (size_t i = 0; i < host_allocs.n; i++) {
        struct host_alloc *h = host_allocs.v[i];
        if (h->p == p) {
            munmap(h->p, h->bytes);
            hc_reg_del(&host_allocs, (long)i);
            free(h);
            RETURN(OK);
        }
    }
    RETURN(E_INVALID_VALUE);
}
