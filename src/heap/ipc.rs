//! Sharing blocks with other processes (CUDA IPC) as PyTorch's own allocator does, and opening
//! what another process shared (stepalloc or PyTorch). Part of the heap: runs under the device
//! lock, `&mut self` throughout; the handle format is `crate::ipc`'s.
//!
//! - A block of a plain segment goes as the segment's `cudaIpcMemHandle_t` (a `cuMemAlloc`
//!   reservation) and the block's offset in it.
//! - A block of an expandable segment goes as the pages it touches — one exported POSIX file
//!   descriptor per page, all of the segment's page size — and its offset from the first page.
//!   Those pages stay mapped while the block is allocated: only whole pages inside free blocks
//!   are ever unmapped or moved (`page_reuse`), and a page the block touches is not one.
//! - Keeping a shared block allocated while a receiver holds it is the caller's part (PyTorch's
//!   reference counter in shared memory; `python_shim/stepalloc/ipc.py` holds the storage),
//!   which says when receivers are done (`unshare`). Until then the block is counted as shared,
//!   and a pause of its tag is refused: a receiver keeps the pages it mapped, so a pause and
//!   resume would give the two processes different memory behind one tensor.
//! - Opened ranges are cached by handle bytes and counted, as PyTorch caches its
//!   `ipcMemHandle_to_devptr`: the same handle opened twice maps once.
//! - A receiver maps only what the handle names (the pages exported, or the one allocation of a
//!   legacy handle), never a device-sized reservation, and every open checks the storage's
//!   offset and size, which travel beside the handle, against the mapped length: memory outside
//!   the mapping is never handed out.

use super::Heap;
use crate::backend::PhysHandle;
use crate::error::{Error, Result};
use crate::ipc::Shareable;
use crate::segment::BlockId;
use rustc_hash::FxHashMap;

/// Ranges this heap mapped from other processes, and blocks it shared.
#[derive(Default)]
pub(crate) struct IpcState {
    /// Blocks shared and not yet let go of by their receivers: start address, shares.
    shared: FxHashMap<u64, u32>,
    /// By address in this process.
    opened: FxHashMap<u64, Opened>,
    /// The address of each open handle (its bytes).
    by_handle: FxHashMap<Vec<u8>, u64>,
}

struct Opened {
    handle: Vec<u8>,
    /// Bytes mapped at the base.
    len: u64,
    /// Opens not yet closed.
    refs: u32,
    /// `None`: a legacy handle (the driver unmaps it); else the imported pages of `page` bytes.
    pages: Option<(u64, Vec<PhysHandle>)>,
}

impl Heap {
    /// The handle and the offset in it that PyTorch's `shareIpcHandle` gives for the allocated
    /// block at `ptr` (its start, as a storage's data pointer is).
    pub fn share(&mut self, ptr: u64) -> Result<(Shareable, u64)> {
        let id = self.arena.find_allocated(ptr).ok_or(Error::UnknownPointer { device: self.device, ptr })?;
        if let Some(refused) = self.share_refusal(ptr, id) {
            return Err(refused);
        }
        let block = self.arena.block(id).clone();
        let seg = self.arena.segment(block.segment).clone();
        let shared = if !seg.expandable() {
            let handle = self.backend.ipc_handle(seg.addr)?;
            (Shareable::Legacy(handle), block.addr - seg.addr)
        } else {
            self.share_pages(&block, &seg)?
        };
        let shares = self.ipc.shared.entry(ptr).or_insert(0);
        *shares = shares.saturating_add(1);
        Ok(shared)
    }

    /// Receivers of one share of the block at `ptr` let go of it (its counter fell to zero): once
    /// every share is let go of, its tag may pause again. A pointer not shared is an error.
    pub fn unshare(&mut self, ptr: u64) -> Result<()> {
        let Some(shares) = self.ipc.shared.get_mut(&ptr) else {
            return Err(Error::UnknownPointer { device: self.device, ptr });
        };
        *shares -= 1;
        if *shares == 0 {
            self.ipc.shared.remove(&ptr);
        }
        Ok(())
    }

    /// The live blocks of `tag` that other processes may still hold: how many, and their bytes.
    pub fn shared_of_tag(&self, tag: crate::tags::TagId) -> (usize, u64) {
        let blocks = self.ipc.shared.keys().filter_map(|&ptr| self.arena.find_allocated(ptr));
        let of_tag = blocks.filter(|&id| self.arena.segment(self.arena.block(id).segment).tag == tag);
        of_tag.fold((0, 0), |(n, bytes), id| (n + 1, bytes + self.arena.block(id).size))
    }

