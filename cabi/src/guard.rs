//! The panic guard every export runs under. Layer: the boundary.
//!
//! `guard` runs the body under `catch_unwind`, records the outcome in the thread-local last
//! error, and turns a failure into the value the return type uses for failure (`FailValue`):
//! NULL for pointers, the status code for `int` statuses, 0 for lengths, nothing for `void`.
//! No panic and no Rust error ever crosses the C ABI.

use crate::last_error;
use crate::status::{AbiError, STEPALLOC_PANIC};
use std::any::Any;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The value an export returns when it fails.
pub trait FailValue {
    fn fail_value(status: c_int) -> Self;
}

impl FailValue for *mut c_void {
    fn fail_value(_: c_int) -> Self {
        std::ptr::null_mut()
    }
}

impl FailValue for usize {
    fn fail_value(_: c_int) -> Self {
        0
    }
}

impl FailValue for () {
    fn fail_value(_: c_int) -> Self {}
}

/// A status-returning export returns the status itself.
pub struct Status;

impl FailValue for Status {
    fn fail_value(_: c_int) -> Self {
        Status
    }
}

/// Runs an export's body: success records OK; an error or a panic records the status and
/// message and yields `T::fail_value`.
#[inline]
pub fn guard<T: FailValue>(body: impl FnOnce() -> Result<T, AbiError>) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => {
            last_error::set_ok();
            value
        }
        Ok(Err(error)) => fail(&error),
        Err(payload) => panicked(payload),
    }
}

/// `guard` for exports that return an `int` status.
#[inline]
pub fn guard_status(body: impl FnOnce() -> Result<(), AbiError>) -> c_int {
    guard(|| body().map(|()| Status));
    last_error::status()
}

#[cold]
fn fail<T: FailValue>(error: &AbiError) -> T {
    let status = error.code();
    last_error::set_error(status, error.to_string());
    T::fail_value(status)
}

#[cold]
fn panicked<T: FailValue>(payload: Box<dyn Any + Send>) -> T {
    let what = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    last_error::set_error(STEPALLOC_PANIC, format!("internal error in stepalloc (a bug; please report it): {what}"));
    T::fail_value(STEPALLOC_PANIC)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::*;
    use stepalloc::Error;

    #[test]
    fn success_error_and_panic() {
        assert_eq!(guard_status(|| Ok(())), STEPALLOC_OK);
        assert_eq!(guard_status(|| Err(Error::InvalidArgument("bad".into()).into())), STEPALLOC_INVALID_ARGUMENT);
        last_error::with_message(|m| assert_eq!(m, "invalid argument: bad"));
        let p: *mut c_void = guard(|| -> Result<*mut c_void, AbiError> { panic!("boom") });
        assert!(p.is_null());
        assert_eq!(last_error::status(), STEPALLOC_PANIC);
        last_error::with_message(|m| assert!(m.ends_with("boom"), "{m}"));
        // A later success resets the status but keeps the last failure's message.
        assert_eq!(guard(|| Ok(5usize)), 5);
        assert_eq!(last_error::status(), STEPALLOC_OK);
        last_error::with_message(|m| assert!(m.ends_with("boom"), "{m}"));
    }
}
