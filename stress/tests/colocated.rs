//! The colocated loop: on the default preset, stepalloc's pause/resume keeps the device's peak
//! within 3% of the larger phase's own peak and below every other way of sharing the device,
//! and its modelled switch time within 1.2x of its copies at link speed at 25 and 50 GB/s; the
//! run is deterministic; the command line prints the table and the JSON it promises and honours
//! the device's size however it is given.

use stepalloc_stress::workload::colocated::{
    self, ColocatedReport, ColocatedSpec, CostModel, PCIE4_X16_GBPS, PCIE5_X16_GBPS,
};

const GB80_MB: u64 = 80 * 1024;

fn default_run() -> ColocatedReport {
    colocated::run(&ColocatedSpec::default(), GB80_MB, CostModel::new(PCIE4_X16_GBPS).unwrap()).unwrap()
}

fn stepalloc_column(r: &ColocatedReport) -> &colocated::Column {
    r.columns.iter().find(|c| c.name == "stepalloc").unwrap()
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
    let tight = colocated::run(&ColocatedSpec::default(), 34 * 1024, CostModel::new(PCIE4_X16_GBPS).unwrap()).unwrap();
    assert!(tight.columns.iter().all(|c| !c.fits));
}

#[test]
fn same_spec_same_report_and_the_link_scales_the_copies() {
    assert_eq!(default_run(), default_run());
    let fast = colocated::run(&ColocatedSpec::default(), GB80_MB, CostModel::new(50.0).unwrap()).unwrap();
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
    let e = colocated::run(&bad, GB80_MB, CostModel::new(25.0).unwrap()).unwrap_err();
    assert!(e.contains("--response-max"), "{e}");
    let bad = ColocatedSpec { hidden: 1000, ..ColocatedSpec::default() };
    assert!(colocated::run(&bad, GB80_MB, CostModel::new(25.0).unwrap()).unwrap_err().contains("--heads"));
    for link in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
        assert!(CostModel::new(link).unwrap_err().contains("--link-gbps"), "{link}");
    }
    let huge = ColocatedSpec { iterations: 64, micro_batches: 64, layers: 256, ..ColocatedSpec::default() };
    assert!(colocated::run(&huge, GB80_MB, CostModel::new(25.0).unwrap()).unwrap_err().contains("events"));
    let e = colocated::run(&ColocatedSpec::default(), 0, CostModel::new(25.0).unwrap()).unwrap_err();
    assert!(e.contains("--capacity-gb") && e.contains("--capacity-mb"), "{e}");
    // Grouped-query attention needs as many query heads per key/value head everywhere.
    let bad = ColocatedSpec { kv_heads: 5, ..ColocatedSpec::default() };
    let e = colocated::run(&bad, GB80_MB, CostModel::new(25.0).unwrap()).unwrap_err();
    assert!(e.contains("--heads 12 is not a multiple of --kv-heads 5"), "{e}");
    for kv_heads in [1, 2, 3, 4, 6, 12] {
        let ok = ColocatedSpec { kv_heads, ..ColocatedSpec::default() };
        assert!(ok.validate().is_ok(), "--kv-heads {kv_heads}");
    }
}

/// The default loop's switch at both links, timed on the simulated device's clock as the
/// library makes its calls (its copy engine at the link's rate): within 1.2x of the copies at
/// link speed, and never below them.
#[test]
fn overlapped_switch_is_within_1_2x_of_the_link_at_25_and_50_gbps() {
    for link in [PCIE4_X16_GBPS, PCIE5_X16_GBPS] {
        let r = colocated::run(&ColocatedSpec::default(), GB80_MB, CostModel::new(link).unwrap()).unwrap();
        let s = stepalloc_column(&r);
        let floor = s.link_floor_s_per_iteration;
        assert!(floor > 0.0);
        assert!(
            s.switch_s_per_iteration >= floor && s.switch_s_per_iteration <= 1.2 * floor,
            "{link} GB/s: stepalloc's switch {:.4} s against {floor:.4} s of copies",
            s.switch_s_per_iteration
        );
    }
}

/// `--capacity-mb` and `--h200` were listed and ignored ("device 80 GiB", "fits: yes" for a
/// 1 MiB device); now they set the device, and each capacity flag's 0 is refused under its name.
#[test]
fn capacity_flags_set_the_device_to_fit() {
    let bin = env!("CARGO_BIN_EXE_stepalloc-stress");
    let json = |args: &[&str]| -> serde_json::Value {
        let out = std::process::Command::new(bin)
            .args(["colocated", "--iterations", "1", "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let fits = |v: &serde_json::Value| -> Vec<bool> {
        v["columns"].as_array().unwrap().iter().map(|c| c["fits"].as_bool().unwrap()).collect()
    };
    let default = json(&[]);
    assert_eq!(default["capacity_bytes"], 80u64 << 30);
    assert_eq!(fits(&default), [true; 4]);
    let tiny = json(&["--capacity-mb", "1"]);
    assert_eq!(tiny["capacity_bytes"], 1u64 << 20);
    assert_eq!(fits(&tiny), [false; 4]);
    assert_eq!(json(&["--capacity-mb", "40960"])["capacity_bytes"], 40u64 << 30);
    assert_eq!(json(&["--h200"])["capacity_bytes"], 143_771u64 << 20);
    let out = std::process::Command::new(bin).args(["colocated", "--capacity-mb", "1"]).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("device 1 MiB") && !text.contains("80 GiB"), "{text}");
    for (args, flag) in [
        (&["--capacity-mb", "0"][..], "--capacity-mb 0"),
        (&["--capacity-gb", "0"][..], "--capacity-gb 0"),
        (&["--capacity-gb", "16385"][..], "--capacity-gb 16385"),
        (&["--capacity-gb", "40", "--capacity-mb", "1024"][..], "--capacity-gb"),
        (&["--h200", "--capacity-mb", "1024"][..], "--h200"),
    ] {
        let out = std::process::Command::new(bin).arg("colocated").args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
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
