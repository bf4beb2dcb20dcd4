/* hostcudart: a stub CUDA runtime (libcudart.so.13) over the host-memory driver (hostcuda*.c), so
 * that real PyTorch runs its CUDA allocation paths on a machine without a GPU: torch's libraries
 * import the runtime functions listed in testdrv/cudart_exports.txt and are bound at load time,
 * so every one of them exists here. A few dozen do real work, by forwarding to the driver (a
 * runtime stream is a driver stream, a runtime event a driver event, memory is the driver's,
 * one primary context per device), so PyTorch and stepalloc share one device, one memory budget
 * and one capture state. The rest answer cudaErrorNotSupported; kernels never run (launches fail,
 * which PyTorch reports as torch.AcceleratorError).
 *
 * Invariants:
 * - Each thread has a current device (default 0); the first call that needs a context retains
 *   that device's primary context and makes it current, as the real runtime does.
 * - Every failing call sets the thread's last error (cudaGetLastError), as the real runtime does.
 * - No state beyond that: handles are validated by the driver.
 *
 * Types are declared here, field by field where a struct crosses the boundary (cudaDeviceProp,
 * cudaPointerAttributes), following CUDA 13's cuda_runtime_api.h and driver_types.h, so the
 * stub builds without CUDA headers. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
typedef int CUresult;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef unsigned long long CUdeviceptr;

enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorPeerAccessUnsupported = 217,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
};

/* cudaMemcpyKind */
enum { H2H = 0, H2D = 1, D2H = 2, D2D = 3, DEFAULT_KIND = 4 };

/* ------------------------------------------------------------------------------------------ */
/* the driver calls we forward to (hostcuda*.c; linked with -lcuda) */

CUresult cuInit(unsigned);
CUresult cuDriverGetVersion(int *);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceGet(int *, int);
CUresult cuDeviceGetName(char *, int, int);
CUresult cuDeviceTotalMem_v2(size_t *, int);
CUresult cuDeviceGetAttribute(int *, int, int);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxGetCurrent(void **);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxSynchronize(void);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, void *);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, void *);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, void *);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, void *);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);
CUresult cuStreamCreate(void **, unsigned);
CUresult cuStreamDestroy_v2(void *);
CUresult cuStreamQuery(void *);
CUresult cuStreamSynchronize(void *);
CUresult cuStreamWaitEvent(void *, void *, unsigned);
CUresult cuStreamBeginCapture_v2(void *, int);
CUresult cuStreamEndCapture(void *, void **);
CUresult cuStreamIsCapturing(void *, int *);
CUresult cuStreamGetCaptureInfo_v2(void *, int *, unsigned long long *, void **, const void ***, size_t *);
CUresult cuThreadExchangeStreamCaptureMode(int *);
CUresult cuGraphDestroy(void *);
CUresult cuEventCreate(void **, unsigned);
CUresult cuEventDestroy_v2(void *);
CUresult cuEventRecord(void *, void *);
CUresult cuEventQuery(void *);
CUresult cuEventSynchronize(void *);
CUresult cuEventElapsedTime(float *, void *, void *);

/* ------------------------------------------------------------------------------------------ */
/* errors and per-thread state */

static __thread int t_device;
static __thread int t_bound = -1; /* the device whose primary context is current here */
static __thread cudaError_t t_last;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CUresult init_result;
static void do_init(void) { init_result = cuInit(0); }

/* Records a failure as the thread's last error and returns it. Driver and runtime codes agree
 * numerically for everything these calls return (1, 2, 3, 101, 201, 400, 600, 801, 900–908). */
static cudaError_t ret(cudaError_t e) {
    if (e) t_last = e;
    return e;
}

