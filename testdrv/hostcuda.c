/* hostcuda: a host-memory stand-in for the CUDA driver API subset that stepalloc's CUDA backend
 * (src/backend/cuda.rs) and the GPU scripts (the gpu/ Python files, through ctypes) call. Built as
 * libcuda.so / libcuda.so.1 (testdrv/build.sh) and found through LD_LIBRARY_PATH, so the CUDA
 * path runs on machines without a GPU. It is a test double that enforces the driver's documented
 * rules and returns the documented error codes; testdrv/README.md lists each call, its rule and
 * the documentation it follows, and every configuration variable.
 *
 * The driver is one library built from these files, which share hostcuda_internal.h (types,
 * state, entry macros, the hc_ helpers, hidden from the library's exports):
 * - hostcuda.c (this file): the global state and its lock, configuration (HOSTCUDA_*), failure
 *   injection, the registries of live objects, cuInit, devices, error names, the calls PyTorch
 *   resolves that are not modelled, and the test controls hostcuda_set / hostcuda_used;
 * - hostcuda_account.c: device memory accounting (per process, or a device shared by several
 *   processes, HOSTCUDA_SHARED) and warm memory (HOSTCUDA_WARM_MB);
 * - hostcuda_mem.c: contexts, linear memory (cuMemAlloc, cuMemFree, cuMemGetInfo), what is
 *   device memory, pointer attributes and address ranges;
 * - hostcuda_vmm.c: virtual memory management (reserve, create, map, set access, unmap, release);
 * - hostcuda_stream.c: streams, stream time, capture and its rules, events, graphs that replay
 *   their captured copies;
 * - hostcuda_copy.c: memsets, copies (synchronous and on streams) and pinned host memory;
 * - hostcuda_ipc.c: sharing between processes (cuIpc*, POSIX file descriptor export / import).
 *
 * Invariants (the accounting and warm-memory rules are in hostcuda_account.c):
 * - Device memory is host memory in a memfd (named hostcuda-dev<N>): cuMemAlloc maps it
 *   MAP_SHARED at once; cuMemCreate's is mapped with MAP_SHARED|MAP_FIXED inside ranges reserved
 *   with PROT_NONE, so one physical chunk can be mapped at two addresses, and in another process
 *   (IPC, hostcuda_ipc.c), and data written through one is read through the other.
 *   Memory freed or released is kept warm per device (not once shared with another process).
 * - One global mutex guards all state; a call that waits (synchronize) computes the time it
 *   waits for under the lock and sleeps without it.
 * - Handles (streams, events, graphs, physical chunks) are checked against registries of live
 *   objects, so a stale or foreign handle is CUDA_ERROR_INVALID_HANDLE, never a crash.
 */
#include "hostcuda_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* state and configuration */

struct hc_state hc_g = {.lock = PTHREAD_MUTEX_INITIALIZER};
struct ctx hc_ctxs[MAX_DEVICES];
__thread struct ctx *hc_current;

void hc_lock(void) { pthread_mutex_lock(&hc_g.lock); }
void hc_unlock(void) { pthread_mutex_unlock(&hc_g.lock); }

unsigned long long hc_rand64(void) { /* xorshift64, under the lock */
    unsigned long long x = hc_g.rng ? hc_g.rng : 88172645463325252ull;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return hc_g.rng = x;
}

