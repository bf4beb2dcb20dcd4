//! Host backups on CUDA (`pause` / `resume`): pinned host buffers (`cuMemHostAlloc`, portable),
//! pageable ones (anonymous `mmap`, never registered with the driver: torch_memory_saver's
//! `mmap` backend), asynchronous copies between them and device memory on a copy stream of the
//! device's own (created on first use with `CU_STREAM_NON_BLOCKING`, in the primary context,
//! never destroyed, like the context), events recorded on it, and the disk store's file I/O
//! from and to a pinned staging buffer. Part of the CUDA backend: the same rules as `cuda.rs`
//! (plain-integer results, our context made current for each driver call).
//!
//! Pageable buffers take the same copy calls: the driver stages them (a copy to pageable memory
//! returns when done; one from it may return once staged, so the copy stream's event is what
//! says the bytes arrived, as for pinned ones).

use super::{check, elapsed_ns, symbol, CuStream, CudaDevice};
use crate::backend::{Event, Stream};
use crate::error::{Error, Result};
use std::ffi::{c_uint, c_void};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;
use std::time::Instant;

const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
const CU_STREAM_NON_BLOCKING: c_uint = 1;

/// The driver functions of the copy path, resolved by exact name like `Api`'s.
struct HostApi {
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> i32,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> i32,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, u64, usize, CuStream) -> i32,
    memcpy_htod_async: unsafe extern "C" fn(u64, *const c_void, usize, CuStream) -> i32,
}

/// Loaded once, on the first backup. Precondition: a `CudaDevice` exists (the library is open).
fn host_api() -> Result<&'static HostApi> {
    static API: OnceLock<std::result::Result<HostApi, String>> = OnceLock::new();
    API.get_or_init(|| {
        Ok(HostApi {
            mem_host_alloc: symbol("cuMemHostAlloc")?,
            mem_free_host: symbol("cuMemFreeHost")?,
            memcpy_dtoh_async: symbol("cuMemcpyDtoHAsync_v2")?,
            memcpy_htod_async: symbol("cuMemcpyHtoDAsync_v2")?,
        })
    })
    .as_ref()
    .map_err(|e| Error::Unavailable(e.clone()))
}

fn to_size(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| Error::InvalidArgument(format!("{bytes} bytes do not fit this platform")))
}

impl CudaDevice {
    /// The device's copy stream, created on first use. Precondition: our context is current.
    fn copy_stream(&mut self) -> Result<CuStream> {
        if let Some(stream) = self.copy_stream {
            return Ok(stream);
        }
        let mut stream: CuStream = std::ptr::null_mut();
        // Safety: one out-pointer to a local; our context is current (the caller entered it).
        check("cuStreamCreate", unsafe { (self.api.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING) })?;
        self.copy_stream = Some(stream);
        Ok(stream)
    }

    pub(super) fn host_alloc_pinned(&mut self, bytes: u64) -> Result<u64> {
        let api = host_api()?;
        let _current = self.enter()?;
        let size = to_size(bytes)?;
        let start = Instant::now();
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // Safety: one out-pointer to a local; our context is current.
        let done = check("cuMemHostAlloc", unsafe { (api.mem_host_alloc)(&mut ptr, size, CU_MEMHOSTALLOC_PORTABLE) });
        self.time.create_ns += elapsed_ns(start);
        done.map(|()| ptr as usize as u64)
    }

    pub(super) fn host_free_pinned(&mut self, ptr: u64) -> Result<()> {
        let api = host_api()?;
        let _current = self.enter()?;
        // Safety: the caller's precondition: a buffer from `host_alloc_pinned` that no queued
        // copy uses, freed once.
        check("cuMemFreeHost", unsafe { (api.mem_free_host)(ptr as usize as *mut c_void) })
    }

