//! Multi-device runs: a snapshot holding several devices replays each device on its own
//! simulated device, to exactly the figures of that device's trace replayed alone; the headline
//! is the worst device, not a sum of peaks; the JSON and the table carry every device; and
//! `agent --devices N` runs N ranks, each device equal to its rank run alone.

use serde_json::{json, Value};
use stepalloc_stress::advise;
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::ops::Program;
use stepalloc_stress::replay::{self, RunConfig};
use stepalloc_stress::report::{DeviceReport, RunReport, StepReport};
use stepalloc_stress::trace;
use stepalloc_stress::workload::agent::{AgentArgs, AgentSpec, AgentStream, Preset};

const MIB: u64 = 1 << 20;
const EXE: &str = env!("CARGO_BIN_EXE_stepalloc-stress");
const CONFIGS: &[&str] = &["pytorch", "pytorch_expandable", "stepalloc"];

fn configs(devices: u16) -> Vec<RunConfig> {
    let names: Vec<String> = CONFIGS.iter().map(|s| s.to_string()).collect();
    compare::resolve(&names, &Base { cuda: false, capacity_mb: 81920, devices }).unwrap()
}

/// One device's trace as PyTorch records it: allocations of sizes up to `max_mib` MiB and
/// frees of random live blocks (`free_requested` then `free_completed`), `alloc_every_us`
/// apart from `start_us`. Deterministic in `seed`.
fn device_trace(seed: u64, max_mib: u64, start_us: u64, alloc_every_us: u64) -> Vec<Value> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut entries = Vec::new();
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut t = start_us;
    let mut addr = 1u64 << 40;
    let entry = |action: &str, addr: u64, size: u64, t: u64| json!({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []});
    for i in 0..600u64 {
        t += alloc_every_us;
        // Sizes from 512 B to max_mib MiB, small ones most often.
        let size = match next() % 4 {
            0 => next() % (max_mib * MIB) + 1,
            1 => next() % (4 * MIB) + 1,
            _ => next() % (64 << 10) + 512,
        };
        addr += 64 * MIB;
        entries.push(entry("alloc", addr, size, t));
        live.push((addr, size));
        if i % 3 != 0 {
            let (a, s) = live.swap_remove((next() % live.len() as u64) as usize);
            entries.push(entry("free_requested", a, s, t + 1));
            entries.push(entry("free_completed", a, s, t + 2));
        }
    }
    entries
}

/// A `_dump_snapshot` pickle holding `traces` as its devices.
fn pickle(traces: &[&Vec<Value>]) -> Vec<u8> {
    let snapshot = json!({"segments": [], "device_traces": traces, "external_annotations": []});
    serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new()).unwrap()
}

fn parse(traces: &[&Vec<Value>]) -> Program {
    let program = trace::parse(&pickle(traces)).unwrap();
    assert_eq!(program.devices as usize, traces.len());
    program
}

/// `d` renumbered as device 0 (to compare with the same trace replayed alone).
fn as_device_0(d: &DeviceReport) -> DeviceReport {
    DeviceReport { device: 0, ..d.clone() }
}

/// The headline figures are exactly those of `worst`.
fn assert_headline_is(run: &RunReport, worst: usize) {
    let d = &run.devices[worst];
    assert_eq!(run.worst_device, worst, "{}", run.name);
    assert_eq!(
        (run.worst.floor, run.worst.stats_peak_requested, run.worst.peak_allocated, run.worst.peak_reserved),
        (d.figures.floor, d.figures.stats_peak_requested, d.figures.peak_allocated, d.figures.peak_reserved),
        "{}",
        run.name
    );
    assert_eq!(
        (run.worst.device_mallocs, run.worst.device_frees),
        (d.figures.device_mallocs, d.figures.device_frees),
        "{}",
        run.name
    );
    assert_eq!(run.worst.reserved_over_floor, d.figures.reserved_over_floor, "{}", run.name);
    assert_eq!(
        (run.worst.driver_maps, run.worst.driver_unmaps, run.worst.driver_creates),
        (d.figures.driver_maps, d.figures.driver_unmaps, d.figures.driver_creates),
        "{}",
        run.name
    );
}

