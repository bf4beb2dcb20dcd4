//! The simulated device: a part of the product, not a test double. It gives machines without a
//! GPU the whole allocator — CI, the stress tool, replaying a user's snapshot on a laptop.
//!
//! It models a device of a set capacity with its own address space, events that complete a set
//! time after they are recorded, failure injection, and an optional cost model that charges
//! each driver call a modelled time. Time is virtual: it advances only through the cost model,
//! `advance_time`, and waits, so every run with the same inputs is the same run.
//!
//! Two timelines under the cost model: the host's (`now_ns`: each driver call moves it by its
//! cost, a wait moves it to the awaited completion) and the copy engine's (`copy_done_ns`: a
//! copy starts when the host queues it or when the copy before it ends, whichever is later,
//! and takes its bytes at `sim_copy_mb_s`). So whether the host's calls run under the copies
//! or after them follows from the order the allocator makes them in. A stream's
//! synchronization waits for the compute streams' events, not for the copy stream's (which is
//! a stream of its own, as on a GPU); a device synchronization waits for both.

use super::{Backend, DeviceInfo, DriverTime, Event, PhysHandle, Stream};
use crate::config::SimConfig;
use crate::error::{Error, OomReport, Result};
use crate::units::MIB;
use std::collections::BTreeMap;

/// Each device's addresses live in their own 16 TiB window, so devices never share an address.
const ADDRESS_WINDOW: u64 = 1 << 44;
/// Reservations are aligned like large `cuMemAlloc` results.
const ALIGNMENT: u64 = 2 * MIB;

/// Modelled driver costs (ns), in the range measured for cuMemAlloc / cuMemFree on recent GPUs.
const COST_RESERVE_NS: u64 = 20_000;
const COST_RESERVE_PER_GIB_NS: u64 = 5_000;
const COST_RELEASE_NS: u64 = 40_000;
const COST_EVENT_RECORD_NS: u64 = 2_000;
const COST_EVENT_QUERY_NS: u64 = 1_000;
/// Virtual-memory calls (open question until measured on a GPU; see docs/performance.md): published
/// measurements put cuMemCreate of a 2 MiB chunk at tens of microseconds, cuMemMap plus
/// cuMemSetAccess of one chunk at about 10 µs, cuMemUnmap similar, and an idle
/// cuStreamSynchronize at a few microseconds.
const COST_ADDRESS_NS: u64 = 5_000;
const COST_CREATE_NS: u64 = 20_000;
const COST_CREATE_PER_GIB_NS: u64 = 5_000;
const COST_RELEASE_PHYSICAL_NS: u64 = 10_000;
const COST_MAP_NS: u64 = 10_000;
const COST_UNMAP_NS: u64 = 10_000;
const COST_SYNC_NS: u64 = 5_000;
/// Host backups: a copy over the host link at `sim_copy_mb_s` (default 25 GiB/s,
/// `config::DEFAULT_SIM_COPY_BYTES_PER_S`: PCIe 5 x16 in practice, about what a pinned `copy_()`
/// reaches on an H100), plus a per-call cost like an async memcpy's launch.
const COST_COPY_CALL_NS: u64 = 3_000;
/// A pinned host allocation: about 1 ms per GiB (page pinning), the cost the backup buffers
/// are kept to avoid.
const COST_HOST_ALLOC_NS: u64 = 50_000;
const COST_HOST_ALLOC_PER_GIB_NS: u64 = 1_000_000;
/// Host buffers get addresses in a window of their own, apart from every device's.
const HOST_WINDOW: u64 = 1 << 62;
/// Virtual-memory granularity, as `cuMemGetAllocationGranularity` reports on current GPUs.
pub const GRANULARITY: u64 = 2 * MIB;

/// A physical chunk: counted against capacity until released and mapped nowhere.
struct Physical {
    bytes: u64,
    mappings: u32,
    released: bool,
}

/// One `map`: a whole chunk at an address.
struct Mapping {
    bytes: u64,
    handle: u64,
}

/// A failed file call, with the system's reason.
fn io_error(call: &str, e: std::io::Error) -> Error {
    Error::Unavailable(format!("{call}: {e}"))
}

