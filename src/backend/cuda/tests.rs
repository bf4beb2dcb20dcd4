//! Tests on a CUDA driver run when `STEPALLOC_GPU_TESTS=1` (a real device) or
//! `STEPALLOC_HOSTCUDA=1` (the host-memory driver of `testdrv/`, found through
//! `LD_LIBRARY_PATH`; the test command runs them so, with `--test-threads=1`); otherwise they
//! print why they were skipped. Tests named `host_` need the host driver's controls (failure
//! injection, capacity) and skip on a real driver. The no-driver tests run everywhere else.
use super::*;
use crate::allocator::Allocator;
use crate::config::Config;
use crate::units::MIB;
use cudarc::driver::sys;
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

fn wanted(test: &str) -> bool {
    let on = |name: &str| std::env::var(name).as_deref() == Ok("1");
    if !on("STEPALLOC_GPU_TESTS") && !on("STEPALLOC_HOSTCUDA") {
        eprintln!(
            "skipped {test}: set STEPALLOC_GPU_TESTS=1 (a CUDA device) or STEPALLOC_HOSTCUDA=1 (testdrv) to run it"
        );
        return false;
    }
    if !driver_present() {
        // Asked for, but impossible: fail rather than pass silently.
        assert!(
            !on("STEPALLOC_HOSTCUDA"),
            "STEPALLOC_HOSTCUDA=1 but no libcuda.so: run testdrv/build.sh and set LD_LIBRARY_PATH=target/hostcuda"
        );
        eprintln!("skipped {test}: no CUDA driver library (libcuda.so) on this machine");
        return false;
    }
    true
}

/// The devices when driver tests are enabled and possible, else `None` after printing why.
fn devices(test: &str) -> Option<Vec<CudaDevice>> {
    if !wanted(test) {
        return None;
    }
    match open_devices() {
        Ok(devices) => Some(devices),
        Err(e) => {
            eprintln!("skipped {test}: no usable CUDA device: {e}");
            None
        }
    }
}

fn gpu(test: &str) -> Option<Vec<Box<dyn Backend>>> {
    devices(test).map(|ds| ds.into_iter().map(|d| Box::new(d) as Box<dyn Backend>).collect())
}

/// The host driver's test controls (`hostcuda_set`), or `None` on a real driver.
struct HostCuda {
    set: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int,
    used: unsafe extern "C" fn(c_int) -> i64,
}

impl HostCuda {
    fn get(test: &str) -> Option<HostCuda> {
        if !wanted(test) {
            return None;
        }
        match (symbol("hostcuda_set"), symbol("hostcuda_used")) {
            (Ok(set), Ok(used)) => Some(HostCuda { set, used }),
            _ => {
                eprintln!("skipped {test}: needs the host-memory driver's controls (testdrv), not a real driver");
                None
            }
        }
    }

    fn set(&self, key: &str, value: &str) {
        let (k, v) = (CString::new(key).expect("key"), CString::new(value).expect("value"));
        // Safety: two NUL-terminated strings that live for the call.
        assert_eq!(unsafe { (self.set)(k.as_ptr(), v.as_ptr()) }, 0, "hostcuda_set({key}, {value})");
    }

    fn used(&self, device: c_int) -> u64 {
        // Safety: plain value.
        unsafe { (self.used)(device) as u64 }
    }
}

/// Runs `f` with `key` set, and resets it afterwards even when `f` panics.
fn with_setting(host: &HostCuda, key: &str, value: &str, reset: &str, f: impl FnOnce()) {
    host.set(key, value);
    let outcome = catch_unwind(AssertUnwindSafe(f));
    host.set(key, reset);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

fn current(api: &Api) -> CuContext {
    let mut c: CuContext = std::ptr::null_mut();
    // Safety: one out-pointer to a local.
    check("cuCtxGetCurrent", unsafe { (api.ctx_get_current)(&mut c) }).expect("cuCtxGetCurrent");
    c
}

/// A new non-blocking stream of `dev`'s context; the caller's context is restored.
fn new_stream(dev: &mut CudaDevice) -> CuStream {
    let api = dev.api;
    let _current = dev.enter().expect("enter");
    let mut stream: CuStream = std::ptr::null_mut();
    // Safety: one out-pointer to a local; the device's context is current.
    check("cuStreamCreate", unsafe { (api.stream_create)(&mut stream, 1) }).expect("cuStreamCreate");
    stream
}

#[test]
fn without_a_driver_open_all_says_why() {
    if driver_present() {
        eprintln!("skipped without_a_driver_open_all_says_why: a CUDA driver is present");
        return;
    }
    let e = open_all().err().expect("no driver, so no devices");
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("libcuda.so"), "{e}");
    let auto = Allocator::new(Config::parse("backend:auto").expect("valid")).err().expect("no driver");
    assert!(auto.to_string().contains("backend:auto found no usable CUDA device"), "{auto}");
    assert!(auto.to_string().contains("backend:sim"), "{auto}");
    let cuda = Allocator::new(Config::parse("backend:cuda").expect("valid")).err().expect("no driver");
    assert!(matches!(cuda, Error::Unavailable(_)), "{cuda}");
}

