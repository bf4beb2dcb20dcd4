//! The backup stores of paused tags (src/heap/backup.rs) on the simulated device: what a region
//! with a `mmap` store backs up goes to pageable host memory (the pinned figure stays 0), what a
//! `disk` region backs up goes to one file per block in the backup directory (while paused
//! only; removed at resume and at the block's free), and every store of one tag keeps its own
//! memory. Bad input: a backup directory that cannot be set, one that is gone or a file that
//! cannot be written at pause: the pause fails naming the tag and the path, nothing is released,
//! no file is left, and a later pause works. The simulated device holds no bytes, so the files
//! hold zeros of the right length (the hostcuda test in src/backend/cuda/host.rs checks bytes).
//! The backup directory is process-wide: the tests that set it take `DIR_LOCK`.

mod common;

use common::{figures, in_region_with, sim_4gib};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use stepalloc::heap::{backup_dir, set_backup_dir};
use stepalloc::tags::Store;
use stepalloc::units::MIB;

static DIR_LOCK: Mutex<()> = Mutex::new(());

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stepalloc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The files in `dir` with their sizes, sorted by size.
fn files(dir: &Path) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
        .collect();
    out.sort_by_key(|&(_, len)| len);
    out
}

#[test]
fn the_mmap_store_backs_up_to_pageable_memory_and_pins_none() {
    let a = sim_4gib("");
    let tag = "stores_mmap";
    let blocks = in_region_with(&a, 0, tag, Store::Mmap, &[30 * MIB, 1000, 70 * MIB]);
    let want: u64 = blocks.iter().map(|&(_, s)| s).sum();
    for cycle in 0..3 {
        let r = a.pause(Some(tag), None).unwrap();
        assert_eq!(r.copied_bytes, want, "cycle {cycle}");
        let f = figures(&a, tag);
        assert_eq!((f.paused, f.backup_bytes), (true, want));
        assert!(f.mmap_bytes >= want, "cycle {cycle}: {} pageable bytes for {want}", f.mmap_bytes);
        assert_eq!(f.host_bytes, 0, "cycle {cycle}: the mmap store pinned host memory");
        assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0, "no pinned memory on the device");
        let r = a.resume(Some(tag)).unwrap();
        assert_eq!(r.copied_bytes, want);
        a.check_invariants().unwrap();
    }
    a.release_backup().unwrap();
    assert_eq!(figures(&a, tag).mmap_bytes, 0, "release_backup unmaps the pageable buffers");
    for (p, s) in blocks {
        a.free(0, p, s).unwrap();
    }
}