/* Makes the current device's primary context current on this thread. */
static cudaError_t ensure_ctx(void) {
    pthread_once(&init_once, do_init);
    if (init_result) return ret(cudaErrorInitializationError);
    if (t_bound == t_device) return cudaSuccess;
    void *ctx;
    CUresult r = cuDevicePrimaryCtxRetain(&ctx, t_device);
    if (!r) r = cuCtxSetCurrent(ctx);
    if (r) return ret(r);
    t_bound = t_device;
    return cudaSuccess;
}

#define CTX() do { cudaError_t e_ = ensure_ctx(); if (e_) return e_; } while (0)

static const struct { int code; const char *name, *text; } errors[] = {
    {0, "cudaSuccess", "no error"},
    {1, "cudaErrorInvalidValue", "invalid argument"},
    {2, "cudaErrorMemoryAllocation", "out of memory"},
    {3, "cudaErrorInitializationError", "initialization error"},
    {101, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {201, "cudaErrorDeviceUninitialized", "invalid device context"},
    {217, "cudaErrorPeerAccessUnsupported", "peer access is not supported between these two devices"},
    {400, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {401, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
    {600, "cudaErrorNotReady", "device not ready"},
    {801, "cudaErrorNotSupported", "operation not supported (the host-memory CUDA runtime runs no kernels)"},
    {900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"},
    {901, "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"},
    {906, "cudaErrorStreamCaptureImplicit", "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "cudaErrorStreamCaptureWrongThread", "attempt to terminate a thread-local capture sequence from another thread"},
};

const char *cudaGetErrorName(cudaError_t e) {
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == e) return errors[i].name;
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == e) return errors[i].text;
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) { return t_last; }

/* The functions PyTorch imports but that these paths do not need (kernels, libraries,
 * stream-ordered pools, graph editing): they fail cleanly. */
#define UNSUPPORTED(name) \
    cudaError_t name(void) { return ret(cudaErrorNotSupported); }

UNSUPPORTED(__cudaLaunchKernel)
UNSUPPORTED(__cudaGetKernel)
UNSUPPORTED(cudaLaunchKernel)
UNSUPPORTED(cudaLaunchKernelExC)
UNSUPPORTED(cudaLaunchCooperativeKernel)
UNSUPPORTED(cudaFuncGetAttributes)
UNSUPPORTED(cudaFuncSetAttribute)
UNSUPPORTED(cudaKernelSetAttributeForDevice)
UNSUPPORTED(cudaOccupancyMaxActiveBlocksPerMultiprocessor)
UNSUPPORTED(cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)
UNSUPPORTED(cudaGetSymbolAddress)
UNSUPPORTED(cudaMemcpyToSymbol)
UNSUPPORTED(cudaLibraryGetGlobal)
UNSUPPORTED(cudaLibraryGetKernel)
UNSUPPORTED(cudaLibraryGetKernelCount)
UNSUPPORTED(cudaLibraryGetManaged)
UNSUPPORTED(cudaLibraryGetUnifiedFunction)
UNSUPPORTED(cudaLibraryLoadData)
UNSUPPORTED(cudaLibraryLoadFromFile)
UNSUPPORTED(cudaLibraryUnload)
UNSUPPORTED(cudaMallocAsync)
UNSUPPORTED(cudaFreeAsync)
UNSUPPORTED(cudaMallocManaged)
UNSUPPORTED(cudaDeviceGetDefaultMemPool)
UNSUPPORTED(cudaMemPoolGetAttribute)
UNSUPPORTED(cudaMemPoolSetAccess)
UNSUPPORTED(cudaMemPoolSetAttribute)
UNSUPPORTED(cudaMemPoolTrimTo)
UNSUPPORTED(cudaMemcpy2DAsync)
UNSUPPORTED(cudaDeviceGetGraphMemAttribute)
UNSUPPORTED(cudaDeviceSetGraphMemAttribute)
UNSUPPORTED(cudaGraphAddNode)
UNSUPPORTED(cudaGraphConditionalHandleCreate)
UNSUPPORTED(cudaGraphRetainUserObject)
UNSUPPORTED(cudaUserObjectCreate)
UNSUPPORTED(cudaUserObjectRelease)
UNSUPPORTED(cudaStreamBeginCaptureToGraph)
UNSUPPORTED(cudaStreamUpdateCaptureDependencies)
UNSUPPORTED(cudaStreamAddCallback)
/* vLLM's CudaRTLibrary binds it (ctypes) and never calls it on these paths; destroying every
 * allocation of the device is not modelled. */
UNSUPPORTED(cudaDeviceReset)

cudaError_t cudaProfilerStart(void) { return cudaSuccess; }
cudaError_t cudaProfilerStop(void) { return cudaSuccess; }

/* ------------------------------------------------------------------------------------------ */
/* kernel registration: libraries register their kernels from static constructors at load time,
 * so these succeed and keep nothing; a launch then fails. */

typedef struct { unsigned x, y, z; } dim3;

static void *fatbin_handle;
void **__cudaRegisterFatBinary(void *fatbin) { (void)fatbin; return &fatbin_handle; }
void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
void __cudaUnregisterFatBinary(void **h) { (void)h; }
void __cudaRegisterFunction(void) {}
void __cudaRegisterVar(void) {}
/* torch 2.14 (vLLM 0.34's torch) imports it: loads a registered module's code; nothing to load. */
char __cudaInitModule(void **h) { (void)h; return 1; }
unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, void *stream) {
    (void)grid, (void)block, (void)shared, (void)stream;
    return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shared, void **stream) {
    if (grid) *grid = (dim3){1, 1, 1};
    if (block) *block = (dim3){1, 1, 1};
    if (shared) *shared = 0;
    if (stream) *stream = NULL;
    return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* versions and devices */

cudaError_t cudaDriverGetVersion(int *v) {
    if (!v) return ret(cudaErrorInvalidValue);
    return ret(cuDriverGetVersion(v));
}

cudaError_t cudaRuntimeGetVersion(int *v) {
    if (!v) return ret(cudaErrorInvalidValue);
    *v = 13000;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n) {
    if (!n) return ret(cudaErrorInvalidValue);
    pthread_once(&init_once, do_init);
    if (init_result) return ret(cudaErrorInitializationError);
    return ret(cuDeviceGetCount(n));
}

cudaError_t cudaGetDevice(int *d) {
    if (!d) return ret(cudaErrorInvalidValue);
    *d = t_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e) return e;
    if (d < 0 || d >= n) return ret(cudaErrorInvalidDevice);
    t_device = d;
    return ensure_ctx();
}

cudaError_t cudaDeviceSynchronize(void) {
    CTX();
    return ret(cuCtxSynchronize());
}

cudaError_t cudaDeviceGetPCIBusId(char *out, int len, int d) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e) return e;
    if (d < 0 || d >= n) return ret(cudaErrorInvalidDevice);
    if (!out || len < 13) return ret(cudaErrorInvalidValue);
    snprintf(out, (size_t)len, "00000000:%02X:00.0", d + 1);
    return cudaSuccess;
}

