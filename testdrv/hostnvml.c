/* hostnvml: a stub NVML (libnvidia-ml.so.1) over the host-memory driver (hostcuda*.c), for real
 * PyTorch on a machine without a GPU: torch.cuda.device_count() asks NVML through ctypes, and
 * c10's expandable segments probe NVML for fabric handles on their first map. It answers the
 * device count, handles, UUIDs and memory from the driver, "not supported" for fabric and
 * NVLink queries, and no processes. */
#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3 };

int cuInit(unsigned);
int cuDeviceGetCount(int *);
int cuDeviceTotalMem_v2(size_t *, int);
int cuDriverGetVersion(int *);
long long hostcuda_used(int);

struct device { int index; };
static struct device devices[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static int inited;

static int count(void) {
    int n = 0;
    if (cuInit(0) || cuDeviceGetCount(&n)) return 0;
    return n < 8 ? n : 8;
}

static struct device *device_of(void *h) {
    struct device *d = h;
    if (!inited || d < devices || d >= devices + count()) return NULL;
    return d;
}

nvmlReturn_t nvmlInit_v2(void) { inited = 1; return NVML_SUCCESS; }
nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return nvmlInit_v2(); }
nvmlReturn_t nvmlShutdown(void) { inited = 0; return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)count();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned *n) { return nvmlDeviceGetCount_v2(n); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, void **out) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    if (!out || i >= (unsigned)count()) return NVML_ERROR_INVALID_ARGUMENT;
    *out = &devices[i];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned i, void **out) { return nvmlDeviceGetHandleByIndex_v2(i, out); }

/* The bus ids hostcudart's cudaDeviceGetPCIBusId gives: device d is on bus d + 1. */
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **out) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    unsigned domain = 0, b = 0;
    if (!bus || !out || sscanf(bus, "%x:%x", &domain, &b) != 2 || b < 1 || b > (unsigned)count())
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &devices[b - 1];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(void *h, char *out, unsigned len) {
    struct device *d = device_of(h);
    if (!d || !out) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(out, len, "GPU-%08x-0000-0000-0000-000000000000", d->index + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **out) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    unsigned i = 0;
    if (!uuid || !out || sscanf(uuid, "GPU-%08x", &i) != 1 || i < 1 || i > (unsigned)count())
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &devices[i - 1];
    return NVML_SUCCESS;
}

struct nvml_memory { unsigned long long total, free, used; };

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *h, struct nvml_memory *m) {
    struct device *d = device_of(h);
    if (!d || !m) return NVML_ERROR_INVALID_ARGUMENT;
    size_t total = 0;
    cuDeviceTotalMem_v2(&total, d->index);
    long long used = hostcuda_used(d->index);
    m->total = total;
    m->used = used > 0 ? (unsigned long long)used : 0;
    m->free = m->total > m->used ? m->total - m->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    return cuDriverGetVersion(v) ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(void *h, unsigned *n, void *infos) {
    (void)infos;
    if (!device_of(h) || !n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = 0;
    return NVML_SUCCESS;
}

/* No fabric (multi-node NVLink) and no NVLink: expandable segments then use POSIX handles. */
/* nvmlGpuFabricInfoV_t up to its state: a device outside any fabric answers success with the
 * state NVML_GPU_FABRIC_STATE_NOT_SUPPORTED (0). */
struct fabric_info { unsigned version; unsigned char cluster_uuid[16]; nvmlReturn_t status; unsigned clique; unsigned char state; };

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(void *h, struct fabric_info *info) {
    if (!device_of(h) || !info) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned version = info->version;
    memset(info, 0, sizeof *info);
    info->version = version;
    info->status = NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuFabricInfo(void *h, struct fabric_info *info) { return nvmlDeviceGetGpuFabricInfoV(h, info); }
nvmlReturn_t nvmlDeviceGetP2PStatus(void) { return NVML_ERROR_NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(void) { return NVML_ERROR_NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(void) { return NVML_ERROR_NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus, void **out) { return nvmlDeviceGetHandleByPciBusId_v2(bus, out); }

/* Sensors (torch.cuda.utilization, temperature, power_draw, clock_rate through pynvml): a host
 * memory device has none. */
nvmlReturn_t nvmlDeviceGetUtilizationRates(void) { return NVML_ERROR_NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetTemperature(void) { return NVML_ERROR_NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetPowerUsage(void) { return NVML_ERROR_NOT_SUPPORTED; }
nvmlReturn_t nvmlDeviceGetClockInfo(void) { return NVML_ERROR_NOT_SUPPORTED; }
