//! Control and inspection: configuration, step boundaries, statistics, snapshots, traces and
//! metrics. Layer: the boundary; everything here is off the hot path.
//!
//! Text comes out as `size_t f(char *buf, size_t cap)`: the return value is the full length
//! in bytes (without the NUL); with `buf` NULL nothing is written (measure first, then call
//! again with `cap` = length + 1); otherwise at most `cap - 1` bytes and a NUL are written.
//! A text that may change between the two calls (snapshot, stats) can come back longer the
//! second time: compare the returned length with `cap` and retry. On failure these return 0
//! and set the last error; `stepalloc_last_status()` tells an empty text from a failure.

use crate::guard::{guard, guard_status};
use crate::status::AbiError;
use crate::{allocator, device_index, last_error};
use std::ffi::{c_char, c_int, CStr};
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use stepalloc::metrics;
use stepalloc::{Allocator, BackendKind, Config};

/// Copies `text` into `buf` as described at the top; returns `text.len()`.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
pub(crate) unsafe fn write_text(text: &str, buf: *mut c_char, cap: usize) -> usize {
    if !buf.is_null() && cap > 0 {
        let n = text.len().min(cap - 1);
        // Safety: the caller guarantees `cap` writable bytes at `buf`; n + 1 <= cap.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

/// A C string argument as UTF-8.
///
/// # Safety
/// `s` must be NULL or a NUL-terminated string.
pub(crate) unsafe fn c_str<'a>(s: *const c_char, what: &str) -> Result<&'a str, AbiError> {
    if s.is_null() {
        return Err(AbiError::invalid(format!("{what} is NULL")));
    }
    // Safety: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(s) };
    s.to_str().map_err(|_| AbiError::invalid(format!("{what} is not valid UTF-8")))
}

/// A string argument given with its length (it may hold NUL characters, which are then
/// refused by the callee, where a C string would silently end at the first one).
///
/// # Safety
/// `s` must be NULL or point to `len` readable bytes.
unsafe fn str_with_len<'a>(s: *const c_char, len: usize, what: &str) -> Result<&'a str, AbiError> {
    if s.is_null() {
        return Err(AbiError::invalid(format!("{what} is NULL")));
    }
    // Safety: non-NULL, and `len` readable bytes by the caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(s.cast::<u8>(), len) };
    std::str::from_utf8(bytes).map_err(|_| AbiError::invalid(format!("{what} is not valid UTF-8")))
}

/// Sets the configuration (`STEPALLOC_CONF` syntax, `key:value,...`) before the first use;
/// afterwards the configuration is fixed and this fails with `STEPALLOC_INVALID_ARGUMENT`.
/// A bad key or value fails with `STEPALLOC_CONFIG`, naming the key and the accepted form,
/// and changes nothing. Returns a status.
///
/// # Safety
/// `conf` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_configure(conf: *const c_char) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let text = unsafe { c_str(conf, "configuration string") }?;
        stepalloc::configure_global(text)?;
        Ok(())
    })
}

/// `stepalloc_configure` for a string of `len` bytes that need not end in a NUL: a NUL
/// character inside it is an error (`STEPALLOC_CONFIG`, naming the key), not the end of the
/// string. What language bindings should call.
///
/// # Safety
/// `conf` must be NULL or point to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_configure_len(conf: *const c_char, len: usize) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let text = unsafe { str_with_len(conf, len, "configuration string") }?;
        stepalloc::configure_global(text)?;
        Ok(())
    })
}

/// Every configuration key with its default, accepted form and meaning, one per line.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_config_help(buf: *mut c_char, cap: usize) -> usize {
    // Safety: forwarded caller contract.
    guard(|| Ok(unsafe { write_text(&Config::describe(), buf, cap) }))
}

/// Begins a step of the loop, labelled `phase` (e.g. "rollout", "train"); ends the current
/// step first if one is open. Release policies run at step boundaries. Returns a status.
///
/// # Safety
/// `phase` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_step_begin(phase: *const c_char) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let phase = unsafe { c_str(phase, "phase") }?;
        allocator()?.step_begin(phase)?;
        Ok(())
    })
}

/// `stepalloc_step_begin` for a name of `len` bytes that need not end in a NUL: a NUL
/// character inside it is refused (`STEPALLOC_INVALID_ARGUMENT`), not the end of the name.
///
/// # Safety
/// `phase` must be NULL or point to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_step_begin_len(phase: *const c_char, len: usize) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let phase = unsafe { str_with_len(phase, len, "phase") }?;
        stepalloc::step::validate_phase(phase)?;
        allocator()?.step_begin(phase)?;
        Ok(())
    })
}

/// Ends the current step on every device. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_step_end() -> c_int {
    guard_status(|| {
        allocator()?.step_end()?;
        Ok(())
    })
}