fn invalid(call: &'static str) -> Error {
    Error::Driver { call, code: "CUDA_ERROR_INVALID_VALUE".into() }
}

pub struct SimDevice {
    index: usize,
    config: SimConfig,
    used: u64,
    /// Live reservations: start -> size. Invariant: ranges are disjoint and inside the window.
    live: BTreeMap<u64, u64>,
    /// Where the next address search starts (a rotating first fit, so freed ranges are reused
    /// only after the window wraps, which makes stale pointers easy to spot).
    cursor: u64,
    reserves: u64,
    rng: u64,
    now_ns: u64,
    /// Completion time of each live event, indexed by event id; `None` marks a free slot.
    events: Vec<Option<u64>>,
    free_events: Vec<u64>,
    /// Completion time of the last event recorded on any stream, the copy stream included
    /// (what `synchronize` waits for).
    last_completion_ns: u64,
    /// Completion time of the last event recorded on a compute stream (what
    /// `synchronize_stream` waits for: the copy stream is not one of them).
    last_compute_ns: u64,
    time: DriverTime,
    /// Virtual ranges (offset -> size); also in `live`, which holds every used address range.
    ranges: BTreeMap<u64, u64>,
    /// Mappings by offset. Invariant: disjoint, each inside one range.
    mappings: BTreeMap<u64, Mapping>,
    physical: BTreeMap<u64, Physical>,
    next_handle: u64,
    /// Pinned host buffers: address -> size (the simulated device holds no bytes, so neither
    /// do they: copies are checked and timed, not performed).
    host: BTreeMap<u64, u64>,
    /// Pageable host buffers (`host_alloc_pageable`), likewise; they count against the host
    /// capacity with the pinned ones but are not pinned.
    pageable: BTreeMap<u64, u64>,
    next_host: u64,
    /// When the copy stream's queued copies complete (virtual time).
    copy_done_ns: u64,
    /// Bytes copied each way (device to host, host to device), for tests and reports.
    pub copied: [u64; 2],
}

impl SimDevice {
    pub fn new(index: usize, config: &SimConfig) -> SimDevice {
        SimDevice {
            index,
            config: config.clone(),
            used: 0,
            live: BTreeMap::new(),
            cursor: 0,
            reserves: 0,
            rng: config.seed ^ 0x9E37_79B9_7F4A_7C15 ^ (index as u64) << 32,
            now_ns: 0,
            events: Vec::new(),
            free_events: Vec::new(),
            last_completion_ns: 0,
            last_compute_ns: 0,
            time: DriverTime::default(),
            ranges: BTreeMap::new(),
            mappings: BTreeMap::new(),
            physical: BTreeMap::new(),
            next_handle: 0,
            host: BTreeMap::new(),
            pageable: BTreeMap::new(),
            next_host: HOST_WINDOW + (index as u64) * ADDRESS_WINDOW,
            copy_done_ns: 0,
            copied: [0; 2],
        }
    }

    /// Bytes of pinned host memory allocated now.
    pub fn host_bytes(&self) -> u64 {
        self.host.values().sum()
    }

    /// Bytes of pageable host memory allocated now (`host_alloc_pageable`).
    pub fn pageable_bytes(&self) -> u64 {
        self.pageable.values().sum()
    }

    /// A host buffer's address past the last one, counted against the host capacity.
    fn new_host_buffer(&mut self, bytes: u64, call: &'static str) -> Result<u64> {
        if bytes == 0 {
            return Err(invalid(call));
        }
        let held = self.host_bytes().saturating_add(self.pageable_bytes());
        if self.config.host_capacity != 0 && held.saturating_add(bytes) > self.config.host_capacity {
            return Err(Error::OutOfMemory(Box::<OomReport>::default()));
        }
        let addr = self.next_host;
        self.next_host = addr.saturating_add(bytes.div_ceil(ALIGNMENT) * ALIGNMENT);
        Ok(addr)
    }

    /// Whether `[addr, addr + bytes)` is wholly mapped device memory.
    fn mapped(&self, addr: u64, bytes: u64) -> bool {
        let offset = addr.wrapping_sub(self.base());
        let Some(end) = offset.checked_add(bytes) else { return false };
        let mut cursor = match self.mappings.range(..=offset).next_back() {
            Some((&start, m)) if start + m.bytes > offset => start + m.bytes,
            _ => return false,
        };
        if cursor >= end {
            return true;
        }
        for (&start, m) in self.mappings.range(cursor..end) {
            if start != cursor {
                return false;
            }
            cursor = start + m.bytes;
        }
        cursor >= end
    }