/* NAME:CODE[:after=N][:count=M][:prob=P], comma-separated; NAME * matches every call. */
static int parse_rules(const char *spec) {
    hc_g.nrules = 0;
    if (!spec || !*spec) return 0;
    char *copy = strdup(spec), *save = NULL;
    if (!copy) return -1;
    int bad = 0;
    for (char *item = strtok_r(copy, ",", &save); item && hc_g.nrules < 32; item = strtok_r(NULL, ",", &save)) {
        struct rule r = {.count = -1, .prob = 1.0};
        char *save2 = NULL, *field = strtok_r(item, ":", &save2);
        if (!field) continue;
        snprintf(r.name, sizeof r.name, "%s", field);
        field = strtok_r(NULL, ":", &save2);
        if (!field) { bad = 1; continue; }
        r.code = atoi(field);
        while ((field = strtok_r(NULL, ":", &save2))) {
            if (!strncmp(field, "after=", 6)) r.after = atol(field + 6);
            else if (!strncmp(field, "count=", 6)) r.count = atol(field + 6);
            else if (!strncmp(field, "prob=", 5)) r.prob = atof(field + 5);
            else bad = 1;
        }
        hc_g.rules[hc_g.nrules++] = r;
    }
    free(copy);
    if (bad) fprintf(stderr, "hostcuda: HOSTCUDA_FAIL: bad rule in '%s'\n", spec);
    return bad ? -1 : 0;
}

static unsigned long long env_u64(const char *name, unsigned long long dflt) {
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : dflt;
}

static void configure(void) { /* under the lock */
    if (hc_g.configured) return;
    hc_g.configured = 1;
    hc_g.devices = (int)env_u64("HOSTCUDA_DEVICES", 2);
    if (hc_g.devices < 0) hc_g.devices = 0;
    if (hc_g.devices > MAX_DEVICES) hc_g.devices = MAX_DEVICES;
    hc_g.capacity = env_u64("HOSTCUDA_CAPACITY_MB", 1024) << 20;
    hc_g.vmm = (int)env_u64("HOSTCUDA_VMM", 1);
    hc_g.delay_ns = env_u64("HOSTCUDA_DELAY_US", 0) * 1000;
    hc_g.jitter_ns = env_u64("HOSTCUDA_JITTER_US", 0) * 1000;
    hc_g.rng = env_u64("HOSTCUDA_SEED", 1);
    hc_g.trace = (int)env_u64("HOSTCUDA_TRACE", 0);
    parse_rules(getenv("HOSTCUDA_FAIL"));
    hc_shared_open();
}

/* The injected failure for this call, if a rule fires (under the lock). */
CUresult hc_inject(const char *call) {
    configure();
    for (int i = 0; i < hc_g.nrules; i++) {
        struct rule *r = &hc_g.rules[i];
        if (strcmp(r->name, "*") && strcmp(r->name, call)) continue;
        if (++r->seen <= r->after) continue;
        if (r->count >= 0 && r->fired >= r->count) continue;
        if (r->prob < 1.0 && (double)(hc_rand64() >> 11) / 9007199254740992.0 >= r->prob) continue;
        r->fired++;
        if (hc_g.trace) fprintf(stderr, "hostcuda: injected %d into %s\n", r->code, call);
        return r->code;
    }
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* registries of live objects (struct reg) */

int hc_reg_add(struct reg *r, void *p) {
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 64;
        void **v = realloc(r->v, cap * sizeof *v);
        if (!v) return -1;
        r->v = v;
        r->cap = cap;
    }
    r->v[r->n++] = p;
    return 0;
}

long hc_reg_find(struct reg *r, const void *p) {
    for (size_t i = 0; i < r->n; i++)
        if (r->v[i] == p) return (long)i;
    return -1;
}

void hc_reg_del(struct reg *r, long i) { r->v[i] = r->v[--r->n]; }

/* Whether `c` is a primary context, and retained. */
int hc_ctx_valid(const struct ctx *c) {
    return c >= hc_ctxs && c < hc_ctxs + hc_g.devices && ((const char *)c - (const char *)hc_ctxs) % sizeof *c == 0 && c->refs > 0;
}

/* ------------------------------------------------------------------------------------------ */
/* initialization, devices, errors */

CUresult cuInit(unsigned flags) {
    BEGIN(cuInit);
    if (flags) RETURN(E_INVALID_VALUE);
    if (!hc_g.inited) {
        for (int d = 0; d < MAX_DEVICES; d++) {
            hc_ctxs[d].dev = d;
            hc_ctxs[d].null_stream.ctx = &hc_ctxs[d];
        }
        hc_g.inited = 1;
    }
    RETURN(OK);
}

