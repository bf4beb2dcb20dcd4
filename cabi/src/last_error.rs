//! The thread-local last status and error message. Layer: the boundary.
//!
//! Every export records its outcome on the calling thread: the status of the last call
//! (`STEPALLOC_OK` on success) and, on failure, a message. The message of the last failure is
//! kept until another failure replaces it, so a caller can read it after any number of
//! successful calls. Recording success touches one thread-local integer (no allocation).

use crate::status::STEPALLOC_OK;
use std::cell::{Cell, RefCell};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once any thread records a failure. Until then every thread's status is still the initial
/// `STEPALLOC_OK`, so recording a success need not look up the thread-local at all (a call to
/// `__tls_get_addr` in a shared library). A thread's own failure sets it before its status, so
/// that thread's later successes always see it.
static ANY_FAILURE: AtomicBool = AtomicBool::new(false);

thread_local! {
    static LAST_STATUS: Cell<c_int> = const { Cell::new(STEPALLOC_OK) };
    static LAST_MESSAGE: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Records a successful call.
#[inline]
pub fn set_ok() {
    if ANY_FAILURE.load(Ordering::Relaxed) {
        LAST_STATUS.with(|s| s.set(STEPALLOC_OK));
    }
}

/// Records a failed call with its status and message.
pub fn set_error(status: c_int, mut message: String) {
    ANY_FAILURE.store(true, Ordering::Relaxed);
    LAST_STATUS.with(|s| s.set(status));
    // The message leaves as a C string: a NUL inside would cut it short.
    if message.contains('\0') {
        message = message.replace('\0', "\\0");
    }
    // try_borrow_mut: never panic here, even if a caller re-entered during a read.
    LAST_MESSAGE.with(|m| {
        if let Ok(mut m) = m.try_borrow_mut() {
            *m = message;
        }
    });
}

pub fn status() -> c_int {
    LAST_STATUS.with(Cell::get)
}

/// Runs `f` on the last failure's message ("" when nothing failed on this thread).
pub fn with_message<R>(f: impl FnOnce(&str) -> R) -> R {
    LAST_MESSAGE.with(|m| match m.try_borrow() {
        Ok(m) => f(&m),
        Err(_) => f(""),
    })
}