/* Attributes PyTorch reads, with an H100-class device's answers where the driver has none. */
cudaError_t cudaDeviceGetAttribute(int *v, int attr, int d) {
    if (!v) return ret(cudaErrorInvalidValue);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e) return e;
    if (d < 0 || d >= n) return ret(cudaErrorInvalidDevice);
    switch (attr) {
    case 1: *v = 1024; return cudaSuccess;        /* max threads per block */
    case 2: case 3: *v = 1024; return cudaSuccess; /* max block dims x, y */
    case 4: *v = 64; return cudaSuccess;
    case 5: *v = 2147483647; return cudaSuccess;  /* max grid x */
    case 6: case 7: *v = 65535; return cudaSuccess;
    case 8: *v = 49152; return cudaSuccess;       /* shared memory per block */
    case 10: *v = 32; return cudaSuccess;         /* warp size */
    case 12: *v = 65536; return cudaSuccess;      /* registers per block */
    case 13: *v = 1980000; return cudaSuccess;    /* clock rate, kHz */
    case 16: *v = 132; return cudaSuccess;        /* multiprocessors */
    case 31: *v = 1; return cudaSuccess;          /* concurrent kernels */
    case 33: *v = d + 1; return cudaSuccess;      /* PCI bus id */
    case 34: *v = 0; return cudaSuccess;          /* PCI device id */
    case 38: *v = 52428800; return cudaSuccess;   /* L2 cache size */
    case 39: *v = 2048; return cudaSuccess;       /* max threads per multiprocessor */
    case 41: *v = 1; return cudaSuccess;          /* unified addressing */
    case 50: *v = 0; return cudaSuccess;          /* PCI domain */
    case 81: *v = 233472; return cudaSuccess;     /* shared memory per multiprocessor */
    case 97: *v = 232448; return cudaSuccess;     /* shared memory per block, opt-in */
    default: return ret(cuDeviceGetAttribute(v, attr, d));
    }
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer) {
    (void)d, (void)peer;
    if (!can) return ret(cudaErrorInvalidValue);
    *can = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
    (void)peer, (void)flags;
    return ret(cudaErrorPeerAccessUnsupported);
}