    /// Whether `[addr, addr + bytes)` lies in one host buffer (pinned or pageable).
    fn in_host_buffer(&self, addr: u64, bytes: u64) -> bool {
        [&self.host, &self.pageable].into_iter().any(|buffers| {
            buffers
                .range(..=addr)
                .next_back()
                .is_some_and(|(&start, &size)| addr.checked_add(bytes).is_some_and(|end| end <= start + size))
        })
    }

    /// Queues a checked copy on the copy stream: `way` 0 to the host, 1 to the device.
    fn queue_copy(&mut self, device: u64, host: u64, bytes: u64, way: usize, call: &'static str) -> Result<()> {
        let cost = self.charge(COST_COPY_CALL_NS);
        self.time.event_ns = self.time.event_ns.saturating_add(cost);
        if bytes == 0 || !self.mapped(device, bytes) || !self.in_host_buffer(host, bytes) {
            return Err(invalid(call));
        }
        if self.config.cost_model {
            let rate = u128::from(self.config.copy_bytes_per_s.max(1));
            let ns = u64::try_from(u128::from(bytes) * 1_000_000_000 / rate).unwrap_or(u64::MAX);
            self.copy_done_ns = self.copy_done_ns.max(self.now_ns).saturating_add(ns);
        }
        self.copied[way] = self.copied[way].saturating_add(bytes);
        Ok(())
    }

    fn base(&self) -> u64 {
        (self.index as u64 + 1) * ADDRESS_WINDOW
    }

    /// splitmix64: a tiny deterministic generator, enough for failure injection and small
    /// enough not to justify a dependency in the allocator core.
    fn next_random(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Charges a modelled driver call. The clock saturates at `u64::MAX` ns (585 years): an
    /// event delay or a trace's timestamps near the limit stop the clock there, never wrap it.
    fn charge(&mut self, ns: u64) -> u64 {
        if self.config.cost_model {
            self.now_ns = self.now_ns.saturating_add(ns);
            ns
        } else {
            0
        }
    }

    /// A free address range of `bytes` (aligned), searching from the cursor and wrapping once.
    fn find_range(&self, bytes: u64) -> Option<u64> {
        let span = bytes.div_ceil(ALIGNMENT) * ALIGNMENT;
        for start in [self.cursor, 0] {
            let mut candidate = start;
            for (&addr, &size) in self.live.range(start..) {
                if candidate + span <= addr {
                    return Some(candidate);
                }
                candidate = candidate.max((addr + size).div_ceil(ALIGNMENT) * ALIGNMENT);
            }
            // Addresses past the configured space (`sim_address_space_mb`) stay unused.
            if candidate + span <= self.config.address_space.min(ADDRESS_WINDOW) {
                return Some(candidate);
            }
        }
        None
    }

    /// Whether the configured failure injection fails this reserve or create.
    fn inject_failure(&mut self) -> bool {
        (self.config.fail_nth != 0 && self.reserves == self.config.fail_nth)
            || (self.config.fail_prob > 0.0 && self.next_random() < self.config.fail_prob)
    }

    /// Frees a physical chunk's bytes once it is released and mapped nowhere.
    fn drop_physical_if_unused(&mut self, handle: u64) {
        if self.physical.get(&handle).is_some_and(|p| p.released && p.mappings == 0) {
            if let Some(p) = self.physical.remove(&handle) {
                self.used -= p.bytes;
            }
        }
    }

    fn event_slot(&self, event: Event) -> Result<u64> {
        match self.events.get(event.0 as usize) {
            Some(Some(done)) => Ok(*done),
            _ => Err(Error::Driver { call: "cuEventQuery", code: "CUDA_ERROR_INVALID_HANDLE".into() }),
        }
    }
}

impl Backend for SimDevice {
    fn info(&self) -> DeviceInfo {
        DeviceInfo { name: format!("stepalloc simulated device {}", self.index), total_bytes: self.config.capacity }
    }

