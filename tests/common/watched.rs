//! A simulated device that logs the calls the heap makes, for tests that state an order or a
//! rule of driver calls (`capture_rules.rs`: calls a capture forbids; `sleep.rs`: a pause
//! synchronizes the device before its first unmap), as `common::watched`.

use parking_lot::Mutex;
use std::sync::Arc;
use stepalloc::backend::sim::SimDevice;
use stepalloc::backend::{DeviceInfo, DriverTime, Event, PhysHandle};
use stepalloc::{Allocator, Backend, Config, Result, Stream};

/// What the test and the backend share: whether a capture is in progress (set by the test
/// around what it captures), the calls made during one, and every call in order.
#[derive(Default)]
pub struct Watch {
    pub capturing: bool,
    pub violations: Vec<String>,
    pub log: Vec<String>,
}

pub struct Watched {
    inner: SimDevice,
    watch: Arc<Mutex<Watch>>,
}

impl Watched {
    /// Logs a call; one that a capture forbids is a violation while a capture is in progress.
    fn note(&self, call: String, forbidden_in_capture: bool) {
        let mut w = self.watch.lock();
        if w.capturing && forbidden_in_capture {
            w.violations.push(call.clone());
        }
        w.log.push(call);
    }
}

impl Backend for Watched {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn mem_info(&mut self) -> Result<(u64, u64)> {
        self.inner.mem_info()
    }
    fn reserve(&mut self, bytes: u64) -> Result<u64> {
        self.note(format!("reserve {bytes}"), false);
        self.inner.reserve(bytes)
    }
    fn release(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        self.note(format!("release {bytes}"), true);
        self.inner.release(ptr, bytes)
    }
    fn record_event(&mut self, stream: Stream) -> Result<Event> {
        self.note(format!("record_event {:#x}", stream.0), true);
        self.inner.record_event(stream)
    }
    fn event_done(&mut self, event: Event) -> Result<bool> {
        self.note("event_done".into(), true);
        self.inner.event_done(event)
    }
    fn wait_event(&mut self, event: Event) -> Result<()> {
        self.note("wait_event".into(), true);
        self.inner.wait_event(event)
    }
    fn free_event(&mut self, event: Event) {
        self.inner.free_event(event)
    }
    fn synchronize(&mut self) -> Result<()> {
        self.note("synchronize".into(), true);
        self.inner.synchronize()
    }
    fn driver_time(&self) -> DriverTime {
        self.inner.driver_time()
    }
    fn vm_granularity(&mut self) -> Result<u64> {
        self.inner.vm_granularity()
    }
    fn reserve_address(&mut self, bytes: u64) -> Result<u64> {
        self.inner.reserve_address(bytes)
    }
    fn free_address(&mut self, addr: u64, bytes: u64) -> Result<()> {
        self.note("free_address".into(), true);
        self.inner.free_address(addr, bytes)
    }
    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle> {
        self.inner.create_physical(bytes)
    }
    fn release_physical(&mut self, handle: PhysHandle) -> Result<()> {
        self.note("release_physical".into(), true);
        self.inner.release_physical(handle)
    }
    fn map(&mut self, addr: u64, bytes: u64, handle: PhysHandle) -> Result<()> {
        self.inner.map(addr, bytes, handle)
    }
    fn unmap(&mut self, addr: u64, bytes: u64) -> Result<()> {
        self.note("unmap".into(), true);
        self.inner.unmap(addr, bytes)
    }
    fn synchronize_stream(&mut self, stream: Stream) -> Result<()> {
        self.note(format!("synchronize_stream {:#x}", stream.0), true);
        self.inner.synchronize_stream(stream)
    }
    fn advance_time(&mut self, ns: u64) {
        self.inner.advance_time(ns)
    }
    // Host backups (a pause with backup), forwarded.
    fn host_alloc(&mut self, bytes: u64) -> Result<u64> {
        self.inner.host_alloc(bytes)
    }
    fn host_free(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        self.inner.host_free(ptr, bytes)
    }
    fn copy_to_host(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.note("copy_to_host".into(), true);
        self.inner.copy_to_host(dst, src, bytes)
    }
    fn copy_to_device(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.note("copy_to_device".into(), true);
        self.inner.copy_to_device(dst, src, bytes)
    }
    fn record_copy_event(&mut self) -> Result<Event> {
        self.inner.record_copy_event()
    }
}

/// An allocator of one watched simulated device configured by `conf`.
pub fn watched(conf: &str) -> (Allocator, Arc<Mutex<Watch>>) {
    let config = Config::parse(&format!("backend:sim,{conf}")).expect("valid config");
    let watch = Arc::new(Mutex::new(Watch::default()));
    let backend = Watched { inner: SimDevice::new(0, &config.sim), watch: Arc::clone(&watch) };
    (Allocator::with_backends(config, vec![Box::new(backend)]), watch)
}