/// Starts recording allocator events anew on every device (what snapshots show in
/// `device_traces` and `stepalloc_trace_jsonl` writes), keeping the newest `max_entries` (at
/// most 2^26); 0 stops recording and drops the history. Writes the limit in force to `*limit`
/// when it is not NULL. Returns a status. For `torch.cuda.memory._record_memory_history`.
#[no_mangle]
// `limit` is NULL or a valid out-parameter (documented); checked before the one write.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub extern "C" fn stepalloc_record_history(max_entries: u64, limit: *mut u64) -> c_int {
    guard_status(|| {
        let entries = usize::try_from(max_entries).unwrap_or(usize::MAX);
        let in_force = allocator()?.record_history(entries) as u64;
        if !limit.is_null() {
            // Safety: the caller passes NULL or a valid, writable u64 (documented above).
            unsafe { *limit = in_force };
        }
        Ok(())
    })
}

/// Resets the `.peak` statistics of `device` to their current values. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_reset_peak_stats(device: c_int) -> c_int {
    guard_status(|| {
        allocator()?.reset_peak_stats(device_index(device)?)?;
        Ok(())
    })
}

/// Resets the `.allocated` / `.freed` counters and `num_*` counts of `device`. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_reset_accumulated_stats(device: c_int) -> c_int {
    guard_status(|| {
        allocator()?.reset_accumulated_stats(device_index(device)?)?;
        Ok(())
    })
}

/// The number of devices the allocator drives, or -1 when it cannot be created (see the
/// last error).
#[no_mangle]
pub extern "C" fn stepalloc_device_count() -> c_int {
    // `guard` yields 0 on failure, so shift by one: failure becomes -1.
    let count_plus_one = guard(|| Ok(allocator()?.device_count() + 1));
    count_plus_one as c_int - 1
}

/// Whether the process-wide allocator exists: 1 once something created it (the first
/// allocation, `stepalloc_init`, or any call that needs it), 0 before. Creates nothing, so
/// callers can answer "nothing allocated yet" without fixing the configuration.
#[no_mangle]
pub extern "C" fn stepalloc_is_initialised() -> c_int {
    catch_unwind(|| c_int::from(stepalloc::allocator::global_if_initialised().is_some())).unwrap_or(0)
}

/// The number of devices an allocator created from `conf` (configuration string syntax) would
/// drive, without creating it: `sim_devices` for `backend:sim`, else the CUDA driver's device
/// count (no context is created). -1 when `conf` is rejected or no device is usable (see the
/// last error).
///
/// # Safety
/// `conf` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_config_device_count(conf: *const c_char) -> c_int {
    // `guard` yields 0 on failure, so shift by one: failure becomes -1.
    let count_plus_one = guard(|| {
        // Safety: forwarded caller contract.
        let text = unsafe { c_str(conf, "configuration string") }?;
        let config = Config::parse(text)?;
        let count = match config.backend {
            BackendKind::Sim => config.sim.devices,
            BackendKind::Cuda | BackendKind::Auto => stepalloc::backend::cuda::open_all()?.len(),
        };
        Ok(count.saturating_add(1))
    });
    c_int::try_from(count_plus_one).unwrap_or(c_int::MAX) - 1
}

/// `torch.cuda.memory_stats(device)` as one JSON object (same keys, plus `stepalloc.*`).
/// Like the other readers below, it does not create the allocator: before the first
/// allocation it reports zeros, so reading statistics never fixes the configuration.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_stats_json(device: c_int, buf: *mut c_char, cap: usize) -> usize {
    guard(|| {
        let device = device_index(device)?;
        let text = match stepalloc::allocator::global_if_initialised() {
            Some(allocator) => allocator.stats_json(device)?,
            None => Allocator::empty_stats_json(device),
        };
        // Safety: forwarded caller contract.
        Ok(unsafe { write_text(&text, buf, cap) })
    })
}

thread_local! {
    /// The snapshot text a measuring call (`buf` NULL) rendered on this thread, kept for the
    /// call with a buffer that follows, so that measure-then-fill builds the snapshot once.
    static MEASURED_SNAPSHOT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// The whole state as JSON in the layout of `torch.cuda.memory._snapshot()`.
///
/// Measuring (`buf` NULL or `cap` 0) renders the snapshot and keeps it on this thread; the next
/// call with a buffer on the same thread writes that same text (the state as of the measuring
/// call, whose length the caller sized the buffer for) instead of building it again. A call
/// with a buffer and nothing measured renders afresh.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_snapshot_json(buf: *mut c_char, cap: usize) -> usize {
    guard(|| {
        let render = || match stepalloc::allocator::global_if_initialised() {
            Some(allocator) => allocator.snapshot_json(),
            None => Allocator::empty_snapshot().to_string(),
        };
        if buf.is_null() || cap == 0 {
            let text = render();
            let len = text.len();
            MEASURED_SNAPSHOT.with(|m| *m.borrow_mut() = Some(text));
            return Ok(len);
        }
        let text = MEASURED_SNAPSHOT.with(|m| m.borrow_mut().take()).unwrap_or_else(render);
        // Safety: forwarded caller contract.
        Ok(unsafe { write_text(&text, buf, cap) })
    })
}

