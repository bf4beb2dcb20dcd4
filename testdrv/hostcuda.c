/* hostcuda: a host-memory stand-in for the CUDA driver API subset that stepalloc's CUDA backend
 * (src/backend/cuda.rs) and the GPU scripts (the gpu/ Python files, through ctypes) call. Built as
 * libcuda.so / libcuda.so.1 (testdrv/build.sh) and found through LD_LIBRARY_PATH, so the CUDA
 * path runs on machines without a GPU. It is a test double that enforces the driver's documented
 * rules and returns the documented error codes; testdrv/README.md lists each call, its rule and
 * the documentation it follows, and every configuration variable.
 *
 * Invariants (the accounting and warm-memory rules are in their sections near the end):
 * - Device memory is host memory in a memfd (named hostcuda-dev<N>): cuMemAlloc maps it
 *   MAP_SHARED at once; cuMemCreate's is mapped with MAP_SHARED|MAP_FIXED inside ranges reserved
 *   with PROT_NONE, so one physical chunk can be mapped at two addresses, and in another process
 *   (IPC, at the end of this file), and data written through one is read through the other.
 *   Memory freed or released is kept warm per device (not once shared with another process).
 * - One global mutex guards all state; a call that waits (synchronize) computes the time it
 *   waits for under the lock and sleeps without it.
 * - Handles (streams, events, graphs, physical chunks) are checked against registries of live
 *   objects, so a stale or foreign handle is CUDA_ERROR_INVALID_HANDLE, never a crash.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_INVALID_HANDLE = 400,
    E_ILLEGAL_STATE = 401,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_NOT_SUPPORTED = 801,
    E_CAPTURE_UNSUPPORTED = 900,
    E_CAPTURE_INVALIDATED = 901,
    E_CAPTURE_IMPLICIT = 906,
    E_CAPTURED_EVENT = 907,
    E_CAPTURE_WRONG_THREAD = 908,
    E_UNKNOWN = 999,
};

enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
enum { CAP_NONE = 0, CAP_ACTIVE = 1, CAP_INVALIDATED = 2 };
#define STREAM_NON_BLOCKING 1u
#define MAX_DEVICES 8
#define GRANULARITY (2ull << 20)
#define ALLOC_PAGE (2ull << 20)

/* ------------------------------------------------------------------------------------------ */
/* configuration */

struct rule {
    char name[64];
    int code;
    long after, count, seen, fired;
    double prob;
};

static struct {
    pthread_mutex_t lock;
    int configured, inited, devices, vmm, trace;
    unsigned long long capacity, delay_ns, jitter_ns, rng;
    struct rule rules[32];
    int nrules;
    unsigned long long capture_ids;
} g = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void lock(void) { pthread_mutex_lock(&g.lock); }
static void unlock(void) { pthread_mutex_unlock(&g.lock); }

/* Device memory accounting and warm memory, defined in the last sections of this file (a
 * device shared by several processes; memory released earlier handed back uncleared). Called
 * under the lock. */
static void shared_open(void);
static int set_capacity(unsigned long long bytes);
static void set_warm_limit(unsigned long long bytes);
static unsigned long long dev_capacity(void);
static unsigned long long dev_free(int d);
static int dev_charge(int d, unsigned long long bytes);
static void dev_uncharge(int d, unsigned long long bytes);
static void *warm_linear_take(unsigned long long bytes, int dev, int *fd);
static void warm_linear_put(void *p, int fd, int dev, unsigned long long bytes);
static int warm_chunk_take(unsigned long long bytes, int dev, int *warm);
static void warm_chunk_put(int fd, int dev, unsigned long long bytes);
static void warm_populate(unsigned long long ptr, unsigned long long size);
/* Captured copies and memsets, replayed when the graph is launched (the last section). */
struct stream;
enum { OP_COPY = 0, OP_SET8 = 1, OP_SET32 = 2 };
static void capture_record(struct stream *s, int kind, unsigned long long dst, unsigned long long src,
                           unsigned long long n);
static void *graph_new(struct stream *s, int keep);
static void graph_free(void *gr);

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

static unsigned long long rand64(void) { /* xorshift64, under the lock */
    unsigned long long x = g.rng ? g.rng : 88172645463325252ull;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return g.rng = x;
}