    fn mem_info(&mut self) -> Result<(u64, u64)> {
        Ok((self.config.capacity - self.used, self.config.capacity))
    }

    fn reserve(&mut self, bytes: u64) -> Result<u64> {
        self.reserves += 1;
        let cost = self.charge(COST_RESERVE_NS + COST_RESERVE_PER_GIB_NS * (bytes >> 30));
        self.time.reserve_ns = self.time.reserve_ns.saturating_add(cost);
        if self.inject_failure() || bytes > self.config.capacity - self.used {
            return Err(Error::OutOfMemory(Box::<OomReport>::default()));
        }
        let Some(offset) = self.find_range(bytes) else {
            return Err(Error::Driver { call: "cuMemAlloc", code: "simulated address space exhausted".into() });
        };
        self.live.insert(offset, bytes);
        self.cursor = offset + bytes.div_ceil(ALIGNMENT) * ALIGNMENT;
        self.used += bytes;
        Ok(self.base() + offset)
    }

    fn release(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        let cost = self.charge(COST_RELEASE_NS);
        self.time.release_ns = self.time.release_ns.saturating_add(cost);
        let offset = ptr.wrapping_sub(self.base());
        match self.live.get(&offset) {
            Some(&size) if size == bytes && !self.ranges.contains_key(&offset) => {
                self.live.remove(&offset);
                self.used -= bytes;
                Ok(())
            }
            _ => Err(Error::Driver { call: "cuMemFree", code: "CUDA_ERROR_INVALID_VALUE".into() }),
        }
    }

    fn record_event(&mut self, _stream: Stream) -> Result<Event> {
        let cost = self.charge(COST_EVENT_RECORD_NS);
        self.time.event_ns = self.time.event_ns.saturating_add(cost);
        // Saturating: a delay near u64::MAX must make the event complete (almost) never, not
        // wrap into the past and complete at once while the block is still in use.
        let done = self.now_ns.saturating_add(self.config.event_delay_ns);
        self.last_completion_ns = self.last_completion_ns.max(done);
        self.last_compute_ns = self.last_compute_ns.max(done);
        let id = match self.free_events.pop() {
            Some(id) => {
                self.events[id as usize] = Some(done);
                id
            }
            None => {
                self.events.push(Some(done));
                self.events.len() as u64 - 1
            }
        };
        Ok(Event(id))
    }

    fn event_done(&mut self, event: Event) -> Result<bool> {
        let cost = self.charge(COST_EVENT_QUERY_NS);
        self.time.event_ns = self.time.event_ns.saturating_add(cost);
        Ok(self.event_slot(event)? <= self.now_ns)
    }

    fn wait_event(&mut self, event: Event) -> Result<()> {
        let done = self.event_slot(event)?;
        if done > self.now_ns {
            self.time.sync_ns = self.time.sync_ns.saturating_add(done - self.now_ns);
            self.now_ns = done;
        }
        Ok(())
    }