CUresult cuDriverGetVersion(int *v) {
    BEGIN(cuDriverGetVersion);
    if (!v) RETURN(E_INVALID_VALUE);
    *v = 12040;
    RETURN(OK);
}

/* cuGetProcAddress (CUDA 12's form, exported as _v2): the driver function for a base name, its
 * newest variant (NAME_v2, else NAME) from this library's own exports. Rules as documented: symbol
 * and pfn non-NULL and flags 0, 1 (legacy stream) or 2 (per-thread stream), else INVALID_VALUE; a
 * cudaVersion above the driver's (12040) is INVALID_VALUE; an unknown name is success with *pfn
 * NULL and status SYMBOL_NOT_FOUND (1). Like cuDriverGetVersion it answers before cuInit (it is
 * how a runtime finds cuInit). */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    BEGIN(cuGetProcAddress_v2);
    if (!symbol || !pfn || flags > 2 || version > 12040) RETURN(E_INVALID_VALUE);
    *pfn = NULL;
    Dl_info self;
    void *lib = dladdr((void *)cuGetProcAddress_v2, &self) ? dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    char name[128];
    if (lib && strlen(symbol) + 4 < sizeof name && !strncmp(symbol, "cu", 2)) {
        snprintf(name, sizeof name, "%s_v2", symbol);
        *pfn = dlsym(lib, name);
        if (!*pfn) *pfn = dlsym(lib, symbol);
    }
    if (lib) dlclose(lib);
    if (status) *status = *pfn ? 0 : 1;
    RETURN(OK);
}

CUresult cuDeviceGetCount(int *n) {
    BEGIN(cuDeviceGetCount);
    NEED_INIT();
    if (!n) RETURN(E_INVALID_VALUE);
    *n = hc_g.devices;
    RETURN(OK);
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    BEGIN(cuDeviceGet);
    NEED_DEV(ordinal);
    if (!dev) RETURN(E_INVALID_VALUE);
    *dev = ordinal;
    RETURN(OK);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    BEGIN(cuDeviceGetName);
    NEED_DEV(dev);
    if (!name || len <= 0) RETURN(E_INVALID_VALUE);
    snprintf(name, (size_t)len, "hostcuda host-memory device %d", dev);
    RETURN(OK);
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    BEGIN(cuDeviceTotalMem_v2);
    NEED_DEV(dev);
    if (!bytes) RETURN(E_INVALID_VALUE);
    *bytes = hc_dev_capacity();
    RETURN(OK);
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    BEGIN(cuDeviceGetAttribute);
    NEED_DEV(dev);
    if (!value) RETURN(E_INVALID_VALUE);
    switch (attribute) {
    case 1: *value = 1024; break;        /* MAX_THREADS_PER_BLOCK */
    case 16: *value = 4; break;          /* MULTIPROCESSOR_COUNT */
    case 75: *value = 9; break;          /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;          /* COMPUTE_CAPABILITY_MINOR */
    case 102: *value = hc_g.vmm != 0; break; /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: *value = hc_g.vmm != 0; break; /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (memfd) */
    default:
        /* Every other attribute of CUDA 13's list answers 0, an absent feature (fabric and
         * Win32 handles, multicast, RDMA, ...); beyond the list, INVALID_VALUE. */
        if (attribute < 1 || attribute > 138) RETURN(E_INVALID_VALUE);
        *value = 0;
    }
    RETURN(OK);
}

