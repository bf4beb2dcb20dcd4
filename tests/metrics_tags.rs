//! The per-tag figures on the Prometheus endpoint (src/metrics/collector.rs), against exact
//! expected values on the simulated device: live, paused and backed-up bytes, the pinned host
//! memory kept for a tag's backups, pauses and resumes, through several pause / resume cycles
//! of a backed-up and a discarded tag; the tag label set stays bounded (one value per tag a
//! region named, plus "default"); the families follow the metric rules (DESIGN.md).

mod common;

use common::samples;
use std::collections::{BTreeMap, BTreeSet};
use stepalloc::metrics::{self, Kind, METRICS};
use stepalloc::{tags, Allocator, Config, Stream};

const MIB: u64 = 1 << 20;
const S: Stream = Stream(0);

/// The per-tag samples of `name` on device 0, by tag.
fn by_tag(a: &Allocator, name: &str) -> BTreeMap<String, f64> {
    samples(&metrics::render(a))
        .into_iter()
        .filter(|((n, l), _)| n == name && l.get("device").map(String::as_str) == Some("0"))
        // Host memory by kind: these tags' backups are pinned.
        .filter(|((_, l), _)| l.get("kind").is_none_or(|k| k == "pinned"))
        .map(|((_, l), v)| (l["tag"].clone(), v))
        .collect()
}

fn figure(a: &Allocator, name: &str, tag: &str) -> u64 {
    *by_tag(a, name).get(tag).unwrap_or_else(|| panic!("no {name}{{tag={tag:?}}}")) as u64
}

#[test]
fn per_tag_figures_follow_pause_and_resume_exactly() {
    let a = Allocator::new(Config::parse("backend:sim,sim_capacity_mb:4096").unwrap()).unwrap();
    let (w, k) = ("metrics_tags_weights", "metrics_tags_kv");
    // Sizes of whole large-pool granules, so the blocks' sizes are the requests'.
    let weights = [96 * MIB, 10 * MIB, 2 * MIB];
    let kv = [256 * MIB];
    tags::enter(w, true).unwrap();
    let wp: Vec<u64> = weights.iter().map(|&s| a.malloc(0, s, S).unwrap()).collect();
    tags::exit().unwrap();
    tags::enter(k, false).unwrap();
    let kp: Vec<u64> = kv.iter().map(|&s| a.malloc(0, s, S).unwrap()).collect();
    tags::exit().unwrap();
    let untagged = a.malloc(0, 4 * MIB, S).unwrap();
    let (wb, kb): (u64, u64) = (weights.iter().sum(), kv.iter().sum());

    assert_eq!(figure(&a, "stepalloc_tag_live_bytes", w), wb);
    assert_eq!(figure(&a, "stepalloc_tag_live_bytes", k), kb);
    assert_eq!(figure(&a, "stepalloc_tag_live_bytes", "default"), 4 * MIB);
    for name in ["stepalloc_tag_paused_bytes", "stepalloc_tag_backup_bytes", "stepalloc_tag_pauses_total"] {
        assert_eq!(figure(&a, name, w), 0, "{name}");
    }

    let mut host = 0;
    for cycle in 1..=4u64 {
        a.pause(None, None).unwrap();
        assert_eq!(figure(&a, "stepalloc_tag_live_bytes", w), 0, "cycle {cycle}");
        assert_eq!(figure(&a, "stepalloc_tag_paused_bytes", w), wb, "cycle {cycle}");
        assert_eq!(figure(&a, "stepalloc_tag_paused_bytes", k), kb, "cycle {cycle}");
        assert_eq!(figure(&a, "stepalloc_tag_backup_bytes", w), wb, "cycle {cycle}: backed up");
        assert_eq!(figure(&a, "stepalloc_tag_backup_bytes", k), 0, "cycle {cycle}: discarded");
        assert_eq!(figure(&a, "stepalloc_tag_paused", w), 1);
        assert_eq!(figure(&a, "stepalloc_tag_pauses_total", w), cycle);
        assert_eq!(figure(&a, "stepalloc_tag_pauses_total", k), cycle);
        // The host buffers are allocated at the first pause and kept: the figure is flat.
        let h = figure(&a, "stepalloc_tag_backup_host_bytes", w);
        assert!(h >= wb, "cycle {cycle}: {h} bytes of host memory for {wb} backed up");
        if cycle > 1 {
            assert_eq!(h, host, "cycle {cycle}: the host memory held for backups grew");
        }
        host = h;
        assert_eq!(figure(&a, "stepalloc_tag_backup_host_bytes", k), 0, "a discarded tag holds no host memory");
        a.resume(None).unwrap();
        assert_eq!(figure(&a, "stepalloc_tag_live_bytes", w), wb);
        assert_eq!(figure(&a, "stepalloc_tag_paused_bytes", w), 0);
        assert_eq!(figure(&a, "stepalloc_tag_backup_bytes", w), 0);
        assert_eq!(figure(&a, "stepalloc_tag_paused", w), 0);
        assert_eq!(figure(&a, "stepalloc_tag_resumes_total", w), cycle);
        assert_eq!(figure(&a, "stepalloc_tag_resumes_total", k), cycle);
    }
    let seconds = samples(&metrics::render(&a))
        .into_iter()
        .filter(|((n, l), _)| n == "stepalloc_tag_sleep_seconds_total" && l["tag"] == w)
        .count();
    assert_eq!(seconds, 2, "one series per op (pause, resume)");
    a.release_backup().unwrap();
    assert_eq!(figure(&a, "stepalloc_tag_backup_host_bytes", w), 0, "release_backup gives the host memory back");
    for (p, s) in wp.into_iter().zip(weights).chain(kp.into_iter().zip(kv)).chain([(untagged, 4 * MIB)]) {
        a.free(0, p, s).unwrap();
    }
}

#[test]
fn the_tag_label_set_is_bounded_and_the_families_follow_the_rules() {
    let a = Allocator::new(Config::parse("backend:sim,sim_capacity_mb:4096").unwrap()).unwrap();
    tags::enter("metrics_tags_bounded", false).unwrap();
    let p = a.malloc(0, 2 * MIB, S).unwrap();
    tags::exit().unwrap();
    let samples = samples(&metrics::render(&a));
    let tag_values: BTreeSet<String> = samples.keys().filter_map(|(_, l)| l.get("tag").cloned()).collect();
    let registered: BTreeSet<String> =
        tags::registered().into_iter().map(|(_, n)| n).chain([tags::DEFAULT_NAME.to_string()]).collect();
    // Tags of other tests in this binary may have no memory on this allocator, so no series.
    assert!(tag_values.is_subset(&registered), "label values beyond the tags regions named: {tag_values:?}");
    assert!(tag_values.contains("metrics_tags_bounded") && tag_values.contains(tags::DEFAULT_NAME));
    assert!(tag_values.len() <= tags::MAX_TAGS + 1);
    for spec in METRICS.iter().filter(|m| m.name.starts_with("stepalloc_tag_")) {
        assert!(spec.labels.contains(&"tag") && spec.labels.contains(&"device"), "{}", spec.name);
        match spec.kind {
            Kind::Counter => assert!(spec.name.ends_with("_total"), "{}", spec.name),
            _ => assert!(!spec.name.ends_with("_total"), "{}", spec.name),
        }
        assert!(samples.keys().any(|(n, _)| n == spec.name || n.starts_with(spec.name)), "{} is exported", spec.name);
    }
    a.free(0, p, 2 * MIB).unwrap();
}
