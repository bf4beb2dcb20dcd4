//! Fourth adversarial pass, sleep and wake on the simulated device: a resume short
//! of memory (a memory fraction, failing maps, a device another device's resume could not
//! follow), pause and resume racing allocation and free on other threads, pause while a CUDA
//! graph is being captured, and the Prometheus text and `tags_json` read while pause and resume
//! run. Each test is an attempt a hostile but realistic user makes; what must hold is the
//! contract of `src/sleep.rs`: a clear error, nothing lost (the tag stays paused with its
//! backup), and the process keeps working. docs/testing.md ("Fourth adversarial pass") lists
//! each attempt and its outcome.

mod common;

use common::{figures, in_region_on, next, sample, samples, sim_4gib, used, Shadow, S0};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use stepalloc::units::MIB;
use stepalloc::{metrics, tags, Allocator, Error, Stream};

fn paused_on(a: &Allocator, device: usize, tag: &str) -> bool {
    let id = tags::lookup(tag).expect("registered");
    a.with_heap(device, |h| h.tag_paused(id)).unwrap()
}

/// A memory fraction too small for the tag: the resume is a clear out-of-memory error, the tag
/// stays paused with every backed-up byte, nothing of the attempt stays mapped, and once the
/// fraction allows it the same call succeeds and copies everything back.
#[test]
fn a_resume_refused_by_the_memory_fraction_keeps_the_tag_paused_and_a_retry_works() {
    for conf in ["", ",expandable_segments:True", &format!(",{}", stepalloc::config::RECOMMENDED)] {
        let a = sim_4gib(conf);
        let blocks = in_region_on(&a, 0, "adv_frac_w", true, &[200 * MIB, 3 * MIB, 4096]);
        let want: u64 = blocks.iter().map(|&(_, s)| s).sum();
        a.pause(Some("adv_frac_w"), None).unwrap();
        let before = used(&a, 0);
        a.set_memory_fraction(0, 0.01).unwrap(); // 40 MiB of 4 GiB
        for attempt in 0..3 {
            let e = a.resume(Some("adv_frac_w")).unwrap_err();
            let Error::OutOfMemory(report) = &e else { panic!("{conf}: attempt {attempt}: {e}") };
            assert!(report.hint.contains("adv_frac_w") && report.hint.contains("stays paused"), "{conf}: {e}");
            assert!(paused_on(&a, 0, "adv_frac_w"), "{conf}: attempt {attempt}: not paused after a failed resume");
            let f = figures(&a, "adv_frac_w");
            assert_eq!((f.backup_bytes, f.live_bytes), (want, 0), "{conf}: attempt {attempt}: {f:?}");
            assert_eq!(used(&a, 0), before, "{conf}: attempt {attempt}: a failed resume left memory mapped");
            a.check_invariants().unwrap_or_else(|e| panic!("{conf}: attempt {attempt}: {e}"));
        }
        a.set_memory_fraction(0, 1.0).unwrap();
        let r = a.resume(Some("adv_frac_w")).unwrap();
        assert_eq!(r.copied_bytes, want, "{conf}");
        assert!(!paused_on(&a, 0, "adv_frac_w"));
        a.check_invariants().unwrap();
        for (p, s) in blocks {
            a.free(0, p, s).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(used(&a, 0), 0, "{conf}");
    }
}

/// Maps that fail at random while resuming (a driver error, not out of memory): every failed
/// resume leaves the tag paused with its whole backup and nothing mapped; retrying succeeds
/// eventually, and across cycles no block or byte of backup is lost.
#[test]
fn resumes_that_fail_while_mapping_lose_nothing_and_retries_succeed() {
    let a = sim_4gib(",expandable_segments:True,sim_fail_map_prob:0.05,sim_seed:31");
    // Allocation maps too and may fail: a user retries.
    let mut blocks = Vec::new();
    tags::enter("adv_mapfail_w", true).unwrap();
    for &size in &[64 * MIB, 30 * MIB, 5 * MIB, 700 * 1024, 4096] {
        let p = (0..100).find_map(|_| a.malloc(0, size, S0).ok()).expect("an allocation within 100 tries");
        blocks.push((p, size));
    }
    tags::exit().unwrap();
    let want: u64 = blocks.iter().map(|&(_, s)| s).sum();
    let mut failures = 0;
    for cycle in 0..6 {
        a.pause(Some("adv_mapfail_w"), None).unwrap();
        let paused_used = used(&a, 0);
        let mut tries = 0;
        loop {
            tries += 1;
            assert!(tries < 200, "cycle {cycle}: no resume succeeded in 200 tries");
            match a.resume(Some("adv_mapfail_w")) {
                Ok(r) => {
                    assert_eq!(r.copied_bytes, want, "cycle {cycle}: {r:?}");
                    break;
                }
                Err(e) => {
                    failures += 1;
                    assert!(paused_on(&a, 0, "adv_mapfail_w"), "cycle {cycle}: not paused after {e}");
                    let f = figures(&a, "adv_mapfail_w");
                    assert_eq!(f.backup_bytes, want, "cycle {cycle}: backup lost after {e}");
                    assert_eq!(used(&a, 0), paused_used, "cycle {cycle}: {e} left memory mapped");
                    a.check_invariants().unwrap_or_else(|i| panic!("cycle {cycle}, after {e}: {i}"));
                }
            }
        }
        a.check_invariants().unwrap();
        for &(p, _) in &blocks {
            assert!(a.with_heap(0, |h| h.is_live(p)).unwrap(), "cycle {cycle}: block {p:#x} lost");
        }
    }
    assert!(failures > 0, "the injected map failures never hit a resume: the test tests nothing");
    for (p, s) in blocks {
        a.free(0, p, s).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(used(&a, 0), 0);
}

/// Two devices, a tag without backup on both, device 1 short of memory: the resume fails (all
/// or none) and device 0, which had resumed, pauses again. A tag whose policy is no backup must
/// not get host buffers nor have its (discarded, meaningless) bytes copied out by that rollback:
/// for a KV cache of tens of GiB that is tens of GiB of pinned host memory the user never asked
/// for, and a host allocation failure there leaves device 0 resumed (the error is ignored) while
/// the error says the tag stays paused.
#[test]
fn a_failed_resume_on_two_devices_rolls_back_without_backing_up_a_no_backup_tag() {
    let a = sim_4gib(",sim_devices:2,sim_capacity_mb:1024");
    let on0 = in_region_on(&a, 0, "adv_rb_kv", false, &[256 * MIB]);
    let on1 = in_region_on(&a, 1, "adv_rb_kv", false, &[256 * MIB]);
    a.pause(Some("adv_rb_kv"), None).unwrap();
    let hog = a.malloc(1, 900 * MIB, S0).unwrap();
    let e = a.resume(Some("adv_rb_kv")).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert!(paused_on(&a, 0, "adv_rb_kv") && paused_on(&a, 1, "adv_rb_kv"), "all or none");
    let host: u64 = (0..2).map(|d| a.with_heap(d, |h| h.backup_host_bytes()).unwrap()).sum();
    assert_eq!(host, 0, "the rollback gave a no-backup tag {host} bytes of pinned host buffers");
    assert_eq!(figures(&a, "adv_rb_kv").backup_bytes, 0, "the rollback backed up discarded bytes");
    a.free(1, hog, 900 * MIB).unwrap();
    a.resume(Some("adv_rb_kv")).unwrap();
    for (d, blocks) in [(0, on0), (1, on1)] {
        for (p, s) in blocks {
            a.free(d, p, s).unwrap();
        }
    }
}

/// The same rollback keeps a backed-up tag's bytes: device 0 resumed, device 1 failed, device 0
/// paused again with a backup of what it had restored, and the retry restores both devices.
/// (Held: a regression test for the all-or-none rule.)
#[test]
fn a_failed_resume_on_two_devices_is_all_or_none_and_the_retry_restores_both() {
    let a = sim_4gib(",sim_devices:2,sim_capacity_mb:1024");
    let on0 = in_region_on(&a, 0, "adv_rb_w", true, &[128 * MIB, 4096]);
    let on1 = in_region_on(&a, 1, "adv_rb_w", true, &[256 * MIB]);
    a.pause(Some("adv_rb_w"), None).unwrap();
    let hog = a.malloc(1, 900 * MIB, S0).unwrap();
    let e = a.resume(Some("adv_rb_w")).unwrap_err();
    assert!(matches!(&e, Error::OutOfMemory(r) if r.hint.contains("adv_rb_w")), "{e}");
    assert!(paused_on(&a, 0, "adv_rb_w") && paused_on(&a, 1, "adv_rb_w"), "all or none");
    assert_eq!(figures(&a, "adv_rb_w").backup_bytes, 128 * MIB + 4096 + 256 * MIB);
    assert_eq!(used(&a, 0), 0, "device 0 gave its pages back again");
    a.check_invariants().unwrap();
    a.free(1, hog, 900 * MIB).unwrap();
    let r = a.resume(Some("adv_rb_w")).unwrap();
    assert_eq!(r.copied_bytes, 128 * MIB + 4096 + 256 * MIB);
    assert!(!paused_on(&a, 0, "adv_rb_w") && !paused_on(&a, 1, "adv_rb_w"));
    a.check_invariants().unwrap();
    for (d, blocks) in [(0, on0), (1, on1)] {
        for (p, s) in blocks {
            a.free(d, p, s).unwrap();
        }
    }
}

/// A CUDA graph being captured on device 1 (PyTorch calls `begin_allocate_to_pool` first) while
/// the program pauses a tag that lives on both devices. The capture's device refuses, naming
/// the capture (held); but device 0 was paused before device 1 refused, so the call fails with
/// the tag half paused — and on a GPU the pause's `cuEventSynchronize` and `cuMemUnmap` on
/// device 0, made while a global-mode capture is underway on another thread, invalidate that
/// capture. A capture on any device must refuse the whole call before any device changes.
#[test]
fn a_pause_during_a_capture_on_another_device_changes_no_device() {
    let a = sim_4gib(",sim_devices:2");
    let on0 = in_region_on(&a, 0, "adv_cap_w", true, &[8 * MIB]);
    let on1 = in_region_on(&a, 1, "adv_cap_w", true, &[8 * MIB]);
    a.begin_allocate_to_pool(1, (5, 5)).unwrap();
    let e = a.pause(Some("adv_cap_w"), None).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("capture")), "{e}");
    let half = (paused_on(&a, 0, "adv_cap_w"), paused_on(&a, 1, "adv_cap_w"));
    assert_eq!(half, (false, false), "a refused pause changed device 0");
    a.end_allocate_to_pool(1, (5, 5)).unwrap();
    a.release_pool(1, (5, 5)).unwrap();
    for (d, blocks) in [(0, on0), (1, on1)] {
        for (p, s) in blocks {
            a.free(d, p, s).unwrap();
        }
    }
}