static const struct { int code; const char *name, *text; } names[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* Codes this driver does not know (226, 46, ...) are CUDA_ERROR_INVALID_VALUE with *out NULL,
 * as a driver older than the code does. */
static CUresult lookup(int code, const char **out, int text) {
    if (!out) return E_INVALID_VALUE;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (names[i].code == code) {
            *out = text ? names[i].text : names[i].name;
            return OK;
        }
    *out = NULL;
    return E_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult code, const char **out) {
    BEGIN(cuGetErrorName);
    RETURN(lookup(code, out, 0));
}

CUresult cuGetErrorString(CUresult code, const char **out) {
    BEGIN(cuGetErrorString);
    RETURN(lookup(code, out, 1));
}

/* ------------------------------------------------------------------------------------------ */
/* calls not modelled */

/* Calls PyTorch resolves when it starts (c10's driver table must find every one) for features
 * this driver does not model: green contexts, multicast, allocation properties, driver logs, stream
 * memory operations. They are documented to return CUDA_ERROR_NOT_SUPPORTED on devices without
 * the feature. */
#define NOT_MODELLED(name) \
    CUresult name(void) { BEGIN(name); RETURN(E_NOT_SUPPORTED); }
NOT_MODELLED(cuCtxFromGreenCtx)
NOT_MODELLED(cuDevResourceGenerateDesc)
NOT_MODELLED(cuDevSmResourceSplitByCount)
NOT_MODELLED(cuDeviceGetDevResource)
NOT_MODELLED(cuGreenCtxCreate)
NOT_MODELLED(cuGreenCtxDestroy)
NOT_MODELLED(cuGreenCtxStreamCreate)
NOT_MODELLED(cuLogsRegisterCallback)
NOT_MODELLED(cuLogsUnregisterCallback)
NOT_MODELLED(cuMemGetAllocationPropertiesFromHandle)
NOT_MODELLED(cuMemRetainAllocationHandle)
NOT_MODELLED(cuMulticastAddDevice)
NOT_MODELLED(cuMulticastBindMem)
NOT_MODELLED(cuMulticastCreate)
NOT_MODELLED(cuMulticastUnbind)
NOT_MODELLED(cuStreamWriteValue32_v2)
/* Hopper's tensor-memory-accelerator descriptors (vLLM's kernels library binds it at load). */
NOT_MODELLED(cuTensorMapEncodeTiled)

/* ------------------------------------------------------------------------------------------ */
/* control for tests (not part of CUDA): a test finds it with dlsym and skips on a real driver */

/* Sets one setting: capacity_mb, delay_us, jitter_us, vmm, seed, trace, fail (a HOSTCUDA_FAIL
 * rule list, replacing the rules and their counters). Returns 0, or -1 for an unknown key or
 * a bad value. */
int hostcuda_set(const char *key, const char *value) {
    hc_lock();
    configure();
    int rc = 0;
    unsigned long long v = value ? strtoull(value, NULL, 10) : 0;
    if (!key || !value) rc = -1;
    else if (!strcmp(key, "capacity_mb")) rc = hc_set_capacity(v << 20);
    else if (!strcmp(key, "delay_us")) hc_g.delay_ns = v * 1000;
    else if (!strcmp(key, "jitter_us")) hc_g.jitter_ns = v * 1000;
    else if (!strcmp(key, "vmm")) hc_g.vmm = v != 0;
    else if (!strcmp(key, "seed")) hc_g.rng = v;
    else if (!strcmp(key, "trace")) hc_g.trace = (int)v;
    else if (!strcmp(key, "fail")) rc = parse_rules(value);
    else if (!strcmp(key, "warm_mb")) hc_set_warm_limit(v << 20);
    else rc = -1;
    hc_unlock();
    return rc;
}

/* How many cuMemUnmap calls unmapped memory that work queued on a stream still used (a fault
 * under a running kernel on a GPU). */
long long hostcuda_unmaps_under_work(void) {
    hc_lock();
    long long n = (long long)hc_g.unmaps_under_work;
    hc_unlock();
    return n;
}

/* Bytes of device memory (linear and physical) in use on `dev`, or -1. */
long long hostcuda_used(int dev) {
    hc_lock();
    configure();
    long long r = dev >= 0 && dev < hc_g.devices ? (long long)hc_dev_used(dev) : -1;
    hc_unlock();
    return r;
}