    fn free_event(&mut self, event: Event) {
        if let Some(slot @ Some(_)) = self.events.get_mut(event.0 as usize) {
            *slot = None;
            self.free_events.push(event.0);
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        if self.last_completion_ns > self.now_ns {
            self.time.sync_ns = self.time.sync_ns.saturating_add(self.last_completion_ns - self.now_ns);
            self.now_ns = self.last_completion_ns;
        }
        Ok(())
    }

    fn driver_time(&self) -> DriverTime {
        self.time
    }

    fn vm_granularity(&mut self) -> Result<u64> {
        Ok(GRANULARITY)
    }

    fn reserve_address(&mut self, bytes: u64) -> Result<u64> {
        let cost = self.charge(COST_ADDRESS_NS);
        self.time.map_ns = self.time.map_ns.saturating_add(cost);
        if bytes == 0 || bytes % GRANULARITY != 0 {
            return Err(invalid("cuMemAddressReserve"));
        }
        let Some(offset) = self.find_range(bytes) else {
            return Err(Error::OutOfMemory(Box::<OomReport>::default()));
        };
        self.live.insert(offset, bytes);
        self.ranges.insert(offset, bytes);
        self.cursor = offset + bytes;
        Ok(self.base() + offset)
    }

    fn free_address(&mut self, addr: u64, bytes: u64) -> Result<()> {
        let offset = addr.wrapping_sub(self.base());
        if self.ranges.get(&offset) != Some(&bytes) || self.mappings.range(offset..offset + bytes).next().is_some() {
            return Err(invalid("cuMemAddressFree"));
        }
        self.ranges.remove(&offset);
        self.live.remove(&offset);
        Ok(())
    }

    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle> {
        self.reserves += 1;
        let cost = self.charge(COST_CREATE_NS + COST_CREATE_PER_GIB_NS * (bytes >> 30));
        self.time.create_ns = self.time.create_ns.saturating_add(cost);
        if bytes == 0 || bytes % GRANULARITY != 0 {
            return Err(invalid("cuMemCreate"));
        }
        if self.inject_failure() || bytes > self.config.capacity - self.used {
            return Err(Error::OutOfMemory(Box::<OomReport>::default()));
        }
        self.used += bytes;
        self.next_handle += 1;
        self.physical.insert(self.next_handle, Physical { bytes, mappings: 0, released: false });
        Ok(PhysHandle(self.next_handle))
    }

    /// Names the reservation (its address in the first eight bytes); nothing can open it.
    fn ipc_handle(&mut self, base: u64) -> Result<[u8; 64]> {
        if !self.live.contains_key(&base.wrapping_sub(self.base())) {
            return Err(invalid("cuIpcGetMemHandle"));
        }
        let mut handle = [0; 64];
        handle[..8].copy_from_slice(&base.to_ne_bytes());
        Ok(handle)
    }

    /// The chunk's number stands for its descriptor.
    fn export_physical(&mut self, handle: PhysHandle) -> Result<i32> {
        match self.physical.get(&handle.0) {
            Some(p) if !p.released => i32::try_from(handle.0).map_err(|_| invalid("cuMemExportToShareableHandle")),
            _ => Err(invalid("cuMemExportToShareableHandle")),
        }
    }

    fn release_physical(&mut self, handle: PhysHandle) -> Result<()> {
        let cost = self.charge(COST_RELEASE_PHYSICAL_NS);
        self.time.create_ns = self.time.create_ns.saturating_add(cost);
        match self.physical.get_mut(&handle.0) {
            Some(p) if !p.released => p.released = true,
            _ => return Err(invalid("cuMemRelease")),
        }
        self.drop_physical_if_unused(handle.0);
        Ok(())
    }

    fn map(&mut self, addr: u64, bytes: u64, handle: PhysHandle) -> Result<()> {
        let cost = self.charge(COST_MAP_NS);
        self.time.map_ns = self.time.map_ns.saturating_add(cost);
        let offset = addr.wrapping_sub(self.base());
        let in_range = self
            .ranges
            .range(..=offset)
            .next_back()
            .is_some_and(|(&start, &size)| offset.checked_add(bytes).is_some_and(|end| end <= start + size));
        let overlaps = self
            .mappings
            .range(..offset.saturating_add(bytes))
            .next_back()
            .is_some_and(|(&start, m)| start + m.bytes > offset);
        let whole_chunk = self.physical.get(&handle.0).is_some_and(|p| !p.released && p.bytes == bytes);
        if offset % GRANULARITY != 0 || !in_range || overlaps || !whole_chunk {
            return Err(invalid("cuMemMap"));
        }
        if self.config.fail_map_prob > 0.0 && self.next_random() < self.config.fail_map_prob {
            return Err(Error::OutOfMemory(Box::<OomReport>::default()));
        }
        if let Some(p) = self.physical.get_mut(&handle.0) {
            p.mappings += 1;
        }
        self.mappings.insert(offset, Mapping { bytes, handle: handle.0 });
        Ok(())
    }

    fn unmap(&mut self, addr: u64, bytes: u64) -> Result<()> {
        let cost = self.charge(COST_UNMAP_NS);
        self.time.map_ns = self.time.map_ns.saturating_add(cost);
        let offset = addr.wrapping_sub(self.base());
        // The range must be exactly whole mappings, without gaps (cuMemUnmap's rule).
        let mut cursor = offset;
        let end = offset.checked_add(bytes).ok_or_else(|| invalid("cuMemUnmap"))?;
        let mut covered = Vec::new();
        for (&start, m) in self.mappings.range(offset..end) {
            if start != cursor || start + m.bytes > end {
                return Err(invalid("cuMemUnmap"));
            }
            cursor += m.bytes;
            covered.push(start);
        }
        if cursor != end || bytes == 0 {
            return Err(invalid("cuMemUnmap"));
        }
        for start in covered {
            if let Some(m) = self.mappings.remove(&start) {
                if let Some(p) = self.physical.get_mut(&m.handle) {
                    p.mappings -= 1;
                }
                self.drop_physical_if_unused(m.handle);
            }
        }
        Ok(())
    }

    fn synchronize_stream(&mut self, _stream: Stream) -> Result<()> {
        // Events do not record their compute stream here: waiting for every compute stream is
        // the safe bound. The copy stream is not waited for, as `cuStreamSynchronize` of another
        // stream would not.
        let cost = self.charge(COST_SYNC_NS);
        self.time.sync_ns = self.time.sync_ns.saturating_add(cost);
        if self.last_compute_ns > self.now_ns {
            self.time.sync_ns = self.time.sync_ns.saturating_add(self.last_compute_ns - self.now_ns);
            self.now_ns = self.last_compute_ns;
        }
        Ok(())
    }

    fn advance_time(&mut self, ns: u64) {
        self.now_ns = self.now_ns.saturating_add(ns);
    }

    fn host_alloc(&mut self, bytes: u64) -> Result<u64> {
        let cost = self.charge(COST_HOST_ALLOC_NS + COST_HOST_ALLOC_PER_GIB_NS * (bytes >> 30));
        self.time.create_ns = self.time.create_ns.saturating_add(cost);
        let addr = self.new_host_buffer(bytes, "cuMemHostAlloc")?;
        self.host.insert(addr, bytes);
        Ok(addr)
    }

    fn host_free(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        match self.host.get(&ptr) {
            Some(&size) if size == bytes => {
                self.host.remove(&ptr);
                Ok(())
            }
            _ => Err(invalid("cuMemFreeHost")),
        }
    }

    fn host_alloc_pageable(&mut self, bytes: u64) -> Result<u64> {
        let addr = self.new_host_buffer(bytes, "mmap")?;
        self.pageable.insert(addr, bytes);
        Ok(addr)
    }

    fn host_free_pageable(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        match self.pageable.get(&ptr) {
            Some(&size) if size == bytes => {
                self.pageable.remove(&ptr);
                Ok(())
            }
            _ => Err(invalid("munmap")),
        }
    }

    /// The simulated buffers hold no bytes: the file gets `bytes` zeros, really written, so a
    /// full disk or a file-size limit fails here as it would with a device's bytes.
    fn host_to_file(&mut self, host: u64, bytes: u64, file: &std::fs::File, offset: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if !self.in_host_buffer(host, bytes) {
            return Err(invalid("pwrite"));
        }
        let zeros = [0u8; 64 * 1024];
        let mut done = 0u64;
        while done < bytes {
            let n = (bytes - done).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], offset + done).map_err(|e| io_error("pwrite", e))?;
            done += n as u64;
        }
        Ok(())
    }