typedef struct { char bytes[16]; } cudaUUID_t;

/* CUDA 13's cudaDeviceProp, field by field (its layout is the ABI). */
struct cudaDeviceProp {
    char name[256];
    cudaUUID_t uuid;
    char luid[8];
    unsigned int luidDeviceNodeMask;
    size_t totalGlobalMem, sharedMemPerBlock;
    int regsPerBlock, warpSize;
    size_t memPitch;
    int maxThreadsPerBlock, maxThreadsDim[3], maxGridSize[3];
    size_t totalConstMem;
    int major, minor;
    size_t textureAlignment, texturePitchAlignment;
    int multiProcessorCount, integrated, canMapHostMemory, maxTexture1D, maxTexture1DMipmap;
    int maxTexture2D[2], maxTexture2DMipmap[2], maxTexture2DLinear[3], maxTexture2DGather[2];
    int maxTexture3D[3], maxTexture3DAlt[3], maxTextureCubemap, maxTexture1DLayered[2];
    int maxTexture2DLayered[3], maxTextureCubemapLayered[2], maxSurface1D, maxSurface2D[2];
    int maxSurface3D[3], maxSurface1DLayered[2], maxSurface2DLayered[3], maxSurfaceCubemap;
    int maxSurfaceCubemapLayered[2];
    size_t surfaceAlignment;
    int concurrentKernels, ECCEnabled, pciBusID, pciDeviceID, pciDomainID, tccDriver;
    int asyncEngineCount, unifiedAddressing, memoryBusWidth, l2CacheSize;
    int persistingL2CacheMaxSize, maxThreadsPerMultiProcessor, streamPrioritiesSupported;
    int globalL1CacheSupported, localL1CacheSupported;
    size_t sharedMemPerMultiprocessor;
    int regsPerMultiprocessor, managedMemory, isMultiGpuBoard, multiGpuBoardGroupID;
    int hostNativeAtomicSupported, pageableMemoryAccess, concurrentManagedAccess;
    int computePreemptionSupported, canUseHostPointerForRegisteredMem, cooperativeLaunch;
    size_t sharedMemPerBlockOptin;
    int pageableMemoryAccessUsesHostPageTables, directManagedMemAccessFromHost;
    int maxBlocksPerMultiProcessor, accessPolicyMaxWindowSize;
    size_t reservedSharedMemPerBlock;
    int hostRegisterSupported, sparseCudaArraySupported, hostRegisterReadOnlySupported;
    int timelineSemaphoreInteropSupported, memoryPoolsSupported, gpuDirectRDMASupported;
    unsigned int gpuDirectRDMAFlushWritesOptions;
    int gpuDirectRDMAWritesOrdering;
    unsigned int memoryPoolSupportedHandleTypes;
    int deferredMappingCudaArraySupported, ipcEventSupported, clusterLaunch;
    int unifiedFunctionPointers, deviceNumaConfig, deviceNumaId, mpsEnabled, hostNumaId;
    unsigned int gpuPciDeviceID, gpuPciSubsystemID;
    int hostNumaMultinodeIpcSupported;
    int reserved[56];
};

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
    if (!p) return ret(cudaErrorInvalidValue);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e) return e;
    if (d < 0 || d >= n) return ret(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    cuDeviceGetName(p->name, sizeof p->name, d);
    cuDeviceTotalMem_v2(&p->totalGlobalMem, d);
    p->uuid.bytes[0] = (char)(d + 1);
    cudaDeviceGetAttribute(&p->major, 75, d);
    cudaDeviceGetAttribute(&p->minor, 76, d);
    cudaDeviceGetAttribute(&p->multiProcessorCount, 16, d);
    p->sharedMemPerBlock = 49152;
    p->sharedMemPerBlockOptin = 232448;
    p->sharedMemPerMultiprocessor = 233472;
    p->regsPerBlock = p->regsPerMultiprocessor = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->maxThreadsPerMultiProcessor = 2048;
    p->maxBlocksPerMultiProcessor = 32;
    p->l2CacheSize = 52428800;
    p->concurrentKernels = p->unifiedAddressing = p->managedMemory = 1;
    p->streamPrioritiesSupported = p->canMapHostMemory = p->memoryPoolsSupported = 1;
    p->pciBusID = d + 1;
    p->memoryBusWidth = 5120;
    p->asyncEngineCount = 2;
    return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* the driver's entry points (c10 resolves its virtual-memory calls through this) */

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version,
                                             unsigned long long flags, int *status) {
    (void)version, (void)flags;
    if (!symbol || !fn) return ret(cudaErrorInvalidValue);
    static void *driver;
    if (!driver) driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!driver) driver = dlopen("libcuda.so.1", RTLD_NOW);
    /* The current form of a call whose signature changed carries a suffix in the driver's
     * export table (cuMemAlloc_v2); this driver exports no older forms under those names. */
    char name[128];
    snprintf(name, sizeof name, "%s_v2", symbol);
    *fn = driver ? dlsym(driver, name) : NULL;
    if (!*fn && driver) *fn = dlsym(driver, symbol);
    if (status) *status = *fn ? 0 : 1; /* cudaDriverEntryPointSuccess / SymbolNotFound */
    return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* memory */