/* NAME:CODE[:after=N][:count=M][:prob=P], comma-separated; NAME * matches every call. */
static int parse_rules(const char *spec) {
    g.nrules = 0;
    if (!spec || !*spec) return 0;
    char *copy = strdup(spec), *save = NULL;
    if (!copy) return -1;
    int bad = 0;
    for (char *item = strtok_r(copy, ",", &save); item && g.nrules < 32; item = strtok_r(NULL, ",", &save)) {
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
        g.rules[g.nrules++] = r;
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
    if (g.configured) return;
    g.configured = 1;
    g.devices = (int)env_u64("HOSTCUDA_DEVICES", 2);
    if (g.devices < 0) g.devices = 0;
    if (g.devices > MAX_DEVICES) g.devices = MAX_DEVICES;
    g.capacity = env_u64("HOSTCUDA_CAPACITY_MB", 1024) << 20;
    g.vmm = (int)env_u64("HOSTCUDA_VMM", 1);
    g.delay_ns = env_u64("HOSTCUDA_DELAY_US", 0) * 1000;
    g.jitter_ns = env_u64("HOSTCUDA_JITTER_US", 0) * 1000;
    g.rng = env_u64("HOSTCUDA_SEED", 1);
    g.trace = (int)env_u64("HOSTCUDA_TRACE", 0);
    parse_rules(getenv("HOSTCUDA_FAIL"));
    shared_open();
}

/* The injected failure for this call, if a rule fires (under the lock). */
static CUresult inject(const char *call) {
    configure();
    for (int i = 0; i < g.nrules; i++) {
        struct rule *r = &g.rules[i];
        if (strcmp(r->name, "*") && strcmp(r->name, call)) continue;
        if (++r->seen <= r->after) continue;
        if (r->count >= 0 && r->fired >= r->count) continue;
        if (r->prob < 1.0 && (double)(rand64() >> 11) / 9007199254740992.0 >= r->prob) continue;
        r->fired++;
        if (g.trace) fprintf(stderr, "hostcuda: injected %d into %s\n", r->code, call);
        return r->code;
    }
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* registries of live objects */

struct reg {
    void **v;
    size_t n, cap;
};

static int reg_add(struct reg *r, void *p) {
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

static long reg_find(struct reg *r, const void *p) {
    for (size_t i = 0; i < r->n; i++)
        if (r->v[i] == p) return (long)i;
    return -1;
}

static void reg_del(struct reg *r, long i) { r->v[i] = r->v[--r->n]; }

struct ctx;
struct stream {
    struct ctx *ctx;
    unsigned flags;
    unsigned long long busy_until; /* when the work queued so far completes */
    int cap_status, cap_mode;
    pthread_t cap_thread;
    unsigned long long cap_id; /* the capture's unique id (cuStreamGetCaptureInfo) */
};

struct ctx { /* the primary context of a device; its address is the CUcontext */
    int dev, refs;
    struct stream null_stream; /* the legacy default stream */
};

struct ev_shared;
struct event {
    struct ctx *ctx;
    unsigned long long done_at;
    int captured; /* recorded inside a capture and not recorded again since */
    unsigned flags;
    struct ev_shared *sh; /* an event shared with other processes (IPC): its state lives there */
    int sh_fd;
};

/* `fd` backs the memory; an allocation opened from another process's IPC handle has `ipc_pid`
 * (the producer), `ipc_ino` (its memfd) and `ipc_refs` (opens not yet closed), and no charge. */
struct alloc { unsigned long long addr, size, charged; int dev, fd, ipc_pid, ipc_refs, exported; unsigned long long ipc_ino; };
struct resv { unsigned long long base, size; };
/* `warm`: its pages were touched before; `handle_types`: cuMemCreate's requestedHandleTypes;
 * `imported` from another process's file descriptor (not charged here: the exporter's device
 * holds the charge); `exported`: its descriptor went to another process (never kept warm). */
struct phys { int fd, dev, released, maps, warm, handle_types, imported, exported; unsigned long long size; };
struct mapping { unsigned long long addr, size, offset; struct phys *p; int prot; };

static struct ctx ctxs[MAX_DEVICES];
static unsigned long long used[MAX_DEVICES];
static struct reg streams, events, graphs, allocs, resvs, physs, maps;
static __thread struct ctx *t_current;
static __thread int t_mode = MODE_GLOBAL;

/* IPC events (end of the file): the shared state is read before and written after use. */
static void ev_pull(struct event *e);
static void ev_push(struct event *e);
static void ev_unshare(struct event *e);
static int device_memfd(int dev);

static int ctx_valid(const struct ctx *c) {
    return c >= ctxs && c < ctxs + g.devices && ((const char *)c - (const char *)ctxs) % sizeof *c == 0 && c->refs > 0;
}

/* The stream a handle names: 0 (legacy), 1 (CU_STREAM_LEGACY) and 2 (CU_STREAM_PER_THREAD)
 * are the current context's default stream. */
static CUresult stream_of(void *h, struct stream **out) {
    if ((uintptr_t)h <= 2) {
        if (!t_current || !ctx_valid(t_current)) return E_INVALID_CONTEXT;
        *out = &t_current->null_stream;
        return OK;
    }
    if (reg_find(&streams, h) < 0) return E_INVALID_HANDLE;
    *out = h;
    return OK;
}

static int is_null_stream(const struct stream *s) { return s == &s->ctx->null_stream; }

static void for_each_stream(struct ctx *c, void (*f)(struct stream *, void *), void *arg) {
    f(&c->null_stream, arg);
    for (size_t i = 0; i < streams.n; i++) {
        struct stream *s = streams.v[i];
        if (s->ctx == c) f(s, arg);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* stream capture rules (CUDA Programming Guide, "Prohibited and Unhandled Operations";
 * cuThreadExchangeStreamCaptureMode) */

static int capturing(const struct stream *s) { return s->cap_status != CAP_NONE; }

/* Whether capture `s` forbids this thread's potentially unsafe calls. */
static int forbids(const struct stream *s) {
    if (!capturing(s) || t_mode == MODE_RELAXED) return 0;
    int mine = pthread_equal(s->cap_thread, pthread_self());
    if (mine) return s->cap_mode != MODE_RELAXED;
    return t_mode == MODE_GLOBAL && s->cap_mode == MODE_GLOBAL;
}

/* A potentially unsafe call: fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates
 * each capture that forbids it. */
static CUresult unsafe_call(const char *call) {
    int hit = 0;
    for (size_t i = 0; i < streams.n; i++) {
        struct stream *s = streams.v[i];
        if (forbids(s)) {
            s->cap_status = CAP_INVALIDATED;
            hit = 1;
        }
    }
    if (hit && g.trace) fprintf(stderr, "hostcuda: %s during a capture invalidated it\n", call);
    return hit ? E_CAPTURE_UNSUPPORTED : OK;
}

/* Work on the legacy stream while a blocking stream of its context captures. */
static CUresult legacy_during_capture(struct stream *s) {
    if (!is_null_stream(s)) return OK;
    int hit = 0;
    for (size_t i = 0; i < streams.n; i++) {
        struct stream *o = streams.v[i];
        if (o->ctx == s->ctx && capturing(o) && !(o->flags & STREAM_NON_BLOCKING)) {
            o->cap_status = CAP_INVALIDATED;
            hit = 1;
        }
    }
    return hit ? E_CAPTURE_IMPLICIT : OK;
}

/* ------------------------------------------------------------------------------------------ */
/* streams and time */

static void max_busy(struct stream *s, void *arg) {
    unsigned long long *t = arg;
    if (s->busy_until > *t) *t = s->busy_until;
}

static void max_busy_blocking(struct stream *s, void *arg) {
    if (!(s->flags & STREAM_NON_BLOCKING)) max_busy(s, arg);
}

/* Queues work on `s` (not capturing) and returns when it completes: after the stream's
 * earlier work (and the legacy stream's rules), plus the configured delay and jitter. */
static unsigned long long enqueue(struct stream *s) {
    unsigned long long start = now_ns();
    if (s->busy_until > start) start = s->busy_until;
    if (is_null_stream(s)) for_each_stream(s->ctx, max_busy_blocking, &start);
    else if (!(s->flags & STREAM_NON_BLOCKING) && s->ctx->null_stream.busy_until > start)
        start = s->ctx->null_stream.busy_until;
    unsigned long long delay = g.delay_ns + (g.jitter_ns ? rand64() % g.jitter_ns : 0);
    s->busy_until = start + delay;
    return s->busy_until;
}

static void sleep_until(unsigned long long t) { /* without the lock */
    for (unsigned long long n = now_ns(); n < t; n = now_ns()) {
        unsigned long long d = t - n;
        struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* entry helpers */

#define BEGIN(name)                                                                           \
    lock();                                                                                   \
    const char *call_ = #name;                                                                \
    CUresult inj_ = inject(#name);                                                            \
    if (inj_) { unlock(); return inj_; }
#define RETURN(x) do { CUresult r_ = (x); if (r_ && g.trace > 1) fprintf(stderr, "hostcuda: %s returns %d\n", call_, r_); unlock(); return r_; } while (0)
#define NEED_INIT() do { if (!g.inited) RETURN(E_NOT_INITIALIZED); } while (0)
#define NEED_CTX() do { NEED_INIT(); if (!t_current || !ctx_valid(t_current)) RETURN(E_INVALID_CONTEXT); } while (0)
#define NEED_DEV(d) do { NEED_INIT(); if ((d) < 0 || (d) >= g.devices) RETURN(E_INVALID_DEVICE); } while (0)

/* ------------------------------------------------------------------------------------------ */
/* initialization, devices, errors */

CUresult cuInit(unsigned flags) {
    BEGIN(cuInit);
    if (flags) RETURN(E_INVALID_VALUE);
    if (!g.inited) {
        for (int d = 0; d < MAX_DEVICES; d++) {
            ctxs[d].dev = d;
            ctxs[d].null_stream.ctx = &ctxs[d];
        }
        g.inited = 1;
    }
    RETURN(OK);
}

CUresult cuDriverGetVersion(int *v) {
    BEGIN(cuDriverGetVersion);
    if (!v) RETURN(E_INVALID_VALUE);
    *v = 12040;
    RETURN(OK);
}

CUresult cuDeviceGetCount(int *n) {
    BEGIN(cuDeviceGetCount);
    NEED_INIT();
    if (!n) RETURN(E_INVALID_VALUE);
    *n = g.devices;
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
    *bytes = dev_capacity();
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
    case 102: *value = g.vmm != 0; break; /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: *value = g.vmm != 0; break; /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (memfd) */
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
/* contexts */

CUresult cuDevicePrimaryCtxRetain(void **out, CUdevice dev) {
    BEGIN(cuDevicePrimaryCtxRetain);
    NEED_DEV(dev);
    if (!out) RETURN(E_INVALID_VALUE);
    ctxs[dev].refs++;
    *out = &ctxs[dev];
    RETURN(OK);
}

static CUresult primary_release(CUdevice dev) {
    if (ctxs[dev].refs <= 0) return E_INVALID_CONTEXT;
    ctxs[dev].refs--;
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
    *active = ctxs[dev].refs > 0;
    RETURN(OK);
}

CUresult cuCtxGetCurrent(void **out) {
    BEGIN(cuCtxGetCurrent);
    NEED_INIT();
    if (!out) RETURN(E_INVALID_VALUE);
    *out = t_current;
    RETURN(OK);
}

CUresult cuCtxSetCurrent(void *c) {
    BEGIN(cuCtxSetCurrent);
    NEED_INIT();
    if (c && !ctx_valid(c)) RETURN(E_INVALID_CONTEXT);
    t_current = c;
    RETURN(OK);
}

CUresult cuCtxGetDevice(CUdevice *dev) {
    BEGIN(cuCtxGetDevice);
    NEED_CTX();
    if (!dev) RETURN(E_INVALID_VALUE);
    *dev = t_current->dev;
    RETURN(OK);
}

CUresult cuCtxSynchronize(void) {
    BEGIN(cuCtxSynchronize);
    NEED_CTX();
    CUresult r = unsafe_call("cuCtxSynchronize");
    if (r) RETURN(r);
    unsigned long long until = 0;
    for_each_stream(t_current, max_busy, &until);
    unlock();
    sleep_until(until);
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* streams and capture */

CUresult cuStreamCreate(void **out, unsigned flags) {
    BEGIN(cuStreamCreate);
    NEED_CTX();
    if (!out || (flags & ~STREAM_NON_BLOCKING)) RETURN(E_INVALID_VALUE);
    struct stream *s = calloc(1, sizeof *s);
    if (!s || reg_add(&streams, s)) { free(s); RETURN(E_OUT_OF_MEMORY); }
    s->ctx = t_current;
    s->flags = flags;
    *out = s;
    RETURN(OK);
}

static CUresult stream_destroy(void *h) {
    long i = (uintptr_t)h <= 2 ? -1 : reg_find(&streams, h);
    if (i < 0) return E_INVALID_HANDLE;
    reg_del(&streams, i);
    free(h);
    return OK;
}

CUresult cuStreamDestroy_v2(void *h) {
    BEGIN(cuStreamDestroy_v2);
    NEED_INIT();
    RETURN(stream_destroy(h));
}

CUresult cuStreamDestroy(void *h) {
    BEGIN(cuStreamDestroy);
    NEED_INIT();
    RETURN(stream_destroy(h));
}

CUresult cuStreamGetCtx(void *h, void **out) {
    BEGIN(cuStreamGetCtx);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(h, &s);
    if (r) RETURN(r);
    if (!out) RETURN(E_INVALID_VALUE);
    *out = s->ctx;
    RETURN(OK);
}

CUresult cuStreamQuery(void *h) {
    BEGIN(cuStreamQuery);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(h, &s);
    if (r) RETURN(r);
    if (capturing(s)) { s->cap_status = CAP_INVALIDATED; RETURN(E_CAPTURE_UNSUPPORTED); }
    if ((r = unsafe_call("cuStreamQuery"))) RETURN(r);
    RETURN(s->busy_until <= now_ns() ? OK : E_NOT_READY);
}

CUresult cuStreamSynchronize(void *h) {
    BEGIN(cuStreamSynchronize);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(h, &s);
    if (r) RETURN(r);
    if (capturing(s)) { s->cap_status = CAP_INVALIDATED; RETURN(E_CAPTURE_UNSUPPORTED); }
    if ((r = unsafe_call("cuStreamSynchronize"))) RETURN(r);
    unsigned long long until = s->busy_until;
    unlock();
    sleep_until(until);
    return OK;
}

CUresult cuStreamBeginCapture_v2(void *h, int mode) {
    BEGIN(cuStreamBeginCapture_v2);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(h, &s);
    if (r) RETURN(r);
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) RETURN(E_INVALID_VALUE);
    if (is_null_stream(s)) RETURN(E_CAPTURE_UNSUPPORTED);
    if (capturing(s)) RETURN(E_ILLEGAL_STATE);
    s->cap_status = CAP_ACTIVE;
    s->cap_id = ++g.capture_ids;
    s->cap_mode = mode;
    s->cap_thread = pthread_self();
    RETURN(OK);
}

CUresult cuStreamEndCapture(void *h, void **graph) {
    BEGIN(cuStreamEndCapture);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(h, &s);
    if (r) RETURN(r);
    if (!graph) RETURN(E_INVALID_VALUE);
    if (!capturing(s)) RETURN(E_ILLEGAL_STATE);
    if (s->cap_mode != MODE_RELAXED && !pthread_equal(s->cap_thread, pthread_self()))
        RETURN(E_CAPTURE_WRONG_THREAD);
    int invalid = s->cap_status == CAP_INVALIDATED;
    s->cap_status = CAP_NONE;
    *graph = NULL;
    void *gr = graph_new(s, !invalid); /* takes the capture's recorded work */
    if (invalid) RETURN(E_CAPTURE_INVALIDATED);
    if (!gr || reg_add(&graphs, gr)) { graph_free(gr); RETURN(E_OUT_OF_MEMORY); }
    *graph = gr;
    RETURN(OK);
}

CUresult cuStreamIsCapturing(void *h, int *status) {
    BEGIN(cuStreamIsCapturing);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(h, &s);
    if (r) RETURN(r);
    if (!status) RETURN(E_INVALID_VALUE);
    *status = s->cap_status;
    RETURN(OK);
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    BEGIN(cuThreadExchangeStreamCaptureMode);
    NEED_INIT();
    if (!mode || *mode < MODE_GLOBAL || *mode > MODE_RELAXED) RETURN(E_INVALID_VALUE);
    int old = t_mode;
    t_mode = *mode;
    *mode = old;
    RETURN(OK);
}

CUresult cuGraphDestroy(void *gr) {
    BEGIN(cuGraphDestroy);
    NEED_INIT();
    long i = reg_find(&graphs, gr);
    if (i < 0) RETURN(E_INVALID_VALUE);
    reg_del(&graphs, i);
    graph_free(gr);
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* events */

CUresult cuEventCreate(void **out, unsigned flags) {
    BEGIN(cuEventCreate);
    NEED_CTX();
    if (!out || (flags & ~0xfu)) RETURN(E_INVALID_VALUE);
    struct event *e = calloc(1, sizeof *e);
    if (!e || reg_add(&events, e)) { free(e); RETURN(E_OUT_OF_MEMORY); }
    e->ctx = t_current;
    e->flags = flags;
    *out = e;
    RETURN(OK);
}

static CUresult event_destroy(void *h) {
    long i = reg_find(&events, h);
    if (i < 0) return E_INVALID_HANDLE;
    reg_del(&events, i);
    ev_unshare(h);
    free(h);
    return OK;
}

CUresult cuEventDestroy_v2(void *h) {
    BEGIN(cuEventDestroy_v2);
    NEED_INIT();
    RETURN(event_destroy(h));
}

CUresult cuEventDestroy(void *h) {
    BEGIN(cuEventDestroy);
    NEED_INIT();
    RETURN(event_destroy(h));
}

CUresult cuEventRecord(void *h, void *sh) {
    BEGIN(cuEventRecord);
    NEED_INIT();
    if (reg_find(&events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    struct stream *s;
    CUresult r = stream_of(sh, &s);
    if (r) RETURN(r);
    /* The event and the stream must belong to the same context. */
    if (e->ctx != s->ctx) RETURN(E_INVALID_HANDLE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) {
        e->captured = 1; /* a node of the graph: it completes only when the graph runs */
        ev_push(e);
        RETURN(OK);
    }
    if ((r = legacy_during_capture(s))) RETURN(r);
    e->captured = 0;
    e->done_at = enqueue(s);
    ev_push(e);
    RETURN(OK);
}

CUresult cuEventQuery(void *h) {
    BEGIN(cuEventQuery);
    NEED_INIT();
    if (reg_find(&events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    CUresult r = unsafe_call("cuEventQuery");
    if (r) RETURN(r);
    ev_pull(e);
    if (e->captured) RETURN(E_CAPTURED_EVENT);
    RETURN(e->done_at <= now_ns() ? OK : E_NOT_READY);
}

CUresult cuEventSynchronize(void *h) {
    BEGIN(cuEventSynchronize);
    NEED_INIT();
    if (reg_find(&events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    CUresult r = unsafe_call("cuEventSynchronize");
    if (r) RETURN(r);
    ev_pull(e);
    if (e->captured) RETURN(E_CAPTURED_EVENT);
    unsigned long long until = e->done_at;
    unlock();
    sleep_until(until);
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* linear memory */

static unsigned long long round_up(unsigned long long x, unsigned long long to) { return (x + to - 1) / to * to; }

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    BEGIN(cuMemGetInfo_v2);
    NEED_CTX();
    if (!free_bytes || !total) RETURN(E_INVALID_VALUE);
    int d = t_current->dev;
    *free_bytes = dev_free(d);
    *total = dev_capacity();
    RETURN(OK);
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t bytes) {
    BEGIN(cuMemAlloc_v2);
    NEED_CTX();
    CUresult r = unsafe_call("cuMemAlloc_v2");
    if (r) RETURN(r);
    if (!out || bytes == 0) RETURN(E_INVALID_VALUE);
    int d = t_current->dev;
    unsigned long long charged = round_up(bytes, ALLOC_PAGE);
    if (dev_charge(d, charged)) RETURN(E_OUT_OF_MEMORY);
    /* A memfd, so that another process can map it (cuIpcGetMemHandle). */
    int fd = -1;
    void *p = warm_linear_take(charged, d, &fd);
    if (!p) {
        fd = device_memfd(d);
        if (fd < 0 || ftruncate(fd, (off_t)charged)) {
            if (fd >= 0) close(fd);
            dev_uncharge(d, charged);
            RETURN(E_OUT_OF_MEMORY);
        }
        p = mmap(NULL, charged, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
        if (p == MAP_FAILED) { close(fd); dev_uncharge(d, charged); RETURN(E_OUT_OF_MEMORY); }
    }
    struct alloc *a = calloc(1, sizeof *a);
    if (!a || reg_add(&allocs, a)) { free(a); munmap(p, charged); close(fd); dev_uncharge(d, charged); RETURN(E_OUT_OF_MEMORY); }
    *a = (struct alloc){.addr = (uintptr_t)p, .size = bytes, .charged = charged, .dev = d, .fd = fd};
    *out = (uintptr_t)p;
    RETURN(OK);
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    BEGIN(cuMemFree_v2);
    NEED_CTX();
    CUresult r = unsafe_call("cuMemFree_v2");
    if (r) RETURN(r);
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (a->addr == ptr && !a->ipc_pid) { /* IPC mappings go with cuIpcCloseMemHandle */
            if (a->exported) {
                munmap((void *)(uintptr_t)a->addr, a->charged);
                close(a->fd);
            } else {
                warm_linear_put((void *)(uintptr_t)a->addr, a->fd, a->dev, a->charged);
            }
            dev_uncharge(a->dev, a->charged);
            reg_del(&allocs, (long)i);
            free(a);
            RETURN(OK);
        }
    }
    RETURN(E_INVALID_VALUE);
}

/* Whether [ptr, ptr+n) is device memory: inside one allocation, or mapped throughout with
 * access that allows writing (`write`) or reading. */
static int device_range(unsigned long long ptr, unsigned long long n, int write) {
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (ptr >= a->addr && ptr + n <= a->addr + a->size) return 1;
    }
    unsigned long long pos = ptr, end = ptr + n;
    while (pos < end) {
        struct mapping *hit = NULL;
        for (size_t i = 0; i < maps.n && !hit; i++) {
            struct mapping *m = maps.v[i];
            if (pos >= m->addr && pos < m->addr + m->size) hit = m;
        }
        if (!hit || !(hit->prot & (write ? PROT_WRITE : PROT_READ))) return 0;
        pos = hit->addr + hit->size;
    }
    return n > 0;
}

CUresult cuMemsetD8_v2(CUdeviceptr ptr, unsigned char value, size_t n) {
    BEGIN(cuMemsetD8_v2);
    NEED_CTX();
    CUresult r = unsafe_call("cuMemsetD8_v2");
    if (r) RETURN(r);
    if (!device_range(ptr, n, 1)) RETURN(E_INVALID_VALUE);
    memset((void *)(uintptr_t)ptr, value, n);
    RETURN(OK);
}

CUresult cuMemsetD8Async(CUdeviceptr ptr, unsigned char value, size_t n, void *sh) {
    BEGIN(cuMemsetD8Async);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(sh, &s);
    if (r) RETURN(r);
    if (!device_range(ptr, n, 1)) RETURN(E_INVALID_VALUE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) { capture_record(s, OP_SET8, ptr, value, n); RETURN(OK); } /* runs when the graph runs */
    if ((r = legacy_during_capture(s))) RETURN(r);
    memset((void *)(uintptr_t)ptr, value, n);
    enqueue(s);
    RETURN(OK);
}

static void fill32(unsigned long long ptr, unsigned value, size_t words) {
    unsigned *p = (unsigned *)(uintptr_t)ptr;
    for (size_t i = 0; i < words; i++) p[i] = value;
}

CUresult cuMemsetD32_v2(CUdeviceptr ptr, unsigned value, size_t words) {
    BEGIN(cuMemsetD32_v2);
    NEED_CTX();
    CUresult r = unsafe_call("cuMemsetD32_v2");
    if (r) RETURN(r);
    if (ptr % 4 || words > (~0ull >> 2) || !device_range(ptr, 4ull * words, 1)) RETURN(E_INVALID_VALUE);
    fill32(ptr, value, words);
    RETURN(OK);
}

CUresult cuMemsetD32Async(CUdeviceptr ptr, unsigned value, size_t words, void *sh) {
    BEGIN(cuMemsetD32Async);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(sh, &s);
    if (r) RETURN(r);
    if (ptr % 4 || words > (~0ull >> 2) || !device_range(ptr, 4ull * words, 1)) RETURN(E_INVALID_VALUE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) { capture_record(s, OP_SET32, ptr, value, words); RETURN(OK); } /* runs when the graph runs */
    if ((r = legacy_during_capture(s))) RETURN(r);
    fill32(ptr, value, words);
    enqueue(s);
    RETURN(OK);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    BEGIN(cuMemcpyDtoH_v2);
    NEED_CTX();
    CUresult r = unsafe_call("cuMemcpyDtoH_v2");
    if (r) RETURN(r);
    if (!dst || !device_range(src, n, 0)) RETURN(E_INVALID_VALUE);
    memcpy(dst, (void *)(uintptr_t)src, n);
    RETURN(OK);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    BEGIN(cuMemcpyHtoD_v2);
    NEED_CTX();
    CUresult r = unsafe_call("cuMemcpyHtoD_v2");
    if (r) RETURN(r);
    if (!src || !device_range(dst, n, 1)) RETURN(E_INVALID_VALUE);
    memcpy((void *)(uintptr_t)dst, src, n);
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* virtual memory management */

struct location { int type, id; };
struct alloc_prop {
    int type, handle_types;
    struct location location;
    void *win32;
    unsigned char compression, rdma;
    unsigned short usage;
    unsigned char reserved[4];
};
struct access_desc { struct location location; int flags; };

static CUresult vmm_check(void) {
    if (!g.inited) return E_NOT_INITIALIZED;
    return g.vmm ? OK : E_NOT_SUPPORTED;
}

/* CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE of an existing device. */
static CUresult prop_check(const struct alloc_prop *p) {
    if (!p || p->type != 1 || p->location.type != 1) return E_INVALID_VALUE;
    if (p->location.id < 0 || p->location.id >= g.devices) return E_INVALID_DEVICE;
    return OK;
}

CUresult cuMemGetAllocationGranularity(size_t *out, const struct alloc_prop *prop, int option) {
    BEGIN(cuMemGetAllocationGranularity);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    if (!out || (option != 0 && option != 1)) RETURN(E_INVALID_VALUE);
    if ((r = prop_check(prop))) RETURN(r);
    *out = GRANULARITY;
    RETURN(OK);
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    BEGIN(cuMemAddressReserve);
    (void)addr; /* a hint only */
    CUresult r = vmm_check();
    if (r) RETURN(r);
    if (!out || size == 0 || size % GRANULARITY || flags || (alignment & (alignment - 1))) RETURN(E_INVALID_VALUE);
    unsigned long long align = alignment > GRANULARITY ? alignment : GRANULARITY;
    unsigned long long span = size + align;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) RETURN(E_OUT_OF_MEMORY);
    unsigned long long base = round_up((uintptr_t)p, align);
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
    unsigned long long tail = (uintptr_t)p + span - (base + size);
    if (tail) munmap((void *)(uintptr_t)(base + size), tail);
    struct resv *v = malloc(sizeof *v);
    if (!v || reg_add(&resvs, v)) { free(v); munmap((void *)(uintptr_t)base, size); RETURN(E_OUT_OF_MEMORY); }
    *v = (struct resv){base, size};
    *out = base;
    RETURN(OK);
}

static int overlaps(unsigned long long a, unsigned long long an, unsigned long long b, unsigned long long bn) {
    return a < b + bn && b < a + an;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    BEGIN(cuMemAddressFree);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    for (size_t i = 0; i < resvs.n; i++) {
        struct resv *v = resvs.v[i];
        if (v->base != ptr || v->size != size) continue;
        for (size_t j = 0; j < maps.n; j++) {
            struct mapping *m = maps.v[j];
            if (overlaps(m->addr, m->size, ptr, size)) RETURN(E_INVALID_VALUE); /* still mapped */
        }
        munmap((void *)(uintptr_t)ptr, size);
        reg_del(&resvs, (long)i);
        free(v);
        RETURN(OK);
    }
    RETURN(E_INVALID_VALUE);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const struct alloc_prop *prop, unsigned long long flags) {
    BEGIN(cuMemCreate);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    if (!out || size == 0 || size % GRANULARITY || flags) RETURN(E_INVALID_VALUE);
    if ((r = prop_check(prop))) RETURN(r);
    int d = prop->location.id;
    if (dev_charge(d, size)) RETURN(E_OUT_OF_MEMORY);
    int warm = 0, fd = warm_chunk_take(size, d, &warm);
    if (fd < 0) fd = device_memfd(d);
    if (fd < 0) { dev_uncharge(d, size); RETURN(E_OUT_OF_MEMORY); }
    if (!warm && ftruncate(fd, (off_t)size)) { close(fd); dev_uncharge(d, size); RETURN(E_OUT_OF_MEMORY); }
    struct phys *p = calloc(1, sizeof *p);
    if (!p || reg_add(&physs, p)) { free(p); close(fd); dev_uncharge(d, size); RETURN(E_OUT_OF_MEMORY); }
    p->fd = fd;
    p->dev = d;
    p->size = size;
    p->warm = warm;
    p->handle_types = prop->handle_types;
    *out = (uintptr_t)p;
    RETURN(OK);
}

static void phys_free(struct phys *p) {
    if (p->imported) {
        close(p->fd);
    } else {
        if (p->exported) close(p->fd);
        else warm_chunk_put(p->fd, p->dev, p->size);
        dev_uncharge(p->dev, p->size);
    }
    reg_del(&physs, reg_find(&physs, p));
    free(p);
}

/* Released now if mapped nowhere, else when its last mapping is unmapped. */
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    BEGIN(cuMemRelease);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    struct phys *p = (struct phys *)(uintptr_t)h;
    if (reg_find(&physs, p) < 0 || p->released) RETURN(E_INVALID_VALUE);
    p->released = 1;
    if (p->maps == 0) phys_free(p);
    RETURN(OK);
}

static int reserved(unsigned long long ptr, unsigned long long size) {
    for (size_t i = 0; i < resvs.n; i++) {
        struct resv *v = resvs.v[i];
        if (ptr >= v->base && ptr + size <= v->base + v->size) return 1;
    }
    return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    BEGIN(cuMemMap);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    struct phys *p = (struct phys *)(uintptr_t)h;
    if (reg_find(&physs, p) < 0 || p->released) RETURN(E_INVALID_HANDLE);
    if (flags || size == 0 || ptr % GRANULARITY || size % GRANULARITY || offset % GRANULARITY ||
        offset + size > p->size)
        RETURN(E_INVALID_VALUE);
    if (!reserved(ptr, size)) RETURN(E_INVALID_VALUE);
    for (size_t i = 0; i < maps.n; i++) {
        struct mapping *m = maps.v[i];
        if (overlaps(m->addr, m->size, ptr, size)) RETURN(E_INVALID_VALUE); /* never over mapped bytes */
    }
    /* Inaccessible until cuMemSetAccess, as on a device. */
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset);
    if (at == MAP_FAILED) RETURN(E_OUT_OF_MEMORY);
    struct mapping *m = malloc(sizeof *m);
    if (!m || reg_add(&maps, m)) {
        free(m);
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        RETURN(E_OUT_OF_MEMORY);
    }
    *m = (struct mapping){ptr, size, offset, p, PROT_NONE};
    p->maps++;
    RETURN(OK);
}

/* The mappings that make up exactly [ptr, ptr+size), or 0 when the range has a hole or cuts
 * a mapping. */
static int whole_mappings(unsigned long long ptr, unsigned long long size) {
    unsigned long long covered = 0;
    for (size_t i = 0; i < maps.n; i++) {
        struct mapping *m = maps.v[i];
        if (!overlaps(m->addr, m->size, ptr, size)) continue;
        if (m->addr < ptr || m->addr + m->size > ptr + size) return 0;
        covered += m->size;
    }
    return covered == size;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct access_desc *desc, size_t count) {
    BEGIN(cuMemSetAccess);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    if (!desc || count == 0 || size == 0 || ptr % GRANULARITY || size % GRANULARITY) RETURN(E_INVALID_VALUE);
    if (!whole_mappings(ptr, size)) RETURN(E_INVALID_VALUE);
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1) RETURN(E_INVALID_VALUE);
        if (desc[i].location.id < 0 || desc[i].location.id >= g.devices) RETURN(E_INVALID_DEVICE);
        switch (desc[i].flags) {
        case 0: break;
        case 1: prot |= PROT_READ; break;
        case 3: prot |= PROT_READ | PROT_WRITE; break;
        default: RETURN(E_INVALID_VALUE);
        }
    }
    if (mprotect((void *)(uintptr_t)ptr, size, prot)) RETURN(E_INVALID_VALUE);
    for (size_t i = 0; i < maps.n; i++) {
        struct mapping *m = maps.v[i];
        if (!overlaps(m->addr, m->size, ptr, size)) continue;
        m->prot = prot;
        /* Warm memory is usable at once, as on a device: its page tables are filled now. */
        if (m->p->warm && (prot & PROT_WRITE)) warm_populate(m->addr, m->size);
    }
    RETURN(OK);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    BEGIN(cuMemUnmap);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    if (size == 0 || ptr % GRANULARITY || size % GRANULARITY || !whole_mappings(ptr, size)) RETURN(E_INVALID_VALUE);
    /* Back to reserved, inaccessible address space. */
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    for (size_t i = 0; i < maps.n;) {
        struct mapping *m = maps.v[i];
        if (!overlaps(m->addr, m->size, ptr, size)) { i++; continue; }
        struct phys *p = m->p;
        reg_del(&maps, (long)i);
        free(m);
        if (--p->maps == 0 && p->released) phys_free(p);
    }
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* control for tests (not part of CUDA): a test finds it with dlsym and skips on a real driver */

/* ------------------------------------------------------------------------------------------ */
/* what a CUDA runtime needs on top (testdrv/hostcudart.c): copies, waits, capture ids, pointer
 * attributes. Copies run at once, in call order, and complete (for events and synchronize) after
 * the stream's earlier work, like the async memsets above. */

/* Whether [ptr, ptr+n) is device memory; used by the copies in both directions. */
static CUresult copy_check(void *sh, struct stream **s, unsigned long long dev_a, int write_a,
                           unsigned long long dev_b, int has_b, size_t n) {
    CUresult r = stream_of(sh, s);
    if (r) return r;
    if (n == 0) return OK;
    if (!device_range(dev_a, n, write_a)) return E_INVALID_VALUE;
    if (has_b && !device_range(dev_b, n, 0)) return E_INVALID_VALUE;
    if ((*s)->cap_status == CAP_INVALIDATED) return E_CAPTURE_INVALIDATED;
    return OK;
}

/* Runs a checked copy on `s`: captured (not run) during an active capture, else now. */
static CUresult copy_run(struct stream *s, void *dst, const void *src, size_t n) {
    if (s->cap_status == CAP_ACTIVE) { /* runs when the graph runs */
        capture_record(s, OP_COPY, (uintptr_t)dst, (uintptr_t)src, n);
        return OK;
    }
    CUresult r = legacy_during_capture(s);
    if (r) return r;
    if (n) memmove(dst, src, n);
    enqueue(s);
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
    CUresult r = unsafe_call("cuMemcpyDtoD_v2");
    if (r) RETURN(r);
    if (n && (!device_range(dst, n, 1) || !device_range(src, n, 0))) RETURN(E_INVALID_VALUE);
    if (n) memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    RETURN(OK);
}

/* The stream's later work starts after the event's work. Waiting on an event recorded in a
 * capture from outside it is CUDA_ERROR_CAPTURED_EVENT's case; inside a capture the wait is a
 * graph dependency, nothing to do here. */
CUresult cuStreamWaitEvent(void *sh, void *h, unsigned flags) {
    BEGIN(cuStreamWaitEvent);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(sh, &s);
    if (r) RETURN(r);
    if (reg_find(&events, h) < 0) RETURN(E_INVALID_HANDLE);
    if (flags & ~1u) RETURN(E_INVALID_VALUE);
    struct event *e = h;
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) RETURN(OK);
    ev_pull(e);
    if (e->captured) RETURN(E_CAPTURED_EVENT);
    if (e->done_at > s->busy_until) s->busy_until = e->done_at;
    RETURN(OK);
}

/* Milliseconds between two completed events. */
CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
    BEGIN(cuEventElapsedTime);
    NEED_INIT();
    if (reg_find(&events, start) < 0 || reg_find(&events, end) < 0) RETURN(E_INVALID_HANDLE);
    if (!ms) RETURN(E_INVALID_VALUE);
    struct event *a = start, *b = end;
    if (a->captured || b->captured) RETURN(E_CAPTURED_EVENT);
    if (!a->done_at || !b->done_at) RETURN(E_INVALID_HANDLE); /* never recorded */
    unsigned long long t = now_ns();
    if (a->done_at > t || b->done_at > t) RETURN(E_NOT_READY);
    *ms = (float)((double)((long long)(b->done_at - a->done_at)) / 1e6);
    RETURN(OK);
}

/* CUDA 12's form: status, the capture's id, and no graph or dependency nodes (this driver
 * builds no graphs). */
CUresult cuStreamGetCaptureInfo_v2(void *sh, int *status, unsigned long long *id, void **graph,
                                   const void ***deps, size_t *ndeps) {
    BEGIN(cuStreamGetCaptureInfo_v2);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(sh, &s);
    if (r) RETURN(r);
    if (!status) RETURN(E_INVALID_VALUE);
    *status = s->cap_status;
    if (id) *id = s->cap_status ? s->cap_id : 0;
    if (graph) *graph = NULL;
    if (deps) *deps = NULL;
    if (ndeps) *ndeps = 0;
    RETURN(OK);
}

/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2: CU_MEMORYTYPE_DEVICE) and DEVICE_ORDINAL (9) of device
 * memory; any other pointer is CUDA_ERROR_INVALID_VALUE, as for unregistered host memory. */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    BEGIN(cuPointerGetAttribute);
    NEED_INIT();
    if (!data) RETURN(E_INVALID_VALUE);
    int dev = -1;
    for (size_t i = 0; i < allocs.n && dev < 0; i++) {
        struct alloc *a = allocs.v[i];
        if (ptr >= a->addr && ptr < a->addr + a->size) dev = a->dev;
    }
    for (size_t i = 0; i < maps.n && dev < 0; i++) {
        struct mapping *m = maps.v[i];
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
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (ptr >= a->addr && ptr < a->addr + a->size) {
            if (base) *base = a->addr;
            if (size) *size = a->size;
            RETURN(OK);
        }
    }
    for (size_t i = 0; i < maps.n; i++) {
        struct mapping *m = maps.v[i];
        if (ptr >= m->addr && ptr < m->addr + m->size) {
            if (base) *base = m->addr;
            if (size) *size = m->size;
            RETURN(OK);
        }
    }
    RETURN(E_NOT_FOUND);
}

/* A per-thread stack of contexts under the current one. */
static __thread struct ctx *t_stack[16];
static __thread int t_depth;

CUresult cuCtxPushCurrent_v2(void *c) {
    BEGIN(cuCtxPushCurrent_v2);
    NEED_INIT();
    if (!ctx_valid(c)) RETURN(E_INVALID_CONTEXT);
    if (t_depth == 16) RETURN(E_OUT_OF_MEMORY);
    t_stack[t_depth++] = t_current;
    t_current = c;
    RETURN(OK);
}

CUresult cuCtxPopCurrent_v2(void **out) {
    BEGIN(cuCtxPopCurrent_v2);
    NEED_INIT();
    if (!t_current) RETURN(E_INVALID_CONTEXT);
    if (out) *out = t_current;
    t_current = t_depth ? t_stack[--t_depth] : NULL;
    RETURN(OK);
}

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

/* Sets one setting: capacity_mb, delay_us, jitter_us, vmm, seed, trace, fail (a HOSTCUDA_FAIL
 * rule list, replacing the rules and their counters). Returns 0, or -1 for an unknown key or
 * a bad value. */
int hostcuda_set(const char *key, const char *value) {
    lock();
    configure();
    int rc = 0;
    unsigned long long v = value ? strtoull(value, NULL, 10) : 0;
    if (!key || !value) rc = -1;
    else if (!strcmp(key, "capacity_mb")) rc = set_capacity(v << 20);
    else if (!strcmp(key, "delay_us")) g.delay_ns = v * 1000;
    else if (!strcmp(key, "jitter_us")) g.jitter_ns = v * 1000;
    else if (!strcmp(key, "vmm")) g.vmm = v != 0;
    else if (!strcmp(key, "seed")) g.rng = v;
    else if (!strcmp(key, "trace")) g.trace = (int)v;
    else if (!strcmp(key, "fail")) rc = parse_rules(value);
    else if (!strcmp(key, "warm_mb")) set_warm_limit(v << 20);
    else rc = -1;
    unlock();
    return rc;
}

/* Bytes of device memory (linear and physical) in use on `dev`, or -1. */
long long hostcuda_used(int dev) {
    lock();
    configure();
    long long r = dev >= 0 && dev < g.devices ? (long long)used[dev] : -1;
    unlock();
    return r;
}

/* ------------------------------------------------------------------------------------------ */
/* a device shared by several processes (HOSTCUDA_SHARED)
 *
 * With HOSTCUDA_SHARED=/dev/shm/NAME, every process naming the same file drives the same
 * devices: one capacity and one free-memory figure across them, as processes sharing a GPU
 * see. The file holds a process-shared robust mutex, the capacity (set by the process that
 * created the file, from HOSTCUDA_CAPACITY_MB) and one slot per process with its bytes per
 * device. A process's charge is counted while it lives: a slot whose process is gone (exit,
 * crash, exec) no longer counts, as a driver frees a dead process's memory. Without the
 * variable the accounting is this process's own, as before. */

#define SHARED_MAGIC 0x68637368u
#define SHARED_VERSION 1u
#define SHARED_SLOTS 64

struct shared_slot {
    int pid;
    unsigned long long used[MAX_DEVICES];
};
struct shared {
    unsigned magic, version;
    pthread_mutex_t lock;
    unsigned long long capacity;
    struct shared_slot slots[SHARED_SLOTS];
};

static struct shared *sh;  /* NULL: not shared */
static int sh_slot = -1;   /* this process's slot, valid while sh_pid == getpid() */
static int sh_pid;

static void sh_lock(void) {
    if (pthread_mutex_lock(&sh->lock) == EOWNERDEAD) pthread_mutex_consistent(&sh->lock);
}
static void sh_unlock(void) { pthread_mutex_unlock(&sh->lock); }

static int pid_alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

static void shared_open(void) { /* from configure(), under the lock */
    const char *path = getenv("HOSTCUDA_SHARED");
    if (!path || !*path) return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    struct stat st;
    if (fd < 0 || flock(fd, LOCK_EX) || fstat(fd, &st) ||
        ((size_t)st.st_size < sizeof *sh && ftruncate(fd, sizeof *sh))) {
        fprintf(stderr, "hostcuda: HOSTCUDA_SHARED=%s: cannot open the shared device file: %s\n", path, strerror(errno));
        abort(); /* a test that asked for a shared device must not run on a private one */
    }
    struct shared *m = mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        fprintf(stderr, "hostcuda: HOSTCUDA_SHARED=%s: mmap: %s\n", path, strerror(errno));
        abort();
    }
    if (m->magic != SHARED_MAGIC || m->version != SHARED_VERSION) { /* new file (zeroed by ftruncate) */
        memset(m, 0, sizeof *m);
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&m->lock, &a);
        pthread_mutexattr_destroy(&a);
        m->capacity = g.capacity;
        m->version = SHARED_VERSION;
        __atomic_store_n(&m->magic, SHARED_MAGIC, __ATOMIC_RELEASE);
    }
    flock(fd, LOCK_UN);
    close(fd); /* the mapping stays */
    sh = m;
}

/* This process's slot (under sh_lock), claimed at its first charge; -1 when all are taken by
 * live processes. A slot of this pid from before an exec is stale and reused. */
static int sh_mine(void) {
    int pid = (int)getpid();
    if (sh_slot >= 0 && sh_pid == pid) return sh_slot;
    int got = -1;
    for (int i = 0; i < SHARED_SLOTS; i++) {
        struct shared_slot *s = &sh->slots[i];
        if (s->pid == pid || !pid_alive(s->pid)) {
            memset(s, 0, sizeof *s);
            if (got < 0) { got = i; s->pid = pid; }
        }
    }
    sh_slot = got;
    sh_pid = pid;
    return got;
}

/* Bytes in use on device d by every live process (under sh_lock); `reap` first drops the slots
 * of processes that are gone (a syscall per slot: only when the figure matters). */
static unsigned long long sh_used(int d, int reap) {
    unsigned long long sum = 0;
    for (int i = 0; i < SHARED_SLOTS; i++) {
        struct shared_slot *s = &sh->slots[i];
        if (!s->pid) continue;
        if (reap && !pid_alive(s->pid)) { memset(s, 0, sizeof *s); continue; }
        sum += s->used[d];
    }
    return sum;
}

static unsigned long long dev_capacity(void) { return sh ? __atomic_load_n(&sh->capacity, __ATOMIC_RELAXED) : g.capacity; }

static int set_capacity(unsigned long long bytes) {
    g.capacity = bytes;
    if (sh) __atomic_store_n(&sh->capacity, bytes, __ATOMIC_RELAXED);
    return 0;
}

static unsigned long long dev_free(int d) {
    unsigned long long cap = dev_capacity(), in_use = used[d];
    if (sh) {
        sh_lock();
        in_use = sh_used(d, 1);
        sh_unlock();
    }
    return cap > in_use ? cap - in_use : 0;
}

static int dev_charge(int d, unsigned long long bytes) {
    unsigned long long cap = dev_capacity();
    if (!sh) {
        if (bytes > cap || used[d] > cap - bytes) return -1;
        used[d] += bytes;
        return 0;
    }
    sh_lock();
    int mine = sh_mine();
    unsigned long long in_use = sh_used(d, 0);
    if (mine >= 0 && (bytes > cap || in_use > cap - bytes)) in_use = sh_used(d, 1); /* reclaim the dead's first */
    int ok = mine >= 0 && bytes <= cap && in_use <= cap - bytes;
    if (ok) sh->slots[mine].used[d] += bytes;
    sh_unlock();
    if (!ok) return -1;
    used[d] += bytes;
    return 0;
}

static void dev_uncharge(int d, unsigned long long bytes) {
    used[d] = used[d] > bytes ? used[d] - bytes : 0;
    if (!sh) return;
    sh_lock();
    if (sh_slot >= 0 && sh_pid == (int)getpid()) {
        unsigned long long *u = &sh->slots[sh_slot].used[d];
        *u = *u > bytes ? *u - bytes : 0;
    }
    sh_unlock();
}

/* A clean exit gives its slot back at once (a crash's is reclaimed by the liveness check). */
__attribute__((destructor)) static void shared_close(void) {
    if (!sh || sh_slot < 0 || sh_pid != (int)getpid()) return;
    sh_lock();
    if (sh->slots[sh_slot].pid == sh_pid) memset(&sh->slots[sh_slot], 0, sizeof sh->slots[sh_slot]);
    sh_unlock();
}

/* ------------------------------------------------------------------------------------------ */
/* warm memory: memory released earlier is handed back uncleared (HOSTCUDA_WARM_MB)
 *
 * On a device, creating physical memory and mapping it costs a driver call and the memory is
 * usable at once; host memory costs a page fault per 4 KiB page at first touch, which would
 * dominate what sleep/wake benchmarks measure. So released memory (cuMemFree's linear ranges,
 * cuMemRelease's memfd chunks) is kept, up to HOSTCUDA_WARM_MB per process (default: the
 * capacity), and the next allocation of a size it can serve takes it back with its old
 * contents, as a driver may hand back memory released earlier uncleared; a warm chunk's page
 * tables are filled when cuMemSetAccess makes it writable (MADV_POPULATE_WRITE), so first
 * touches do not fault either. The device charge is returned at release as before: kept warm
 * memory is host memory of this process, not device memory. Fresh memory is as before
 * (zero-filled at first touch). */

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

struct warm { void *p; int fd, dev; unsigned long long size; }; /* p: NULL for a chunk (fd only) */
static struct reg warm_linear, warm_chunks; /* entries: struct warm * */
static unsigned long long warm_bytes, warm_limit;
static int warm_configured;

static unsigned long long warm_cap(void) {
    if (!warm_configured) {
        warm_configured = 1;
        const char *v = getenv("HOSTCUDA_WARM_MB");
        warm_limit = v && *v ? strtoull(v, NULL, 10) << 20 : g.capacity;
    }
    return warm_limit;
}

/* The entry of `pool` that serves `bytes`: the same size, else the smallest larger one. */
static long warm_pick(struct reg *pool, unsigned long long bytes, int dev) {
    long best = -1;
    for (size_t i = 0; i < pool->n; i++) {
        struct warm *w = pool->v[i];
        if (w->dev != dev) continue; /* a memfd names its device (IPC reads it) */
        if (w->size == bytes) return (long)i;
        if (w->size > bytes && (best < 0 || w->size < ((struct warm *)pool->v[best])->size)) best = (long)i;
    }
    return best;
}

static void *warm_linear_take(unsigned long long bytes, int dev, int *fd) {
    long i = warm_pick(&warm_linear, bytes, dev);
    if (i < 0) return NULL;
    struct warm *w = warm_linear.v[i];
    void *p = w->p;
    if (w->size > bytes) { /* sizes are 2 MiB multiples */
        munmap((char *)p + bytes, w->size - bytes);
        if (ftruncate(w->fd, (off_t)bytes)) { /* the tail stays allocated in the file: harmless */ }
    }
    *fd = w->fd;
    warm_bytes -= w->size;
    reg_del(&warm_linear, i);
    free(w);
    return p;
}

static void warm_linear_put(void *p, int fd, int dev, unsigned long long bytes) {
    struct warm *w = NULL;
    if (warm_bytes + bytes > warm_cap() || !(w = malloc(sizeof *w)) || reg_add(&warm_linear, w)) {
        free(w);
        munmap(p, bytes);
        close(fd);
        return;
    }
    *w = (struct warm){p, fd, dev, bytes};
    warm_bytes += bytes;
}

static int warm_chunk_take(unsigned long long bytes, int dev, int *warm) {
    long i = warm_pick(&warm_chunks, bytes, dev);
    if (i < 0) return -1;
    struct warm *w = warm_chunks.v[i];
    int fd = w->fd;
    if (w->size > bytes && ftruncate(fd, (off_t)bytes)) return -1; /* keep it pooled */
    warm_bytes -= w->size;
    reg_del(&warm_chunks, i);
    free(w);
    *warm = 1;
    return fd;
}

static void warm_chunk_put(int fd, int dev, unsigned long long bytes) {
    struct warm *w = NULL;
    if (warm_bytes + bytes > warm_cap() || !(w = malloc(sizeof *w)) || reg_add(&warm_chunks, w)) {
        free(w);
        close(fd);
        return;
    }
    *w = (struct warm){NULL, fd, dev, bytes};
    warm_bytes += bytes;
}

static void warm_populate(unsigned long long ptr, unsigned long long size) {
    madvise((void *)(uintptr_t)ptr, size, MADV_POPULATE_WRITE); /* best effort: faults later otherwise */
}

/* Sets the limit; memory kept beyond it is given back to the host now (warm_mb 0 empties it). */
static void set_warm_limit(unsigned long long bytes) {
    warm_cap();
    warm_limit = bytes;
    while (warm_bytes > warm_limit && (warm_linear.n || warm_chunks.n)) {
        struct reg *pool = warm_linear.n ? &warm_linear : &warm_chunks;
        struct warm *w = pool->v[pool->n - 1];
        if (w->p) munmap(w->p, w->size);
        close(w->fd);
        warm_bytes -= w->size;
        reg_del(pool, (long)pool->n - 1);
        free(w);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* graphs that replay their copies
 *
 * Copies and memsets queued on a capturing stream are recorded (they do not run then, as on a
 * device) and the graph that cuStreamEndCapture returns holds them; the runtime
 * (hostcudart.c) snapshots them at instantiation and runs them, in capture order, at each
 * launch. Each launch checks the device side of every recorded operation against the memory
 * mapped now: a graph whose memory was unmapped (a paused tag) fails with
 * CUDA_ERROR_INVALID_VALUE instead of touching it, where a device would fault. Kernels are not
 * recorded (none run here); cross-stream captures record only the capturing stream's work. */

struct op { int kind; unsigned long long dst, src, n; }; /* SET8/SET32: src is the value */
struct ops { struct op *v; size_t n, cap; };
struct capture_rec { struct stream *s; unsigned long long id; struct ops ops; };
static struct reg captures; /* struct capture_rec *, one per capture with recorded work */

static int ops_add(struct ops *o, struct op op) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 16;
        struct op *v = realloc(o->v, cap * sizeof *v);
        if (!v) return -1;
        o->v = v;
        o->cap = cap;
    }
    o->v[o->n++] = op;
    return 0;
}

static void capture_record(struct stream *s, int kind, unsigned long long dst, unsigned long long src,
                           unsigned long long n) {
    struct capture_rec *c = NULL;
    for (size_t i = 0; i < captures.n && !c; i++) {
        struct capture_rec *x = captures.v[i];
        if (x->s == s && x->id == s->cap_id) c = x;
    }
    if (!c) {
        if (!(c = calloc(1, sizeof *c)) || reg_add(&captures, c)) { free(c); s->cap_status = CAP_INVALIDATED; return; }
        c->s = s;
        c->id = s->cap_id;
    }
    if (ops_add(&c->ops, (struct op){kind, dst, src, n})) s->cap_status = CAP_INVALIDATED; /* out of host memory */
}

/* A graph: the recorded work of the capture that ends on `s` (dropped when !keep). */
static void *graph_new(struct stream *s, int keep) {
    struct ops ops = {0};
    for (size_t i = 0; i < captures.n; i++) {
        struct capture_rec *c = captures.v[i];
        if (c->s != s || c->id != s->cap_id) continue;
        ops = c->ops;
        reg_del(&captures, (long)i);
        free(c);
        break;
    }
    if (!keep) { free(ops.v); return NULL; }
    struct ops *gr = malloc(sizeof *gr);
    if (!gr) { free(ops.v); return NULL; }
    *gr = ops;
    return gr;
}

static void graph_free(void *gr) {
    struct ops *o = gr;
    if (o) free(o->v);
    free(o);
}

/* Whether `p` lies in device address space (an allocation or a reserved range). */
static int device_space(unsigned long long p) {
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (p >= a->addr && p < a->addr + a->charged) return 1;
    }
    return reserved(p, 1);
}

/* For the runtime's cudaGraphInstantiate: a copy of graph `gr`'s recorded work, or NULL
 * (not a live graph, or out of memory). Free with hostcuda_graph_snapshot_free. */
void *hostcuda_graph_snapshot(void *gr) {
    lock();
    struct ops *copy = NULL;
    if (reg_find(&graphs, gr) >= 0 && (copy = calloc(1, sizeof *copy))) {
        struct ops *o = gr;
        if (o->n && !(copy->v = malloc(o->n * sizeof *copy->v))) { free(copy); copy = NULL; }
        else {
            if (o->n) memcpy(copy->v, o->v, o->n * sizeof *copy->v);
            copy->n = copy->cap = o->n;
        }
    }
    unlock();
    return copy;
}

void hostcuda_graph_snapshot_free(void *snap) { graph_free(snap); }

/* For the runtime's cudaGraphGetNodes: the operations recorded in graph `gr` (-1: not a live
 * graph); with `nodes`, up to `cap` handles (the operations' addresses, unique and stable while
 * the graph lives). */
long hostcuda_graph_nodes(void *gr, void **nodes, size_t cap) {
    lock();
    long n = -1;
    if (reg_find(&graphs, gr) >= 0) {
        struct ops *o = gr;
        n = (long)o->n;
        for (size_t i = 0; nodes && i < cap && i < o->n; i++) nodes[i] = &o->v[i];
    }
    unlock();
    return n;
}

/* For the runtime's cudaGraphLaunch: runs the snapshot's work on stream `sh`, in order. */
CUresult hostcuda_graph_launch(void *snap, void *sh) {
    BEGIN(hostcuda_graph_launch);
    NEED_INIT();
    struct stream *s;
    CUresult r = stream_of(sh, &s);
    if (r) RETURN(r);
    if (!snap) RETURN(E_INVALID_VALUE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) RETURN(OK); /* a graph launched inside a capture: a node */
    struct ops *o = snap;
    for (size_t i = 0; i < o->n; i++) { /* every device side mapped now, before anything runs */
        struct op *op = &o->v[i];
        unsigned long long bytes = op->kind == OP_SET32 ? 4 * op->n : op->n;
        if (!bytes) continue;
        if (device_space(op->dst) && !device_range(op->dst, bytes, 1)) RETURN(E_INVALID_VALUE);
        if (op->kind == OP_COPY && device_space(op->src) && !device_range(op->src, bytes, 0)) RETURN(E_INVALID_VALUE);
    }
    for (size_t i = 0; i < o->n; i++) {
        struct op *op = &o->v[i];
        if (op->kind == OP_COPY) memmove((void *)(uintptr_t)op->dst, (const void *)(uintptr_t)op->src, op->n);
        else if (op->kind == OP_SET8) memset((void *)(uintptr_t)op->dst, (int)op->src, op->n);
        else fill32(op->dst, (unsigned)op->src, op->n);
    }
    enqueue(s);
    RETURN(OK);
}

/* inter-process sharing (CUDA driver API reference, "Memory Management": cuIpc*; "Virtual Memory
 * Management": cuMemExportToShareableHandle, cuMemImportFromShareableHandle)
 *
 * Device memory is a memfd, so sharing it is sharing a file descriptor:
 * - a legacy IPC handle (cuIpcGetMemHandle of cuMemAlloc memory) and an IPC event handle name
 *   the producer's pid, its descriptor of the memfd and the memfd's inode; the receiver takes
 *   the descriptor with pidfd_open + pidfd_getfd (as PyTorch takes POSIX-fd handles), checks
 *   the inode (a descriptor number reused for another file is a stale handle) and maps it;
 * - cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) returns a new descriptor of a physical
 *   chunk's memfd, for chunks created with that type in requestedHandleTypes; the importer makes
 *   a physical chunk of the descriptor it got (a duplicate: the caller closes its own).
 * Opening a handle of this process is CUDA_ERROR_INVALID_CONTEXT, as on a GPU; opening one that
 * is already open here returns the same address and counts the opens (cuIpcCloseMemHandle
 * unmaps at the last close). An event shared between processes keeps its completion time in a
 * shared page that both sides read and write (the monotonic clock is the same for all). */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#define IPC_MAGIC "hcIPCv1"
enum { IPC_MEMORY = 1, IPC_EVENT = 2 };
enum { EVENT_DISABLE_TIMING = 2, EVENT_INTERPROCESS = 4 };
enum { HANDLE_TYPE_POSIX_FD = 1 };

/* CUipcMemHandle and CUipcEventHandle: 64 opaque bytes. */
struct ipc_handle {
    char magic[8];
    int pid, fd;
    unsigned long long ino, size;
    int dev, kind;
    char reserved[24];
};
_Static_assert(sizeof(struct ipc_handle) == 64, "CUipcMemHandle is 64 bytes");

struct ev_shared { unsigned long long done_at; int captured; };

/* A memfd for device memory of `dev`; its name says the device (read back on import). */
static int device_memfd(int dev) {
    char name[32];
    snprintf(name, sizeof name, "hostcuda-dev%d", dev);
    return memfd_create(name, MFD_CLOEXEC);
}

/* The device of a hostcuda memfd, or -1 when `fd` is not one. */
static int memfd_device(int fd) {
    char path[64], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) return -1;
    target[n] = 0;
    int dev = -1;
    if (sscanf(target, "/memfd:hostcuda-dev%d", &dev) != 1 || dev < 0 || dev >= g.devices) return -1;
    return dev;
}

static unsigned long long fd_inode(int fd) {
    struct stat st;
    return fstat(fd, &st) ? 0 : (unsigned long long)st.st_ino;
}

static void ipc_fill(struct ipc_handle *h, int fd, unsigned long long size, int dev, int kind) {
    memset(h, 0, sizeof *h);
    memcpy(h->magic, IPC_MAGIC, sizeof h->magic);
    h->pid = getpid();
    h->fd = fd;
    h->ino = fd_inode(fd);
    h->size = size;
    h->dev = dev;
    h->kind = kind;
}

/* This process's descriptor of the file a handle names: OK, or the error to return. */
static CUresult ipc_fetch(const struct ipc_handle *h, int kind, int *out) {
    if (memcmp(h->magic, IPC_MAGIC, sizeof h->magic) || h->kind != kind || h->size == 0) return E_INVALID_VALUE;
    if (h->pid == getpid()) return E_INVALID_CONTEXT; /* a handle of this process */
    int pidfd = (int)syscall(SYS_pidfd_open, h->pid, 0);
    if (pidfd < 0) return E_INVALID_HANDLE; /* the producer is gone */
    int fd = (int)syscall(SYS_pidfd_getfd, pidfd, h->fd, 0);
    close(pidfd);
    if (fd < 0) return E_INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) || (unsigned long long)st.st_ino != h->ino || (unsigned long long)st.st_size < h->size) {
        close(fd);
        return E_INVALID_HANDLE; /* freed by the producer, its descriptor number reused */
    }
    *out = fd;
    return OK;
}

CUresult cuIpcGetMemHandle(struct ipc_handle *out, CUdeviceptr ptr) {
    BEGIN(cuIpcGetMemHandle);
    NEED_CTX();
    if (!out) RETURN(E_INVALID_VALUE);
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (a->addr == ptr && !a->ipc_pid) {
            ipc_fill(out, a->fd, a->size, a->dev, IPC_MEMORY);
            a->exported = 1;
            RETURN(OK);
        }
    }
    RETURN(E_INVALID_VALUE); /* only the base of a cuMemAlloc allocation (not cuMemCreate memory) */
}

/* Under the lock (BEGIN's); `call_` names the caller for the trace. */
static CUresult ipc_open(const char *call_, CUdeviceptr *out, struct ipc_handle h, unsigned flags) {
    NEED_CTX();
    if (!out || flags != 1) RETURN(E_INVALID_VALUE); /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (a->ipc_pid && a->ipc_pid == h.pid && a->ipc_ino == h.ino) {
            a->ipc_refs++;
            *out = a->addr;
            RETURN(OK);
        }
    }
    int fd = -1;
    CUresult r = ipc_fetch(&h, IPC_MEMORY, &fd);
    if (r) RETURN(r);
    unsigned long long span = round_up(h.size, ALLOC_PAGE);
    void *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) { close(fd); RETURN(E_OUT_OF_MEMORY); }
    struct alloc *a = calloc(1, sizeof *a);
    if (!a || reg_add(&allocs, a)) { free(a); munmap(p, span); close(fd); RETURN(E_OUT_OF_MEMORY); }
    *a = (struct alloc){.addr = (uintptr_t)p, .size = h.size, .dev = t_current->dev, .fd = fd,
                        .ipc_pid = h.pid, .ipc_refs = 1, .ipc_ino = h.ino};
    *out = a->addr;
    RETURN(OK);
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *out, struct ipc_handle h, unsigned flags) {
    BEGIN(cuIpcOpenMemHandle_v2);
    return ipc_open(call_, out, h, flags);
}

