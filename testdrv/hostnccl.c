/* A host-only stand-in for NCCL, for one rank: enough of libnccl for PyTorch's ProcessGroupNCCL
 * to create a communicator (world size 1), and a record of the user-buffer registrations made
 * on it (ncclCommRegister / ncclCommDeregister), which a test reads with hostnccl_log and checks
 * against the allocator's segments. No collective runs; everything else fails (ncclInternalError).
 *
 * Built by the tests that use it (python_shim/tests/test_nccl.py) and preloaded beside testdrv's
 * runtime, so its symbols come before the empty stand-in of libnccl.so.2 (testdrv/standins.py).
 * Invariants: a handle is never reused; deregistering an unknown handle fails (ncclInvalidArgument).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int rank, count;
} hostnccl_comm;

/* NCCL passes its unique id by value: a 128-byte struct (on the stack in the x86-64 ABI). */
typedef struct {
    char internal[128];
} ncclUniqueId;

enum { OK = 0, INTERNAL = 3, INVALID_ARGUMENT = 4, MAX_REGISTRATIONS = 4096, LOG_BYTES = 1 << 20 };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *comm, *addr;
    size_t size;
    int live;
} g_regs[MAX_REGISTRATIONS];
static int g_nregs;
static char g_log[LOG_BYTES];
static size_t g_log_len;

static void note(const char *line) {
    size_t n = strlen(line);
    if (g_log_len + n < LOG_BYTES) {
        memcpy(g_log + g_log_len, line, n);
        g_log_len += n;
    }
}

int ncclGetVersion(int *version) { *version = 22703; return OK; }
int ncclGetUniqueId(ncclUniqueId *id) { memset(id, 0, sizeof *id); return OK; }
int ncclCommInitRankConfig(hostnccl_comm **comm, int count, ncclUniqueId id, int rank, void *config) {
    (void)id; (void)config;
    if (count != 1 || rank != 0) return INVALID_ARGUMENT;
    *comm = calloc(1, sizeof **comm);
    if (!*comm) return INTERNAL;
    (*comm)->count = count;
    return OK;
}
int ncclCommInitRank(hostnccl_comm **comm, int count, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, count, id, rank, NULL);
}
int ncclCommGetAsyncError(hostnccl_comm *comm, int *error) { (void)comm; *error = OK; return OK; }
int ncclCommUserRank(hostnccl_comm *comm, int *rank) { *rank = comm->rank; return OK; }
int ncclCommCount(hostnccl_comm *comm, int *count) { *count = comm->count; return OK; }
int ncclCommFinalize(hostnccl_comm *comm) { (void)comm; return OK; }
int ncclCommDestroy(hostnccl_comm *comm) { free(comm); return OK; }
int ncclCommAbort(hostnccl_comm *comm) { free(comm); return OK; }
int ncclGroupStart(void) { return OK; }
int ncclGroupEnd(void) { return OK; }
const char *ncclGetErrorString(int result) { (void)result; return "hostnccl: not implemented"; }
const char *ncclGetLastError(void *comm) { (void)comm; return "hostnccl: not implemented"; }

/* Registration: the handle is 1 + the registration's index. */
int ncclCommRegister(void *comm, void *addr, size_t size, void **handle) {
    char line[128];
    pthread_mutex_lock(&g_lock);
    if (g_nregs == MAX_REGISTRATIONS || !comm || !addr || !size) {
        pthread_mutex_unlock(&g_lock);
        return INVALID_ARGUMENT;
    }
    g_regs[g_nregs].comm = comm;
    g_regs[g_nregs].addr = addr;
    g_regs[g_nregs].size = size;
    g_regs[g_nregs].live = 1;
    *handle = (void *)(size_t)(g_nregs + 1);
    snprintf(line, sizeof line, "register %p %p %zu %d\n", comm, addr, size, g_nregs + 1);
    g_nregs++;
    note(line);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

int ncclCommDeregister(void *comm, void *handle) {
    char line[128];
    size_t i = (size_t)handle;
    pthread_mutex_lock(&g_lock);
    if (i == 0 || i > (size_t)g_nregs || !g_regs[i - 1].live || g_regs[i - 1].comm != comm) {
        snprintf(line, sizeof line, "bad-deregister %p %zu\n", comm, i);
        note(line);
        pthread_mutex_unlock(&g_lock);
        return INVALID_ARGUMENT;
    }
    g_regs[i - 1].live = 0;
    snprintf(line, sizeof line, "deregister %p %p %zu %zu\n", comm, g_regs[i - 1].addr, g_regs[i - 1].size, i);
    note(line);
    pthread_mutex_unlock(&g_lock);
    return OK;
}

/* The record, one line per call: "register COMM ADDR SIZE HANDLE", "deregister COMM ADDR SIZE
 * HANDLE", "bad-deregister COMM HANDLE". Returns its length; writes at most cap - 1 bytes and a
 * NUL. */
size_t hostnccl_log(char *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_log_len;
    if (buf && cap) {
        size_t m = n < cap - 1 ? n : cap - 1;
        memcpy(buf, g_log, m);
        buf[m] = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}
