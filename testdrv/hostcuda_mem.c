/* hostcuda_mem.c: contexts and linear memory, for the host-memory CUDA driver (hostcuda.c lists
 * its parts). It owns the primary contexts and each thread's current context and context stack,
 * cuMemAlloc / cuMemFree / cuMemGetInfo and the registry of linear allocations (including ranges
 * opened from another process's IPC handle, hostcuda_ipc.c), what counts as device memory for
 * copies and memsets (hc_device_range), and the pointer queries (cuPointerGetAttribute,
 * cuMemGetAddressRange). */
#include "hostcuda_internal.h"

struct reg hc_allocs; /* struct alloc * */

/* ------------------------------------------------------------------------------------------ */
/* contexts */

CUresult cuDevicePrimaryCtxRetain(void **out, CUdevice dev) {
    BEGIN(cuDevicePrimaryCtxRetain);
    NEED_DEV(dev);
    if (!out) RETURN(E_INVALID_VALUE);
    hc_ctxs[dev].refs++;
    *out = &hc_ctxs[dev];
    RETURN(OK);
}

static CUresult primary_release(CUdevice dev) {
    if (hc_ctxs[dev].refs <= 0) return E_INVALID_CONTEXT;
    hc_ctxs[dev].refs--;
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    BEGIN(cuDevicePrimaryCtxRelease_v2);
    NEED_DEV(dev);
    RETURN(primary_release(dev));
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    BEGIN(cuDevicePrimaryCtxRelease);
    NEED_DEV(dev);
    RETURN(primary_release(dev));
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active) {
    BEGIN(cuDevicePrimaryCtxGetState);
    NEED_DEV(dev);
    if (!flags || !active) RETURN(E_INVALID_VALUE);
    *flags = 0;
    *active = hc_ctxs[dev].refs > 0;
    RETURN(OK);
}

CUresult cuCtxGetCurrent(void **out) {
    BEGIN(cuCtxGetCurrent);
    NEED_INIT();
    if (!out) RETURN(E_INVALID_VALUE);
    *out = hc_current;
    RETURN(OK);
}

CUresult cuCtxSetCurrent(void *c) {
    BEGIN(cuCtxSetCurrent);
    NEED_INIT();
    if (c && !hc_ctx_valid(c)) RETURN(E_INVALID_CONTEXT);
    hc_current = c;
    RETURN(OK);
}

CUresult cuCtxGetDevice(CUdevice *dev) {
    BEGIN(cuCtxGetDevice);
    NEED_CTX();
    if (!dev) RETURN(E_INVALID_VALUE);
    *dev = hc_current->dev;
    RETURN(OK);
}

/* A per-thread stack of contexts under the current one. */
static __thread struct ctx *t_stack[16];
static __thread int t_depth;

CUresult cuCtxPushCurrent_v2(void *c) {
    BEGIN(cuCtxPushCurrent_v2);
    NEED_INIT();
    if (!hc_ctx_valid(c)) RETURN(E_INVALID_CONTEXT);
    if (t_depth == 16) RETURN(E_OUT_OF_MEMORY);
    t_stack[t_depth++] = hc_current;
    hc_current = c;
    RETURN(OK);
}

