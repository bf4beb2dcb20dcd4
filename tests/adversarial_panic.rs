//! A panic under a device's lock, in the middle of a heap operation: the C ABI's guard turns it
//! into an error and the device's lock ignores poisoning, so the next caller finds the heap as
//! the panic left it. A backend that panics on a chosen driver call (reserve, map, unmap, ...)
//! interrupts malloc, free, `empty_cache`, pause and resume half way; after each panic the
//! device must be whole (its invariants hold, no block handed out twice) or refuse every later
//! call, never hand out memory it has not accounted for.

mod common;

use common::{next, Shadow, S0, S1};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use stepalloc::backend::sim::SimDevice;
use stepalloc::backend::{DeviceInfo, DriverTime, Event, PhysHandle};
use stepalloc::tags;
use stepalloc::{Allocator, Backend, Config, Result, Stream};

const MIB: u64 = 1 << 20;

/// Panics on the driver call numbered `arm` (counting every call), then works again.
struct Panicky {
    inner: SimDevice,
    calls: Arc<AtomicU64>,
    arm: Arc<AtomicU64>,
}

impl Panicky {
    fn tick(&self, what: &str) {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.arm.load(Ordering::SeqCst) {
            panic!("injected panic in {what} (driver call {n})");
        }
    }
}

impl Backend for Panicky {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn mem_info(&mut self) -> Result<(u64, u64)> {
        self.inner.mem_info()
    }
    fn reserve(&mut self, bytes: u64) -> Result<u64> {
        self.tick("reserve");
        self.inner.reserve(bytes)
    }
    fn release(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        self.tick("release");
        self.inner.release(ptr, bytes)
    }
    fn record_event(&mut self, stream: Stream) -> Result<Event> {
        self.tick("record_event");
        self.inner.record_event(stream)
    }
    fn event_done(&mut self, event: Event) -> Result<bool> {
        self.tick("event_done");
        self.inner.event_done(event)
    }
    fn wait_event(&mut self, event: Event) -> Result<()> {
        self.tick("wait_event");
        self.inner.wait_event(event)
    }
    fn free_event(&mut self, event: Event) {
        self.inner.free_event(event)
    }
    fn synchronize(&mut self) -> Result<()> {
        self.tick("synchronize");
        self.inner.synchronize()
    }
    fn driver_time(&self) -> DriverTime {
        self.inner.driver_time()
    }
    fn vm_granularity(&mut self) -> Result<u64> {
        self.inner.vm_granularity()
    }
    fn reserve_address(&mut self, bytes: u64) -> Result<u64> {
        self.tick("reserve_address");
        self.inner.reserve_address(bytes)
    }
    fn free_address(&mut self, addr: u64, bytes: u64) -> Result<()> {
        self.tick("free_address");
        self.inner.free_address(addr, bytes)
    }
    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle> {
        self.tick("create_physical");
        self.inner.create_physical(bytes)
    }
    fn release_physical(&mut self, handle: PhysHandle) -> Result<()> {
        self.tick("release_physical");
        self.inner.release_physical(handle)
    }
    fn map(&mut self, addr: u64, bytes: u64, handle: PhysHandle) -> Result<()> {
        self.tick("map");
        self.inner.map(addr, bytes, handle)
    }
    fn unmap(&mut self, addr: u64, bytes: u64) -> Result<()> {
        self.tick("unmap");
        self.inner.unmap(addr, bytes)
    }
    fn synchronize_stream(&mut self, stream: Stream) -> Result<()> {
        self.tick("synchronize_stream");
        self.inner.synchronize_stream(stream)
    }
    fn advance_time(&mut self, ns: u64) {
        self.inner.advance_time(ns)
    }
    fn host_alloc(&mut self, bytes: u64) -> Result<u64> {
        self.tick("host_alloc");
        self.inner.host_alloc(bytes)
    }
    fn host_free(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        self.inner.host_free(ptr, bytes)
    }
    fn copy_to_host(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.tick("copy_to_host");
        self.inner.copy_to_host(dst, src, bytes)
    }
    fn copy_to_device(&mut self, dst: u64, src: u64, bytes: u64) -> Result<()> {
        self.tick("copy_to_device");
        self.inner.copy_to_device(dst, src, bytes)
    }
    fn record_copy_event(&mut self) -> Result<Event> {
        self.tick("record_copy_event");
        self.inner.record_copy_event()
    }
}

fn panicky(conf: &str) -> (Allocator, Arc<AtomicU64>, Arc<AtomicU64>) {
    let config = Config::parse(&format!("backend:sim,sim_capacity_mb:2048,{conf}")).expect("valid config");
    let (calls, arm) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let backend = Panicky { inner: SimDevice::new(0, &config.sim), calls: Arc::clone(&calls), arm: Arc::clone(&arm) };
    (Allocator::with_backends(config, vec![Box::new(backend)]), calls, arm)
}

