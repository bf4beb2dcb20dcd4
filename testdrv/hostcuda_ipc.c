/* hostcuda_ipc.c: sharing between processes, for the host-memory CUDA driver (hostcuda.c lists
 * its parts). It owns the memfds device memory lives in (hostcuda-dev<N>), the legacy IPC handles
 * of memory and events (cuIpcGetMemHandle, cuIpcOpenMemHandle, cuIpcCloseMemHandle,
 * cuIpcGetEventHandle, cuIpcOpenEventHandle) with the shared state of an IPC event, and the
 * POSIX file descriptor export and import of physical chunks (cuMemExportToShareableHandle,
 * cuMemImportFromShareableHandle). */
#include "hostcuda_internal.h"

/* ------------------------------------------------------------------------------------------ */
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
int hc_device_memfd(int dev) {
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
    if (sscanf(target, "/memfd:hostcuda-dev%d", &dev) != 1 || dev < 0 || dev >= hc_g.devices) return -1;
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
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
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
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (a->ipc_pid && a->ipc_pid == h.pid && a->ipc_ino == h.ino) {
            a->ipc_refs++;
            *out = a->addr;
            RETURN(OK);
        }
    }
    int fd = -1;
    CUresult r = ipc_fetch(&h, IPC_MEMORY, &fd);
    if (r) RETURN(r);
    unsigned long long span = hc_round_up(h.size, ALLOC_PAGE);
    void *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) { close(fd); RETURN(E_OUT_OF_MEMORY); }
    struct alloc *a = calloc(1, sizeof *a);
    if (!a || hc_reg_add(&hc_allocs, a)) { free(a); munmap(p, span); close(fd); RETURN(E_OUT_OF_MEMORY); }
    *a = (struct alloc){.addr = (uintptr_t)p, .size = h.size, .dev = hc_current->dev, .fd = fd,
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
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (a->addr != ptr || !a->ipc_pid) continue;
        if (--a->ipc_refs == 0) {
            munmap((void *)(uintptr_t)a->addr, hc_round_up(a->size, ALLOC_PAGE));
            close(a->fd);
            hc_reg_del(&hc_allocs, (long)i);
            free(a);
        }
        RETURN(OK);
    }
    RETURN(E_INVALID_VALUE);
}

void hc_ev_pull(struct event *e) {
    if (!e->sh) return;
    e->done_at = __atomic_load_n(&e->sh->done_at, __ATOMIC_ACQUIRE);
    e->captured = __atomic_load_n(&e->sh->captured, __ATOMIC_ACQUIRE);
}

void hc_ev_push(struct event *e) {
    if (!e->sh) return;
    __atomic_store_n(&e->sh->captured, e->captured, __ATOMIC_RELEASE);
    __atomic_store_n(&e->sh->done_at, e->done_at, __ATOMIC_RELEASE);
}

void hc_ev_unshare(struct event *e) {
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
    if (!out || hc_reg_find(&hc_events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    if ((e->flags & (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)) != (EVENT_INTERPROCESS | EVENT_DISABLE_TIMING))
        RETURN(E_INVALID_VALUE);
    if (!e->sh) {
        int fd = memfd_create("hostcuda-event", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, sizeof *e->sh)) { if (fd >= 0) close(fd); RETURN(E_OUT_OF_MEMORY); }
        if (!(e->sh = ev_map(fd))) { close(fd); RETURN(E_OUT_OF_MEMORY); }
        e->sh_fd = fd;
        hc_ev_push(e);
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
    if (!e || !(e->sh = ev_map(fd)) || hc_reg_add(&hc_events, e)) {
        if (e && e->sh) munmap(e->sh, sizeof *e->sh);
        free(e);
        close(fd);
        RETURN(E_OUT_OF_MEMORY);
    }
    e->ctx = hc_current;
    e->flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING;
    e->sh_fd = fd;
    hc_ev_pull(e);
    *out = e;
    RETURN(OK);
}

/* A new descriptor of the chunk's memfd; the caller owns it. */
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
    BEGIN(cuMemExportToShareableHandle);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    struct phys *p = (struct phys *)(uintptr_t)h;
    if (hc_reg_find(&hc_physs, p) < 0 || p->released) RETURN(E_INVALID_HANDLE);
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
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    if (!out || type != HANDLE_TYPE_POSIX_FD) RETURN(E_INVALID_VALUE);
    int theirs = (int)(intptr_t)os_handle;
    int dev = memfd_device(theirs);
    struct stat st;
    if (dev < 0 || fstat(theirs, &st) || st.st_size <= 0 || (unsigned long long)st.st_size % GRANULARITY)
        RETURN(E_INVALID_VALUE); /* not a descriptor from cuMemExportToShareableHandle */
    struct phys *p = calloc(1, sizeof *p);
    if (!p) RETURN(E_OUT_OF_MEMORY);
    for (size_t i = 0; i < hc_physs.n && !p->fd_refs; i++) {
        struct phys *q = hc_physs.v[i];
        if (q->imported && q->ino == (unsigned long long)st.st_ino) {
            p->fd = q->fd;
            p->fd_refs = q->fd_refs;
        }
    }
    if (!p->fd_refs) {
        p->fd_refs = calloc(1, sizeof *p->fd_refs);
        p->fd = p->fd_refs ? fcntl(theirs, F_DUPFD_CLOEXEC, 0) : -1;
        if (p->fd < 0) { free(p->fd_refs); free(p); RETURN(E_OUT_OF_MEMORY); }
    }
    if (hc_reg_add(&hc_physs, p)) {
        if (*p->fd_refs == 0) { close(p->fd); free(p->fd_refs); }
        free(p);
        RETURN(E_OUT_OF_MEMORY);
    }
    ++*p->fd_refs;
    p->ino = (unsigned long long)st.st_ino;
    p->dev = dev;
    p->size = (unsigned long long)st.st_size;
    p->handle_types = HANDLE_TYPE_POSIX_FD;
    p->imported = 1;
    *out = (uintptr_t)p;
    RETURN(OK);
}
