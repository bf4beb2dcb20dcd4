//! Sleep and wake: regions that tag allocations, `pause` and `resume` by tag, the last report
//! and the per-tag figures. Layer: the boundary; off the hot path (a region's tag is one
//! thread-local byte that `malloc` reads in the core).
//!
//! Outcomes: pausing a tag no region ever used, pausing or resuming "default", and either call
//! during a CUDA-graph capture are `STEPALLOC_INVALID_ARGUMENT` naming the tag; pausing a
//! paused tag and resuming one that is not paused succeed and list the tag in the report's
//! "skipped"; a resume that cannot get the memory is `STEPALLOC_OUT_OF_MEMORY` naming the tag
//! and the shortfall (the tag stays paused with its backup; a retry works); an allocation in a
//! paused tag's region is `STEPALLOC_PAUSED`; freeing a block of a paused tag drops it and its
//! backup.

use crate::allocator;
use crate::control::{c_str, write_text};
use crate::guard::{guard, guard_status};
use crate::status::AbiError;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};

thread_local! {
    /// The calling thread's last pause or resume, as JSON ("" before the first).
    static LAST_REPORT: RefCell<String> = const { RefCell::new(String::new()) };
}

/// An optional tag argument: NULL means every tag.
///
/// # Safety
/// `tag` must be NULL or a NUL-terminated string.
unsafe fn optional_tag<'a>(tag: *const c_char) -> Result<Option<&'a str>, AbiError> {
    if tag.is_null() {
        return Ok(None);
    }
    // Safety: forwarded caller contract.
    Ok(Some(unsafe { c_str(tag, "tag") }?))
}

/// Enters a region of `tag` on the calling thread: until the matching
/// `stepalloc_region_exit`, what this thread allocates carries `tag` and lives in pages of its
/// own, which `stepalloc_pause` can give back. `tag` is 1 to 64 characters of letters, digits,
/// `_`, `.`, `:` and `-`; "default" is the tag outside any region. At most 32 tags besides
/// "default" per process (the 33rd is `STEPALLOC_INVALID_ARGUMENT`); regions nest up to 64
/// deep. `backup`: where a pause keeps what this region allocates: 0 nowhere (discarded), 1
/// pinned host memory, 2 pageable host memory (anonymous mmap, not pinned), 3 one file per
/// block in the backup directory (`stepalloc_set_backup_dir`; removed at resume). It belongs to
/// each allocation, so regions of one tag with different `backup` never change each other's
/// memory. Returns a status.
///
/// # Safety
/// `tag` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_region_enter(tag: *const c_char, backup: c_int) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let tag = unsafe { c_str(tag, "tag") }?;
        let Some(store) = stepalloc::tags::Store::from_number(backup) else {
            return Err(AbiError::invalid(format!(
                "region {tag:?}: backup must be 0 (none), 1 (pinned), 2 (mmap) or 3 (disk), not {backup}"
            )));
        };
        stepalloc::tags::enter_with(tag, store)?;
        Ok(())
    })
}

/// Exits the calling thread's innermost region (`STEPALLOC_INVALID_ARGUMENT` when it has
/// none). Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_region_exit() -> c_int {
    guard_status(|| {
        stepalloc::tags::exit()?;
        Ok(())
    })
}

/// Sets whether a pause of `tag` (registered if new) gives its free cached pages back only
/// until the resume, which maps them again (no copy) after the live pages as the tag's free
/// cached memory (`on` nonzero: torch_memory_saver's semantics, whose resume maps a region's
/// whole segments; the resume's room check counts them and it maps all or nothing), or for
/// good (`on` 0, the default: the resume maps only the live blocks' pages). Blocks freed while
/// paused count as cached pages too. Takes effect at the next pause. "default" is
/// `STEPALLOC_INVALID_ARGUMENT`. Returns a status.
///
/// # Safety
/// `tag` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_tag_keep_cached(tag: *const c_char, on: c_int) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let tag = unsafe { c_str(tag, "tag") }?;
        stepalloc::tags::set_keep_cached(tag, on != 0)?;
        Ok(())
    })
}

/// Pauses `tag` (NULL: every tag a region has used) on every device: the physical memory of
/// its live blocks and cached pages goes back to the device, every address stays reserved
/// (tensors keep their pointers; CUDA graphs captured before stay valid), after the device is
/// synchronized (no stream's queued work still uses it). `backup` -1 follows each allocation's region; 0
/// discards the live bytes; 1 copies them to pinned host memory first. Idle cached pages of
/// other tags are released too, so the device shows the memory free when this returns.
/// Returns a status; `stepalloc_sleep_report_json` tells what it did.
///
/// # Safety
/// `tag` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_pause(tag: *const c_char, backup: c_int) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let tag = unsafe { optional_tag(tag) }?;
        let backup = match backup {
            -1 => None,
            0 => Some(false),
            1 => Some(true),
            other => return Err(AbiError::invalid(format!("pause: backup must be -1, 0 or 1, not {other}"))),
        };
        let report = allocator()?.pause(tag, backup)?;
        LAST_REPORT.with(|r| *r.borrow_mut() = report.to_json());
        Ok(())
    })
}

