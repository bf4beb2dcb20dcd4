/* hostcuda_stream.c: streams, events, capture and graphs, for the host-memory CUDA driver
 * (hostcuda.c lists its parts). It owns the streams and the time their queued work completes
 * (HOSTCUDA_DELAY_US, HOSTCUDA_JITTER_US), the waits (cuCtxSynchronize, cuStreamSynchronize,
 * cuEventSynchronize, cuStreamWaitEvent), stream capture and its rules (which calls a capture
 * prohibits, each thread's capture mode), events, and the graphs cuStreamEndCapture returns with
 * the copies and memsets captured into them, replayed for the runtime (hostcuda_graph_*). */
#include "hostcuda_internal.h"

static struct reg streams, graphs; /* struct stream *; struct ops * (graphs from cuStreamEndCapture) */
struct reg hc_events;              /* struct event * */
static __thread int t_mode = MODE_GLOBAL;

/* Graphs: the captured work of a capture that ends (in the last section). */
static void *graph_new(struct stream *s, int keep);
static void graph_free(void *gr);

/* ------------------------------------------------------------------------------------------ */
/* the clock and stream handles */

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* The stream a handle names: 0 (legacy), 1 (CU_STREAM_LEGACY) and 2 (CU_STREAM_PER_THREAD)
 * are the current context's default stream. */
