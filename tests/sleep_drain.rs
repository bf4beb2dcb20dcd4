//! A pause drains the device before it unmaps anything: every stream's queued work, not only
//! the streams the heap saw allocate or `record_stream` (a kernel queued on a side stream may
//! still write a tensor of the tag: unmapping under it faults on a GPU). On the watched
//! simulated device the log shows the device synchronization before the pause's first unmap,
//! whether the tag is backed up or discarded, and for `pause` of several tags.

mod common;

use common::watched::watched;
use stepalloc::units::MIB;
use stepalloc::{tags, Stream};

#[test]
fn a_pause_synchronizes_the_device_before_its_first_unmap() {
    for (tag, backup) in [("drain_backed", true), ("drain_discarded", false)] {
        let (a, watch) = watched("sim_capacity_mb:1024");
        tags::enter(tag, backup).unwrap();
        let blocks: Vec<u64> = [8 * MIB, 64 * MIB].iter().map(|&s| a.malloc(0, s, Stream(0)).unwrap()).collect();
        tags::exit().unwrap();
        watch.lock().log.clear();
        let r = a.pause(Some(tag), None).unwrap();
        assert!(r.released_bytes >= 72 * MIB, "{tag}: {r:?}");
        let log = watch.lock().log.clone();
        let first_unmap = log.iter().position(|c| c == "unmap").expect("the pause unmapped pages");
        let sync = log.iter().position(|c| c == "synchronize");
        assert!(
            sync.is_some_and(|s| s < first_unmap),
            "{tag}: the device is not synchronized before the first unmap: {log:?}"
        );
        a.resume(Some(tag)).unwrap();
        for (p, s) in blocks.into_iter().zip([8 * MIB, 64 * MIB]) {
            a.free(0, p, s).unwrap();
        }
    }
}
