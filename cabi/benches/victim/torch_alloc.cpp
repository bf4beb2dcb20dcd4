// PyTorch's own CUDA caching allocator behind the C ABI's malloc/free signatures, so the
// random-victim bench drives it exactly as it drives libstepalloc.so (`victim/mod.rs`,
// `Churn::load_torch`). Built against the installed torch by scripts/torch_victim.sh; needs
// testdrv's stub runtime and host-memory driver (no GPU) or a GPU.
//
// A pair is what a tensor costs PyTorch's allocator: `allocate` through the registered CUDA
// allocator (c10::GetAllocator(kCUDA), which must be CUDACachingAllocator's: checked at init),
// and the DataPtr's deleter, as a tensor's storage calls it when it dies.
#include <ATen/Context.h>
#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdio>
#include <exception>

namespace c10::cuda::CUDACachingAllocator {
class CUDAAllocator;
extern std::atomic<CUDAAllocator*> allocator;  // exported by libc10_cuda.so
}  // namespace c10::cuda::CUDACachingAllocator

namespace {
c10::Allocator* cuda_allocator = nullptr;
c10::DeleterFnPtr deleter = nullptr;
}  // namespace

// 0 on success; otherwise prints why and returns -1.
extern "C" int torch_victim_init() {
    try {
        at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
        cuda_allocator = c10::GetAllocator(c10::DeviceType::CUDA);
        void* caching = c10::cuda::CUDACachingAllocator::allocator.load();
        if (cuda_allocator == nullptr || static_cast<void*>(cuda_allocator) != caching) {
            std::fprintf(stderr, "torch_victim: the CUDA allocator is not CUDACachingAllocator's\n");
            return -1;
        }
        deleter = cuda_allocator->raw_deleter();
        if (deleter == nullptr) {
            std::fprintf(stderr, "torch_victim: the CUDA allocator has no raw deleter\n");
            return -1;
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "torch_victim: %s\n", e.what());
        return -1;
    }
}

// The signatures of stepalloc_malloc / stepalloc_free; device and stream are the current ones.
extern "C" void* torch_victim_malloc(size_t size, int, void*) {
    try {
        return cuda_allocator->raw_allocate(size);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "torch_victim: %s\n", e.what());
        return nullptr;
    }
}

extern "C" void torch_victim_free(void* ptr, size_t, int, void*) { deleter(ptr); }
