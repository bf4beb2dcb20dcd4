//! CUDA IPC on the CUDA backend: legacy handles of `cuMemAlloc` reservations, and POSIX file
//! descriptors of `cuMemCreate` chunks, which another process takes with `pidfd_getfd` (as
//! PyTorch's expandable segments are shared). Layer: part of the CUDA backend, called through
//! `Backend`'s IPC methods under the device lock.
//!
//! Invariants:
//! - A chunk is exported once: its descriptor stays open in `CudaDevice::exported` (the receiver
//!   takes it from this process's descriptor table, later) and is closed when the chunk is
//!   released (`forget_export`), as PyTorch closes its own when it unmaps a page.
//! - Descriptors taken from another process are closed once the driver imported them.
//! - Only memory created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested can be
//!   exported; a device without that support shares plain segments only (a clear error).

use super::{check, CudaDevice};
use crate::backend::PhysHandle;
use crate::error::{Error, Result};
use std::ffi::{c_int, c_long, c_uint, c_void};

pub(super) const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
const CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: c_int = 103;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// Whether the device can create memory shareable as a POSIX file descriptor. A driver that
/// does not know the attribute answers an error: then it cannot.
pub(super) fn posix_fd_supported(dev: &CudaDevice) -> Result<bool> {
    let mut supported: c_int = 0;
    // Safety: one out-pointer to a local; `device` came from cuDeviceGet.
    let code = unsafe {
        (dev.api.device_get_attribute)(
            &mut supported,
            CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            dev.device,
        )
    };
    Ok(code == 0 && supported != 0)
}

pub(super) fn mem_handle(dev: &mut CudaDevice, base: u64) -> Result<[u8; 64]> {
    let _current = dev.enter()?;
    let mut handle = IpcMemHandle { reserved: [0; 64] };
    // Safety: one out-pointer to a local of the driver's layout; `base` is the caller's
    // reservation (a bad one is an error from the driver).
    check("cuIpcGetMemHandle", unsafe { (dev.api.ipc_get_mem_handle)(&mut handle, base) })?;
    Ok(handle.reserved)
}