/// Resumes `tag` (NULL: every paused tag) on every device: physical memory is mapped at the
/// same addresses and backed-up bytes are copied back. All or nothing: when the device cannot
/// give the memory, `STEPALLOC_OUT_OF_MEMORY` names the tag and the shortfall and the tag stays
/// paused with its backup. Returns a status.
///
/// # Safety
/// `tag` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_resume(tag: *const c_char) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let tag = unsafe { optional_tag(tag) }?;
        let report = allocator()?.resume(tag)?;
        LAST_REPORT.with(|r| *r.borrow_mut() = report.to_json());
        Ok(())
    })
}

/// A comma-separated list of tag names: each one a tag (names hold no commas).
///
/// # Safety
/// `tags` must be NULL or a NUL-terminated string.
unsafe fn tag_list<'a>(tags: *const c_char) -> Result<Vec<&'a str>, AbiError> {
    // Safety: forwarded caller contract.
    let text = unsafe { c_str(tags, "tags") }?;
    let names: Vec<&str> = text.split(',').collect();
    if names.iter().any(|n| n.is_empty()) {
        return Err(AbiError::invalid(format!("tags {text:?}: an empty name; give names separated by single commas")));
    }
    Ok(names)
}

/// Pauses every tag of `tags` (names separated by commas, e.g. "weights,kv_cache") in one call:
/// on each device the backed-up tags' copies are queued first and the other tags' pages are
/// released while they run, so the call takes about the copies' time. `backup` as
/// `stepalloc_pause`, for every name without its own: "name=1" backs that tag up, "name=0"
/// discards it. Every name is checked before anything changes; when the call fails, the names
/// are paused one after the other as `stepalloc_pause` of each would (those before the failing
/// one stay paused). Returns a status; `stepalloc_sleep_report_json` tells what it did.
///
/// # Safety
/// `tags` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_pause_tags(tags: *const c_char, backup: c_int) -> c_int {
    // Safety: forwarded caller contract; no discard list.
    unsafe { stepalloc_pause_tags_discarding(tags, backup, std::ptr::null(), 0) }
}

/// `stepalloc_pause_tags`, where the live allocations that start at one of the `count`
/// addresses of `discard` are discarded, not copied, even in a tag that is backed up (vLLM's
/// `sleep(discardable=...)`: storage the caller rewrites after waking). Addresses that start no
/// live allocation of the tags are ignored. Returns a status; `stepalloc_sleep_report_json`
/// counts the discarded bytes.
///
/// # Safety
/// `tags` must be a NUL-terminated string; `discard` must point to `count` readable `u64` (it
/// may be NULL when `count` is 0).
#[no_mangle]
pub unsafe extern "C" fn stepalloc_pause_tags_discarding(
    tags: *const c_char,
    backup: c_int,
    discard: *const u64,
    count: usize,
) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let names = unsafe { tag_list(tags) }?;
        let backup = match backup {
            -1 => None,
            0 => Some(false),
            1 => Some(true),
            other => return Err(AbiError::invalid(format!("pause: backup must be -1, 0 or 1, not {other}"))),
        };
        let discard: &[u64] = match (discard.is_null(), count) {
            (_, 0) => &[],
            (true, _) => return Err(AbiError::invalid(format!("pause: discard is NULL with count {count}"))),
            // Safety: the caller guarantees `count` readable u64 at `discard`.
            (false, n) => unsafe { std::slice::from_raw_parts(discard, n) },
        };
        let mut each = Vec::with_capacity(names.len());
        for name in names {
            each.push(match name.split_once('=') {
                None => (name, backup),
                Some((tag, "1")) => (tag, Some(true)),
                Some((tag, "0")) => (tag, Some(false)),
                Some((tag, other)) => {
                    return Err(AbiError::invalid(format!("pause: {tag:?}={other}: a tag's backup is =0 or =1")))
                }
            });
        }
        let report = allocator()?.pause_tags_discarding(&each, discard)?;
        LAST_REPORT.with(|r| *r.borrow_mut() = report.to_json());
        Ok(())
    })
}

/// Resumes every tag of `tags` (names separated by commas) in one call: the room is checked
/// first, then each copy batch's pages are mapped while the batch before copies. When the call
/// fails, the names are resumed one after the other as `stepalloc_resume` of each would; a tag
/// that cannot get its memory stays paused with its backup (`STEPALLOC_OUT_OF_MEMORY` naming
/// it). Returns a status.
///
/// # Safety
/// `tags` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_resume_tags(tags: *const c_char) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let names = unsafe { tag_list(tags) }?;
        let report = allocator()?.resume_tags(&names)?;
        LAST_REPORT.with(|r| *r.borrow_mut() = report.to_json());
        Ok(())
    })
}