#[test]
fn error_mapping() {
    let oom = map_error("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY);
    assert!(oom.is_out_of_memory());
    let other = map_error("cuMemFree", 1);
    assert_eq!(other, Error::Driver { call: "cuMemFree", code: "CUDA_ERROR_INVALID_VALUE (1)".into() });
    assert_eq!(other.to_string(), "CUDA driver call cuMemFree failed: CUDA_ERROR_INVALID_VALUE (1)");
    // Codes newer than cudarc's enum are plain numbers here, never the enum.
    let newer = map_error("cuEventQuery", 226);
    assert_eq!(newer.to_string(), "CUDA driver call cuEventQuery failed: CUDA_ERROR_CONTAINED (226)");
    let unknown = map_error("cuEventQuery", 7777);
    assert!(unknown.to_string().contains("CUresult 7777"), "{unknown}");
}

#[test]
fn our_structs_have_the_drivers_layout() {
    assert_eq!(std::mem::size_of::<AllocationProp>(), std::mem::size_of::<sys::CUmemAllocationProp>());
    assert_eq!(std::mem::size_of::<AccessDesc>(), std::mem::size_of::<sys::CUmemAccessDesc>());
    assert_eq!(std::mem::size_of::<MemLocation>(), std::mem::size_of::<sys::CUmemLocation>());
}

#[test]
fn gpu_reserve_release_and_mem_info() {
    let Some(mut devices) = gpu("gpu_reserve_release_and_mem_info") else { return };
    for dev in &mut devices {
        let info = dev.info();
        assert!(info.total_bytes > 0);
        let ptr = dev.reserve(2 * MIB).expect("the first call makes the context");
        dev.release(ptr, 2 * MIB).expect("cuMemFree");
        let (free_before, total) = dev.mem_info().expect("cuMemGetInfo");
        assert_eq!(total, info.total_bytes);
        let ptr = dev.reserve(64 * MIB).expect("cuMemAlloc 64 MiB");
        assert!(ptr != 0 && ptr % 512 == 0, "{ptr:#x}");
        let (free_during, _) = dev.mem_info().expect("cuMemGetInfo");
        assert!(free_during + 64 * MIB <= free_before + 8 * MIB, "{free_before} -> {free_during}");
        dev.release(ptr, 64 * MIB).expect("cuMemFree");
        assert!(dev.driver_time().reserve_ns > 0);
    }
}

#[test]
fn gpu_out_of_memory_is_retryable() {
    let Some(mut devices) = gpu("gpu_out_of_memory_is_retryable") else { return };
    let dev = &mut devices[0];
    let too_much = dev.info().total_bytes * 2;
    let e = dev.reserve(too_much).expect_err("twice the device cannot be reserved");
    assert!(e.is_out_of_memory(), "{e}");
    // The device still works afterwards.
    let ptr = dev.reserve(2 * MIB).expect("cuMemAlloc after OOM");
    dev.release(ptr, 2 * MIB).expect("cuMemFree");
}

#[test]
fn gpu_events_are_pooled_and_complete() {
    let Some(mut devices) = gpu("gpu_events_are_pooled_and_complete") else { return };
    let dev = &mut devices[0];
    let first = dev.record_event(Stream::DEFAULT).expect("record");
    dev.wait_event(first).expect("synchronize");
    assert!(dev.event_done(first).expect("query"));
    dev.free_event(first);
    let second = dev.record_event(Stream::DEFAULT).expect("record");
    assert_eq!(first, second, "a freed event is reused, not recreated");
    dev.synchronize().expect("cuCtxSynchronize");
    assert!(dev.event_done(second).expect("query"));
    dev.free_event(second);
    dev.synchronize_stream(Stream::DEFAULT).expect("cuStreamSynchronize");
}

#[test]
fn gpu_calls_restore_the_callers_context() {
    let Some(mut devices) = devices("gpu_calls_restore_the_callers_context") else { return };
    let api = devices[0].api;
    let before = current(api);
    for dev in &mut devices {
        let ptr = dev.reserve(2 * MIB).expect("cuMemAlloc");
        dev.release(ptr, 2 * MIB).expect("cuMemFree");
        let event = dev.record_event(Stream::DEFAULT).expect("record");
        dev.wait_event(event).expect("wait");
        dev.free_event(event);
    }
    assert_eq!(current(api), before);
}

#[test]
fn gpu_reserve_during_stream_capture() {
    let Some(mut devices) = devices("gpu_reserve_during_stream_capture") else { return };
    let dev = &mut devices[0];
    let api = dev.api;
    let stream = new_stream(dev);
    let _current = CurrentContext::enter(api, dev.context.expect("retained")).expect("enter");
    for mode in [0, 1] {
        // Safety: `stream` is a live stream of the current context.
        check("cuStreamBeginCapture", unsafe { (api.stream_begin_capture)(stream, mode) }).expect("begin capture");
        let reserved = dev.reserve(2 * MIB);
        let mut status: c_int = 0;
        // Safety: as above; one out-pointer to a local.
        check("cuStreamIsCapturing", unsafe { (api.stream_is_capturing)(stream, &mut status) }).expect("is capturing");
        assert_eq!(status, 1, "the capture is still active (not invalidated) after cuMemAlloc");
        assert!(dev.stream_is_capturing(Stream(stream as u64)).expect("backend query"));
        let mut graph: CuGraph = std::ptr::null_mut();
        // Safety: as above; one out-pointer to a local.
        let ended = check("cuStreamEndCapture", unsafe { (api.stream_end_capture)(stream, &mut graph) });
        let ptr = reserved.unwrap_or_else(|e| panic!("cuMemAlloc during a mode {mode} capture: {e}"));
        ended.unwrap_or_else(|e| panic!("the mode {mode} capture was invalidated: {e}"));
        // Safety: the graph just captured, destroyed once.
        let _ = unsafe { (api.graph_destroy)(graph) };
        dev.release(ptr, 2 * MIB).expect("cuMemFree after the capture");
        assert!(!dev.stream_is_capturing(Stream(stream as u64)).expect("backend query"));
    }
    // Safety: the stream made above, destroyed once.
    let _ = unsafe { (api.stream_destroy)(stream) };
}

#[test]
fn gpu_allocator_on_cuda() {
    if !wanted("gpu_allocator_on_cuda") {
        return;
    }
    let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("CUDA allocator");
    let mut ptrs = Vec::new();
    for i in 0..200u64 {
        let size = 1 + (i * 7919) % (4 * MIB);
        ptrs.push((a.malloc(0, size, Stream::DEFAULT).expect("malloc"), size));
    }
    for (ptr, size) in ptrs.drain(..) {
        a.free(0, ptr, size).expect("free");
    }
    a.check_invariants().expect("invariants");
    let stats = a.stats(0).expect("stats").to_map();
    assert_eq!(stats.get("allocated_bytes.all.current").and_then(|v| v.as_u64()), Some(0));
    assert!(a.empty_cache().expect("empty_cache") > 0);
}

#[test]
fn gpu_record_on_a_stream_of_another_device() {
    let Some(mut devices) = devices("gpu_record_on_a_stream_of_another_device") else { return };
    if devices.len() < 2 {
        eprintln!("skipped gpu_record_on_a_stream_of_another_device: needs two devices");
        return;
    }
    let peer = new_stream(&mut devices[1]);
    let dev = &mut devices[0];
    let before = current(dev.api);
    // record_stream with device 1's stream on a block of device 0: the event is recorded in
    // device 1's context (in device 0's it is CUDA_ERROR_INVALID_HANDLE).
    let event = dev.record_event(Stream(peer as usize as u64)).expect("record on the peer's stream");
    dev.wait_event(event).expect("wait");
    assert!(dev.event_done(event).expect("query"));
    dev.free_event(event);
    let again = dev.record_event(Stream(peer as usize as u64)).expect("record again");
    assert_eq!(again, event, "the peer context's event is pooled");
    dev.free_event(again);
    dev.synchronize_stream(Stream(peer as usize as u64)).expect("synchronize the peer's stream");
    // Our own events stay in our context.
    let own = dev.record_event(Stream::DEFAULT).expect("record on our stream");
    assert_ne!(own, event);
    dev.free_event(own);
    assert_eq!(current(dev.api), before);
    // Safety: the stream made above, destroyed once.
    let _ = unsafe { (dev.api.stream_destroy)(peer) };
}

#[test]
fn gpu_virtual_memory_map_rules_and_shared_data() {
    let Some(mut devices) = devices("gpu_virtual_memory_map_rules_and_shared_data") else { return };
    let host = symbol::<unsafe extern "C" fn(c_int) -> i64>("hostcuda_used").ok();
    let dev = &mut devices[0];
    let g = match dev.vm_granularity() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipped gpu_virtual_memory_map_rules_and_shared_data: {e}");
            return;
        }
    };
    assert!(g.is_power_of_two() && g >= 2 * MIB, "{g}");
    let a = dev.reserve_address(4 * g).expect("reserve a");
    let b = dev.reserve_address(4 * g).expect("reserve b");
    assert!(a % g == 0 && b % g == 0);
    let (free0, _) = dev.mem_info().expect("mem_info");
    let h = dev.create_physical(2 * g).expect("create");
    let (free1, _) = dev.mem_info().expect("mem_info");
    assert!(free1 + 2 * g <= free0 + 8 * MIB, "physical memory counts: {free0} -> {free1}");
    dev.map(a, 2 * g, h).expect("map at a");
    assert!(dev.map(a + g, 2 * g, h).is_err(), "mapped over mapped bytes");
    assert!(dev.unmap(a, g).is_err(), "unmapped part of a mapping");
    // Write through a, read through a second mapping of the same memory at b.
    let api = dev.api;
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut back = vec![0u8; pattern.len()];
    {
        let _current = dev.enter().expect("enter");
        // Safety: `a` is mapped read-write for at least 4096 bytes; the buffer lives.
        check("cuMemcpyHtoD", unsafe { (api.memcpy_htod)(a + g, pattern.as_ptr().cast(), pattern.len()) })
            .expect("write a");
    }
    dev.map(b, 2 * g, h).expect("map the same memory at b");
    dev.unmap(a, 2 * g).expect("unmap a");
    // testdrv refuses a second unmap (a wrong call sequence of ours should fail a test); an
    // H200's driver accepted it in the GPU kit, so only the host-memory driver is held to it.
    let again = dev.unmap(a, 2 * g);
    assert!(host.is_none() || again.is_err(), "unmapped twice");
    {
        let _current = dev.enter().expect("enter");
        // Safety: `b` is mapped read-write; the buffer has room.
        check("cuMemcpyDtoH", unsafe { (api.memcpy_dtoh)(back.as_mut_ptr().cast(), b + g, back.len()) })
            .expect("read b");
    }
    assert_eq!(back, pattern, "data written through a is read through b");
    // Release while mapped: deferred until the last mapping goes.
    dev.release_physical(h).expect("release while mapped at b");
    if let Some(used) = host {
        // Safety: plain value.
        assert_eq!(unsafe { used(0) } as u64 % g, 0);
        assert!(dev.free_address(b, 4 * g).is_err(), "freed a range that is still mapped");
    }
    {
        let _current = dev.enter().expect("enter");
        back.fill(0);
        // Safety: as above: still mapped at b after the release.
        check("cuMemcpyDtoH", unsafe { (api.memcpy_dtoh)(back.as_mut_ptr().cast(), b + g, back.len()) })
            .expect("read b");
    }
    assert_eq!(back, pattern, "the memory lives while mapped");
    dev.synchronize_stream(Stream::DEFAULT).expect("sync before unmap");
    dev.unmap(b, 2 * g).expect("unmap b");
    let (free2, _) = dev.mem_info().expect("mem_info");
    assert!(free2 + 8 * MIB >= free0, "released after the last unmap: {free0} -> {free2}");
    dev.free_address(a, 4 * g).expect("free a");
    dev.free_address(b, 4 * g).expect("free b");
    assert!(dev.driver_time().map_ns > 0 && dev.driver_time().create_ns > 0);
}