    pub(super) fn host_alloc_mmap(&mut self, bytes: u64) -> Result<u64> {
        let size = to_size(bytes)?;
        if size == 0 {
            return Err(Error::InvalidArgument("mmap of 0 bytes".into()));
        }
        let start = Instant::now();
        // Safety: an anonymous private mapping at an address the kernel chooses touches no
        // existing memory; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        self.time.create_ns += elapsed_ns(start);
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ENOMEM) => Error::OutOfMemory(Box::default()),
                _ => Error::Unavailable(format!("mmap of {bytes} bytes: {e}")),
            });
        }
        Ok(ptr as usize as u64)
    }

    pub(super) fn host_free_mmap(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        let size = to_size(bytes)?;
        // Safety: the caller's precondition: a mapping from `host_alloc_mmap` of exactly `bytes`
        // that no queued copy uses, unmapped once.
        if unsafe { libc::munmap(ptr as usize as *mut c_void, size) } != 0 {
            return Err(Error::Unavailable(format!("munmap: {}", std::io::Error::last_os_error())));
        }
        Ok(())
    }

    /// Writes `bytes` at host address `host` to `file` at `offset`.
    pub(super) fn write_host_to_file(&mut self, host: u64, bytes: u64, file: &File, offset: u64) -> Result<()> {
        let size = to_size(bytes)?;
        // Safety: the heap passes a range inside one of its own host buffers (live until it
        // frees them) that no queued copy writes (it waited for the copy stream's event).
        let data = unsafe { std::slice::from_raw_parts(host as usize as *const u8, size) };
        file.write_all_at(data, offset).map_err(|e| Error::Unavailable(format!("write: {e}")))
    }

    /// Reads `bytes` of `file` at `offset` into host address `host`.
    pub(super) fn read_file_to_host(&mut self, file: &File, offset: u64, host: u64, bytes: u64) -> Result<()> {
        let size = to_size(bytes)?;
        // Safety: as `write_host_to_file`; no queued copy reads or writes the range, and nothing
        // else in this process holds a reference into the heap's host buffers.
        let data = unsafe { std::slice::from_raw_parts_mut(host as usize as *mut u8, size) };
        file.read_exact_at(data, offset).map_err(|e| Error::Unavailable(format!("read: {e}")))
    }

    /// Queues one copy on the copy stream: to the host when `to_host`.
    pub(super) fn queue_copy(&mut self, device: u64, host: u64, bytes: u64, to_host: bool) -> Result<()> {
        let api = host_api()?;
        let _current = self.enter()?;
        let stream = self.copy_stream()?;
        let size = to_size(bytes)?;
        let start = Instant::now();
        let host_ptr = host as usize as *mut c_void;
        // Safety: the heap copies only between mapped pages of its own blocks and its own pinned
        // buffers, sized by it; both stay valid until it waited for the copy stream's event.
        let done = if to_host {
            check("cuMemcpyDtoHAsync", unsafe { (api.memcpy_dtoh_async)(host_ptr, device, size, stream) })
        } else {
            check("cuMemcpyHtoDAsync", unsafe { (api.memcpy_htod_async)(device, host_ptr, size, stream) })
        };
        self.time.event_ns += elapsed_ns(start);
        done
    }

    /// An event on the copy stream, after the copies queued so far.
    pub(super) fn record_on_copy_stream(&mut self) -> Result<Event> {
        let _current = self.enter()?;
        let stream = self.copy_stream()?;
        let own = self.context()?;
        let start = Instant::now();
        let recorded = self.record_in(own, true, Stream(stream as usize as u64));
        self.time.event_ns += elapsed_ns(start);
        recorded
    }
}

#[cfg(test)]
mod tests {
    //! Over a CUDA driver (testdrv's host-memory one with `STEPALLOC_HOSTCUDA=1`, or a device with
    //! `STEPALLOC_GPU_TESTS=1`), like the backend's other tests: bytes written into tagged
    //! tensors survive a pause with backup and a resume at the same addresses, and the memory is
    //! back in `cuMemGetInfo` when pause returns.
    use super::super::open_devices;
    use super::super::tools::DeviceTools;
    use super::*;
    use crate::allocator::Allocator;
    use crate::backend::Backend;
    use crate::config::Config;
    use crate::units::MIB;