/// During a capture on the tag's own device, pause and resume are refused and change nothing
/// (held); allocation of the tag into the graph's pool goes on; after the capture both work.
#[test]
fn pause_and_resume_during_a_capture_on_the_same_device_change_nothing() {
    let a = sim_4gib(&format!(",{}", stepalloc::config::RECOMMENDED));
    let w = in_region_on(&a, 0, "adv_cap1_w", true, &[8 * MIB, 4096]);
    a.begin_allocate_to_pool(0, (9, 9)).unwrap();
    let before = (used(&a, 0), a.stats(0).unwrap().heap.num_unmap);
    let e = a.pause(Some("adv_cap1_w"), None).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("capture") && m.contains("adv_cap1_w")), "{e}");
    assert!(!paused_on(&a, 0, "adv_cap1_w"));
    assert_eq!((used(&a, 0), a.stats(0).unwrap().heap.num_unmap), before, "a refused pause unmapped");
    let g = a.malloc_in_pool(0, MIB, S0, Some((9, 9))).unwrap();
    a.end_allocate_to_pool(0, (9, 9)).unwrap();
    a.pause(Some("adv_cap1_w"), None).unwrap();
    // Paused with a capture underway: the resume is refused and the tag stays paused.
    a.begin_allocate_to_pool(0, (10, 10)).unwrap();
    assert!(a.resume(Some("adv_cap1_w")).is_err());
    assert!(paused_on(&a, 0, "adv_cap1_w"));
    a.end_allocate_to_pool(0, (10, 10)).unwrap();
    a.release_pool(0, (10, 10)).unwrap();
    assert_eq!(a.resume(Some("adv_cap1_w")).unwrap().copied_bytes, 8 * MIB + 4096);
    a.free(0, g, MIB).unwrap();
    a.release_pool(0, (9, 9)).unwrap();
    for (p, s) in w {
        a.free(0, p, s).unwrap();
    }
    a.check_invariants().unwrap();
}