#[test]
fn host_mapping_outside_a_reserved_range_fails() {
    let Some(_host) = HostCuda::get("host_mapping_outside_a_reserved_range_fails") else { return };
    let mut devices = open_devices().expect("devices");
    let dev = &mut devices[0];
    let g = dev.vm_granularity().expect("granularity");
    let a = dev.reserve_address(2 * g).expect("reserve");
    let h = dev.create_physical(2 * g).expect("create");
    assert!(dev.map(a + g, 2 * g, h).is_err(), "mapped past the end of the range");
    dev.map(a, 2 * g, h).expect("map inside");
    dev.unmap(a, 2 * g).expect("unmap");
    dev.release_physical(h).expect("release");
    assert!(dev.release_physical(h).is_err(), "released twice");
    dev.free_address(a, 2 * g).expect("free");
}

#[test]
fn host_no_virtual_memory_support_is_unavailable() {
    let Some(host) = HostCuda::get("host_no_virtual_memory_support_is_unavailable") else { return };
    with_setting(&host, "vmm", "0", "1", || {
        let mut devices = open_devices().expect("devices");
        let e = devices[0].vm_granularity().expect_err("no VMM support");
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        assert!(e.to_string().contains("virtual memory management"), "{e}");
        let e = devices[0].reserve_address(2 * MIB).expect_err("no VMM support");
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
    });
}