/// The demonstration: two single-device snapshots, merged into one two-device
/// snapshot in both orders, replay to each device's own single-device figures exactly, and the
/// headline is the worse device wherever it sits.
#[test]
fn two_device_snapshot_replays_each_device_as_alone() {
    // `big` needs more memory than `small` under every configuration; their events interleave
    // in time (the reader merges devices by time).
    let big = device_trace(1, 48, 1_000_000, 10);
    let small = device_trace(2, 6, 1_000_003, 7);
    let one = configs(1);
    let alone: Vec<(RunReport, RunReport)> = one
        .iter()
        .map(|rc| {
            let big = replay::run(&parse(&[&big]), rc, None, None).unwrap();
            let small = replay::run(&parse(&[&small]), rc, None, None).unwrap();
            (big, small)
        })
        .collect();
    for (big, small) in &alone {
        assert!(big.worst.peak_reserved > small.worst.peak_reserved, "{}: the test needs a worse device", big.name);
        assert!(small.worst.device_mallocs > 0 && small.worst.floor > 0);
        assert_eq!((big.ooms, big.errors, small.ooms, small.errors), (0, 0, 0, 0));
    }
    for (order, worst) in [([&big, &small], 0usize), ([&small, &big], 1)] {
        let program = parse(&order);
        assert_eq!(program.count_allocs(), 2 * 600, "every allocation of both devices");
        for (rc, (big_alone, small_alone)) in configs(2).iter().zip(&alone) {
            let run = replay::run(&program, rc, None, None).unwrap();
            assert_eq!(run.devices.len(), 2, "{}", rc.name);
            let (big_run, small_run) = (&run.devices[worst], &run.devices[1 - worst]);
            assert_eq!((big_run.device, small_run.device), (worst, 1 - worst));
            // Every per-device figure (peaks, device and driver calls, their modelled times)
            // equals the trace replayed alone.
            assert_eq!(as_device_0(big_run), big_alone.devices[0], "{}: the worse device", rc.name);
            assert_eq!(as_device_0(small_run), small_alone.devices[0], "{}: the other device", rc.name);
            assert_eq!(big_run.figures.floor, big_alone.worst.floor);
            assert_eq!(big_run.figures.peak_reserved, big_alone.worst.peak_reserved);
            assert_eq!(small_run.figures.device_mallocs, small_alone.worst.device_mallocs);
            assert_headline_is(&run, worst);
            // Not the sum of the two peaks (what the runner used to report).
            assert!(run.worst.peak_reserved < big_alone.worst.peak_reserved + small_alone.worst.peak_reserved);
        }
        // The peak's attribution counts the peak device's live allocations only, as alone.
        {
            let rc = &configs(2)[0];
            let tracked = RunConfig { track_peak: true, ..rc.clone() };
            let run = replay::run(&program, &tracked, None, None).unwrap();
            let alone_program = parse(&[&big]);
            let alone =
                replay::run(&alone_program, &RunConfig { track_peak: true, ..configs(1)[0].clone() }, None, None);
            let (m, a) = (run.peak_moment.unwrap(), alone.unwrap().peak_moment.unwrap());
            assert_eq!(m.device, worst, "{}", rc.name);
            let merged = advise::attribute(&program, m.op, m.device, 8, &[]);
            let single = advise::attribute(&alone_program, a.op, 0, 8, &[]);
            assert_eq!((merged.live_bytes, merged.live_count), (single.live_bytes, single.live_count), "{}", rc.name);
        }
    }
}

/// One device: the per-device entry is the headline itself.
#[test]
fn one_device_reports_itself_as_the_only_device() {
    let program = parse(&[&device_trace(3, 20, 0, 5)]);
    for rc in configs(1) {
        let run = replay::run(&program, &rc, None, None).unwrap();
        assert_eq!(run.devices.len(), 1);
        assert_headline_is(&run, 0);
    }
}