    fn devices(test: &str) -> Option<Vec<CudaDevice>> {
        let on = |name: &str| std::env::var(name).as_deref() == Ok("1");
        if !on("STEPALLOC_GPU_TESTS") && !on("STEPALLOC_HOSTCUDA") {
            eprintln!("skipped {test}: set STEPALLOC_GPU_TESTS=1 or STEPALLOC_HOSTCUDA=1 to run it");
            return None;
        }
        match open_devices() {
            Ok(d) => Some(d),
            Err(e) => {
                assert!(!on("STEPALLOC_HOSTCUDA"), "STEPALLOC_HOSTCUDA=1 but no usable driver: {e}");
                eprintln!("skipped {test}: {e}");
                None
            }
        }
    }

    /// Fills `[ptr, ptr + bytes)` (whole words) with `value`.
    fn write(tools: &DeviceTools, ptr: u64, bytes: u64, value: u32) {
        tools.memset_d32(ptr, value, (bytes / 4) as usize).unwrap();
    }

    /// Whether every whole word of `[ptr, ptr + bytes)` holds `value`.
    fn holds(tools: &DeviceTools, ptr: u64, bytes: u64, value: u32) -> bool {
        let mut data = vec![0u8; (bytes / 4 * 4) as usize];
        tools.copy_to_host(&mut data, ptr).unwrap();
        data.chunks_exact(4).all(|w| u32::from_ne_bytes([w[0], w[1], w[2], w[3]]) == value)
    }