cudaError_t cudaMalloc(void **p, size_t n) {
    if (!p) return ret(cudaErrorInvalidValue);
    CTX();
    *p = NULL;
    if (n == 0) return cudaSuccess;
    CUdeviceptr d = 0;
    CUresult r = cuMemAlloc_v2(&d, n);
    if (r) return ret(r);
    *p = (void *)(uintptr_t)d;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    CTX(); /* cudaFree(NULL) is the idiom for "initialize the context" */
    if (!p) return cudaSuccess;
    return ret(cuMemFree_v2((uintptr_t)p));
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
    CTX();
    return ret(cuMemGetInfo_v2(free_bytes, total));
}

/* Pinned host memory is plain host memory here; the registry answers cudaPointerGetAttributes. */
static pthread_mutex_t host_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uintptr_t base; size_t size; int owned; } host[4096];
static size_t nhost;

static int host_add(void *p, size_t n, int owned) {
    pthread_mutex_lock(&host_lock);
    int ok = nhost < sizeof host / sizeof *host;
    if (ok) host[nhost++] = (typeof(host[0])){(uintptr_t)p, n, owned};
    pthread_mutex_unlock(&host_lock);
    return ok;
}

/* Removes the registration starting at p; returns 1 if found (and whether it was owned). */
static int host_del(void *p, int *owned) {
    pthread_mutex_lock(&host_lock);
    int found = 0;
    for (size_t i = 0; i < nhost; i++)
        if (host[i].base == (uintptr_t)p) {
            *owned = host[i].owned;
            host[i] = host[--nhost];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&host_lock);
    return found;
}

