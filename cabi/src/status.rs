//! Stable status codes of the C ABI and the boundary's error type. Layer: the boundary.
//! The numbers never change meaning; new codes are only ever appended. Every `Error` of the
//! core maps to exactly one code.

use std::ffi::c_int;
use std::fmt;
use stepalloc::Error;

/// Success.
pub const STEPALLOC_OK: c_int = 0;
/// The device could not provide the memory after the whole out-of-memory path ran.
pub const STEPALLOC_OUT_OF_MEMORY: c_int = 1;
/// A pointer that is not a live allocation (never allocated, already freed, other device).
pub const STEPALLOC_UNKNOWN_POINTER: c_int = 2;
/// A NULL or out-of-range argument, a size that disagrees with the allocation, a misuse.
pub const STEPALLOC_INVALID_ARGUMENT: c_int = 3;
/// A configuration key or value was not accepted.
pub const STEPALLOC_CONFIG: c_int = 4;
/// A CUDA driver call failed (other than out of memory).
pub const STEPALLOC_DRIVER: c_int = 5;
/// No usable backend (no driver, no device) or a service that could not start.
pub const STEPALLOC_UNAVAILABLE: c_int = 6;
/// A bug: a panic inside stepalloc was caught at the boundary. The call had no effect or an
/// unknown partial effect on statistics; allocations stay valid.
pub const STEPALLOC_PANIC: c_int = 7;
/// The operation needs memory of a tag that is paused (`stepalloc_pause`): an allocation in a
/// paused tag's region. Resume the tag first.
pub const STEPALLOC_PAUSED: c_int = 8;

/// A failure at the boundary: a core error, or a pointer no device knows (the core's
/// `UnknownPointer` names a device, which callers such as `record_stream` do not give).
#[derive(Debug)]
pub enum AbiError {
    Core(Error),
    UnknownPointer(u64),
}

impl AbiError {
    pub fn invalid(message: String) -> AbiError {
        AbiError::Core(Error::InvalidArgument(message))
    }

    pub fn code(&self) -> c_int {
        match self {
            AbiError::Core(e) => code_of(e),
            AbiError::UnknownPointer(_) => STEPALLOC_UNKNOWN_POINTER,
        }
    }
}

impl From<Error> for AbiError {
    fn from(e: Error) -> AbiError {
        AbiError::Core(e)
    }
}

impl fmt::Display for AbiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbiError::Core(e) => e.fmt(f),
            AbiError::UnknownPointer(ptr) => {
                write!(f, "pointer {ptr:#x} is not a live stepalloc allocation on any device")
            }
        }
    }
}

/// The status code of a core error.
pub fn code_of(error: &Error) -> c_int {
    match error {
        Error::OutOfMemory(_) => STEPALLOC_OUT_OF_MEMORY,
        Error::UnknownPointer { .. } => STEPALLOC_UNKNOWN_POINTER,
        Error::InvalidArgument(_) => STEPALLOC_INVALID_ARGUMENT,
        Error::Config { .. } => STEPALLOC_CONFIG,
        Error::Driver { .. } => STEPALLOC_DRIVER,
        Error::Unavailable(_) => STEPALLOC_UNAVAILABLE,
        Error::Paused(_) => STEPALLOC_PAUSED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stepalloc::OomReport;

    #[test]
    fn every_error_has_its_own_stable_code() {
        let cases = [
            (Error::OutOfMemory(Box::<OomReport>::default()), 1),
            (Error::UnknownPointer { device: 0, ptr: 1 }, 2),
            (Error::InvalidArgument("x".into()), 3),
            (Error::config("k", "m"), 4),
            (Error::Driver { call: "cuMemAlloc", code: "X".into() }, 5),
            (Error::Unavailable("x".into()), 6),
            (Error::Paused("x".into()), 8),
        ];
        for (error, code) in cases {
            assert_eq!(code_of(&error), code, "{error}");
        }
        assert_eq!(STEPALLOC_OK, 0);
        assert_eq!(STEPALLOC_PANIC, 7);
    }
}