/// Worker threads allocate and free, on two devices and their own streams, inside the region of
/// a tag (a `Paused` error is the only failure they may see, and only while it is paused), in
/// a second tag and outside any region, while another thread pauses and resumes the first tag
/// (with and without backup) and yet another reads tags, statistics and the Prometheus text.
/// Afterwards: no overlap was ever handed out, every block is still live, every invariant
/// holds, and once everything is freed nothing stays on either device.
#[test]
fn pause_and_resume_race_allocation_and_free_on_other_threads() {
    race(stepalloc::config::RECOMMENDED);
}

/// The same race with page release under a tight cache limit and a grace: the limit's releases
/// (at frees, at later allocations) run between the pauses and resumes.
#[test]
fn pause_and_resume_race_threads_under_page_release_and_a_cache_limit() {
    race(&format!("{},page_release:True,cache_limit_mb:8,page_release_grace:4", stepalloc::config::RECOMMENDED));
}

/// Plain segments for untagged memory (tags are always virtual ranges).
#[test]
fn pause_and_resume_race_threads_with_plain_segments() {
    race("expandable_segments:False,cache_limit_mb:16");
}

fn race(conf: &str) {
    let a = Arc::new(sim_4gib(&format!(",sim_devices:2,sim_capacity_mb:2048,{conf}")));
    let shadow = Arc::new(Shadow::default());
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    // Registered before the threads start, so the controller can name it.
    tags::register("adv_race_kv").unwrap();
    tags::register("adv_race_w").unwrap();
    let mut workers = Vec::new();
    for t in 0..4u64 {
        let (a, shadow, stop, refused) = (Arc::clone(&a), Arc::clone(&shadow), Arc::clone(&stop), Arc::clone(&refused));
        workers.push(std::thread::spawn(move || {
            let tag = ["adv_race_kv", "adv_race_kv", "adv_race_w", "default"][t as usize];
            if tag != "default" {
                tags::enter(tag, tag == "adv_race_w").unwrap();
            }
            let mut rng = 0xada0 + t;
            let mut mine: Vec<(usize, u64, u64)> = Vec::new();
            let stream = Stream(t + 1);
            let mut ops = 0;
            while !stop.load(Ordering::Relaxed) || ops < 2000 {
                ops += 1;
                let r = next(&mut rng);
                if mine.len() < 48 && (r % 3 != 0 || mine.is_empty()) {
                    let device = (r >> 8) as usize % 2;
                    let size = match (r >> 16) % 4 {
                        0 => 512 + (r >> 24) % 8192,
                        1 => MIB + (r >> 24) % (3 * MIB),
                        2 => 16 * MIB + (r >> 24) % (8 * MIB),
                        _ => 1 + (r >> 24) % 511,
                    };
                    match a.malloc(device, size, stream) {
                        Ok(p) => {
                            shadow.insert(device, p, size);
                            mine.push((device, p, size));
                        }
                        Err(Error::Paused(m)) => {
                            assert!(m.contains("adv_race_kv") && tag == "adv_race_kv", "{tag}: {m}");
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("thread {t} ({tag}): malloc of {size} on device {device}: {e}"),
                    }
                } else if !mine.is_empty() {
                    let (device, p, size) = mine.swap_remove((r >> 8) as usize % mine.len());
                    if r % 7 == 0 {
                        a.record_stream(device, p, Stream(100 + t)).unwrap();
                    }
                    shadow.remove(device, p);
                    a.free(device, p, size).unwrap_or_else(|e| panic!("thread {t} ({tag}): free {p:#x}: {e}"));
                }
                if ops % 256 == 0 {
                    a.advance_time(200_000);
                }
            }
            if tag != "default" {
                tags::exit().unwrap();
            }
            mine
        }));
    }
    let reader = {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let text = metrics::render(&a);
                assert!(text.contains("stepalloc_tag_paused{"), "{text}");
                let json: serde_json::Value = serde_json::from_str(&a.tags_json()).expect("tags_json is JSON");
                assert!(json.get("default").is_some(), "{json}");
                let _ = a.stats_json(1).unwrap();
                reads += 1;
            }
            reads
        })
    };
    let mut cycles = 0;
    for i in 0..40 {
        let backup = if i % 3 == 0 { Some(true) } else { None };
        let r = a.pause(Some("adv_race_kv"), backup).unwrap_or_else(|e| panic!("pause {i}: {e}"));
        assert!(r.skipped.is_empty(), "pause {i}: {r:?}");
        std::thread::yield_now();
        let r = a.resume(Some("adv_race_kv")).unwrap_or_else(|e| panic!("resume {i}: {e}"));
        assert_eq!(r.tags, ["adv_race_kv"], "resume {i}");
        cycles += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let kept: Vec<Vec<(usize, u64, u64)>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let reads = reader.join().unwrap();
    assert_eq!(cycles, 40);
    assert!(reads > 0);
    a.check_invariants().unwrap();
    for &(device, p, size) in kept.iter().flatten() {
        assert!(a.with_heap(device, |h| h.is_live(p)).unwrap(), "block {p:#x} ({size}) on device {device} lost");
        a.free(device, p, size).unwrap();
    }
    a.check_invariants().unwrap();
    a.advance_time(10_000_000);
    a.empty_cache().unwrap();
    assert_eq!((used(&a, 0), used(&a, 1)), (0, 0), "memory left on the devices");
    eprintln!("{} allocations refused while paused", refused.load(Ordering::Relaxed));
}

