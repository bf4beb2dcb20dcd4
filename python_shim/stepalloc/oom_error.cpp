// Built by stepalloc/_oom.py against the installed torch's headers and libc10: the function
// libstepalloc.so calls on out-of-memory in process-wide mode. PyTorch turns only
// c10::OutOfMemoryError into torch.OutOfMemoryError, so the exception must be of that type.
#include <c10/util/Exception.h>

#include <string>

extern "C" [[noreturn]] void stepalloc_throw_oom(const char *message) {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                std::string(message));
}