    /// Reads (and drops) `bytes` of the file: a short or unreadable file fails as it would.
    fn file_to_host(&mut self, file: &std::fs::File, offset: u64, host: u64, bytes: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if !self.in_host_buffer(host, bytes) {
            return Err(invalid("pread"));
        }
        let mut scratch = vec![0u8; bytes.min(1 << 20) as usize];
        let mut done = 0u64;
        while done < bytes {
            let n = (bytes - done).min(scratch.len() as u64) as usize;
            file.read_exact_at(&mut scratch[..n], offset + done).map_err(|e| io_error("pread", e))?;
            done += n as u64;
        }
        Ok(())
    }

    fn copy_to_host(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.queue_copy(src, dst, bytes, 0, "cuMemcpyDtoHAsync")
    }

    fn copy_to_device(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.queue_copy(dst, src, bytes, 1, "cuMemcpyHtoDAsync")
    }

    fn record_copy_event(&mut self) -> Result<Event> {
        let compute = self.last_compute_ns;
        let event = self.record_event(Stream::DEFAULT)?;
        self.last_compute_ns = compute;
        // The copy stream's event completes with its copies (and no earlier than an event on
        // any stream would).
        if let Some(Some(done)) = self.events.get_mut(event.0 as usize) {
            *done = (*done).max(self.copy_done_ns);
            self.last_completion_ns = self.last_completion_ns.max(*done);
        }
        Ok(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(conf: &str) -> SimDevice {
        SimDevice::new(0, &crate::config::Config::parse(conf).unwrap().sim)
    }

    #[test]
    fn addresses_are_aligned_disjoint_and_never_null() {
        let mut d = device("sim_capacity_mb:64");
        let a = d.reserve(2 * MIB).unwrap();
        let b = d.reserve(20 * MIB).unwrap();
        let c = d.reserve(512).unwrap();
        assert!(a != 0 && a % ALIGNMENT == 0 && b % ALIGNMENT == 0 && c % ALIGNMENT == 0);
        assert!(a + 2 * MIB <= b && b + 20 * MIB <= c);
        assert_eq!(d.mem_info().unwrap(), (64 * MIB - 22 * MIB - 512, 64 * MIB));
        assert!(d.reserve(64 * MIB).unwrap_err().is_out_of_memory());
        d.release(b, 20 * MIB).unwrap();
        assert!(d.release(b, 20 * MIB).is_err(), "double release is a driver error");
        assert_eq!(d.mem_info().unwrap().0, 64 * MIB - 2 * MIB - 512);
        let other = SimDevice::new(1, &SimConfig::default()).base();
        assert!(other > a + ADDRESS_WINDOW / 2);
    }

    #[test]
    fn failure_injection() {
        let mut d = device("sim_fail_nth:2");
        assert!(d.reserve(2 * MIB).is_ok());
        assert!(d.reserve(2 * MIB).unwrap_err().is_out_of_memory());
        assert!(d.reserve(2 * MIB).is_ok());
        let mut d = device("sim_fail_prob:0.5,sim_seed:7");
        let failures = (0..1000).filter(|_| d.reserve(512).is_err()).count();
        assert!((400..600).contains(&failures), "{failures}");
    }

    #[test]
    fn events_complete_after_the_delay() {
        let mut d = device("sim_event_delay_us:10");
        let e = d.record_event(Stream(1)).unwrap();
        assert!(!d.event_done(e).unwrap());
        d.advance_time(9_999);
        assert!(!d.event_done(e).unwrap());
        d.advance_time(1);
        assert!(d.event_done(e).unwrap());
        let f = d.record_event(Stream(2)).unwrap();
        d.wait_event(f).unwrap();
        assert!(d.event_done(f).unwrap());
        assert_eq!(d.driver_time().sync_ns, 10_000);
        d.free_event(e);
        assert!(d.event_done(e).is_err(), "a freed event is not live");
    }

    #[test]
    fn a_huge_event_delay_never_completes_at_once() {
        // now + delay must not wrap in a release build: the event would be complete at once
        // and its block reused while another stream still used it.
        let mut d = device("sim_event_delay_us:18446744073709551,sim_cost_model:True");
        d.reserve(2 * MIB).unwrap(); // the cost model moves the clock past 0
        let e = d.record_event(Stream(1)).unwrap();
        assert!(!d.event_done(e).unwrap());
        d.advance_time(u64::MAX / 2);
        assert!(!d.event_done(e).unwrap());
        // The clock saturates at its end instead of wrapping back.
        d.advance_time(u64::MAX);
        assert!(d.event_done(e).unwrap());
        let f = d.record_event(Stream(1)).unwrap();
        d.wait_event(f).unwrap();
        d.synchronize().unwrap();
        assert!(d.event_done(f).unwrap());
    }

    #[test]
    fn cost_model_charges_driver_calls() {
        let mut d = device("sim_cost_model:True");
        let p = d.reserve(2 * MIB).unwrap();
        d.release(p, 2 * MIB).unwrap();
        let t = d.driver_time();
        assert_eq!((t.reserve_ns, t.release_ns), (COST_RESERVE_NS, COST_RELEASE_NS));
        let mut d = device("");
        d.reserve(2 * MIB).unwrap();
        assert_eq!(d.driver_time().reserve_ns, 0);
    }

    #[test]
    fn copies_run_on_their_own_engine_at_the_configured_rate() {
        let mut d = device("sim_cost_model:True,sim_copy_mb_s:1000");
        let host = d.host_alloc(100 * MIB).unwrap();
        let range = d.reserve_address(100 * MIB).unwrap();
        let page = d.create_physical(100 * MIB).unwrap();
        d.map(range, 100 * MIB, page).unwrap();
        let start = d.now_ns;
        d.copy_to_host(host, range, 100 * MIB).unwrap();
        let copy_ns = 100 * MIB * 1_000_000_000 / 1_000_000_000;
        let event = d.record_copy_event().unwrap();
        // The host goes on while the copy runs: a stream's synchronization does not wait for it.
        d.synchronize_stream(Stream(1)).unwrap();
        assert!(d.now_ns < start + copy_ns / 2, "a stream sync waited for the copy stream");
        assert!(!d.event_done(event).unwrap());
        d.wait_event(event).unwrap();
        assert_eq!(d.now_ns, start + COST_COPY_CALL_NS + copy_ns, "the copy's bytes at 1000 MB/s after its launch");
        // A device synchronization waits for both.
        d.copy_to_host(host, range, 100 * MIB).unwrap();
        let queued = d.now_ns;
        d.record_copy_event().map(|e| d.free_event(e)).unwrap();
        d.synchronize().unwrap();
        assert!(d.now_ns >= queued + copy_ns);
    }

    #[test]
    fn virtual_memory_follows_the_drivers_rules() {
        let mut d = device("sim_capacity_mb:8");
        let g = d.vm_granularity().unwrap();
        assert_eq!(g, 2 * MIB);
        let range = d.reserve_address(8 * g).unwrap();
        assert_eq!(d.mem_info().unwrap().0, 8 * MIB, "an address range costs no memory");
        let a = d.create_physical(g).unwrap();
        let b = d.create_physical(2 * g).unwrap();
        assert!(d.create_physical(2 * g).unwrap_err().is_out_of_memory(), "physical memory counts");
        assert!(d.map(range + 512, g, a).is_err(), "unaligned");
        assert!(d.map(range, 2 * g, a).is_err(), "a chunk maps whole");
        assert!(d.map(range + 7 * g, 2 * g, b).is_err(), "outside the range");
        d.map(range, g, a).unwrap();
        assert!(d.map(range, 2 * g, b).is_err(), "over a mapped range");
        d.map(range + g, 2 * g, b).unwrap();
        assert!(d.unmap(range, 2 * g).is_err(), "part of a mapping");
        assert!(d.free_address(range, 8 * g).is_err(), "mapped bytes inside");
        assert!(d.release(range, 8 * g).is_err(), "cuMemFree of a virtual range");
        // Released while mapped: the memory stays until it is unmapped.
        d.release_physical(a).unwrap();
        assert!(d.release_physical(a).is_err(), "double release");
        assert_eq!(d.mem_info().unwrap().0, 2 * MIB);
        d.unmap(range, 3 * g).unwrap();
        assert_eq!(d.mem_info().unwrap().0, 4 * MIB);
        assert!(d.unmap(range, g).is_err(), "nothing mapped there");
        // An unmapped chunk maps again elsewhere.
        d.map(range + 4 * g, 2 * g, b).unwrap();
        d.unmap(range + 4 * g, 2 * g).unwrap();
        d.release_physical(b).unwrap();
        d.free_address(range, 8 * g).unwrap();
        assert_eq!(d.mem_info().unwrap().0, 8 * MIB);
    }

    #[test]
    fn address_space_wraps_and_reuses_freed_ranges() {
        let mut d = device("sim_capacity_mb:16777216");
        let big = ADDRESS_WINDOW / 4;
        let ptrs: Vec<u64> = (0..4).map(|_| d.reserve(big).unwrap()).collect();
        d.release(ptrs[1], big).unwrap();
        // The window is full after the cursor; the search wraps and finds the hole.
        assert_eq!(d.reserve(ALIGNMENT).unwrap(), ptrs[1]);
    }
}