#[test]
fn host_events_complete_when_the_streams_work_does() {
    let Some(host) = HostCuda::get("host_events_complete_when_the_streams_work_does") else { return };
    let delay = std::env::var("HOSTCUDA_DELAY_US").unwrap_or("0".into());
    with_setting(&host, "delay_us", "30000", &delay, || {
        let mut devices = open_devices().expect("devices");
        let dev = &mut devices[0];
        let event = dev.record_event(Stream::DEFAULT).expect("record");
        assert!(!dev.event_done(event).expect("query"), "30 ms of queued work completed at once");
        dev.wait_event(event).expect("wait");
        assert!(dev.event_done(event).expect("query"));
        dev.free_event(event);
        let event = dev.record_event(Stream::DEFAULT).expect("record");
        dev.synchronize_stream(Stream::DEFAULT).expect("stream sync");
        assert!(dev.event_done(event).expect("query"), "a stream sync waits for the stream's work");
        dev.free_event(event);
    });
}

#[test]
fn host_unknown_error_codes_are_reported_by_number() {
    let Some(host) = HostCuda::get("host_unknown_error_codes_are_reported_by_number") else { return };
    let mut devices = open_devices().expect("devices");
    let dev = &mut devices[0];
    let event = dev.record_event(Stream::DEFAULT).expect("record");
    // 226 is CUDA_ERROR_CONTAINED (Hopper), newer than cudarc's cuda-11040 enum: reading
    // it as that enum was undefined behaviour (SIGILL). 7777 is known to nobody.
    for (code, expect) in [("226", "CUDA_ERROR_CONTAINED (226)"), ("7777", "CUresult 7777")] {
        with_setting(&host, "fail", &format!("cuEventQuery:{code}:count=1"), "", || {
            let e = dev.event_done(event).expect_err("injected failure");
            assert!(e.to_string().contains(expect), "{e}");
            assert!(e.to_string().contains("cuEventQuery"), "{e}");
        });
    }
    dev.wait_event(event).expect("wait after the failures");
    assert!(dev.event_done(event).expect("query after the failures"));
    dev.free_event(event);
    // The same through the allocator: a failed cuMemAlloc with an unknown code.
    let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
    with_setting(&host, "fail", "cuMemAlloc_v2:916", "", || {
        let e = a.malloc(0, 64 * MIB, Stream::DEFAULT).expect_err("injected failure");
        assert!(e.to_string().contains("916"), "{e}");
    });
    let p = a.malloc(0, 64 * MIB, Stream::DEFAULT).expect("malloc after the failure");
    a.free(0, p, 64 * MIB).expect("free");
}