/// The calling thread's last successful pause or resume, as JSON: {"op":"pause"|"resume",
/// "tags":[..],"skipped":[..],"released_bytes":N,"mapped_bytes":N,"copied_bytes":N,
/// "discarded_bytes":N,"seconds":F,"gib_per_s":F}; empty before the first. Text convention.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_sleep_report_json(buf: *mut c_char, cap: usize) -> usize {
    // Safety: forwarded caller contract.
    guard(|| Ok(LAST_REPORT.with(|r| unsafe { write_text(&r.borrow(), buf, cap) })))
}

/// Sets the directory disk backups (`stepalloc_region_enter` with `backup` 3) go to from the
/// next pause on, for the whole process; it is created if missing. Before any call: the
/// environment's `STEPALLOC_BACKUP_DIR`, else the system's temporary directory. A path that
/// cannot be created, is not a directory or where no file can be created is
/// `STEPALLOC_INVALID_ARGUMENT` naming it (the directory stays as it was). A pause that cannot
/// write a file there (full disk, file-size limit, directory gone) fails naming the tag and the
/// file, with the tag resident and intact. Returns a status.
///
/// # Safety
/// `path` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_set_backup_dir(path: *const c_char) -> c_int {
    guard_status(|| {
        // Safety: forwarded caller contract.
        let path = unsafe { c_str(path, "path") }?;
        stepalloc::heap::set_backup_dir(path)?;
        Ok(())
    })
}

/// The directory disk backups go to now. Text convention.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_backup_dir(buf: *mut c_char, cap: usize) -> usize {
    let dir = stepalloc::heap::backup_dir();
    // Safety: forwarded caller contract.
    guard(|| Ok(unsafe { write_text(&dir.to_string_lossy(), buf, cap) }))
}

/// Frees the host buffers (pinned and mmap) kept for backups that hold no paused bytes now,
/// and the disk backups' pinned staging (they are otherwise kept across pauses: a new pinned
/// allocation costs far more than the copy).
/// Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_release_backup() -> c_int {
    guard_status(|| {
        allocator()?.release_backup()?;
        Ok(())
    })
}

/// The host address of the backed-up bytes `[ptr, ptr + n)` of a paused tag's block (what
/// `torch_memory_saver.get_cpu_backup` reads), valid until the tag resumes or the block is
/// freed; NULL when those bytes are not paused with a backup in one host buffer, or the device
/// is the simulated one (its buffers are addresses only).
#[no_mangle]
pub extern "C" fn stepalloc_backup_pointer(ptr: *const c_void, n: usize) -> *mut c_void {
    guard(|| {
        let Some(addr) = allocator()?.backup_host_address(ptr as u64, n as u64) else {
            return Ok(std::ptr::null_mut());
        };
        Ok(addr as *mut c_void)
    })
}

/// Per-tag figures summed over devices, as JSON: {"default":{...},"weights":{"live_bytes":N,
/// "paused":bool,"paused_bytes":N,"backup":bool,"backup_bytes":N,"host_bytes":N,"pauses":N,
/// "resumes":N,"pause_seconds":F,"resume_seconds":F},...}. Text convention.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_tags_json(buf: *mut c_char, cap: usize) -> usize {
    // Safety: forwarded caller contract.
    guard(|| Ok(unsafe { write_text(&allocator()?.tags_json(), buf, cap) }))
}

/// Lends the calling thread's current tag (its innermost region) for a while: autograd runs
/// `backward()` on its own device thread, which borrows the tag (`stepalloc_region_borrow`) so
/// that what backward allocates for this thread carries it. Writes the lease's token to
/// `*lease`, or 0 when the thread is in no region (nothing to lend). End it with
/// `stepalloc_region_lend_end`. At most 64 leases are open at once. Returns a status.
///
/// # Safety
/// `lease` must be NULL or point to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn stepalloc_region_lend(lease: *mut u64) -> c_int {
    guard_status(|| {
        if lease.is_null() {
            return Err(AbiError::invalid("region_lend: lease is NULL".to_string()));
        }
        let tag = stepalloc::tags::current();
        let token = if tag == stepalloc::tags::DEFAULT { 0 } else { stepalloc::tags::lend::lend(tag)? };
        // Safety: checked non-NULL; the caller's contract makes it writable.
        unsafe { lease.write(token) };
        Ok(())
    })
}

/// The calling thread borrows the tag of `lease` (from `stepalloc_region_lend` on another
/// thread) until the lease ends: what it allocates outside its own regions carries the tag.
/// `STEPALLOC_INVALID_ARGUMENT` for a lease that ended. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_region_borrow(lease: u64) -> c_int {
    guard_status(|| {
        stepalloc::tags::lend::borrow(lease)?;
        Ok(())
    })
}

/// Ends `lease`: the threads that borrowed it allocate under their own tags again (they see it
/// at their next allocation). `STEPALLOC_INVALID_ARGUMENT` for a lease not open. Returns a status.
#[no_mangle]
pub extern "C" fn stepalloc_region_lend_end(lease: u64) -> c_int {
    guard_status(|| {
        stepalloc::tags::lend::end(lease)?;
        Ok(())
    })
}