pub(super) fn export(dev: &mut CudaDevice, handle: PhysHandle) -> Result<i32> {
    if let Some(&fd) = dev.exported.get(&handle.0) {
        return Ok(fd);
    }
    dev.vmm()?;
    if !dev.posix_fd {
        return Err(Error::Unavailable(format!(
            "device {} ({}) cannot share virtual-memory pages as POSIX file descriptors \
             (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0), so tensors in \
             expandable segments cannot be sent to another process; turn off expandable_segments",
            dev.ordinal, dev.name
        )));
    }
    let _current = dev.enter()?;
    let mut fd: c_int = -1;
    // Safety: for this handle type the driver writes one int to the out-pointer; `handle` is a
    // live chunk of ours (the heap's precondition).
    check("cuMemExportToShareableHandle", unsafe {
        (dev.api.mem_export_to_shareable_handle)(
            (&mut fd as *mut c_int).cast::<c_void>(),
            handle.0,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    dev.exported.insert(handle.0, fd);
    Ok(fd)
}

/// Closes the descriptor exported for `handle`, if any (the chunk is being released).
pub(super) fn forget_export(dev: &mut CudaDevice, handle: PhysHandle) {
    if let Some(fd) = dev.exported.remove(&handle.0) {
        // Safety: a descriptor the driver gave us and nothing else closes.
        unsafe { libc::close(fd) };
    }
}

/// Opens a legacy handle; returns the mapped address and the allocation's length there.
pub(super) fn open(dev: &mut CudaDevice, handle: &[u8; 64]) -> Result<(u64, u64)> {
    let _current = dev.enter()?;
    let mut ptr: u64 = 0;
    // Safety: one out-pointer to a local; the handle is passed by value in the driver's layout.
    check("cuIpcOpenMemHandle", unsafe {
        (dev.api.ipc_open_mem_handle)(&mut ptr, IpcMemHandle { reserved: *handle }, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    })?;
    let (mut base, mut len) = (0u64, 0usize);
    // Safety: two out-pointers to locals; `ptr` was just mapped by the driver.
    let range = check("cuMemGetAddressRange", unsafe { (dev.api.mem_get_address_range)(&mut base, &mut len, ptr) });
    match range {
        // The mapping starts at the allocation's base (the handle names a whole allocation).
        Ok(()) if base == ptr => Ok((ptr, len as u64)),
        failed => {
            // Safety: `ptr` came from cuIpcOpenMemHandle above and is closed once.
            let _ = unsafe { (dev.api.ipc_close_mem_handle)(ptr) };
            Err(failed.err().unwrap_or_else(|| {
                Error::InvalidArgument(format!("cuIpcOpenMemHandle mapped {ptr:#x} inside an allocation at {base:#x}"))
            }))
        }
    }
}

pub(super) fn close(dev: &mut CudaDevice, addr: u64) -> Result<()> {
    let _current = dev.enter()?;
    // Safety: `addr` came from `open` (the caller's precondition; the driver checks it too).
    check("cuIpcCloseMemHandle", unsafe { (dev.api.ipc_close_mem_handle)(addr) })
}

fn os_error(what: &str, pid: i32) -> Error {
    let err = std::io::Error::last_os_error();
    let hint = if err.raw_os_error() == Some(libc::ENOSYS) {
        " (the kernel lacks it: Linux 5.6 or newer is needed to receive tensors from expandable segments)"
    } else if err.raw_os_error() == Some(libc::EPERM) {
        " (not allowed to take descriptors of that process: another user, or ptrace restricted by Yama)"
    } else {
        ""
    };
    Error::Unavailable(format!("{what} of process {pid}: {err}{hint}"))
}

pub(super) fn import(dev: &mut CudaDevice, pid: i32, fd: i32) -> Result<PhysHandle> {
    dev.vmm()?;
    // Safety: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as c_long, 0 as c_long) };
    if pidfd < 0 {
        return Err(os_error("pidfd_open", pid));
    }
    // Safety: pidfd_getfd takes our pidfd, a descriptor number of that process and flags, and
    // returns a new descriptor of ours or -1.
    let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd as c_long, 0 as c_long) };
    let taken = if mine < 0 { Err(os_error("pidfd_getfd", pid)) } else { Ok(mine as c_int) };
    // Safety: our own descriptor from pidfd_open, closed once.
    unsafe { libc::close(pidfd as c_int) };
    let mine = taken?;
    let imported = dev.enter().and_then(|_current| {
        let mut handle: u64 = 0;
        // Safety: for POSIX descriptors the driver takes the descriptor as the pointer value.
        check("cuMemImportFromShareableHandle", unsafe {
            (dev.api.mem_import_from_shareable_handle)(
                &mut handle,
                mine as usize as *mut c_void,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })
        .map(|()| PhysHandle(handle))
    });
    // Safety: our descriptor from pidfd_getfd; the driver keeps its own reference.
    unsafe { libc::close(mine) };
    imported
}

#[cfg(test)]
mod tests {
    use super::super::{driver_present, open_devices};
    use crate::backend::Backend;
    use std::ffi::c_void;

    /// Exports a page, takes its descriptor back through pidfd_getfd (from this process, the
    /// receiver's path), imports and maps it at a second address: data written through one
    /// mapping is read through the other; the descriptor closes with the chunk. A legacy handle
    /// of this process is refused when opened here, as the driver documents.
    #[test]
    fn gpu_shared_pages_map_twice_and_own_handles_do_not_open() {
        let on = |name: &str| std::env::var(name).as_deref() == Ok("1");
        if !(on("STEPALLOC_GPU_TESTS") || on("STEPALLOC_HOSTCUDA")) || !driver_present() {
            eprintln!("skipped: set STEPALLOC_GPU_TESTS=1 or STEPALLOC_HOSTCUDA=1 with a driver");
            return;
        }
        let mut devices = open_devices().expect("devices");
        let dev = &mut devices[0];
        let page = dev.vm_granularity().expect("virtual memory");
        let chunk = dev.create_physical(page).expect("create");
        let fd = dev.export_physical(chunk).expect("export");
        assert_eq!(dev.export_physical(chunk).expect("export again"), fd, "exported once");
        let range = dev.reserve_address(2 * page).expect("reserve");
        dev.map(range, page, chunk).expect("map");
        let imported = dev.import_physical(std::process::id() as i32, fd).expect("import");
        dev.map(range + page, page, imported).expect("map the import");
        let written: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut read = vec![0u8; written.len()];
        {
            let _current = dev.enter().expect("enter");
            // Safety: both ranges are mapped device memory of at least 4096 bytes; the host
            // buffers live for the calls.
            unsafe {
                assert_eq!((dev.api.memcpy_htod)(range, written.as_ptr().cast::<c_void>(), written.len()), 0);
                assert_eq!((dev.api.memcpy_dtoh)(read.as_mut_ptr().cast::<c_void>(), range + page, read.len()), 0);
            }
        }
        assert_eq!(read, written, "one memory behind both mappings");
        dev.unmap(range + page, page).expect("unmap the import");
        dev.unmap(range, page).expect("unmap");
        dev.release_physical(imported).expect("release the import");
        dev.release_physical(chunk).expect("release");
        // Safety: fcntl on a descriptor number only reads its flags.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_GETFD) }, -1, "the exported descriptor closes with its chunk");
        dev.free_address(range, 2 * page).expect("free");

        let base = dev.reserve(2 << 20).expect("cuMemAlloc");
        let handle = dev.ipc_handle(base).expect("legacy handle");
        let refused = dev.ipc_open(&handle).expect_err("a handle of this process");
        assert!(refused.to_string().contains("cuIpcOpenMemHandle"), "{refused}");
        dev.release(base, 2 << 20).expect("free");
    }
}

/// The receiver's side at scale, through the heap: PyTorch's expandable segments reserve 9/8 of
/// the device's memory of address space per imported handle and run out after ~1,450 imports
/// (PyTorch #186213); stepalloc maps only the pages a handle exports.
#[cfg(test)]
mod scale_tests {
    use super::super::{driver_present, open_devices};
    use crate::config::Config;
    use crate::heap::Heap;
    use crate::ipc::Shareable;

    /// The open descriptors of this process.
    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
    }

    /// 10,000 handles (two pages each, of 101 pages another heap exported) open at once in one
    /// receiver, each range exactly the 4 MiB it names; a storage outside a mapping is refused
    /// whether or not the handle is open already, and changes nothing; the same handle opened
    /// twice maps once; closing every open unmaps everything and closes every descriptor.
    #[test]
    fn gpu_ten_thousand_imports_map_only_what_was_exported() {
        let on = |name: &str| std::env::var(name).as_deref() == Ok("1");
        if !(on("STEPALLOC_GPU_TESTS") || on("STEPALLOC_HOSTCUDA")) || !driver_present() {
            eprintln!("skipped: set STEPALLOC_GPU_TESTS=1 or STEPALLOC_HOSTCUDA=1 with a driver");
            return;
        }
        let mut devices = open_devices().expect("devices");
        let receiver_device = devices.pop().expect("a device");
        let producer_device = open_devices().expect("devices").swap_remove(0);
        let config = Config::parse("backend:cuda,expandable_segments:True,large_segment_size_mb:2").unwrap();
        let mut producer = Heap::new(0, &config, Box::new(producer_device));
        let mut receiver = Heap::new(devices.len(), &config, Box::new(receiver_device));
        let handles = 10_000;

        let page = 2u64 << 20;
        let blocks: Vec<u64> =
            (0..101).map(|_| producer.malloc(page, crate::backend::Stream::DEFAULT, None).unwrap()).collect();
        let mut fds = Vec::new();
        let mut pid = 0;
        for &b in &blocks {
            let (shared, offset) = producer.share(b).unwrap();
            assert_eq!(producer.share(b).unwrap(), (shared.clone(), offset), "the same block, the same handle");
            let Shareable::Expandable { pid: p, page: pg, fds: f } = shared else { panic!("{shared:?}") };
            assert_eq!((pg, f.len(), offset), (page, 1, 0));
            pid = p;
            fds.push(f[0]);
        }
        let pairs = (0..fds.len()).flat_map(|i| (0..fds.len()).filter(move |&j| j != i).map(move |j| (i, j)));
        let encoded: Vec<Vec<u8>> = pairs
            .take(handles)
            .map(|(i, j)| Shareable::Expandable { pid, page, fds: vec![fds[i], fds[j]] }.encode())
            .collect();

        let before = open_fds();
        let refused = receiver.open_shared(&encoded[0], page + 1, page).unwrap_err().to_string();
        assert!(refused.contains(&format!("{page} bytes at offset {}", page + 1)), "{refused}");
        assert!(refused.contains(&format!("({} bytes)", 2 * page)), "{refused}");
        assert!(receiver.shared_ranges().is_empty(), "a refused open maps nothing");
        let mut bases = Vec::with_capacity(encoded.len());
        for handle in &encoded {
            bases.push(receiver.open_shared(handle, page / 2, page).expect("open"));
        }
        let ranges = receiver.shared_ranges();
        assert_eq!(ranges.len(), handles);
        assert!(ranges.iter().all(|&(_, len, refs)| len == 2 * page && refs == 1), "only the exported pages");
        assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "disjoint ranges");
        assert_eq!(receiver.open_shared(&encoded[7], 0, 2 * page).unwrap(), bases[7], "mapped once");
        let e = receiver.open_shared(&encoded[7], 1 << 40, 1).unwrap_err().to_string();
        assert!(e.contains("1 bytes at offset 1099511627776"), "{e}");
        let mut twice = ranges.clone();
        twice.iter_mut().filter(|r| r.0 == bases[7]).for_each(|r| r.2 = 2);
        assert_eq!(receiver.shared_ranges(), twice, "the refused open changed nothing");
        receiver.close_shared(bases[7]).unwrap();
        for base in bases {
            receiver.close_shared(base).unwrap();
        }
        assert!(receiver.shared_ranges().is_empty());
        assert_eq!(open_fds(), before, "every imported descriptor closed");
        for b in blocks {
            producer.free(b, page).unwrap();
        }
    }
}