#[test]
fn host_failed_record_on_another_device_waits_for_that_stream() {
    let Some(host) = HostCuda::get("host_failed_record_on_another_device_waits_for_that_stream") else { return };
    let mut devices = open_devices().expect("devices");
    let peer = new_stream(&mut devices[1]);
    let dev = &mut devices[0];
    dev.mem_info().ok();
    with_setting(&host, "fail", "cuEventRecord:999:count=1", "", || {
        let event = dev.record_event(Stream(peer as usize as u64)).expect("falls back to a stream sync");
        assert!(dev.event_done(event).expect("query"), "the stream was synchronized");
        dev.free_event(event);
    });
    with_setting(&host, "fail", "cuEventRecord:999:count=1,cuStreamSynchronize:999:count=1", "", || {
        let e = dev.record_event(Stream(peer as usize as u64)).expect_err("both failed");
        assert!(e.to_string().contains("cuEventRecord") && e.to_string().contains("999"), "{e}");
    });
}

#[test]
fn host_out_of_memory_at_the_configured_capacity() {
    let Some(host) = HostCuda::get("host_out_of_memory_at_the_configured_capacity") else { return };
    with_setting(&host, "capacity_mb", "256", &std::env::var("HOSTCUDA_CAPACITY_MB").unwrap_or("1024".into()), || {
        let mut devices = open_devices().expect("devices");
        let dev = &mut devices[0];
        assert_eq!(dev.info().total_bytes, 256 * MIB);
        let base = host.used(0);
        let p = dev.reserve(256 * MIB - base).expect("the rest of the device");
        assert!(dev.reserve(2 * MIB).expect_err("full").is_out_of_memory());
        assert_eq!(dev.mem_info().expect("mem_info").0, 0);
        dev.release(p, 256 * MIB - base).expect("release");
        // Through the allocator: fill until out of memory; the report names the capacity.
        let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
        let mut live = Vec::new();
        let e = loop {
            match a.malloc(0, 50 * MIB, Stream::DEFAULT) {
                Ok(p) => live.push(p),
                Err(e) => break e,
            }
            assert!(live.len() < 10, "more than the capacity allocated");
        };
        assert!(e.is_out_of_memory(), "{e}");
        assert!(e.to_string().starts_with("CUDA out of memory."), "{e}");
        assert!(e.to_string().contains("256.00 MiB"), "{e}");
        for p in live {
            a.free(0, p, 50 * MIB).expect("free");
        }
        a.empty_cache().expect("empty_cache");
        assert_eq!(host.used(0), base);
    });
}