/// `replay --json` of a two-device snapshot has a per-device array and names the worst
/// device; the table prints a per-device table with the worst marked.
#[test]
fn command_line_reports_every_device() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("two.pickle");
    std::fs::write(&path, pickle(&[&device_trace(2, 6, 0, 7), &device_trace(1, 48, 0, 10)])).unwrap();
    let out = std::process::Command::new(EXE)
        .args(["replay", "--json", "--compare", "pytorch", "stepalloc", "--"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for run in v["runs"].as_array().unwrap() {
        let devices = run["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 2, "{run}");
        assert_eq!(run["worst_device"], 1);
        for (i, d) in devices.iter().enumerate() {
            assert_eq!(d["device"], i);
            for key in ["floor", "peak_reserved", "reserved_over_floor", "device_mallocs"] {
                assert!(d.get(key).is_some(), "devices[{i}] lacks {key}");
            }
        }
        assert_eq!(run["peak_reserved"], devices[1]["peak_reserved"]);
        assert_eq!(run["floor"], devices[1]["floor"]);
    }

    let out =
        std::process::Command::new(EXE).args(["replay", "--compare", "pytorch", "--"]).arg(&path).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 devices: each column is its worst device"), "{text}");
    assert!(text.contains("per device: pytorch"), "{text}");
    assert!(text.contains("1 (worst)"), "{text}");

    // `advise`: every choice's figures are its worst device's, and every device is listed.
    let out = std::process::Command::new(EXE).args(["advise", "--json", "--"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["current", "best_native", "best_stepalloc"] {
        let c = &v[key];
        let devices = c["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 2, "{key}: {c}");
        assert_eq!(c["worst_device"], 1, "{key}");
        assert_eq!(c["peak_reserved"], devices[1]["peak_reserved"], "{key}");
        assert!(devices[0]["peak_reserved"].as_u64() < devices[1]["peak_reserved"].as_u64(), "{key}");
    }
    let out = std::process::Command::new(EXE).args(["advise", "--"]).arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 devices, each on its own device of the capacity"), "{text}");
    assert!(text.contains("best stepalloc: device 1 (worst): peak reserved"), "{text}");
}

fn small_agent(seed: u64, devices: u64) -> AgentSpec {
    AgentSpec { seed, devices, iterations: 2, layers: 4, vision_layers: 2, ..AgentSpec::preset(Preset::Vlm7b) }
}

fn run_agent(spec: &AgentSpec, rc: &RunConfig) -> RunReport {
    let mut stream = AgentStream::new(spec).unwrap();
    replay::run_source(&mut stream, rc, None, None).unwrap()
}

/// `agent --devices 2`: rank r is the workload with seed + r on device r, and each device's
/// figures are exactly those of its rank run alone.
#[test]
fn agent_ranks_replay_as_alone() {
    let mut devices_seen = [false; 2];
    for (rc, rc_one) in configs(2).iter().zip(configs(1)) {
        let run = run_agent(&small_agent(5, 2), rc);
        assert_eq!(run.devices.len(), 2, "{}", rc.name);
        let mut worst = (0, 0);
        let mut alone_steps = Vec::new();
        for rank in 0..2u64 {
            let alone = run_agent(&small_agent(5 + rank, 1), &rc_one);
            assert_eq!(as_device_0(&run.devices[rank as usize]), alone.devices[0], "{}: rank {rank}", rc.name);
            assert_eq!(run.steps_count, alone.steps_count, "the ranks share their steps");
            worst = worst.max((alone.worst.peak_reserved, 1 - rank as usize));
            alone_steps.push(alone.steps);
        }
        assert_headline_is(&run, 1 - worst.1);
        // Each step reports its own worst device, with that rank's step figures alone.
        assert!(!run.steps.is_empty());
        for (k, step) in run.steps.iter().enumerate() {
            let (a, b) = (&alone_steps[0][k], &alone_steps[1][k]);
            let worse = if (b.peak_reserved, b.peak_requested) > (a.peak_reserved, a.peak_requested) { 1 } else { 0 };
            let alone = &alone_steps[worse][k];
            assert_eq!(step.device, worse, "{}: step {k}", rc.name);
            devices_seen[worse] = true;
            let figures = |s: &StepReport| {
                (
                    s.peak_requested,
                    s.peak_allocated,
                    s.peak_reserved,
                    s.device_mallocs,
                    s.reserved_at_begin,
                    s.reserved_at_end,
                )
            };
            assert_eq!(figures(step), figures(alone), "{}: step {k}", rc.name);
        }
    }
    assert_eq!(devices_seen, [true, true], "each rank is the worst in some step of some configuration");
}

/// The command line: `agent --devices 2 --json` has two per-device entries; bad counts are
/// refused naming the flag and the range; `headroom` refuses `--devices`.
#[test]
fn agent_devices_on_the_command_line() {
    let small = ["--iterations", "1", "--layers", "2", "--vision-layers", "1"];
    let out = std::process::Command::new(EXE)
        .args(["agent", "--devices", "2", "--json", "--compare", "pytorch"])
        .args(small)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["runs"][0]["devices"].as_array().unwrap().len(), 2);
    assert!(v["workload"].as_str().unwrap().contains("2 devices"), "{v}");

    for (value, expected) in [("0", "--devices 0 is out of range: accepted 1..=64"), ("65", "--devices 65")] {
        let out = std::process::Command::new(EXE).args(["agent", "--devices", value]).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains(expected), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let err = AgentArgs { devices: Some(65), ..Default::default() }.spec().unwrap_err();
    assert!(err.contains("accepted 1..=64"), "{err}");

    let out = std::process::Command::new(EXE).args(["headroom", "--devices", "2"]).args(small).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--devices 2"));
}
