//! The colocated loop: on the default preset, stepalloc's pause/resume keeps the device's peak
//! within 3% of the larger phase's own peak and below every other way of sharing the device,
//! and its modelled switch time within 1.2x of its copies at link speed; the run is
//! deterministic; the command line prints the table and the JSON it promises.

use stepalloc_stress::workload::colocated::{self, ColocatedReport, ColocatedSpec, CostModel, PCIE4_X16_GBPS};

fn default_run() -> ColocatedReport {
    colocated::run(&ColocatedSpec::default(), 80, CostModel::new(PCIE4_X16_GBPS).unwrap()).unwrap()
}

#[test]
fn stepalloc_reaches_the_larger_phase_peak_at_link_speed() {
    let r = default_run();
    let names: Vec<&str> = r.columns.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["both_resident", "pytorch_empty_cache", "vllm_sleep", "stepalloc"]);
    let s = r.columns.iter().find(|c| c.name == "stepalloc").unwrap();
    let larger = r.rollout_phase_peak.max(r.train_phase_peak);
    assert_eq!(r.larger_phase_peak, larger);
    // No way of sharing holds less than the larger phase needs.
    for c in &r.columns {
        assert!(c.peak_bytes >= larger, "{}: {} below the larger phase's {larger}", c.name, c.peak_bytes);
    }
    assert!(
        s.peak_bytes as f64 <= larger as f64 * 1.03,
        "stepalloc's peak {} over 1.03x the larger phase's {larger}",
        s.peak_bytes
    );
    for c in r.columns.iter().filter(|c| c.name != "stepalloc") {
        assert!(
            s.peak_bytes < c.peak_bytes,
            "stepalloc's peak {} not below {}'s {}",
            s.peak_bytes,
            c.name,
            c.peak_bytes
        );
    }
    // The weights go out and come back every iteration; the cache is discarded.
    assert_eq!(s.copied_per_iteration, 2 * r.engine_weight_bytes);
    let floor = s.copied_per_iteration as f64 / (PCIE4_X16_GBPS * 1e9);
    assert!((s.link_floor_s_per_iteration - floor).abs() < 1e-9);
    assert!(
        s.switch_s_per_iteration >= floor && s.switch_s_per_iteration <= 1.2 * floor,
        "stepalloc's switch {:.4} s against {floor:.4} s of copies at link speed",
        s.switch_s_per_iteration
    );
    // Only the sleeping columns copy; every column fits 80 GiB, none fits 34 GiB.
    let copied: Vec<bool> = r.columns.iter().map(|c| c.copied_per_iteration > 0).collect();
    assert_eq!(copied, [false, false, true, true]);
    assert!(r.columns.iter().all(|c| c.fits));
    let tight = colocated::run(&ColocatedSpec::default(), 34, CostModel::new(PCIE4_X16_GBPS).unwrap()).unwrap();
    assert!(tight.columns.iter().all(|c| !c.fits));
}

#[test]
fn same_spec_same_report_and_the_link_scales_the_copies() {
    assert_eq!(default_run(), default_run());
    let fast = colocated::run(&ColocatedSpec::default(), 80, CostModel::new(50.0).unwrap()).unwrap();
    let slow = default_run();
    for (f, s) in fast.columns.iter().zip(&slow.columns) {
        assert_eq!(f.peak_bytes, s.peak_bytes);
        assert!((f.link_floor_s_per_iteration * 2.0 - s.link_floor_s_per_iteration).abs() < 1e-9);
        assert!(f.switch_s_per_iteration <= s.switch_s_per_iteration);
    }
}

#[test]
fn bad_dimensions_and_links_are_refused_with_the_flag() {
    let bad = ColocatedSpec { response_max: 1, ..ColocatedSpec::default() };
    let e = colocated::run(&bad, 80, CostModel::new(25.0).unwrap()).unwrap_err();
    assert!(e.contains("--response-max"), "{e}");
    let bad = ColocatedSpec { hidden: 1000, ..ColocatedSpec::default() };
    assert!(colocated::run(&bad, 80, CostModel::new(25.0).unwrap()).unwrap_err().contains("--heads"));
    for link in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
        assert!(CostModel::new(link).unwrap_err().contains("--link-gbps"), "{link}");
    }
    let huge = ColocatedSpec { iterations: 64, micro_batches: 64, layers: 256, ..ColocatedSpec::default() };
    assert!(colocated::run(&huge, 80, CostModel::new(25.0).unwrap()).unwrap_err().contains("events"));
    let e = colocated::run(&ColocatedSpec::default(), 0, CostModel::new(25.0).unwrap()).unwrap_err();
    assert!(e.contains("--capacity-gb"), "{e}");
}

#[test]
fn command_line_prints_the_table_and_json() {
    let bin = env!("CARGO_BIN_EXE_stepalloc-stress");
    let out = std::process::Command::new(bin).args(["colocated", "--iterations", "2"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for want in ["phases' own peaks", "peak device use, GiB", "copied / link bandwidth, ms", "vllm_sleep", "fits"] {
        assert!(text.contains(want), "{want} missing from\n{text}");
    }
    let out = std::process::Command::new(bin)
        .args(["colocated", "--iterations", "2", "--json", "--link-gbps", "50", "--capacity-gb", "40"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cost"]["link_gbps"], 50.0);
    assert_eq!(v["capacity_bytes"], 40u64 << 30);
    assert_eq!(v["columns"].as_array().unwrap().len(), 4);
    assert!(v["columns"][3]["peak_bytes"].as_u64().unwrap() <= v["larger_phase_peak"].as_u64().unwrap() * 103 / 100);
    let out = std::process::Command::new(bin).args(["colocated", "--link-gbps", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--link-gbps"));
}