static int host_find(const void *p) {
    pthread_mutex_lock(&host_lock);
    int found = 0;
    for (size_t i = 0; i < nhost && !found; i++)
        found = (uintptr_t)p >= host[i].base && (uintptr_t)p < host[i].base + host[i].size;
    pthread_mutex_unlock(&host_lock);
    return found;
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    if (!p) return ret(cudaErrorInvalidValue);
    CTX();
    *p = NULL;
    if (n == 0) return cudaSuccess;
    void *m = NULL;
    if (posix_memalign(&m, 4096, n)) return ret(cudaErrorMemoryAllocation);
    if (!host_add(m, n, 1)) { free(m); return ret(cudaErrorMemoryAllocation); }
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }

cudaError_t cudaFreeHost(void *p) {
    if (!p) return cudaSuccess;
    int owned = 0;
    if (!host_del(p, &owned) || !owned) return ret(cudaErrorInvalidValue);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags) {
    (void)flags;
    if (!p || !n) return ret(cudaErrorInvalidValue);
    return host_add(p, n, 0) ? cudaSuccess : ret(cudaErrorMemoryAllocation);
}

cudaError_t cudaHostUnregister(void *p) {
    int owned = 0;
    if (!host_del(p, &owned) || owned) return ret(cudaErrorInvalidValue);
    return cudaSuccess;
}

/* Page-locked host memory is addressed by the same pointer on the device (unified addressing):
 * the pointer must lie in memory cudaHostAlloc gave or cudaHostRegister registered, flags 0. */
cudaError_t cudaHostGetDevicePointer(void **dev, void *p, unsigned flags) {
    if (!dev || flags != 0 || !host_find(p)) return ret(cudaErrorInvalidValue);
    CTX();
    *dev = p;
    return cudaSuccess;
}

struct cudaPointerAttributes {
    int type; /* 0 unregistered, 1 host, 2 device, 3 managed */
    int device;
    void *devicePointer, *hostPointer;
    long reserved[8];
};

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    if (!a) return ret(cudaErrorInvalidValue);
    CTX();
    memset(a, 0, sizeof *a);
    int dev = -1;
    if (!cuPointerGetAttribute(&dev, 9, (uintptr_t)p)) {
        a->type = 2;
        a->device = dev;
        a->devicePointer = (void *)p;
    } else if (host_find(p)) {
        a->type = 1;
        a->device = t_device;
        a->devicePointer = a->hostPointer = (void *)p;
    } else {
        a->device = -2;
    }
    return cudaSuccess;
}

static int is_device(const void *p) {
    unsigned type = 0;
    return !cuPointerGetAttribute(&type, 2, (uintptr_t)p);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, cudaStream_t s) {
    CTX();
    if (kind == DEFAULT_KIND) kind = (is_device(src) ? 2 : 0) + (is_device(dst) ? 1 : 0);
    switch (kind) {
    case H2D: return ret(cuMemcpyHtoDAsync_v2((uintptr_t)dst, src, n, s));
    case D2H: return ret(cuMemcpyDtoHAsync_v2(dst, (uintptr_t)src, n, s));
    case D2D: return ret(cuMemcpyDtoDAsync_v2((uintptr_t)dst, (uintptr_t)src, n, s));
    case H2H: {
        cudaError_t e = ret(cuStreamSynchronize(s));
        if (!e && n) memmove(dst, src, n);
        return e;
    }
    default: return ret(cudaErrorInvalidValue);
    }
}

