//! Headroom: the scaled workload follows its dimensions, the search returns a scale that fits
//! and a larger one that does not, more memory never means less headroom, and the command line
//! prints it as a table and as JSON.

use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::headroom::{self, Dimension, HeadroomArgs, HeadroomReport};
use stepalloc_stress::replay::{self, RunConfig};
use stepalloc_stress::workload::agent::{self, AgentSpec, Preset};

fn base(capacity_mb: u64) -> Base {
    Base { cuda: false, capacity_mb, devices: 1 }
}

fn small_vlm() -> AgentSpec {
    AgentSpec { iterations: 2, ..AgentSpec::preset(Preset::Vlm7b) }
}

fn search(names: &[&str], capacity_mb: u64, probes: u32) -> HeadroomReport {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let configs = compare::resolve(&names, &base(capacity_mb)).unwrap();
    let args = HeadroomArgs { dimension: Dimension::Batch, max_scale: 8.0, probes };
    headroom::run(&small_vlm(), &args, &base(capacity_mb), &configs).unwrap()
}

fn ooms_at(rc: &RunConfig, scale: f64) -> u64 {
    let program = agent::generate(&headroom::scaled(&small_vlm(), scale, Dimension::Batch)).unwrap();
    replay::run(&program, rc, None, None).unwrap().ooms
}

#[test]
fn scaling_multiplies_the_chosen_dimensions_only() {
    let s = AgentSpec::preset(Preset::Vlm7b);
    let b = headroom::scaled(&s, 2.0, Dimension::Batch);
    assert_eq!((b.rollout_batch, b.sft_batch), (16, 16));
    assert_eq!((b.prompt_median, b.prompt_max, b.response_max), (400, 4096, 384));
    let q = headroom::scaled(&s, 0.5, Dimension::Sequence);
    assert_eq!((q.rollout_batch, q.sft_batch), (8, 8));
    assert_eq!((q.prompt_median, q.prompt_max, q.observation_median), (200, 2048, 100));
    assert_eq!((q.response_min, q.response_max), (16, 192));
    let both = headroom::scaled(&s, 1.5, Dimension::Both);
    assert_eq!((both.rollout_batch, both.prompt_median), (12, 600));
    // Never below 1, and still a valid spec for the generator.
    let tiny = headroom::scaled(&s, headroom::MIN_SCALE / 4.0, Dimension::Both);
    assert_eq!((tiny.rollout_batch, tiny.sft_batch, tiny.response_min, tiny.prompt_max), (1, 1, 1, 16));
    assert_eq!(headroom::scaled(&s, 1.0, Dimension::Both), s);
}

#[test]
fn search_brackets_the_largest_fitting_scale() {
    let r = search(&["pytorch", "split128"], 40 * 1024, 4);
    assert_eq!(r.rows.len(), 2);
    for row in &r.rows {
        assert_eq!(row.errors, 0, "{}", row.name);
        assert!(row.scale > 0.0 && row.scale < 1.0, "{}: 40 GiB holds less than the preset: {}", row.name, row.scale);
        let fails_at = row.fails_at.expect("a scale that does not fit was seen");
        assert!(fails_at > row.scale && fails_at <= 1.0, "{}: {fails_at}", row.name);
        // The bisection narrowed the bracket: 4 probes after a bracket of width 1/2.
        assert!(fails_at - row.scale <= 0.5 / 16.0 + 1e-9, "{}: [{}, {fails_at}]", row.name, row.scale);
        // Replayed in full (not stopped at the first OOM), the answer fits and the next does not.
        let rc = compare::resolve_one(&row.name, &base(40 * 1024)).unwrap();
        assert_eq!(ooms_at(&rc, row.scale), 0, "{}", row.name);
        assert!(ooms_at(&rc, fails_at) > 0, "{}", row.name);
        assert!(row.peak_reserved <= 40 << 30 && row.floor > 0 && row.floor <= row.peak_reserved);
        assert_eq!(row.rollout_batch, headroom::scaled(&small_vlm(), row.scale, Dimension::Batch).rollout_batch);
        assert!(row.probes.iter().any(|p| p.scale == row.scale && p.fits));
    }
    let table = headroom::table(&r);
    for needle in ["headroom (scale)", "pytorch", "split128", "40960 MiB"] {
        assert!(table.contains(needle), "{needle}\n{table}");
    }
}

#[test]
fn more_memory_never_means_less_headroom() {
    let small = search(&["pytorch"], 40 * 1024, 3);
    let large = search(&["pytorch"], 64 * 1024, 3);
    assert!(large.rows[0].scale >= small.rows[0].scale, "{} < {}", large.rows[0].scale, small.rows[0].scale);
    // Plenty of memory: the search stops at the largest scale and says so.
    let huge = search(&["pytorch"], 1 << 20, 0);
    assert_eq!((huge.rows[0].scale, huge.rows[0].fails_at), (8.0, None));
    // Too little for the weights: nothing fits.
    let none = search(&["pytorch"], 8 * 1024, 0);
    assert_eq!(none.rows[0].scale, 0.0);
    assert_eq!(none.rows[0].fails_at, Some(headroom::MIN_SCALE));
}

#[test]
fn command_line_prints_headroom_as_json() {
    let exe = env!("CARGO_BIN_EXE_stepalloc-stress");
    let out = std::process::Command::new(exe)
        .args([
            "headroom",
            "--iterations",
            "1",
            "--capacity-mb",
            "40960",
            "--probes",
            "2",
            "--json",
            "--compare",
            "pytorch",
            "split=max_split_size_mb:128",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["capacity_mb"], 40960);
    assert_eq!(v["dimension"], "batch");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["name"], "split");
    assert!(rows[0]["scale"].as_f64().unwrap() > 0.0);

    let out = std::process::Command::new(exe).args(["headroom", "--backend", "cuda"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "headroom needs the simulated device");
}

/// After the virtual-memory merge: stepalloc's recommended configuration fits at least the
/// scale PyTorch's default and expandable segments fit, on every agent preset.
#[test]
fn stepalloc_has_at_least_pytorchs_headroom() {
    for (preset, capacity_mb) in [(Preset::Vlm7b, 40 * 1024), (Preset::Llm7bSft, 40 * 1024)] {
        let spec = AgentSpec { iterations: 3, ..AgentSpec::preset(preset) };
        let names: Vec<String> = ["pytorch", "pytorch_expandable", "stepalloc"].iter().map(|s| s.to_string()).collect();
        let configs = compare::resolve(&names, &base(capacity_mb)).unwrap();
        let args = HeadroomArgs { dimension: Dimension::Batch, max_scale: 8.0, probes: 5 };
        let r = headroom::run(&spec, &args, &base(capacity_mb), &configs).unwrap();
        let (pytorch, expandable, stepalloc) = (&r.rows[0], &r.rows[1], &r.rows[2]);
        assert!(stepalloc.scale >= expandable.scale, "{preset:?}\n{}", headroom::table(&r));
        assert!(stepalloc.scale >= pytorch.scale, "{preset:?}\n{}", headroom::table(&r));
        assert!(r.rows.iter().all(|row| row.errors == 0));
    }
}
