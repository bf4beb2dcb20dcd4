/* hostcuda_vmm.c: virtual memory management, for the host-memory CUDA driver (hostcuda.c lists
 * its parts). It owns reserved address ranges (cuMemAddressReserve / cuMemAddressFree), physical
 * chunks (cuMemCreate / cuMemRelease, each a memfd; chunks imported from another process are made
 * in hostcuda_ipc.c), their mappings (cuMemMap / cuMemUnmap) and access (cuMemSetAccess), and
 * the allocation granularity. */
#include "hostcuda_internal.h"

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
struct resv { unsigned long long base, size; };

static struct reg resvs; /* struct resv * */
struct reg hc_physs;     /* struct phys * */
struct reg hc_maps;      /* struct mapping * */

CUresult hc_vmm_check(void) {
    if (!hc_g.inited) return E_NOT_INITIALIZED;
    return hc_g.vmm ? OK : E_NOT_SUPPORTED;
}

/* CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE of an existing device. */
static CUresult prop_check(const struct alloc_prop *p) {
    if (!p || p->type != 1 || p->location.type != 1) return E_INVALID_VALUE;
    if (p->location.id < 0 || p->location.id >= hc_g.devices) return E_INVALID_DEVICE;
    return OK;
}

CUresult cuMemGetAllocationGranularity(size_t *out, const struct alloc_prop *prop, int option) {
    BEGIN(cuMemGetAllocationGranularity);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    if (!out || (option != 0 && option != 1)) RETURN(E_INVALID_VALUE);
    if ((r = prop_check(prop))) RETURN(r);
    *out = GRANULARITY;
    RETURN(OK);
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    BEGIN(cuMemAddressReserve);
    (void)addr; /* a hint only */
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    if (!out || size == 0 || size % GRANULARITY || flags || (alignment & (alignment - 1))) RETURN(E_INVALID_VALUE);
    unsigned long long align = alignment > GRANULARITY ? alignment : GRANULARITY;
    unsigned long long span = size + align;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) RETURN(E_OUT_OF_MEMORY);
    unsigned long long base = hc_round_up((uintptr_t)p, align);
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
    unsigned long long tail = (uintptr_t)p + span - (base + size);
    if (tail) munmap((void *)(uintptr_t)(base + size), tail);
    struct resv *v = malloc(sizeof *v);
    if (!v || hc_reg_add(&resvs, v)) { free(v); munmap((void *)(uintptr_t)base, size); RETURN(E_OUT_OF_MEMORY); }
    *v = (struct resv){base, size};
    *out = base;
    RETURN(OK);
}

static int overlaps(unsigned long long a, unsigned long long an, unsigned long long b, unsigned long long bn) {
    return a < b + bn && b < a + an;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    BEGIN(cuMemAddressFree);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    for (size_t i = 0; i < resvs.n; i++) {
        struct resv *v = resvs.v[i];
        if (v->base != ptr || v->size != size) continue;
        for (size_t j = 0; j < hc_maps.n; j++) {
            struct mapping *m = hc_maps.v[j];
            if (overlaps(m->addr, m->size, ptr, size)) RETURN(E_INVALID_VALUE); /* still mapped */
        }
        munmap((void *)(uintptr_t)ptr, size);
        hc_reg_del(&resvs, (long)i);
        free(v);
        RETURN(OK);
    }
    RETURN(E_INVALID_VALUE);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const struct alloc_prop *prop, unsigned long long flags) {
    BEGIN(cuMemCreate);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    if (!out || size == 0 || size % GRANULARITY || flags) RETURN(E_INVALID_VALUE);
    if ((r = prop_check(prop))) RETURN(r);
    int d = prop->location.id;
    if (hc_dev_charge(d, size)) RETURN(E_OUT_OF_MEMORY);
    int warm = 0, fd = hc_warm_chunk_take(size, d, &warm);
    if (fd < 0) fd = hc_device_memfd(d);
    if (fd < 0) { hc_dev_uncharge(d, size); RETURN(E_OUT_OF_MEMORY); }
    if (!warm && ftruncate(fd, (off_t)size)) { close(fd); hc_dev_uncharge(d, size); RETURN(E_OUT_OF_MEMORY); }
    struct phys *p = calloc(1, sizeof *p);
    if (!p || hc_reg_add(&hc_physs, p)) { free(p); close(fd); hc_dev_uncharge(d, size); RETURN(E_OUT_OF_MEMORY); }
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
        if (--*p->fd_refs == 0) {
            close(p->fd);
            free(p->fd_refs);
        }
    } else {
        if (p->exported) close(p->fd);
        else hc_warm_chunk_put(p->fd, p->dev, p->size);
        hc_dev_uncharge(p->dev, p->size);
    }
    hc_reg_del(&hc_physs, hc_reg_find(&hc_physs, p));
    free(p);
}