/* Synchronous copies and memsets run on the legacy default stream and wait for it. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n, kind, NULL);
    return e ? e : ret(cuStreamSynchronize(NULL));
}

cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev, size_t n, cudaStream_t s) {
    (void)dst_dev, (void)src_dev;
    return cudaMemcpyAsync(dst, src, n, D2D, s);
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s) {
    CTX();
    if (n == 0) return cudaSuccess;
    return ret(cuMemsetD8Async((uintptr_t)p, (unsigned char)value, n, s));
}

cudaError_t cudaMemset(void *p, int value, size_t n) {
    cudaError_t e = cudaMemsetAsync(p, value, n, NULL);
    return e ? e : ret(cuStreamSynchronize(NULL));
}

/* ------------------------------------------------------------------------------------------ */
/* streams */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    if (!s) return ret(cudaErrorInvalidValue);
    CTX();
    return ret(cuStreamCreate(s, flags & 1u));
}

cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }

/* Priorities are accepted and not modelled. */
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int priority) {
    (void)priority;
    return cudaStreamCreateWithFlags(s, flags);
}

cudaError_t cudaStreamGetPriority(cudaStream_t s, int *priority) {
    (void)s;
    if (!priority) return ret(cudaErrorInvalidValue);
    *priority = 0;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) { CTX(); return ret(cuStreamDestroy_v2(s)); }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { CTX(); return ret(cuStreamSynchronize(s)); }
cudaError_t cudaStreamQuery(cudaStream_t s) {
    CTX();
    CUresult r = cuStreamQuery(s);
    return r == cudaErrorNotReady ? r : ret(r); /* not ready is not an error */
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    CTX();
    return ret(cuStreamWaitEvent(s, e, flags));
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode) {
    CTX();
    return ret(cuStreamBeginCapture_v2(s, mode));
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, void **graph) {
    CTX();
    return ret(cuStreamEndCapture(s, graph));
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, int *status) {
    CTX();
    return ret(cuStreamIsCapturing(s, status));
}

/* CUDA 13's signature: status, id, graph, dependencies, edge data, their count. */
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, int *status, unsigned long long *id, void **graph,
                                     const void ***deps, const void **edges, size_t *ndeps) {
    CTX();
    if (edges) *edges = NULL;
    return ret(cuStreamGetCaptureInfo_v2(s, status, id, graph, deps, ndeps));
}

cudaError_t cudaThreadExchangeStreamCaptureMode(int *mode) {
    pthread_once(&init_once, do_init);
    return ret(cuThreadExchangeStreamCaptureMode(mode));
}

/* A host function runs once the stream's earlier work is done. */
cudaError_t cudaLaunchHostFunc(cudaStream_t s, void (*fn)(void *), void *arg) {
    if (!fn) return ret(cudaErrorInvalidValue);
    CTX();
    int status = 0;
    CUresult r = cuStreamIsCapturing(s, &status);
    if (r) return ret(r);
    if (status) return ret(cudaErrorNotSupported); /* a host node in a graph: not modelled */
    if ((r = cuStreamSynchronize(s))) return ret(r);
    fn(arg);
    return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* events */

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    if (!e) return ret(cudaErrorInvalidValue);
    CTX();
    return ret(cuEventCreate(e, flags));
}

cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { CTX(); return ret(cuEventDestroy_v2(e)); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { CTX(); return ret(cuEventRecord(e, s)); }
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned flags) {
    (void)flags;
    return cudaEventRecord(e, s);
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    CTX();
    CUresult r = cuEventQuery(e);
    return r == cudaErrorNotReady ? r : ret(r);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) { CTX(); return ret(cuEventSynchronize(e)); }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    CTX();
    return ret(cuEventElapsedTime(ms, a, b));
}

/* ------------------------------------------------------------------------------------------ */
/* graphs: a captured graph holds the copies and memsets captured into it (no kernels run);
 * an executable graph is a snapshot of them (the driver's hostcuda_graph_snapshot), run at
 * each launch, so that PyTorch's CUDAGraph capture / replay / reset paths run and a replay
 * moves the bytes it captured. */