/// The recorded event trace (configure `trace_entries`), in stepalloc's JSON-lines format.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_trace_jsonl(buf: *mut c_char, cap: usize) -> usize {
    guard(|| {
        let text = stepalloc::allocator::global_if_initialised().map(|a| a.trace_jsonl()).unwrap_or_default();
        // Safety: forwarded caller contract.
        Ok(unsafe { write_text(&text, buf, cap) })
    })
}

/// The Prometheus text exposition of the allocator's metrics.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_metrics_text(buf: *mut c_char, cap: usize) -> usize {
    guard(|| {
        let text = stepalloc::allocator::global_if_initialised().map(|a| metrics::render(a)).unwrap_or_default();
        // Safety: forwarded caller contract.
        Ok(unsafe { write_text(&text, buf, cap) })
    })
}

/// Where `stepalloc_metrics_serve` started the endpoint, if it did.
static SERVED: parking_lot::Mutex<Option<SocketAddr>> = parking_lot::Mutex::new(None);

/// Starts the Prometheus endpoint (`/metrics`) on one background thread at `addr`
/// (`host:port`, `:port` or `port`; NULL or "" means 127.0.0.1:9835; under torchrun the port
/// is offset by `LOCAL_RANK`). One endpoint per process: a second call, or a call after the
/// `metrics_addr` key started one, fails with `STEPALLOC_INVALID_ARGUMENT`. Returns a status.
///
/// # Safety
/// `addr` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_metrics_serve(addr: *const c_char) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let addr = if addr.is_null() { "" } else { unsafe { c_str(addr, "address") }? };
        let allocator = allocator()?;
        let mut served = SERVED.lock();
        if let Some(running) = served.or_else(metrics::global_server_addr) {
            return Err(AbiError::invalid(format!("the metrics endpoint is already serving on {running}")));
        }
        let server = metrics::serve(Arc::clone(allocator), addr)?;
        // The endpoint runs for the life of the process; only its address is kept.
        *served = Some(server.addr);
        Ok(())
    })
}

/// The message of the last failure on this thread ("" if none). Does not change the last
/// status or error.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_last_error(buf: *mut c_char, cap: usize) -> usize {
    // Safety: forwarded caller contract.
    catch_unwind(AssertUnwindSafe(|| last_error::with_message(|m| unsafe { write_text(m, buf, cap) }))).unwrap_or(0)
}

/// The status of the last stepalloc call on this thread (`STEPALLOC_OK` after a success).
/// Does not change it.
#[no_mangle]
pub extern "C" fn stepalloc_last_status() -> c_int {
    catch_unwind(last_error::status).unwrap_or(crate::status::STEPALLOC_PANIC)
}

/// The library version, e.g. "0.1.0" (a static string; do not free).
#[no_mangle]
pub extern "C" fn stepalloc_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_text_measures_truncates_and_terminates() {
        let mut buf = [0x7f as c_char; 8];
        // Safety (all calls): `buf` has 8 bytes.
        assert_eq!(unsafe { write_text("hello world", std::ptr::null_mut(), 0) }, 11);
        assert_eq!(unsafe { write_text("hello world", buf.as_mut_ptr(), 0) }, 11);
        assert_eq!(buf[0], 0x7f, "cap 0 writes nothing");
        assert_eq!(unsafe { write_text("hello world", buf.as_mut_ptr(), 6) }, 11);
        assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_bytes(), b"hello");
        assert_eq!(buf[6], 0x7f, "nothing past cap");
        assert_eq!(unsafe { write_text("hi", buf.as_mut_ptr(), 8) }, 2);
        assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_bytes(), b"hi");
    }

    #[test]
    fn config_device_count_counts_without_creating_and_rejects_bad_strings() {
        // Safety (all calls): NUL-terminated literals or NULL.
        assert_eq!(unsafe { stepalloc_config_device_count(c"backend:sim,sim_devices:3".as_ptr()) }, 3);
        assert_eq!(unsafe { stepalloc_config_device_count(c"backend:sim".as_ptr()) }, 1);
        assert_eq!(unsafe { stepalloc_config_device_count(c"backend:sim,sim_devices:lots".as_ptr()) }, -1);
        assert_eq!(last_error::status(), crate::status::STEPALLOC_CONFIG);
        assert!(last_error::with_message(|m| m.contains("sim_devices")));
        assert_eq!(unsafe { stepalloc_config_device_count(std::ptr::null()) }, -1);
        assert_eq!(last_error::status(), crate::status::STEPALLOC_INVALID_ARGUMENT);
    }
}