    /// The pages of an expandable segment's block, as one descriptor each.
    fn share_pages(
        &mut self,
        block: &crate::segment::Block,
        seg: &crate::segment::Segment,
    ) -> Result<(Shareable, u64)> {
        let ptr = block.addr;
        let first = (block.addr - seg.addr) / seg.page;
        let end = (block.addr - seg.addr + block.size).div_ceil(seg.page);
        let pages = self.pages.get(&block.segment).map(|p| p.as_slice()).unwrap_or(&[]);
        let handles: Option<Vec<PhysHandle>> = (first..end).map(|i| pages.get(i as usize).copied().flatten()).collect();
        let handles = handles.ok_or_else(|| {
            Error::InvalidArgument(format!("block {ptr:#x} lies on a page that is not mapped (a stepalloc bug)"))
        })?;
        let mut fds = Vec::with_capacity(handles.len());
        for handle in handles {
            fds.push(self.backend.export_physical(handle)?);
        }
        let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        Ok((Shareable::Expandable { pid, page: seg.page, fds }, block.addr - (seg.addr + first * seg.page)))
    }

    /// Why the block must not be shared now, if so: its tag is paused (`sleep`), so its memory
    /// is not on the device — a receiver would map pages the producer gave back.
    fn share_refusal(&self, ptr: u64, id: BlockId) -> Option<Error> {
        let tag = self.arena.segment(self.arena.block(id).segment).tag;
        self.sleep.is_paused(tag).then(|| {
            Error::Paused(format!(
                "the tensor at {ptr:#x} on device {} has tag {:?}, which is paused: its memory is off the \
                 device, so it cannot be shared with another process; resume the tag first \
                 (stepalloc.resume({:?}))",
                self.device,
                crate::tags::name(tag),
                crate::tags::name(tag)
            ))
        })
    }

    /// Maps a range another process shared (`handle`: PyTorch's bytes) for the storage of
    /// `size` bytes at `offset` in it, and returns the range's base here (the caller adds the
    /// offset and closes the base). A storage that does not lie inside the mapping is refused
    /// and the open undone, so a refused open changes nothing.
    pub fn open_shared(&mut self, handle: &[u8], offset: u64, size: u64) -> Result<u64> {
        if let Some(&base) = self.ipc.by_handle.get(handle) {
            if let Some(opened) = self.ipc.opened.get_mut(&base) {
                crate::ipc::check_range(offset, size, opened.len)?;
                opened.refs = opened.refs.checked_add(1).ok_or_else(|| {
                    Error::InvalidArgument(format!("CUDA IPC: the range at {base:#x} is open {} times", u32::MAX))
                })?;
                return Ok(base);
            }
        }
        let (base, len, pages) = match Shareable::parse(handle)? {
            Shareable::Legacy(h) => {
                let (base, len) = self.backend.ipc_open(&h)?;
                if let Err(e) = crate::ipc::check_range(offset, size, len) {
                    // Best effort: the refusal is the error worth reporting.
                    let _ = self.backend.ipc_close(base);
                    return Err(e);
                }
                (base, len, None)
            }
            Shareable::Expandable { pid, page, fds } => {
                // The length is known before anything is mapped.
                let len = page.saturating_mul(fds.len() as u64);
                crate::ipc::check_range(offset, size, len)?;
                let (base, handles) = self.map_shared_pages(pid, page, &fds)?;
                (base, len, Some((page, handles)))
            }
        };
        self.ipc.by_handle.insert(handle.to_vec(), base);
        self.ipc.opened.insert(base, Opened { handle: handle.to_vec(), len, refs: 1, pages });
        Ok(base)
    }

    /// The ranges other processes shared that are open here: (base, bytes mapped, opens).
    pub fn shared_ranges(&self) -> Vec<(u64, u64, u32)> {
        let mut ranges: Vec<_> = self.ipc.opened.iter().map(|(&base, o)| (base, o.len, o.refs)).collect();
        ranges.sort_unstable();
        ranges
    }

    /// Closes one open of the range at `base`; the last one unmaps it.
    pub fn close_shared(&mut self, base: u64) -> Result<()> {
        let opened = self.ipc.opened.get_mut(&base).ok_or(Error::UnknownPointer { device: self.device, ptr: base })?;
        opened.refs -= 1;
        if opened.refs > 0 {
            return Ok(());
        }
        let Some(opened) = self.ipc.opened.remove(&base) else { return Ok(()) };
        self.ipc.by_handle.remove(&opened.handle);
        match opened.pages {
            None => self.backend.ipc_close(base),
            Some((page, handles)) => {
                // As PyTorch's expandable segments: unmapping does not wait for queued work.
                self.backend.synchronize()?;
                let size = page * handles.len() as u64;
                self.unmap_shared_pages(base, size, page, &handles, handles.len())
            }
        }
    }

