/* hostcuda_account.c: device memory accounting and warm memory, for the host-memory CUDA driver
 * (hostcuda.c lists its parts). It owns what each device has in use (this process's bytes, or
 * every process's on a device shared through HOSTCUDA_SHARED), the capacity and free figures,
 * charging and uncharging, and the pools of memory released earlier and handed back uncleared
 * (HOSTCUDA_WARM_MB). Its callers (hostcuda_mem.c, hostcuda_vmm.c, hostcuda.c) hold the lock. */
#include "hostcuda_internal.h"

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

static unsigned long long used[MAX_DEVICES]; /* this process's bytes per device */
static struct shared *sh;  /* NULL: not shared */
static int sh_slot = -1;   /* this process's slot, valid while sh_pid == getpid() */
static int sh_pid;

static void sh_lock(void) {
    if (pthread_mutex_lock(&sh->lock) == EOWNERDEAD) pthread_mutex_consistent(&sh->lock);
}
static void sh_unlock(void) { pthread_mutex_unlock(&sh->lock); }

static int pid_alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

void hc_shared_open(void) { /* from configure(), under the lock */
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
        m->capacity = hc_g.capacity;
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

unsigned long long hc_dev_capacity(void) { return sh ? __atomic_load_n(&sh->capacity, __ATOMIC_RELAXED) : hc_g.capacity; }

int hc_set_capacity(unsigned long long bytes) {
    hc_g.capacity = bytes;
    if (sh) __atomic_store_n(&sh->capacity, bytes, __ATOMIC_RELAXED);
    return 0;
}

unsigned long long hc_dev_free(int d) {
    unsigned long long cap = hc_dev_capacity(), in_use = used[d];
    if (sh) {
        sh_lock();
        in_use = sh_used(d, 1);
        sh_unlock();
    }
    return cap > in_use ? cap - in_use : 0;
}

int hc_dev_charge(int d, unsigned long long bytes) {
    unsigned long long cap = hc_dev_capacity();
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

void hc_dev_uncharge(int d, unsigned long long bytes) {
    used[d] = used[d] > bytes ? used[d] - bytes : 0;
    if (!sh) return;
    sh_lock();
    if (sh_slot >= 0 && sh_pid == (int)getpid()) {
        unsigned long long *u = &sh->slots[sh_slot].used[d];
        *u = *u > bytes ? *u - bytes : 0;
    }
    sh_unlock();
}

/* This process's own bytes on device d (hostcuda_used), shared device or not. */
unsigned long long hc_dev_used(int d) { return used[d]; }

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
        warm_limit = v && *v ? strtoull(v, NULL, 10) << 20 : hc_g.capacity;
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

void *hc_warm_linear_take(unsigned long long bytes, int dev, int *fd) {
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
    hc_reg_del(&warm_linear, i);
    free(w);
    return p;
}

void hc_warm_linear_put(void *p, int fd, int dev, unsigned long long bytes) {
    struct warm *w = NULL;
    if (warm_bytes + bytes > warm_cap() || !(w = malloc(sizeof *w)) || hc_reg_add(&warm_linear, w)) {
        free(w);
        munmap(p, bytes);
        close(fd);
        return;
    }
    *w = (struct warm){p, fd, dev, bytes};
    warm_bytes += bytes;
}

int hc_warm_chunk_take(unsigned long long bytes, int dev, int *warm) {
    long i = warm_pick(&warm_chunks, bytes, dev);
    if (i < 0) return -1;
    struct warm *w = warm_chunks.v[i];
    int fd = w->fd;
    if (w->size > bytes && ftruncate(fd, (off_t)bytes)) return -1; /* keep it pooled */
    warm_bytes -= w->size;
    hc_reg_del(&warm_chunks, i);
    free(w);
    *warm = 1;
    return fd;
}

void hc_warm_chunk_put(int fd, int dev, unsigned long long bytes) {
    struct warm *w = NULL;
    if (warm_bytes + bytes > warm_cap() || !(w = malloc(sizeof *w)) || hc_reg_add(&warm_chunks, w)) {
        free(w);
        close(fd);
        return;
    }
    *w = (struct warm){NULL, fd, dev, bytes};
    warm_bytes += bytes;
}

void hc_warm_populate(unsigned long long ptr, unsigned long long size) {
    madvise((void *)(uintptr_t)ptr, size, MADV_POPULATE_WRITE); /* best effort: faults later otherwise */
}

/* Sets the limit; memory kept beyond it is given back to the host now (warm_mb 0 empties it). */
void hc_set_warm_limit(unsigned long long bytes) {
    warm_cap();
    warm_limit = bytes;
    while (warm_bytes > warm_limit && (warm_linear.n || warm_chunks.n)) {
        struct reg *pool = warm_linear.n ? &warm_linear : &warm_chunks;
        struct warm *w = pool->v[pool->n - 1];
        if (w->p) munmap(w->p, w->size);
        close(w->fd);
        warm_bytes -= w->size;
        hc_reg_del(pool, (long)pool->n - 1);
        free(w);
    }
}