void *hostcuda_graph_snapshot(void *graph);
void hostcuda_graph_snapshot_free(void *snap);
CUresult hostcuda_graph_launch(void *snap, void *stream);
long hostcuda_graph_nodes(void *graph, void **nodes, size_t cap);

struct graph_exec { unsigned magic; void *ops; };
#define EXEC_MAGIC 0x67726170u

cudaError_t cudaGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    (void)flags;
    if (!exec || !graph) return ret(cudaErrorInvalidValue);
    CTX();
    void *ops = hostcuda_graph_snapshot(graph);
    if (!ops) return ret(cudaErrorInvalidValue);
    struct graph_exec *x = malloc(sizeof *x);
    if (!x) { hostcuda_graph_snapshot_free(ops); return ret(cudaErrorMemoryAllocation); }
    x->magic = EXEC_MAGIC;
    x->ops = ops;
    *exec = x;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(void **exec, void *graph, unsigned long long flags) {
    return cudaGraphInstantiateWithFlags(exec, graph, flags);
}

cudaError_t cudaGraphLaunch(void *exec, cudaStream_t s) {
    CTX();
    struct graph_exec *x = exec;
    if (!x || x->magic != EXEC_MAGIC) return ret(cudaErrorInvalidResourceHandle);
    return ret(hostcuda_graph_launch(x->ops, s));
}

cudaError_t cudaGraphExecDestroy(void *exec) {
    struct graph_exec *x = exec;
    if (!x || x->magic != EXEC_MAGIC) return ret(cudaErrorInvalidResourceHandle);
    x->magic = 0;
    hostcuda_graph_snapshot_free(x->ops);
    free(x);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(void *graph) { CTX(); return ret(cuGraphDestroy(graph)); }

cudaError_t cudaGraphGetNodes(void *graph, void **nodes, size_t *n) {
    if (!n) return ret(cudaErrorInvalidValue);
    long count = hostcuda_graph_nodes(graph, nodes, nodes ? *n : 0);
    if (count < 0) return ret(cudaErrorInvalidValue);
    if (!nodes || (size_t)count < *n) *n = (size_t)count; /* with nodes: how many were written */
    return cudaSuccess;
}

cudaError_t cudaGraphNodeGetDependencies(void *node, void **deps, void *edges, size_t *n) {
    (void)node, (void)deps, (void)edges;
    if (!n) return ret(cudaErrorInvalidValue);
    *n = 0;
    return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* inter-process sharing: the driver's cuIpc* calls (hostcuda_ipc.c). The
 * handles are 64 opaque bytes, passed by value as in cuda_runtime_api.h. */

typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
typedef struct { char reserved[64]; } cudaIpcEventHandle_t;
CUresult cuIpcGetMemHandle(cudaIpcMemHandle_t *, CUdeviceptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *, cudaIpcMemHandle_t, unsigned);
CUresult cuIpcCloseMemHandle(CUdeviceptr);
CUresult cuIpcGetEventHandle(cudaIpcEventHandle_t *, void *);
CUresult cuIpcOpenEventHandle(void **, cudaIpcEventHandle_t);

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
    CTX();
    return ret(cuIpcGetMemHandle(h, (CUdeviceptr)(uintptr_t)p));
}

cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags) {
    if (!p) return ret(cudaErrorInvalidValue);
    CTX();
    CUdeviceptr d = 0;
    CUresult r = cuIpcOpenMemHandle_v2(&d, h, flags);
    if (r) return ret(r);
    *p = (void *)(uintptr_t)d;
    return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void *p) { CTX(); return ret(cuIpcCloseMemHandle((CUdeviceptr)(uintptr_t)p)); }
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t *h, cudaEvent_t e) { CTX(); return ret(cuIpcGetEventHandle(h, e)); }
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *e, cudaIpcEventHandle_t h) { CTX(); return ret(cuIpcOpenEventHandle(e, h)); }