    /// Imports `fds` of process `pid` and maps them one after the other in a new range.
    fn map_shared_pages(&mut self, pid: i32, page: u64, fds: &[i32]) -> Result<(u64, Vec<PhysHandle>)> {
        let granularity = self.backend.vm_granularity()?;
        let size = page.checked_mul(fds.len() as u64).filter(|_| granularity > 0 && page % granularity == 0);
        let size = size.ok_or_else(|| {
            Error::InvalidArgument(format!("{} pages of {page} bytes (granularity {granularity})", fds.len()))
        })?;
        let base = self.backend.reserve_address(size)?;
        let mut handles = Vec::with_capacity(fds.len());
        let mut mapped = 0;
        let mut failed = None;
        for (i, &fd) in fds.iter().enumerate() {
            match self.backend.import_physical(pid, fd) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            if let Err(e) = self.backend.map(base + i as u64 * page, page, handles[i]) {
                failed = Some(e);
                break;
            }
            mapped += 1;
        }
        if let Some(e) = failed {
            // Best effort: the first error is the one worth reporting.
            let _ = self.unmap_shared_pages(base, size, page, &handles, mapped);
            return Err(e);
        }
        Ok((base, handles))
    }

    /// Unmaps the first `mapped` pages, releases every imported chunk and frees the range
    /// (`size` bytes at `base`).
    fn unmap_shared_pages(
        &mut self,
        base: u64,
        size: u64,
        page: u64,
        handles: &[PhysHandle],
        mapped: usize,
    ) -> Result<()> {
        let mut first_error = Ok(());
        for i in 0..mapped {
            let done = self.backend.unmap(base + i as u64 * page, page);
            first_error = first_error.and(done);
        }
        for &h in handles {
            first_error = first_error.and(self.backend.release_physical(h));
        }
        first_error.and(self.backend.free_address(base, size))
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sim::SimDevice;
    use crate::backend::Stream;
    use crate::config::Config;
    use crate::heap::Heap;
    use crate::ipc::Shareable;

    const MIB: u64 = 1 << 20;

    fn heap(conf: &str) -> Heap {
        let config = Config::parse(conf).unwrap();
        Heap::new(0, &config, Box::new(SimDevice::new(0, &config.sim)))
    }

    #[test]
    fn plain_blocks_go_as_their_segments_handle_and_offset() {
        let mut h = heap("backend:sim");
        let a = h.malloc(1000, Stream::DEFAULT, None).unwrap();
        let b = h.malloc(1000, Stream::DEFAULT, None).unwrap();
        let (sa, oa) = h.share(a).unwrap();
        let (sb, ob) = h.share(b).unwrap();
        assert_eq!(sa, sb, "one segment, one handle");
        let Shareable::Legacy(handle) = sa else { panic!("{sa:?}") };
        let base = u64::from_ne_bytes(handle[..8].try_into().unwrap());
        assert_eq!((base + oa, base + ob), (a, b));
        assert!(h.share(a + 512).is_err(), "only a block's start");
    }

    #[test]
    fn expandable_blocks_go_as_the_pages_they_touch() {
        let mut h = heap("backend:sim,expandable_segments:True,large_segment_size_mb:2");
        // 3 MiB + 3 MiB: the second starts in the middle of the second page.
        let a = h.malloc(3 * MIB, Stream::DEFAULT, None).unwrap();
        let b = h.malloc(3 * MIB, Stream::DEFAULT, None).unwrap();
        let (sa, oa) = h.share(a).unwrap();
        let (sb, ob) = h.share(b).unwrap();
        let Shareable::Expandable { page, fds: fa, pid } = sa else { panic!("{sa:?}") };
        assert_eq!((page, pid), (2 * MIB, std::process::id() as i32));
        assert_eq!((fa.len(), oa), (2, 0));
        let Shareable::Expandable { fds: fb, .. } = sb else { panic!("{sb:?}") };
        assert_eq!((fb.len(), ob), (2, MIB));
        assert_eq!(fb[0], fa[1], "the page both touch is one chunk");
        assert!(h.open_shared(&Shareable::Expandable { pid: 1, page: 2 * MIB, fds: fa }.encode(), 0, 1).is_err());
    }
}