/// Scrapes (the text and the HTTP endpoint) and `tags_json` while pause and resume run on
/// another thread: every scrape is well formed and consistent with itself — a paused tag has
/// no live bytes and a tag that is not paused no paused bytes, on each device; the allocated
/// bytes never exceed the reserved bytes; no scrape waits behind a pause for long (no
/// deadlock: the test ends).
#[test]
fn scrapes_and_tags_stay_well_formed_and_consistent_while_pause_and_resume_run() {
    let a = Arc::new(sim_4gib(&format!(",sim_devices:2,{}", stepalloc::config::RECOMMENDED)));
    let w0 = in_region_on(&a, 0, "adv_scrape_w", true, &[40 * MIB, 4096, 3 * MIB]);
    let w1 = in_region_on(&a, 1, "adv_scrape_w", true, &[24 * MIB]);
    let kv = in_region_on(&a, 0, "adv_scrape_kv", false, &[64 * MIB]);
    let plain = a.malloc(0, 10 * MIB, S0).unwrap();
    let server = metrics::serve(Arc::clone(&a), "127.0.0.1:0").expect("serve");
    let addr = server.addr;
    let stop = Arc::new(AtomicBool::new(false));
    let controller = {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) && n < 400 {
                let tag = if n % 2 == 0 { "adv_scrape_w" } else { "adv_scrape_kv" };
                a.pause(Some(tag), None).unwrap();
                a.resume(None).unwrap();
                n += 1;
            }
            n
        })
    };
    let mut checked = 0;
    for i in 0..150 {
        let text = if i % 5 == 0 {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
            let mut raw = String::new();
            s.read_to_string(&mut raw).expect("a scrape answered within 20 s");
            let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            body.to_string()
        } else {
            metrics::render(&a)
        };
        let s = samples(&text);
        let get = |name: &str, labels: &[(&str, &str)]| {
            sample(&s, name, labels).unwrap_or_else(|| panic!("scrape {i}: no sample {name}{labels:?}"))
        };
        for device in ["0", "1"] {
            for tag in ["adv_scrape_w", "adv_scrape_kv"] {
                let labels = [("device", device), ("tag", tag)];
                let Some(paused) = sample(&s, "stepalloc_tag_paused", &labels) else { continue };
                let live = get("stepalloc_tag_live_bytes", &labels);
                let paused_bytes = get("stepalloc_tag_paused_bytes", &labels);
                if paused == 1.0 {
                    assert_eq!(live, 0.0, "scrape {i}: device {device}: paused {tag} with live bytes");
                } else {
                    assert_eq!(paused_bytes, 0.0, "scrape {i}: device {device}: {tag} not paused, paused bytes");
                }
                checked += 1;
            }
            let pools = ["small", "large"];
            let reserved: f64 =
                pools.iter().map(|&pool| get("stepalloc_reserved_bytes", &[("device", device), ("pool", pool)])).sum();
            let mapped = get("stepalloc_mapped_bytes", &[("device", device)]);
            assert_eq!(mapped, reserved, "scrape {i}: device {device}: mapped bytes against reserved bytes");
            for pool in pools {
                let labels = [("device", device), ("pool", pool)];
                let allocated = get("stepalloc_allocated_bytes", &labels);
                let reserved = get("stepalloc_reserved_bytes", &labels);
                assert!(allocated <= reserved, "scrape {i}: device {device} {pool}: {allocated} > {reserved}");
            }
        }
        let json: serde_json::Value = serde_json::from_str(&a.tags_json()).expect("tags_json is JSON");
        for tag in ["adv_scrape_w", "adv_scrape_kv", "default"] {
            let f = &json[tag];
            assert!(f["live_bytes"].is_u64() && f["paused"].is_boolean(), "{json}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let cycles = controller.join().unwrap();
    server.shutdown();
    assert!(cycles > 0 && checked > 0);
    a.resume(None).unwrap();
    a.check_invariants().unwrap();
    for (d, blocks) in [(0, w0), (1, w1), (0, kv), (0, vec![(plain, 10 * MIB)])] {
        for (p, s) in blocks {
            a.free(d, p, s).unwrap();
        }
    }
}

/// One thread pauses every tag while another resumes every tag, on two devices. Each call
/// returns; what must hold after both are done is the tag-level state the contract promises
/// ("on several devices a resume is all or none"): each tag paused on every device or on none.
/// Both calls go device by device in the same order, so the resume cannot overtake the pause
/// unless the pausing thread is preempted between releasing device 0 and taking device 1 and
/// the resuming thread takes device 1 first; nothing serializes whole calls. Not reproduced in
/// 300 rounds on a loaded 2-core machine: a search for that window, run on demand.
#[test]
#[ignore = "a search for a rare race (not reproduced): cargo test --test adversarial_sleep -- --ignored concurrent"]
fn concurrent_pause_and_resume_of_all_tags_leave_each_tag_whole() {
    let a = Arc::new(sim_4gib(",sim_devices:2"));
    let mut blocks = Vec::new();
    for tag in ["adv_cc_a", "adv_cc_b"] {
        for device in 0..2 {
            blocks.push((device, in_region_on(&a, device, tag, true, &[MIB; 64])));
        }
    }
    let mut mixed = Vec::new();
    for round in 0..100 {
        let (p, r) = (Arc::clone(&a), Arc::clone(&a));
        let pauser = std::thread::spawn(move || p.pause(None, None).map(|_| ()));
        let resumer = std::thread::spawn(move || r.resume(None).map(|_| ()));
        pauser.join().unwrap().unwrap();
        resumer.join().unwrap().unwrap();
        for tag in ["adv_cc_a", "adv_cc_b"] {
            let state = (paused_on(&a, 0, tag), paused_on(&a, 1, tag));
            if state.0 != state.1 {
                mixed.push(format!("round {round}: {tag} paused on devices {state:?}"));
            }
        }
        a.resume(None).unwrap();
    }
    a.check_invariants().unwrap();
    for (device, list) in blocks {
        for (p, s) in list {
            a.free(device, p, s).unwrap();
        }
    }
    assert!(mixed.is_empty(), "{} of 200: {:?}", mixed.len(), &mixed[..mixed.len().min(5)]);
}

/// `resume(None)` with two tags paused and room for only one: the first resumes, the second
/// fails with an out-of-memory error naming it and stays paused with its backup; the first is
/// not rolled back (each tag is all or none, not the call), and a retry resumes the rest.
#[test]
fn resume_of_every_tag_with_room_for_one_resumes_it_and_names_the_other() {
    let a = sim_4gib(",sim_capacity_mb:512,expandable_segments:True");
    let first = in_region_on(&a, 0, "adv_all_a", true, &[150 * MIB]);
    let second = in_region_on(&a, 0, "adv_all_b", true, &[150 * MIB]);
    a.pause(None, None).unwrap();
    let hog = a.malloc(0, 250 * MIB, S0).unwrap();
    let e = a.resume(None).unwrap_err();
    assert!(matches!(&e, Error::OutOfMemory(r) if r.hint.contains("adv_all_b")), "{e}");
    assert!(!paused_on(&a, 0, "adv_all_a") && paused_on(&a, 0, "adv_all_b"));
    assert_eq!(figures(&a, "adv_all_b").backup_bytes, 150 * MIB);
    a.check_invariants().unwrap();
    a.free(0, hog, 250 * MIB).unwrap();
    let r = a.resume(None).unwrap();
    assert_eq!((r.tags.as_slice(), r.copied_bytes), (["adv_all_b".to_string()].as_slice(), 150 * MIB));
    for (p, s) in first.into_iter().chain(second) {
        a.free(0, p, s).unwrap();
    }
}

/// `record_stream` on a paused tag's block, then its free while paused, and the same with the
/// free after the resume: the block's extra streams are dropped with it, or waited for, and
/// the heap's records stay whole.
#[test]
fn record_stream_on_a_paused_block_then_free_while_paused_or_after() {
    let a = sim_4gib(&format!(",sim_event_delay_us:50,{}", stepalloc::config::RECOMMENDED));
    let blocks = in_region_on(&a, 0, "adv_rs_w", true, &[3 * MIB, 5 * MIB]);
    a.pause(Some("adv_rs_w"), None).unwrap();
    for &(p, _) in &blocks {
        a.record_stream(0, p, Stream(9)).unwrap();
    }
    a.free(0, blocks[0].0, blocks[0].1).unwrap();
    a.check_invariants().unwrap();
    let r = a.resume(Some("adv_rs_w")).unwrap();
    assert_eq!(r.copied_bytes, 5 * MIB);
    a.free(0, blocks[1].0, blocks[1].1).unwrap();
    a.check_invariants().unwrap();
    a.advance_time(1_000_000);
    a.empty_cache().unwrap();
    assert_eq!(used(&a, 0), 0);
}

/// A tensor of a tag sent to another process (CUDA IPC) holds the tag's pause back until its
/// receivers let go (`unshare`, once per share): the receiver keeps the pages it mapped, so a
/// pause would give the two processes different memory behind one tensor (the 4th pass's
/// defect D). The refusal changes nothing and names the tag; a pointer not shared is refused.
#[test]
fn a_tag_with_a_tensor_held_by_another_process_does_not_pause_until_it_is_let_go() {
    let a = sim_4gib(",sim_devices:2");
    let blocks = in_region_on(&a, 1, "adv_ipc_w", true, &[8 * MIB, 4096]);
    let (p, _) = blocks[0];
    for _ in 0..2 {
        a.with_heap(1, |h| h.share(p)).unwrap().unwrap();
    }
    let before = a.stats(1).unwrap().heap.num_unmap;
    for left in [2, 1] {
        let e = a.pause(Some("adv_ipc_w"), None).unwrap_err().to_string();
        assert!(
            e.contains("pause of tag \"adv_ipc_w\": 1 of its tensors (8388608 bytes)") && e.contains("CUDA IPC"),
            "{e}"
        );
        assert!(!paused_on(&a, 0, "adv_ipc_w") && !paused_on(&a, 1, "adv_ipc_w"), "{left} shares left");
        a.with_heap(1, |h| h.unshare(p)).unwrap().unwrap();
    }
    assert_eq!(a.stats(1).unwrap().heap.num_unmap, before, "a refused pause unmapped");
    assert!(matches!(a.with_heap(1, |h| h.unshare(p)).unwrap(), Err(Error::UnknownPointer { .. })));
    assert_eq!(a.pause(Some("adv_ipc_w"), None).unwrap().copied_bytes, 8 * MIB + 4096);
    a.resume(Some("adv_ipc_w")).unwrap();
    for (p, s) in blocks {
        a.free(1, p, s).unwrap();
    }
}
