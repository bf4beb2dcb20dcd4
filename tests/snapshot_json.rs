//! The snapshot written straight to text (`Allocator::snapshot_json`, what the C ABI serves)
//! is the same document as the JSON tree, and the settings are PyTorch's types.

use stepalloc::{Allocator, Config, Stream};

#[test]
fn snapshot_text_is_the_snapshot_and_settings_use_torchs_int64() {
    let a = Allocator::new(Config::parse("backend:sim,sim_devices:2,trace_entries:100000").expect("config"))
        .expect("allocator");
    a.step_begin("train").expect("step");
    let mut live = Vec::new();
    for i in 0..2000u64 {
        let device = (i % 2) as usize;
        live.push((device, a.malloc(device, 512 + i * 700, Stream(i % 3)).expect("malloc")));
    }
    for &(device, p) in live.iter().step_by(3) {
        a.free(device, p, 0).expect("free");
    }
    a.step_end().expect("step end");
    let text = a.snapshot_json();
    let parsed: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert_eq!(parsed, a.snapshot());
    assert_eq!(parsed["allocator_settings"]["max_split_size"], serde_json::json!(-1));
    assert_eq!(parsed["device_traces"].as_array().map(Vec::len), Some(2));
    let blocks: usize = parsed["segments"]
        .as_array()
        .expect("segments")
        .iter()
        .map(|s| s["blocks"].as_array().map_or(0, Vec::len))
        .sum();
    assert!(blocks > 1333, "every live block is listed: {blocks}");
    assert_eq!(parsed["external_annotations"][0]["stage"], "START");
    let limited =
        Allocator::new(Config::parse("backend:sim,max_split_size_mb:128").expect("config")).expect("allocator");
    assert_eq!(limited.snapshot()["allocator_settings"]["max_split_size"], serde_json::json!(128i64 << 20));
}