/// What one step of the churn did, for the bookkeeping done outside the injected panic.
enum Did {
    Allocated(u64, u64),
    Freed,
    Other,
}

/// One churn of mallocs, frees (some after `record_stream`), `empty_cache`, and a backed-up tag
/// paused and resumed, with a panic injected at driver call `arm`. After every step the device's
/// invariants must hold, or the device must refuse what could hand out or change memory. Returns
/// whether the panic left the device refused.
fn churn(conf: &str, arm_at: u64, seed: u64) -> std::result::Result<bool, String> {
    let (a, calls, arm) = panicky(conf);
    arm.store(arm_at, Ordering::SeqCst);
    let shadow = Shadow::default();
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut state = seed;
    let mut paused = false;
    let mut tagged = false;
    for step in 0..300 {
        let r = next(&mut state);
        let victim = if live.is_empty() { None } else { Some((r >> 8) as usize % live.len()) };
        let (free_block, is_free) = match (r % 10, victim) {
            (5..=7, Some(i)) => (Some(live[i]), true),
            _ => (None, false),
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<Did> {
            if let Some((p, size)) = free_block {
                if r & 1 == 0 {
                    a.record_stream(0, p, S1)?;
                }
                a.free(0, p, size)?;
                return Ok(Did::Freed);
            }
            match r % 10 {
                8 => {
                    a.empty_cache()?;
                }
                9 if paused => {
                    a.resume(Some("w"))?;
                }
                9 => {
                    if !tagged {
                        tags::enter_with("w", tags::Store::Pinned).unwrap();
                        let got = a.malloc(0, 6 * MIB, S0);
                        tags::exit().unwrap();
                        return Ok(Did::Allocated(got?, 6 * MIB));
                    }
                    a.pause(Some("w"), None)?;
                }
                _ => {
                    let size = [512, 4096, MIB + 7, 3 * MIB, 13 * MIB, 40 * MIB][(r >> 8) as usize % 6];
                    return Ok(Did::Allocated(a.malloc(0, size, if r & 1 == 0 { S0 } else { S1 })?, size));
                }
            }
            Ok(Did::Other)
        }));
        if is_free {
            // Freed or not by a panic half way, the test no longer uses the block.
            let (p, _) = live.swap_remove(victim.unwrap());
            shadow.remove(0, p);
        }
        match outcome {
            Ok(Ok(Did::Allocated(p, size))) => {
                shadow.insert(0, p, size);
                if size == 6 * MIB && r % 10 == 9 {
                    tagged = true;
                } else {
                    live.push((p, size));
                }
            }
            Ok(Ok(Did::Other)) if r % 10 == 9 => paused = !paused,
            Ok(Ok(_)) | Ok(Err(_)) | Err(_) => {}
        }
        if let Err(why) = a.check_invariants() {
            // Broken by the panic: every call that could hand out or change memory is refused.
            let refused = |what: &str, e: stepalloc::Error| {
                assert!(matches!(e, stepalloc::Error::Unavailable(ref m) if m.contains("inconsistent")), "{what}: {e}")
            };
            let context = format!("after step {step} (driver calls {}): {why}", calls.load(Ordering::SeqCst));
            refused("malloc", a.malloc(0, 4096, S0).err().ok_or_else(|| format!("malloc served: {context}"))?);
            if let Some(&(p, size)) = live.first() {
                refused("free", a.free(0, p, size).err().ok_or_else(|| format!("free done: {context}"))?);
            }
            refused("empty_cache", a.empty_cache().err().ok_or_else(|| format!("empty_cache ran: {context}"))?);
            refused("pause", a.pause(None, None).err().ok_or_else(|| format!("pause ran: {context}"))?);
            return Ok(true);
        }
    }
    Ok(false)
}

#[test]
fn a_panic_in_any_driver_call_leaves_the_device_whole_or_refused() {
    // The injected panics are expected: keep their messages out of the test's output.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.to_string().contains("injected panic") {
            report(info)
        }
    }));
    for conf in ["exact_fit:False", "expandable_segments:True,large_segment_size_mb:2,page_reuse:True"] {
        let mut refused = 0;
        for arm in 1..300 {
            match churn(conf, arm, arm * 7919) {
                Ok(broken) => refused += u32::from(broken),
                Err(why) => panic!("{conf}, panic at driver call {arm}: {why}"),
            }
        }
        eprintln!("{conf}: {refused} of 299 injected panics left the device refused");
    }
}