/* Released now if mapped nowhere, else when its last mapping is unmapped. */
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    BEGIN(cuMemRelease);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    struct phys *p = (struct phys *)(uintptr_t)h;
    if (hc_reg_find(&hc_physs, p) < 0 || p->released) RETURN(E_INVALID_VALUE);
    p->released = 1;
    if (p->maps == 0) phys_free(p);
    RETURN(OK);
}

int hc_reserved(unsigned long long ptr, unsigned long long size) {
    for (size_t i = 0; i < resvs.n; i++) {
        struct resv *v = resvs.v[i];
        if (ptr >= v->base && ptr + size <= v->base + v->size) return 1;
    }
    return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    BEGIN(cuMemMap);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    struct phys *p = (struct phys *)(uintptr_t)h;
    if (hc_reg_find(&hc_physs, p) < 0 || p->released) RETURN(E_INVALID_HANDLE);
    if (flags || size == 0 || ptr % GRANULARITY || size % GRANULARITY || offset % GRANULARITY ||
        offset + size > p->size)
        RETURN(E_INVALID_VALUE);
    if (!hc_reserved(ptr, size)) RETURN(E_INVALID_VALUE);
    for (size_t i = 0; i < hc_maps.n; i++) {
        struct mapping *m = hc_maps.v[i];
        if (overlaps(m->addr, m->size, ptr, size)) RETURN(E_INVALID_VALUE); /* never over mapped bytes */
    }
    /* Inaccessible until cuMemSetAccess, as on a device. */
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset);
    if (at == MAP_FAILED) RETURN(E_OUT_OF_MEMORY);
    struct mapping *m = malloc(sizeof *m);
    if (!m || hc_reg_add(&hc_maps, m)) {
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
    for (size_t i = 0; i < hc_maps.n; i++) {
        struct mapping *m = hc_maps.v[i];
        if (!overlaps(m->addr, m->size, ptr, size)) continue;
        if (m->addr < ptr || m->addr + m->size > ptr + size) return 0;
        covered += m->size;
    }
    return covered == size;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct access_desc *desc, size_t count) {
    BEGIN(cuMemSetAccess);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    if (!desc || count == 0 || size == 0 || ptr % GRANULARITY || size % GRANULARITY) RETURN(E_INVALID_VALUE);
    if (!whole_mappings(ptr, size)) RETURN(E_INVALID_VALUE);
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1) RETURN(E_INVALID_VALUE);
        if (desc[i].location.id < 0 || desc[i].location.id >= hc_g.devices) RETURN(E_INVALID_DEVICE);
        switch (desc[i].flags) {
        case 0: break;
        case 1: prot |= PROT_READ; break;
        case 3: prot |= PROT_READ | PROT_WRITE; break;
        default: RETURN(E_INVALID_VALUE);
        }
    }
    if (mprotect((void *)(uintptr_t)ptr, size, prot)) RETURN(E_INVALID_VALUE);
    for (size_t i = 0; i < hc_maps.n; i++) {
        struct mapping *m = hc_maps.v[i];
        if (!overlaps(m->addr, m->size, ptr, size)) continue;
        m->prot = prot;
        /* Warm memory is usable at once, as on a device: its page tables are filled now. */
        if (m->p->warm && (prot & PROT_WRITE)) hc_warm_populate(m->addr, m->size);
    }
    RETURN(OK);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    BEGIN(cuMemUnmap);
    CUresult r = hc_vmm_check();
    if (r) RETURN(r);
    if (size == 0 || ptr % GRANULARITY || size % GRANULARITY || !whole_mappings(ptr, size)) RETURN(E_INVALID_VALUE);
    /* Not a driver error (a GPU faults later, under the kernel): recorded for tests. */
    if (hc_range_busy(ptr, size)) {
        hc_g.unmaps_under_work++;
        if (hc_g.trace) fprintf(stderr, "hostcuda: cuMemUnmap of %#llx (+%zu) while queued work still uses it\n", ptr, size);
    }
    /* Back to reserved, inaccessible address space. */
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    for (size_t i = 0; i < hc_maps.n;) {
        struct mapping *m = hc_maps.v[i];
        if (!overlaps(m->addr, m->size, ptr, size)) { i++; continue; }
        struct phys *p = m->p;
        hc_reg_del(&hc_maps, (long)i);
        free(m);
        if (--p->maps == 0 && p->released) phys_free(p);
    }
    RETURN(OK);
}