CUresult cuIpcOpenMemHandle(CUdeviceptr *out, struct ipc_handle h, unsigned flags) {
    BEGIN(cuIpcOpenMemHandle);
    return ipc_open(call_, out, h, flags);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
    BEGIN(cuIpcCloseMemHandle);
    NEED_CTX();
    for (size_t i = 0; i < allocs.n; i++) {
        struct alloc *a = allocs.v[i];
        if (a->addr != ptr || !a->ipc_pid) continue;
        if (--a->ipc_refs == 0) {
            munmap((void *)(uintptr_t)a->addr, round_up(a->size, ALLOC_PAGE));
            close(a->fd);
            reg_del(&allocs, (long)i);
            free(a);
        }
        RETURN(OK);
    }
    RETURN(E_INVALID_VALUE);
}

static void ev_pull(struct event *e) {
    if (!e->sh) return;
    e->done_at = __atomic_load_n(&e->sh->done_at, __ATOMIC_ACQUIRE);
    e->captured = __atomic_load_n(&e->sh->captured, __ATOMIC_ACQUIRE);
}

static void ev_push(struct event *e) {
    if (!e->sh) return;
    __atomic_store_n(&e->sh->captured, e->captured, __ATOMIC_RELEASE);
    __atomic_store_n(&e->sh->done_at, e->done_at, __ATOMIC_RELEASE);
}