CUresult hc_stream_of(void *h, struct stream **out) {
    if ((uintptr_t)h <= 2) {
        if (!hc_current || !hc_ctx_valid(hc_current)) return E_INVALID_CONTEXT;
        *out = &hc_current->null_stream;
        return OK;
    }
    if (hc_reg_find(&streams, h) < 0) return E_INVALID_HANDLE;
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
CUresult hc_unsafe_call(const char *call) {
    int hit = 0;
    for (size_t i = 0; i < streams.n; i++) {
        struct stream *s = streams.v[i];
        if (forbids(s)) {
            s->cap_status = CAP_INVALIDATED;
            hit = 1;
        }
    }
    if (hit && hc_g.trace) fprintf(stderr, "hostcuda: %s during a capture invalidated it\n", call);
    return hit ? E_CAPTURE_UNSUPPORTED : OK;
}

/* Work on the legacy stream while a blocking stream of its context captures. */
CUresult hc_legacy_during_capture(struct stream *s) {
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
unsigned long long hc_enqueue(struct stream *s) {
    unsigned long long start = now_ns();
    if (s->busy_until > start) start = s->busy_until;
    if (is_null_stream(s)) for_each_stream(s->ctx, max_busy_blocking, &start);
    else if (!(s->flags & STREAM_NON_BLOCKING) && s->ctx->null_stream.busy_until > start)
        start = s->ctx->null_stream.busy_until;
    unsigned long long delay = hc_g.delay_ns + (hc_g.jitter_ns ? hc_rand64() % hc_g.jitter_ns : 0);
    s->busy_until = start + delay;
    return s->busy_until;
}

/* The device ranges the latest queued work uses, and until when (a ring: the oldest uses are
 * forgotten, long complete in any test). Unmapping a range unfinished work still uses is what a
 * GPU turns into a fault under a running kernel; cuMemUnmap counts it (hostcuda_unmaps_under_work). */
#define USES 4096
static struct { unsigned long long addr, n, done; } uses[USES];
static size_t next_use;

void hc_note_use(unsigned long long addr, unsigned long long n, unsigned long long done) {
    if (!n) return;
    uses[next_use % USES].addr = addr;
    uses[next_use % USES].n = n;
    uses[next_use % USES].done = done;
    next_use++;
}

int hc_range_busy(unsigned long long addr, unsigned long long n) {
    unsigned long long now = now_ns();
    for (size_t i = 0; i < USES && i < next_use; i++)
        if (uses[i].done > now && uses[i].addr < addr + n && addr < uses[i].addr + uses[i].n) return 1;
    return 0;
}

static void sleep_until(unsigned long long t) { /* without the lock */
    for (unsigned long long n = now_ns(); n < t; n = now_ns()) {
        unsigned long long d = t - n;
        struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

/* Waits for the work of every stream of the current context. */
CUresult cuCtxSynchronize(void) {
    BEGIN(cuCtxSynchronize);
    NEED_CTX();
    CUresult r = hc_unsafe_call("cuCtxSynchronize");
    if (r) RETURN(r);
    unsigned long long until = 0;
    for_each_stream(hc_current, max_busy, &until);
    hc_unlock();
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
    if (!s || hc_reg_add(&streams, s)) { free(s); RETURN(E_OUT_OF_MEMORY); }
    s->ctx = hc_current;
    s->flags = flags;
    *out = s;
    RETURN(OK);
}

static CUresult stream_destroy(void *h) {
    long i = (uintptr_t)h <= 2 ? -1 : hc_reg_find(&streams, h);
    if (i < 0) return E_INVALID_HANDLE;
    hc_reg_del(&streams, i);
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
    CUresult r = hc_stream_of(h, &s);
    if (r) RETURN(r);
    if (!out) RETURN(E_INVALID_VALUE);
    *out = s->ctx;
    RETURN(OK);
}

CUresult cuStreamQuery(void *h) {
    BEGIN(cuStreamQuery);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(h, &s);
    if (r) RETURN(r);
    if (capturing(s)) { s->cap_status = CAP_INVALIDATED; RETURN(E_CAPTURE_UNSUPPORTED); }
    if ((r = hc_unsafe_call("cuStreamQuery"))) RETURN(r);
    RETURN(s->busy_until <= now_ns() ? OK : E_NOT_READY);
}

CUresult cuStreamSynchronize(void *h) {
    BEGIN(cuStreamSynchronize);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(h, &s);
    if (r) RETURN(r);
    if (capturing(s)) { s->cap_status = CAP_INVALIDATED; RETURN(E_CAPTURE_UNSUPPORTED); }
    if ((r = hc_unsafe_call("cuStreamSynchronize"))) RETURN(r);
    unsigned long long until = s->busy_until;
    hc_unlock();
    sleep_until(until);
    return OK;
}

CUresult cuStreamBeginCapture_v2(void *h, int mode) {
    BEGIN(cuStreamBeginCapture_v2);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(h, &s);
    if (r) RETURN(r);
    if (mode < MODE_GLOBAL || mode > MODE_RELAXED) RETURN(E_INVALID_VALUE);
    if (is_null_stream(s)) RETURN(E_CAPTURE_UNSUPPORTED);
    if (capturing(s)) RETURN(E_ILLEGAL_STATE);
    s->cap_status = CAP_ACTIVE;
    s->cap_id = ++hc_g.capture_ids;
    s->cap_mode = mode;
    s->cap_thread = pthread_self();
    RETURN(OK);
}

CUresult cuStreamEndCapture(void *h, void **graph) {
    BEGIN(cuStreamEndCapture);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(h, &s);
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
    if (!gr || hc_reg_add(&graphs, gr)) { graph_free(gr); RETURN(E_OUT_OF_MEMORY); }
    *graph = gr;
    RETURN(OK);
}

CUresult cuStreamIsCapturing(void *h, int *status) {
    BEGIN(cuStreamIsCapturing);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(h, &s);
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
    long i = hc_reg_find(&graphs, gr);
    if (i < 0) RETURN(E_INVALID_VALUE);
    hc_reg_del(&graphs, i);
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
    if (!e || hc_reg_add(&hc_events, e)) { free(e); RETURN(E_OUT_OF_MEMORY); }
    e->ctx = hc_current;
    e->flags = flags;
    *out = e;
    RETURN(OK);
}

static CUresult event_destroy(void *h) {
    long i = hc_reg_find(&hc_events, h);
    if (i < 0) return E_INVALID_HANDLE;
    hc_reg_del(&hc_events, i);
    hc_ev_unshare(h);
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
    if (hc_reg_find(&hc_events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    struct stream *s;
    CUresult r = hc_stream_of(sh, &s);
    if (r) RETURN(r);
    /* The event and the stream must belong to the same context. */
    if (e->ctx != s->ctx) RETURN(E_INVALID_HANDLE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) {
        e->captured = 1; /* a node of the graph: it completes only when the graph runs */
        hc_ev_push(e);
        RETURN(OK);
    }
    if ((r = hc_legacy_during_capture(s))) RETURN(r);
    e->captured = 0;
    e->done_at = hc_enqueue(s);
    hc_ev_push(e);
    RETURN(OK);
}

CUresult cuEventQuery(void *h) {
    BEGIN(cuEventQuery);
    NEED_INIT();
    if (hc_reg_find(&hc_events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    CUresult r = hc_unsafe_call("cuEventQuery");
    if (r) RETURN(r);
    hc_ev_pull(e);
    if (e->captured) RETURN(E_CAPTURED_EVENT);
    RETURN(e->done_at <= now_ns() ? OK : E_NOT_READY);
}

CUresult cuEventSynchronize(void *h) {
    BEGIN(cuEventSynchronize);
    NEED_INIT();
    if (hc_reg_find(&hc_events, h) < 0) RETURN(E_INVALID_HANDLE);
    struct event *e = h;
    CUresult r = hc_unsafe_call("cuEventSynchronize");
    if (r) RETURN(r);
    hc_ev_pull(e);
    if (e->captured) RETURN(E_CAPTURED_EVENT);
    unsigned long long until = e->done_at;
    hc_unlock();
    sleep_until(until);
    return OK;
}

/* ------------------------------------------------------------------------------------------ */
/* waits, timing and capture ids (what a CUDA runtime needs on top, testdrv/hostcudart.c) */

/* The stream's later work starts after the event's work. Waiting on an event recorded in a
 * capture from outside it is CUDA_ERROR_CAPTURED_EVENT's case; inside a capture the wait is a
 * graph dependency, nothing to do here. */
CUresult cuStreamWaitEvent(void *sh, void *h, unsigned flags) {
    BEGIN(cuStreamWaitEvent);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(sh, &s);
    if (r) RETURN(r);
    if (hc_reg_find(&hc_events, h) < 0) RETURN(E_INVALID_HANDLE);
    if (flags & ~1u) RETURN(E_INVALID_VALUE);
    struct event *e = h;
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) RETURN(OK);
    hc_ev_pull(e);
    if (e->captured) RETURN(E_CAPTURED_EVENT);
    if (e->done_at > s->busy_until) s->busy_until = e->done_at;
    RETURN(OK);
}

/* Milliseconds between two completed events. */
CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
    BEGIN(cuEventElapsedTime);
    NEED_INIT();
    if (hc_reg_find(&hc_events, start) < 0 || hc_reg_find(&hc_events, end) < 0) RETURN(E_INVALID_HANDLE);
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
    CUresult r = hc_stream_of(sh, &s);
    if (r) RETURN(r);
    if (!status) RETURN(E_INVALID_VALUE);
    *status = s->cap_status;
    if (id) *id = s->cap_status ? s->cap_id : 0;
    if (graph) *graph = NULL;
    if (deps) *deps = NULL;
    if (ndeps) *ndeps = 0;
    RETURN(OK);
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

void hc_capture_record(struct stream *s, int kind, unsigned long long dst, unsigned long long src,
                           unsigned long long n) {
    struct capture_rec *c = NULL;
    for (size_t i = 0; i < captures.n && !c; i++) {
        struct capture_rec *x = captures.v[i];
        if (x->s == s && x->id == s->cap_id) c = x;
    }
    if (!c) {
        if (!(c = calloc(1, sizeof *c)) || hc_reg_add(&captures, c)) { free(c); s->cap_status = CAP_INVALIDATED; return; }
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
        hc_reg_del(&captures, (long)i);
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
    for (size_t i = 0; i < hc_allocs.n; i++) {
        struct alloc *a = hc_allocs.v[i];
        if (p >= a->addr && p < a->addr + a->charged) return 1;
    }
    return hc_reserved(p, 1);
}

/* For the runtime's cudaGraphInstantiate: a copy of graph `gr`'s recorded work, or NULL
 * (not a live graph, or out of memory). Free with hostcuda_graph_snapshot_free. */
void *hostcuda_graph_snapshot(void *gr) {
    hc_lock();
    struct ops *copy = NULL;
    if (hc_reg_find(&graphs, gr) >= 0 && (copy = calloc(1, sizeof *copy))) {
        struct ops *o = gr;
        if (o->n && !(copy->v = malloc(o->n * sizeof *copy->v))) { free(copy); copy = NULL; }
        else {
            if (o->n) memcpy(copy->v, o->v, o->n * sizeof *copy->v);
            copy->n = copy->cap = o->n;
        }
    }
    hc_unlock();
    return copy;
}

void hostcuda_graph_snapshot_free(void *snap) { graph_free(snap); }

/* For the runtime's cudaGraphGetNodes: the operations recorded in graph `gr` (-1: not a live
 * graph); with `nodes`, up to `cap` handles (the operations' addresses, unique and stable while
 * the graph lives). */
long hostcuda_graph_nodes(void *gr, void **nodes, size_t cap) {
    hc_lock();
    long n = -1;
    if (hc_reg_find(&graphs, gr) >= 0) {
        struct ops *o = gr;
        n = (long)o->n;
        for (size_t i = 0; nodes && i < cap && i < o->n; i++) nodes[i] = &o->v[i];
    }
    hc_unlock();
    return n;
}

/* For the runtime's cudaGraphLaunch: runs the snapshot's work on stream `sh`, in order. */
CUresult hostcuda_graph_launch(void *snap, void *sh) {
    BEGIN(hostcuda_graph_launch);
    NEED_INIT();
    struct stream *s;
    CUresult r = hc_stream_of(sh, &s);
    if (r) RETURN(r);
    if (!snap) RETURN(E_INVALID_VALUE);
    if (s->cap_status == CAP_INVALIDATED) RETURN(E_CAPTURE_INVALIDATED);
    if (s->cap_status == CAP_ACTIVE) RETURN(OK); /* a graph launched inside a capture: a node */
    struct ops *o = snap;
    for (size_t i = 0; i < o->n; i++) { /* every device side mapped now, before anything runs */
        struct op *op = &o->v[i];
        unsigned long long bytes = op->kind == OP_SET32 ? 4 * op->n : op->n;
        if (!bytes) continue;
        if (device_space(op->dst) && !hc_device_range(op->dst, bytes, 1)) RETURN(E_INVALID_VALUE);
        if (op->kind == OP_COPY && device_space(op->src) && !hc_device_range(op->src, bytes, 0)) RETURN(E_INVALID_VALUE);
    }
    for (size_t i = 0; i < o->n; i++) {
        struct op *op = &o->v[i];
        if (op->kind == OP_COPY) memmove((void *)(uintptr_t)op->dst, (const void *)(uintptr_t)op->src, op->n);
        else if (op->kind == OP_SET8) memset((void *)(uintptr_t)op->dst, (int)op->src, op->n);
        else hc_fill32(op->dst, (unsigned)op->src, op->n);
    }
    unsigned long long done = hc_enqueue(s);
    for (size_t i = 0; i < o->n; i++) {
        struct op *op = &o->v[i];
        unsigned long long bytes = op->kind == OP_SET32 ? 4 * op->n : op->n;
        if (device_space(op->dst)) hc_note_use(op->dst, bytes, done);
        if (op->kind == OP_COPY && device_space(op->src)) hc_note_use(op->src, bytes, done);
    }
    RETURN(OK);
}