    #[test]
    fn host_backed_up_bytes_survive_pause_and_resume_at_the_same_addresses() {
        let test = "host_backed_up_bytes_survive_pause_and_resume_at_the_same_addresses";
        for conf in ["", ",expandable_segments:True"] {
            let Some(devs) = devices(test) else { return };
            let tools = DeviceTools::open(0).unwrap();
            let config = Config::parse(&format!("backend:cuda{conf}")).unwrap();
            let a =
                Allocator::with_backends(config, devs.into_iter().map(|d| Box::new(d) as Box<dyn Backend>).collect());
            crate::tags::enter("cuda_host_weights", true).unwrap();
            let sizes = [3 * MIB + 100, 4096, 40 * MIB, 1000];
            let weights: Vec<(u64, u64)> = sizes.iter().map(|&s| (a.malloc(0, s, Stream(0)).unwrap(), s)).collect();
            crate::tags::exit().unwrap();
            crate::tags::enter("cuda_host_kv", false).unwrap();
            let kv = a.malloc(0, 64 * MIB, Stream(0)).unwrap();
            crate::tags::exit().unwrap();
            for (i, &(p, s)) in weights.iter().enumerate() {
                write(&tools, p, s, 0xA5A5_0000 + i as u32);
            }
            let (free_before, _) = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap();
            let r = a.pause(None, None).unwrap();
            let (free_after, _) = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap();
            assert!(free_after >= free_before + 100 * MIB, "{conf}: {free_before} -> {free_after}: {r:?}");
            assert_eq!(r.copied_bytes, sizes.iter().sum::<u64>());
            // Memory given back may come back to anyone, uncleared: overwrite what it can.
            let other = a.malloc(0, 128 * MIB, Stream(0)).unwrap();
            write(&tools, other, 128 * MIB, 0xDEAD_BEEF);
            let r = a.resume(None).unwrap();
            a.free(0, other, 128 * MIB).unwrap();
            assert_eq!(r.copied_bytes, sizes.iter().sum::<u64>());
            a.check_invariants().unwrap();
            for (i, &(p, s)) in weights.iter().enumerate() {
                assert!(holds(&tools, p, s, 0xA5A5_0000 + i as u32), "{conf}: block {i} at {p:#x} lost its bytes");
                a.free(0, p, s).unwrap();
            }
            a.free(0, kv, 64 * MIB).unwrap();
            a.release_backup().unwrap();
            a.empty_cache().unwrap();
            assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0);
        }
    }

    /// Files in `dir`.
    fn count_files(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir).unwrap().count()
    }

    #[test]
    fn mmap_and_disk_backed_up_bytes_survive_pause_and_resume() {
        use crate::tags::{self, Store};
        let test = "mmap_and_disk_backed_up_bytes_survive_pause_and_resume";
        let _dir = crate::heap::backup::TEST_DIR_LOCK.lock();
        let dir = std::env::temp_dir().join(format!("stepalloc-cuda-disk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for conf in ["", ",expandable_segments:True"] {
            let Some(devs) = devices(test) else { return };
            crate::heap::set_backup_dir(dir.to_str().unwrap()).unwrap();
            let tools = DeviceTools::open(0).unwrap();
            let config = Config::parse(&format!("backend:cuda{conf}")).unwrap();
            let a =
                Allocator::with_backends(config, devs.into_iter().map(|d| Box::new(d) as Box<dyn Backend>).collect());
            // More than one disk staging buffer (64 MiB), odd sizes, a small one; one tag.
            let sizes = [3 * MIB + 100, 4096, 70 * MIB + 12, 1000];
            let mut blocks = Vec::new();
            for store in [Store::Mmap, Store::Disk] {
                tags::enter_with("cuda_host_stores", store).unwrap();
                blocks.extend(sizes.iter().map(|&s| (a.malloc(0, s, Stream(0)).unwrap(), s)));
                tags::exit().unwrap();
            }
            for (i, &(p, s)) in blocks.iter().enumerate() {
                write(&tools, p, s, 0x5A5A_0000 + i as u32);
            }
            let (free_before, _) = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap();
            let total: u64 = 2 * sizes.iter().sum::<u64>();
            let r = a.pause(None, None).unwrap();
            let (free_after, _) = a.with_heap(0, |h| h.device_mem_info()).unwrap().unwrap();
            assert!(free_after >= free_before + 140 * MIB, "{conf}: {free_before} -> {free_after}: {r:?}");
            assert_eq!(r.copied_bytes, total);
            assert_eq!(count_files(&dir), sizes.len(), "{conf}: a file per disk-backed block");
            // Pinned: only the disk store's staging; the mmap store's bytes are pageable.
            let f = a.tag_figures().into_iter().find(|f| f.tag == "cuda_host_stores").unwrap();
            assert!(f.mmap_bytes >= sizes.iter().sum::<u64>() && f.host_bytes == 0, "{conf}: {f:?}");
            assert_eq!(f.disk_bytes, sizes.iter().sum::<u64>());
            // The mmap store's backup is readable host memory (get_cpu_backup); the disk's is not.
            let host = a.backup_host_address(blocks[0].0, 4).expect("an mmap backup in host memory");
            // Safety (test): a live backup buffer of at least 4 bytes, read once.
            let word = unsafe { std::ptr::read_unaligned(host as usize as *const u32) };
            assert_eq!(word, 0x5A5A_0000);
            assert_eq!(a.backup_host_address(blocks[sizes.len()].0, 4), None);
            let other = a.malloc(0, 256 * MIB, Stream(0)).unwrap();
            write(&tools, other, 256 * MIB, 0xDEAD_BEEF);
            a.free(0, other, 256 * MIB).unwrap();
            let r = a.resume(None).unwrap();
            assert_eq!(r.copied_bytes, total);
            assert_eq!(count_files(&dir), 0, "{conf}: files left after resume");
            a.check_invariants().unwrap();
            for (i, &(p, s)) in blocks.iter().enumerate() {
                assert!(holds(&tools, p, s, 0x5A5A_0000 + i as u32), "{conf}: block {i} at {p:#x} lost its bytes");
                a.free(0, p, s).unwrap();
            }
            a.release_backup().unwrap();
            a.empty_cache().unwrap();
            assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn host_pinned_buffers_and_copy_events() {
        let Some(mut devs) = devices("host_pinned_buffers_and_copy_events") else { return };
        let dev = &mut devs[0];
        let host = dev.host_alloc(4 * MIB).unwrap();
        let ptr = dev.reserve(4 * MIB).unwrap();
        dev.copy_to_device(ptr, host, 4 * MIB).unwrap();
        dev.copy_to_host(host, ptr, 4 * MIB).unwrap();
        let event = dev.record_copy_event().unwrap();
        dev.wait_event(event).unwrap();
        dev.free_event(event);
        dev.release(ptr, 4 * MIB).unwrap();
        dev.host_free(host, 4 * MIB).unwrap();
    }
}