CUresult cuCtxPopCurrent_v2(void **out) {
    BEGIN(cuCtxPopCurrent_v2);
    NEED_INIT();
    if (!hc_current) RETURN(E_INVALID_CONTEXT);
    if (out) *out = hc_current;
    hc_current = t_depth ? t_stack[--t_depth] : NULL;
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* linear memory */

unsigned long long hc_round_up(unsigned long long x, unsigned long long to) { return (x + to - 1) / to * to; }

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    BEGIN(cuMemGetInfo_v2);
    NEED_CTX();
    if (!free_bytes || !total) RETURN(E_INVALID_VALUE);
    int d = hc_current->dev;
    *free_bytes = hc_dev_free(d);
    *total = hc_dev_capacity();
    RETURN(OK);
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t bytes) {
    BEGIN(cuMemAlloc_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemAlloc_v2");
    if (r) RETURN(r);
    if (!out || bytes == 0) RETURN(E_INVALID_VALUE);
    int d = hc_current->dev;
    unsigned long long charged = hc_round_up(bytes, ALLOC_PAGE);
    if (hc_dev_charge(d, charged)) RETURN(E_OUT_OF_MEMORY);
    /* A memfd, so that another process can map it (cuIpcGetMemHandle). */
    int fd = -1;
    void *p = hc_warm_linear_take(charged, d, &fd);
    if (!p) {
        fd = hc_device_memfd(d);
        if (fd < 0 || ftruncate(fd, (off_t)charged)) {
            if (fd >= 0) close(fd);
            hc_dev_uncharge(d, charged);
            RETURN(E_OUT_OF_MEMORY);
        }
        p = mmap(NULL, charged, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
        if (p == MAP_FAILED) { close(fd); hc_dev_uncharge(d, charged); RETURN(E_OUT_OF_MEMORY); }
    }
    struct alloc *a = calloc(1, sizeof *a);
    if (!a || hc_reg_add(&hc_allocs, a)) { free(a); munmap(p, charged); close(fd); hc_dev_uncharge(d, charged); RETURN(E_OUT_OF_MEMORY); }
    *a = (struct alloc){.addr = (uintptr_t)p, .size = bytes, .charged = charged, .dev = d, .fd = fd};
    *out = (uintptr_t)p;
    RETURN(OK);
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    BEGIN(cuMemFree_v2);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuMemFree_v2");
    if (r) RETURN(r);
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (a->addr == ptr && !a->ipc_pid) { /* IPC mappings go with cuIpcCloseMemHandle */
            if (a->exported) {
                munmap((void *)(uintptr_t)a->addr, a->charged);
                close(a->fd);
            } else {
                hc_warm_linear_put((void *)(uintptr_t)a->addr, a->fd, a->dev, a->charged);
            }
            hc_dev_uncharge(a->dev, a->charged);
            hc_reg_del(&hc_allocs, (long)i);
            free(a);
            RETURN(OK);
        }
    }
    RETURN(E_INVALID_VALUE);
}

/* Whether [ptr, ptr+n) is device memory: inside one allocation, or mapped throughout with
 * access that allows writing (`write`) or reading. */
int hc_device_range(unsigned long long ptr, unsigned long long n, int write) {
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (ptr >= a->addr && ptr + n <= a->addr + a->size) return 1;
    }
    unsigned long long pos = ptr, end = ptr + n;
    while (pos < end) {
        struct mapping *hit = NULL;
        for (size_t i = 0; i < hc_maps.n && !hit; i++) {
            struct mapping *m = hc_maps.v[i];
            if (pos >= m->addr && pos < m->addr + m->size) hit = m;
        }
        if (!hit || !(hit->prot & (write ? PROT_WRITE : PROT_READ))) return 0;
        pos = hit->addr + hit->size;
    }
    return n > 0;
}

/* ------------------------------------------------------------------------------------------ */
/* pointer queries */

/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2: CU_MEMORYTYPE_DEVICE) and DEVICE_ORDINAL (9) of device
 * memory; any other pointer is CUDA_ERROR_INVALID_VALUE, as for unregistered host memory. */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    BEGIN(cuPointerGetAttribute);
    NEED_INIT();
    if (!data) RETURN(E_INVALID_VALUE);
    int dev = -1;
    for (size_t i = 0; i < hc_allocs.n && dev < 0; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (ptr >= a->addr && ptr < a->addr + a->size) dev = a->dev;
    }
    for (size_t i = 0; i < hc_maps.n && dev < 0; i++) {
        struct mapping *m = hc_maps.v[i];
        if (ptr >= m->addr && ptr < m->addr + m->size) dev = m->p->dev;
    }
    if (dev < 0) RETURN(E_INVALID_VALUE);
    if (attribute == 2) *(unsigned *)data = 2;
    else if (attribute == 9) *(int *)data = dev;
    else RETURN(E_INVALID_VALUE);
    RETURN(OK);
}

/* The base and size of the allocation or mapping that holds `ptr`. */
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
    BEGIN(cuMemGetAddressRange_v2);
    NEED_CTX();
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (ptr >= a->addr && ptr < a->addr + a->size) {
            if (base) *base = a->addr;
            if (size) *size = a->size;
            RETURN(OK);
        }
    }
    for (size_t i = 0; i < hc_maps.n; i++) {
        struct mapping *m = hc_maps.v[i];
        if (ptr >= m->addr && ptr < m->addr + m->size) {
            if (base) *base = m->addr;
            if (size) *size = m->size;
            RETURN(OK);
        }
    }
    RETURN(E_NOT_FOUND);
}