#[test]
fn one_tag_keeps_each_stores_memory_apart() {
    let _dir = DIR_LOCK.lock().unwrap();
    let dir = scratch("stores-mixed");
    set_backup_dir(dir.to_str().unwrap()).unwrap();
    let a = sim_4gib("");
    let tag = "stores_mixed";
    let pinned = in_region_with(&a, 0, tag, Store::Pinned, &[8 * MIB]);
    let mmap = in_region_with(&a, 0, tag, Store::Mmap, &[6 * MIB]);
    let disk = in_region_with(&a, 0, tag, Store::Disk, &[4 * MIB, 3000]);
    let none = in_region_with(&a, 0, tag, Store::None, &[10 * MIB]);
    let r = a.pause(Some(tag), None).unwrap();
    assert_eq!(r.copied_bytes, 8 * MIB + 6 * MIB + 4 * MIB + 3000);
    assert_eq!(r.discarded_bytes, 10 * MIB);
    let f = figures(&a, tag);
    assert_eq!(f.disk_bytes, 4 * MIB + 3000);
    assert!(f.mmap_bytes >= 6 * MIB && f.host_bytes >= 8 * MIB, "{f:?}");
    assert_eq!(files(&dir).iter().map(|f| f.1).collect::<Vec<_>>(), [3000, 4 * MIB], "a file per disk block");
    let r = a.resume(Some(tag)).unwrap();
    assert_eq!(r.copied_bytes, 8 * MIB + 6 * MIB + 4 * MIB + 3000);
    assert!(files(&dir).is_empty(), "files left after resume: {:?}", files(&dir));
    assert_eq!(figures(&a, tag).disk_bytes, 0);
    // Only names show: "default" and the registered tags, not the other numbers of a name's
    // stores (the per-number state grows by index).
    let registered: Vec<String> = stepalloc::tags::registered().into_iter().map(|(_, name)| name).collect();
    for f in a.tag_figures() {
        assert!(f.tag == "default" || registered.contains(&f.tag), "a figure for no name: {}", f.tag);
    }
    for (p, s) in pinned.into_iter().chain(mmap).chain(disk).chain(none) {
        a.free(0, p, s).unwrap();
    }
    a.check_invariants().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_disk_store_writes_a_file_per_block_while_paused_only() {
    let _dir = DIR_LOCK.lock().unwrap();
    let dir = scratch("stores-disk");
    set_backup_dir(dir.to_str().unwrap()).unwrap();
    assert_eq!(backup_dir(), dir);
    for conf in ["", ",expandable_segments:True"] {
        let a = sim_4gib(conf);
        let tag = "stores_disk";
        // More than one staging buffer (64 MiB), an odd size, a small one.
        let blocks = in_region_with(&a, 0, tag, Store::Disk, &[150 * MIB + 12345, 7, 2 * MIB]);
        let want: u64 = blocks.iter().map(|&(_, s)| s).sum();
        let mut sizes = Vec::new();
        for cycle in 0..3 {
            let r = a.pause(None, None).unwrap();
            assert_eq!(r.copied_bytes, want, "{conf} cycle {cycle}");
            let on_disk = files(&dir);
            assert_eq!(on_disk.iter().map(|f| f.1).collect::<Vec<_>>(), [7, 2 * MIB, 150 * MIB + 12345], "{conf}");
            assert!(on_disk.iter().all(|(n, _)| n.contains(tag)), "the file names the tag: {on_disk:?}");
            assert_eq!(figures(&a, tag).disk_bytes, want);
            sizes.push(on_disk.iter().map(|f| f.1).sum::<u64>());
            // Disk-backed memory has no host copy (torch_memory_saver's get_cpu_backup: None).
            assert_eq!(a.backup_host_address(blocks[0].0, 4), None);
            let r = a.resume(None).unwrap();
            assert_eq!(r.copied_bytes, want);
            assert!(files(&dir).is_empty(), "{conf}: files left after resume: {:?}", files(&dir));
            a.check_invariants().unwrap();
        }
        assert!(sizes.windows(2).all(|w| w[0] == w[1]), "disk use changed across cycles: {sizes:?}");
        // A block freed while paused takes its file with it.
        a.pause(Some(tag), None).unwrap();
        a.free(0, blocks[0].0, blocks[0].1).unwrap();
        assert_eq!(files(&dir).len(), 2, "the freed block's file stayed");
        a.resume(Some(tag)).unwrap();
        assert!(files(&dir).is_empty());
        for &(p, s) in &blocks[1..] {
            a.free(0, p, s).unwrap();
        }
        a.release_backup().unwrap();
        assert_eq!(a.with_heap(0, |h| h.backup_host_bytes()).unwrap(), 0, "the staging buffers are released");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_pause_that_cannot_write_its_files_fails_naming_tag_and_path_and_loses_nothing() {
    let _dir = DIR_LOCK.lock().unwrap();
    let dir = scratch("stores-bad");
    // Refused when set: under a regular file; the directory in force stays.
    set_backup_dir(dir.to_str().unwrap()).unwrap();
    let file = dir.join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let e = set_backup_dir(file.join("sub").to_str().unwrap()).unwrap_err().to_string();
    assert!(e.contains("plain-file/sub"), "{e}");
    assert_eq!(backup_dir(), dir);
    std::fs::remove_file(&file).unwrap();

    let a = sim_4gib("");
    let tag = "stores_bad";
    let other = in_region_with(&a, 0, "stores_bad_pinned", Store::Pinned, &[4 * MIB]);
    let blocks = in_region_with(&a, 0, tag, Store::Disk, &[20 * MIB, 5 * MIB]);
    let kept = in_region_with(&a, 0, tag, Store::Pinned, &[3 * MIB]);
    let live = figures(&a, tag).live_bytes;
    let reserved = a.stats(0).unwrap().heap.reserved_bytes.all.current;
    // The directory disappears after it was set: the pause fails at the first file.
    std::fs::remove_dir_all(&dir).unwrap();
    let e = a.pause(Some(tag), None).unwrap_err().to_string();
    assert!(e.contains(tag) && e.contains(dir.to_str().unwrap()), "the error names the tag and the path: {e}");
    let f = figures(&a, tag);
    assert!(!f.paused && f.live_bytes == live && f.paused_bytes == 0, "the tag is resident: {f:?}");
    assert_eq!(a.stats(0).unwrap().heap.reserved_bytes.all.current, reserved, "nothing was released");
    a.check_invariants().unwrap();
    // Every name stays usable: another tag pauses, and this one once the directory is back.
    a.pause(Some("stores_bad_pinned"), None).unwrap();
    a.resume(Some("stores_bad_pinned")).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    let r = a.pause(Some(tag), None).unwrap();
    assert_eq!(r.copied_bytes, 25 * MIB + 3 * MIB);
    assert_eq!(files(&dir).len(), 2);
    a.resume(Some(tag)).unwrap();
    assert!(files(&dir).is_empty());
    // A file gone while paused: the resume fails naming it, the tag stays paused with the rest
    // of its backup; once the block whose file is gone is freed, the resume works.
    a.pause(Some(tag), None).unwrap();
    let (gone, _) = files(&dir).pop().unwrap(); // the largest: the 20 MiB block's
    std::fs::remove_file(dir.join(&gone)).unwrap();
    let e = a.resume(Some(tag)).unwrap_err().to_string();
    assert!(e.contains(&gone) && e.contains("stays paused"), "{e}");
    assert!(figures(&a, tag).paused);
    a.check_invariants().unwrap();
    a.free(0, blocks[0].0, blocks[0].1).unwrap();
    let r = a.resume(Some(tag)).unwrap();
    assert_eq!(r.copied_bytes, 5 * MIB + 3 * MIB);
    assert!(files(&dir).is_empty());
    for (p, s) in blocks.into_iter().skip(1).chain(kept).chain(other) {
        a.free(0, p, s).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_host_memory_for_the_mmap_store_fails_the_pause_with_the_kind_named() {
    let a = sim_4gib(",sim_host_capacity_mb:16");
    let tag = "stores_mmap_short";
    let blocks = in_region_with(&a, 0, tag, Store::Mmap, &[40 * MIB]);
    let e = a.pause(Some(tag), None).unwrap_err().to_string();
    assert!(e.contains(tag) && e.contains("pageable (mmap) host memory"), "{e}");
    assert!(!figures(&a, tag).paused);
    a.free(0, blocks[0].0, blocks[0].1).unwrap();
}