/// A tag for the block at `ptr` (its first and last 8 bytes hold it while it is live).
fn tag(ptr: u64, size: u64) -> u64 {
    (ptr ^ size.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

fn write_tags(api: &Api, ptr: u64, size: u64) {
    let t = tag(ptr, size).to_ne_bytes();
    for at in [ptr, ptr + size - 8] {
        // Safety: `at..at+8` lies inside a live block of `size` >= 16 bytes; the bytes live.
        check("cuMemcpyHtoD", unsafe { (api.memcpy_htod)(at, t.as_ptr().cast(), 8) }).expect("write tag");
    }
}

fn tags_intact(api: &Api, ptr: u64, size: u64) -> bool {
    [ptr, ptr + size - 8].iter().all(|&at| {
        let mut b = [0u8; 8];
        // Safety: as in `write_tags`; the buffer has room for 8 bytes.
        check("cuMemcpyDtoH", unsafe { (api.memcpy_dtoh)(b.as_mut_ptr().cast(), at, 8) }).expect("read tag");
        u64::from_ne_bytes(b) == tag(ptr, size)
    })
}

/// Random operation programs on backend:cuda: threads x streams of both devices (record_stream
/// across devices) x injected driver failures, including codes unknown to CUDA 11.4. No
/// crash, no overlap, no corrupted tag, every driver error named with its number, and the
/// heap's invariants and statistics consistent at the end.
#[test]
fn host_random_programs_with_injected_failures() {
    let Some(host) = HostCuda::get("host_random_programs_with_injected_failures") else { return };
    let mut devices = open_devices().expect("devices");
    let api = devices[0].api;
    let mut streams = vec![0u64];
    for d in 0..devices.len().min(2) {
        for _ in 0..2 {
            streams.push(new_stream(&mut devices[d]) as usize as u64);
        }
    }
    let context = devices[0].context().expect("context") as usize;
    let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
    let live = parking_lot::Mutex::new(std::collections::BTreeMap::<u64, u64>::new());
    let rules = "cuMemAlloc_v2:2:prob=0.03,cuMemAlloc_v2:226:prob=0.01,cuEventQuery:226:prob=0.02,\
                 cuEventRecord:7777:prob=0.05";
    let errors = std::sync::atomic::AtomicU64::new(0);
    with_setting(&host, "fail", rules, "", || {
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let (a, live, streams, errors) = (&a, &live, &streams, &errors);
                scope.spawn(move || {
                    // Safety: device 0's primary context, retained above and never released.
                    check("cuCtxSetCurrent", unsafe { (api.ctx_set_current)(context as CuContext) }).expect("ctx");
                    let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ (t + 1).wrapping_mul(0x1000_0000_01B3);
                    let mut next = move || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut mine: Vec<(u64, u64)> = Vec::new();
                    let is_reported = |e: &Error| match e {
                        Error::OutOfMemory(_) => true,
                        Error::Driver { code, .. } => code.chars().any(|c| c.is_ascii_digit()),
                        _ => false,
                    };
                    for _ in 0..1500 {
                        if !mine.is_empty() && next() % 2 == 0 {
                            let (ptr, size) = mine.swap_remove((next() % mine.len() as u64) as usize);
                            if size >= 16 {
                                assert!(tags_intact(api, ptr, size), "block {ptr:#x}+{size} was overwritten");
                            }
                            live.lock().remove(&ptr);
                            if next() % 4 == 0 {
                                let s = streams[(next() % streams.len() as u64) as usize];
                                if let Err(e) = a.record_stream(0, ptr, Stream(s)) {
                                    assert!(is_reported(&e), "{e}");
                                }
                            }
                            if let Err(e) = a.free(0, ptr, size) {
                                assert!(is_reported(&e), "{e}");
                                errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        } else {
                            let size = match next() % 10 {
                                0 => next() % (8 * MIB),
                                _ => next() % MIB,
                            };
                            let s = streams[(next() % streams.len() as u64) as usize];
                            match a.malloc(0, size, Stream(s)) {
                                Ok(ptr) => {
                                    let mut map = live.lock();
                                    let before = map.range(..=ptr).next_back().map(|(&p, &n)| (p, n));
                                    if let Some((p, n)) = before {
                                        assert!(p + n.max(1) <= ptr, "{ptr:#x} overlaps {p:#x}+{n}");
                                    }
                                    if let Some((&p, _)) = map.range(ptr + 1..).next() {
                                        assert!(ptr + size.max(1) <= p, "{ptr:#x}+{size} overlaps {p:#x}");
                                    }
                                    map.insert(ptr, size);
                                    drop(map);
                                    if size >= 16 {
                                        write_tags(api, ptr, size);
                                    }
                                    mine.push((ptr, size));
                                }
                                Err(e) => {
                                    assert!(is_reported(&e), "{e}");
                                    errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                            }
                        }
                    }
                    for (ptr, size) in mine {
                        if size >= 16 {
                            assert!(tags_intact(api, ptr, size), "block {ptr:#x}+{size} was overwritten");
                        }
                        live.lock().remove(&ptr);
                        if let Err(e) = a.free(0, ptr, size) {
                            assert!(is_reported(&e), "{e}");
                        }
                    }
                });
            }
        });
    });
    assert!(errors.into_inner() > 0, "no injected failure reached the allocator");
    a.check_invariants().expect("invariants");
    let stats = a.stats(0).expect("stats").to_map();
    assert_eq!(stats.get("allocated_bytes.all.current").and_then(|v| v.as_u64()), Some(0));
    // Pending events (records that succeeded) complete; then the cache empties fully.
    devices[0].synchronize().expect("sync");
    a.empty_cache().expect("empty_cache");
    assert_eq!(a.stats(0).expect("stats").to_map().get("reserved_bytes.all.current").and_then(|v| v.as_u64()), Some(0));
    for s in streams.into_iter().skip(1) {
        // Safety: the streams made above, destroyed once, after every thread finished.
        let _ = unsafe { (api.stream_destroy)(s as usize as CuStream) };
    }
}

/// Found by the random programs: when waiting for a pending free's event failed, the heap
/// had already taken the event off its queue, so the block stayed pending for good and its
/// segment could never be released.
#[test]
fn host_a_failed_wait_does_not_leak_the_block() {
    let Some(host) = HostCuda::get("host_a_failed_wait_does_not_leak_the_block") else { return };
    let mut devices = open_devices().expect("devices");
    let side = new_stream(&mut devices[0]) as usize as u64;
    let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
    let p = a.malloc(0, 4 * MIB, Stream::DEFAULT).expect("malloc");
    a.record_stream(0, p, Stream(side)).expect("record_stream");
    a.free(0, p, 4 * MIB).expect("free: pending on two events");
    with_setting(&host, "fail", "cuEventSynchronize:46:count=1", "", || {
        let _ = a.empty_cache();
    });
    a.empty_cache().expect("empty_cache once the driver works again");
    let reserved = a.stats(0).expect("stats").to_map().get("reserved_bytes.all.current").and_then(|v| v.as_u64());
    assert_eq!(reserved, Some(0), "the block whose wait failed was never freed");
}

/// A resume of two tags in one heap call (`Heap::resume_tags`) whose `cuMemMap` fails after
/// the first copy batch was mapped and its copies queued: both tags stay paused with their
/// backups and the device's memory is as before the call; memory given back meanwhile is
/// overwritten by another allocation; a retry restores every backed-up byte.
#[test]
fn host_a_resume_of_two_tags_that_fails_halfway_loses_nothing() {
    let test = "host_a_resume_of_two_tags_that_fails_halfway_loses_nothing";
    let Some(host) = HostCuda::get(test) else { return };
    let tools = super::tools::DeviceTools::open(0).expect("tools");
    let config = Config::parse("backend:cuda,expandable_segments:True,large_segment_size_mb:2").expect("valid");
    let a = Allocator::new(config).expect("allocator");
    let (w, kv) = ("cuda_halfway_w", "cuda_halfway_kv");
    crate::tags::enter(w, true).expect("region");
    let weights: Vec<u64> = (0..3).map(|_| a.malloc(0, 200 * MIB, Stream::DEFAULT).expect("malloc")).collect();
    crate::tags::exit().expect("exit");
    crate::tags::enter(kv, false).expect("region");
    let cache = a.malloc(0, 100 * MIB, Stream::DEFAULT).expect("malloc");
    crate::tags::exit().expect("exit");
    let words = (200 * MIB / 4) as usize;
    for (i, &p) in weights.iter().enumerate() {
        tools.memset_d32(p, 0x5EED_0000 + i as u32, words).expect("memset");
    }
    a.pause_tags(&[w, kv], None).expect("pause");
    let used = host.used(0);
    let numbers: Vec<u8> = [w, kv].iter().flat_map(|t| crate::tags::numbers(crate::tags::lookup(t).unwrap())).collect();
    // 2 MiB pages: the first batch is 128 of them; the 201st map fails.
    let maps = a.stats(0).expect("stats").heap.num_map;
    with_setting(&host, "fail", "cuMemMap:2:after=200:count=1", "", || {
        let e = a.with_heap(0, |h| h.resume_tags(&numbers)).expect("heap").expect_err("a map fails");
        assert!(e.is_out_of_memory(), "{e}");
    });
    assert_eq!(a.stats(0).expect("stats").heap.num_map - maps, 200, "it failed in the second batch");
    assert_eq!(host.used(0), used, "the failed resume gave back everything it mapped");
    let figures = a.tag_figures();
    let of = |t: &str| figures.iter().find(|f| f.tag == t).expect("figures").clone();
    assert!(of(w).paused && of(kv).paused && of(w).backup_bytes == 600 * MIB, "{figures:?}");
    a.check_invariants().expect("invariants");
    let other = a.malloc(0, 700 * MIB, Stream::DEFAULT).expect("the memory given back");
    tools.memset_d32(other, 0xDEAD_BEEF, (700 * MIB / 4) as usize).expect("memset");
    a.free(0, other, 700 * MIB).expect("free");
    let r = a.resume_tags(&[w, kv]).expect("the retry");
    assert_eq!(r.copied_bytes, 600 * MIB);
    let mut data = vec![0u8; 200 * MIB as usize];
    for (i, &p) in weights.iter().enumerate() {
        tools.copy_to_host(&mut data, p).expect("read");
        let want = (0x5EED_0000 + i as u32).to_ne_bytes();
        assert!(data.chunks_exact(4).all(|x| x == want), "block {i} lost its bytes");
        a.free(0, p, 200 * MIB).expect("free");
    }
    a.free(0, cache, 100 * MIB).expect("free");
    a.release_backup().expect("release_backup");
    a.empty_cache().expect("empty_cache");
}

#[test]
fn gpu_mem_info_on_an_unused_device_creates_no_context() {
    let Some(mut devices) = devices("gpu_mem_info_on_an_unused_device_creates_no_context") else { return };
    let dev = devices.last_mut().expect("a device");
    if dev.primary_context_active().expect("state") {
        eprintln!("skipped gpu_mem_info_on_an_unused_device_creates_no_context: the last device's context is in use");
        return;
    }
    assert!(dev.mem_info().is_err());
    assert!(!dev.primary_context_active().expect("state"), "mem_info created a context");
    // An oversize request's OOM report on an unused device: no context either.
    let a = Allocator::new(Config::parse("backend:cuda").expect("valid")).expect("allocator");
    let last = a.device_count() - 1;
    let e = a.malloc(last, dev.info().total_bytes * 2, Stream::DEFAULT).expect_err("too large");
    assert!(e.is_out_of_memory(), "{e}");
    assert!(!dev.primary_context_active().expect("state"), "an OOM report created a context");
}
