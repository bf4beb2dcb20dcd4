/* hostcuda_internal.h: what the parts of the host-memory CUDA driver (testdrv/hostcuda*.c) share:
 * the CUDA types and result codes it uses, the objects (contexts, streams, events, allocations,
 * physical chunks, mappings), the one lock and the global state, the registries of live objects,
 * the entry macros every call starts with (BEGIN, RETURN, NEED_*), and the helpers one part
 * defines and others call. Every name here that the linker sees has the prefix hc_ and hidden
 * visibility: libcuda.so.1 exports the CUDA calls and the hostcuda_* controls only. Which file
 * owns what: the comment at the top of hostcuda.c. Not part of any public interface. */
#ifndef HOSTCUDA_INTERNAL_H
#define HOSTCUDA_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
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
/* The kinds of captured work a graph replays (hostcuda_stream.c). */
enum { OP_COPY = 0, OP_SET8 = 1, OP_SET32 = 2 };

/* ------------------------------------------------------------------------------------------ */
/* configuration and state (hostcuda.c) */

struct rule {
    char name[64];
    int code;
    long after, count, seen, fired;
    double prob;
};

struct hc_state {
    pthread_mutex_t lock;
    int configured, inited, devices, vmm, trace;
    unsigned long long unmaps_under_work; /* hostcuda_unmaps_under_work */
    unsigned long long capacity, delay_ns, jitter_ns, rng;
    struct rule rules[32];
    int nrules;
    unsigned long long capture_ids;
};

/* registries of live objects */
struct reg {
    void **v;
    size_t n, cap;
};

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

struct ev_shared; /* hostcuda_ipc.c */
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
/* `warm`: its pages were touched before; `handle_types`: cuMemCreate's requestedHandleTypes;
 * `imported` from another process's file descriptor (not charged here: the exporter's device
 * holds the charge); `exported`: its descriptor went to another process (never kept warm). */
/* An imported chunk shares its descriptor with the other imports of the same file (`fd_refs`
 * counts them; `ino` names the file): a driver holds no descriptor per import, so a receiver of
 * thousands of handles must not run out of descriptors here either. */
struct phys {
    int fd, dev, released, maps, warm, handle_types, imported, exported;
    unsigned long long size, ino;
    int *fd_refs;
};
struct mapping { unsigned long long addr, size, offset; struct phys *p; int prot; };

/* Everything from here to the matching pop is internal to libcuda.so.1. */
#pragma GCC visibility push(hidden)

extern struct hc_state hc_g;                 /* hostcuda.c */
extern struct ctx hc_ctxs[MAX_DEVICES];      /* hostcuda.c */
extern __thread struct ctx *hc_current;      /* hostcuda.c: this thread's current context */
extern struct reg hc_allocs;                 /* hostcuda_mem.c: struct alloc * */
extern struct reg hc_physs, hc_maps;         /* hostcuda_vmm.c: struct phys *, struct mapping * */
extern struct reg hc_events;                 /* hostcuda_stream.c: struct event * */

/* hostcuda.c: the lock that guards all state, failure injection, registries, contexts */
void hc_lock(void);
void hc_unlock(void);
unsigned long long hc_rand64(void); /* under the lock */
CUresult hc_inject(const char *call);
int hc_reg_add(struct reg *r, void *p);
long hc_reg_find(struct reg *r, const void *p);
void hc_reg_del(struct reg *r, long i);
int hc_ctx_valid(const struct ctx *c);

/* hostcuda_account.c: device memory accounting (per process, or across the processes of a
 * HOSTCUDA_SHARED device) and warm memory. Called under the lock. */
void hc_shared_open(void);
int hc_set_capacity(unsigned long long bytes);
void hc_set_warm_limit(unsigned long long bytes);
unsigned long long hc_dev_capacity(void);
unsigned long long hc_dev_free(int d);
unsigned long long hc_dev_used(int d);
int hc_dev_charge(int d, unsigned long long bytes);
void hc_dev_uncharge(int d, unsigned long long bytes);
void *hc_warm_linear_take(unsigned long long bytes, int dev, int *fd);
void hc_warm_linear_put(void *p, int fd, int dev, unsigned long long bytes);
int hc_warm_chunk_take(unsigned long long bytes, int dev, int *warm);
void hc_warm_chunk_put(int fd, int dev, unsigned long long bytes);
void hc_warm_populate(unsigned long long ptr, unsigned long long size);

/* hostcuda_mem.c: linear memory */
unsigned long long hc_round_up(unsigned long long x, unsigned long long to);
int hc_device_range(unsigned long long ptr, unsigned long long n, int write);

/* hostcuda_vmm.c: virtual memory management */
CUresult hc_vmm_check(void);
int hc_reserved(unsigned long long ptr, unsigned long long size);

/* hostcuda_stream.c: streams, capture rules, stream time, captured work */
CUresult hc_stream_of(void *h, struct stream **out);
CUresult hc_unsafe_call(const char *call);
CUresult hc_legacy_during_capture(struct stream *s);
unsigned long long hc_enqueue(struct stream *s);
/* Work queued on a stream uses [addr, addr + n) until `done` (hostcuda_stream.c keeps the
 * latest uses); hc_range_busy tells whether unfinished work uses a byte of [addr, addr + n). */
void hc_note_use(unsigned long long addr, unsigned long long n, unsigned long long done);
int hc_range_busy(unsigned long long addr, unsigned long long n);
void hc_capture_record(struct stream *s, int kind, unsigned long long dst, unsigned long long src,
                       unsigned long long n);

/* hostcuda_copy.c */
void hc_fill32(unsigned long long ptr, unsigned value, size_t words);

/* hostcuda_ipc.c: memfds of device memory; events shared between processes, whose state is
 * read before and written after use */
int hc_device_memfd(int dev);
void hc_ev_pull(struct event *e);
void hc_ev_push(struct event *e);
void hc_ev_unshare(struct event *e);

#pragma GCC visibility pop

/* ------------------------------------------------------------------------------------------ */
/* entry helpers: every CUDA call starts with BEGIN (the lock, then failure injection) and leaves
 * through RETURN (trace, unlock) */

#define BEGIN(name)                                                                           \
    hc_lock();                                                                                \
    const char *call_ = #name;                                                                \
    CUresult inj_ = hc_inject(#name);                                                         \
    if (inj_) { hc_unlock(); return inj_; }
#define RETURN(x) do { CUresult r_ = (x); if (r_ && hc_g.trace > 1) fprintf(stderr, "hostcuda: %s returns %d\n", call_, r_); hc_unlock(); return r_; } while (0)
#define NEED_INIT() do { if (!hc_g.inited) RETURN(E_NOT_INITIALIZED); } while (0)
#define NEED_CTX() do { NEED_INIT(); if (!hc_current || !hc_ctx_valid(hc_current)) RETURN(E_INVALID_CONTEXT); } while (0)
#define NEED_DEV(d) do { NEED_INIT(); if ((d) < 0 || (d) >= hc_g.devices) RETURN(E_INVALID_DEVICE); } while (0)

#endif