static void ev_unshare(struct event *e) {
    if (!e->sh) return;
    munmap(e->sh, sizeof *e->sh);
    close(e->sh_fd);
    e->sh = NULL;
}

static struct ev_shared *ev_map(int fd) {
    void *p = mmap(NULL, sizeof(struct ev_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* The event must have been created with CU_EVENT_INTERPROCESS and CU_EVENT_DISABLE_TIMING. */
CUresult cuIpcGetEventHandle(struct ipc_handle *out, void *h) {
    BEGIN(cuIpcGetEventHandle);
    NEED_INIT();
    if (!out || reg_find(&events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    if ((e->flags & (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)) != (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING))
        RETURN(E_INVALID_VALUE);
    if (!e->sh) {
        int fd = memfd_create("hostcuda-event", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, sizeof *e->sh)) { if (fd >= 0) close(fd); RETURN(E_OUT_OF_MEMORY); }
        if (!(e->sh = ev_map(fd))) { close(fd); RETURN(E_OUT_OF_MEMORY); }
        e->sh_fd = fd;
        ev_push(e);
    }
    ipc_fill(out, e->sh_fd, sizeof *e->sh, e->ctx->dev, IPC_EVENT);
    RETURN(OK);
}

CUresult cuIpcOpenEventHandle(void **out, struct ipc_handle h) {
    BEGIN(cuIpcOpenEventHandle);
    NEED_CTX();
    if (!out) RETURN(E_INVALID_VALUE);
    int fd = -1;
    CUresult r = ipc_fetch(&h, IPC_EVENT, &fd);
    if (r) RETURN(r);
    struct event *e = calloc(1, sizeof *e);
    if (!e || !(e->sh = ev_map(fd)) || reg_add(&events, e)) {
        if (e && e->sh) munmap(e->sh, sizeof *e->sh);
        free(e);
        close(fd);
        RETURN(E_OUT_OF_MEMORY);
    }
    e->ctx = t_current;
    e->flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING;
    e->sh_fd = fd;
    ev_pull(e);
    *out = e;
    RETURN(OK);
}

/* A new descriptor of the chunk's memfd; the caller owns it. */
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
    BEGIN(cuMemExportToShareableHandle);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    struct phys *p = (struct phys *)(uintptr_t)h;
    if (reg_find(&physs, p) < 0 || p->released) RETURN(E_INVALID_HANDLE);
    if (!out || flags || type != HANDLE_TYPE_POSIX_FD) RETURN(E_INVALID_VALUE);
    if (!(p->handle_types & HANDLE_TYPE_POSIX_FD)) RETURN(E_INVALID_VALUE); /* not requested at creation */
    int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) RETURN(E_OUT_OF_MEMORY);
    p->exported = 1;
    *(int *)out = fd;
    RETURN(OK);
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle, int type) {
    BEGIN(cuMemImportFromShareableHandle);
    CUresult r = vmm_check();
    if (r) RETURN(r);
    if (!out || type != HANDLE_TYPE_POSIX_FD) RETURN(E_INVALID_VALUE);
    int theirs = (int)(intptr_t)os_handle;
    int dev = memfd_device(theirs);
    struct stat st;
    if (dev < 0 || fstat(theirs, &st) || st.st_size <= 0 || (unsigned long long)st.st_size % GRANULARITY)
        RETURN(E_INVALID_VALUE); /* not a descriptor from cuMemExportToShareableHandle */
    int fd = fcntl(theirs, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) RETURN(E_OUT_OF_MEMORY);
    struct phys *p = calloc(1, sizeof *p);
    if (!p || reg_add(&physs, p)) { free(p); close(fd); RETURN(E_OUT_OF_MEMORY); }
    p->fd = fd;
    p->dev = dev;
    p->size = (unsigned long long)st.st_size;
    p->handle_types = HANDLE_TYPE_POSIX_FD;
    p->imported = 1;
    *out = (uintptr_t)p;
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
    if (!h || reg_add(&host_allocs, h)) { free(h); munmap(p, bytes); RETURN(E_OUT_OF_MEMORY); }
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
            reg_del(&host_allocs, (long)i);
            free(h);
            RETURN(OK);
        }
    }
    RETURN(E_INVALID_VALUE);
}
