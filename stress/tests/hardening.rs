//! Hostile input to the stress tool: every flag, trace and snapshot that once
//! crashed, hung, overflowed or silently changed a result now gives a clear error naming the
//! input and its limit, or the right result. One test per finding, named after it.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use stepalloc::{Allocator, Config, Stream};
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::ops::{self, Op, ProgramBuilder};
use stepalloc_stress::replay::{self, OpSource};
use stepalloc_stress::report::{self, Report};
use stepalloc_stress::trace::{self, Format};
use stepalloc_stress::workload::agent::{self, AgentArgs, AgentSpec, AgentStream, Preset};
use stepalloc_stress::workload::random::{self, RandomArgs};

fn base() -> Base {
    Base { cuda: false, capacity_mb: 81920, devices: 1 }
}

fn pytorch() -> replay::RunConfig {
    compare::resolve(&["pytorch".into()], &base()).unwrap().remove(0)
}

/// Runs the stress tool with `args`; kills it after `limit` (a hang fails the test).
fn stress(args: &[&str], limit: Duration) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status.code().unwrap_or(-1), err);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("stepalloc-stress {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ----- 1. nesting -------------------------------------------------------------------------

/// 20,000 nested empty lists (40 KB) once overflowed the stack of `replay`.
#[test]
fn deeply_nested_pickle_is_rejected_with_its_depth() {
    // {"x": [[[...]]]} and {"x": ((((),),),)}: the value of a key the snapshot skips.
    for (open, close) in [(b']', b'a'), (b')', 0x85)] {
        let mut p = b"\x80\x04}\x8c\x01x".to_vec();
        if close == b'a' {
            p.extend(std::iter::repeat_n(open, 20_000));
            p.extend(std::iter::repeat_n(close, 19_999));
        } else {
            p.push(open);
            p.extend(std::iter::repeat_n(close, 20_000));
        }
        p.extend(b"s.");
        let err = trace::parse(&p).expect_err("a 20,000-level pickle is not a snapshot");
        assert!(err.message.contains("nests deeper than 64 levels"), "{err}");
    }
    // A real snapshot's nesting passes.
    let data = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/snapshot_small.pickle")).unwrap();
    trace::parse(&data).unwrap();
}

/// A few bytes of DUP over a shared container stand for billions of values once the pickle
/// reader copies them (a fuzzed 427-byte pickle took 2.4 GB): refused by size, at once.
#[test]
fn a_pickle_that_shares_values_billions_of_times_is_rejected() {
    // {"x": t40} where t0 = [] and t(k+1) = (tk, tk) through DUP: 2^41 - 1 values copied, and
    // the dict and its key.
    let mut p = b"\x80\x04}\x8c\x01x]".to_vec();
    for _ in 0..40 {
        p.extend_from_slice(b"2\x86");
    }
    p.extend(b"s.");
    let err = trace::parse(&p).expect_err("a DUP bomb is not a snapshot");
    assert!(err.message.contains("stand for 2199023255553 values once copied"), "{err}");
    // Sharing within the bound is read (and then refused only for what it lacks).
    let mut small = b"\x80\x04}\x8c\x01x]".to_vec();
    for _ in 0..10 {
        small.extend_from_slice(b"2\x86");
    }
    small.extend(b"s.");
    let err = trace::parse(&small).expect_err("no device_traces");
    assert!(!err.message.contains("once copied"), "{err}");
}

// ----- 2. device numbers ------------------------------------------------------------------

/// 65,537 devices in `device_traces` once panicked (device number cut to 16 bits); a JSON-lines
/// event on device 65535 overflowed the device count.
#[test]
fn device_numbers_beyond_the_limit_are_errors() {
    let mut snap = String::from("{\"device_traces\":[");
    snap.push_str(&"[],".repeat(65_536));
    snap.push_str("[{\"action\":\"alloc\",\"addr\":1,\"size\":1}]]}");
    let err = trace::parse(snap.as_bytes()).expect_err("65,537 devices");
    assert!(err.message.contains("65537 devices") && err.message.contains("at most 64"), "{err}");

    let jsonl = "{\"op\":\"alloc\",\"addr\":1,\"size\":2}\n{\"op\":\"alloc\",\"device\":65535,\"addr\":1,\"size\":2}\n";
    let err = trace::parse(jsonl.as_bytes()).expect_err("device 65535");
    assert_eq!(err.position, "line 2");
    assert!(err.message.contains("device 65535 is out of range"), "{err}");
    // The last device accepted.
    let jsonl = "{\"op\":\"alloc\",\"device\":63,\"addr\":1,\"size\":2}\n";
    assert_eq!(trace::parse(jsonl.as_bytes()).unwrap().devices, 64);
}

// ----- 3, 4. the random workload's flags ---------------------------------------------------

/// `--cross-free 1.5` once panicked every worker and then hung forever.
#[test]
fn random_with_a_bad_probability_exits_with_an_error_not_a_hang() {
    let (code, err) = stress(
        &["random", "--ops", "2", "--threads", "4", "--cross-free", "1.5", "--seed", "3"],
        Duration::from_secs(60),
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--cross-free 1.5 is out of range"), "{err}");
}

#[test]
fn random_flags_are_range_checked() {
    let rc = pytorch();
    let ok = RandomArgs { threads: 1, ops: 10, streams: 1, ..random_defaults() };
    let cases: Vec<(RandomArgs, &str)> = vec![
        (RandomArgs { cross_free: 1.5, ..ok.clone() }, "--cross-free 1.5"),
        (RandomArgs { cross_free: -0.1, ..ok.clone() }, "--cross-free -0.1"),
        (RandomArgs { record_stream: f64::NAN, ..ok.clone() }, "--record-stream NaN"),
        (RandomArgs { live_fraction: 0.0, ..ok.clone() }, "--live-fraction 0"),
        (RandomArgs { live_fraction: f64::INFINITY, ..ok.clone() }, "--live-fraction inf"),
        (RandomArgs { streams: 9_223_372_036_854_775_808, ..ok.clone() }, "--streams 9223372036854775808"),
        (RandomArgs { threads: 100_000, ..ok.clone() }, "--threads 100000"),
        (RandomArgs { threads: 0, ..ok.clone() }, "--threads 0"),
        (RandomArgs { threads: 2, ops: u64::MAX, ..ok.clone() }, "--ops 18446744073709551615 times --threads 2"),
        (RandomArgs { tag_kib: u64::MAX, ..ok.clone() }, "--tag-kib"),
    ];
    for (args, expected) in cases {
        let err = random::run(&args, &rc).err().unwrap_or_else(|| panic!("{expected} accepted"));
        assert!(err.contains(expected), "{expected}: {err}");
    }
    // The edges of the ranges run.
    let (_, integrity) = random::run(&RandomArgs { cross_free: 1.0, record_stream: 0.0, ..ok }, &rc).unwrap();
    assert!(integrity.ok());
}

/// A worker that fails mid-run (here: an injected panic while blocks cross threads) ends the run
/// with an error naming it; the other workers finish, nothing waits forever.
#[test]
fn a_panicking_worker_ends_the_random_run_with_an_error() {
    let rc = pytorch();
    for worker in [0, 1, 3] {
        let args = RandomArgs {
            threads: 4,
            ops: 20_000,
            streams: 2,
            cross_free: 0.5,
            panic_at: Some((worker, 5_000)),
            ..random_defaults()
        };
        let Err(err) = random::run(&args, &rc) else { panic!("a run with a panicked worker succeeded") };
        assert!(err.contains(&format!("worker thread {worker} panicked: injected failure at operation 5000")), "{err}");
    }
}

fn random_defaults() -> RandomArgs {
    use clap::{Args, FromArgMatches};
    let cmd = RandomArgs::augment_args(clap::Command::new("t"));
    RandomArgs::from_arg_matches(&cmd.get_matches_from(["t"])).unwrap()
}

// ----- 5, 7. the agent workload's dimensions -----------------------------------------------

/// `--rollout-batch 1000000000000` once aborted on a 32 TB allocation; `--dtype-bytes 2^63` and
/// `--hidden 2^32` gave nonsense figures through overflowing products.
#[test]
fn agent_dimensions_out_of_range_are_named() {
    let cases: Vec<(AgentArgs, &str)> = vec![
        (AgentArgs { rollout_batch: Some(1_000_000_000_000), ..Default::default() }, "--rollout-batch 1000000000000"),
        (AgentArgs { dtype_bytes: Some(9_223_372_036_854_775_808), ..Default::default() }, "--dtype-bytes"),
        (AgentArgs { hidden: Some(4_294_967_296), ..Default::default() }, "--hidden 4294967296"),
        (AgentArgs { iterations: Some(u64::MAX), ..Default::default() }, "--iterations"),
        (AgentArgs { resolutions: Some(vec![16_384]), patch: Some(1), ..Default::default() }, "--resolutions"),
    ];
    for (args, expected) in cases {
        let err = args.spec().expect_err(expected);
        assert!(err.contains(expected) && err.contains("accepted"), "{expected}: {err}");
    }
    // The generator checks too (specs built in code, headroom's scaled specs).
    let spec = AgentSpec { vocab: u64::MAX, ..AgentSpec::preset(Preset::Vlm7b) };
    assert!(agent::generate(&spec).unwrap_err().contains("--vocab"));
}

/// `--iterations 1000000` once built its whole event program (12 MB per iteration) before
/// running; the program's size is bounded and the error says where it was reached.
#[test]
fn agent_program_size_is_bounded() {
    let spec = AgentSpec { iterations: 1_000_000, ..AgentSpec::preset(Preset::Vlm7b) };
    let err = agent::generate_within(&spec, 1_000_000).unwrap_err();
    assert!(err.contains("too large") && err.contains("more than 1000000 events"), "{err}");
    assert!(err.contains("of 1000000"), "{err}");
}

/// The agent workload runs as a stream, one iteration at a time: the same figures as the whole
/// program, and iterations beyond what one program may hold.
#[test]
fn agent_stream_runs_what_generate_builds_and_beyond() {
    let small = AgentSpec { iterations: 3, layers: 4, vision_layers: 2, ..AgentSpec::preset(Preset::Vlm7b) };
    let rc = pytorch();
    let whole = replay::run(&agent::generate(&small).unwrap(), &rc, None, None).unwrap();
    let mut stream = AgentStream::new(&small).unwrap();
    let streamed = replay::run_source(&mut stream, &rc, None, None).unwrap();
    // Everything but the means of sampled figures (internal fragmentation, cached free bytes:
    // the stream samples at a stride estimated from its first iteration) and the step-time
    // model, which only the stream carries (a program is a trace).
    assert!(streamed.modelled_step_time_s.is_some() && whole.modelled_step_time_s.is_none());
    let json = |run| {
        let mut v = report::without_wall_clock(Report { runs: vec![run], ..Default::default() }.to_json(true, false));
        let r = v["runs"][0].as_object_mut().unwrap();
        for key in ["internal_fragmentation_mean", "cached_free_mean", "modelled_step_time_s", "driver_share_of_step"] {
            r.remove(key);
        }
        for step in r["steps"].as_array_mut().unwrap() {
            step.as_object_mut().unwrap().remove("modelled_compute_s");
        }
        v
    };
    assert_eq!(json(whole), json(streamed));

    // SFT without evaluation: every iteration has the same number of events.
    let sft = AgentSpec { iterations: 1, layers: 2, eval_every: 0, ..AgentSpec::preset(Preset::Llm7bSft) };
    let one = agent::generate(&sft).unwrap().ops.len();
    let many = AgentSpec { iterations: 20, ..sft };
    let err = agent::generate_within(&many, one).unwrap_err();
    assert!(err.contains("too large"), "{err}");
    let mut stream = AgentStream::within(&many, one).unwrap();
    let run = replay::run_source(&mut stream, &rc, None, None).unwrap();
    assert_eq!(run.steps_count, 20);
    assert!(run.ops > 10 * one as u64);
}

/// The bound on the events held at once is over all devices: each rank held up to the bound
/// alone, so `--devices 16` with long responses ran out of host memory (SIGABRT) instead of
/// being refused up front as one oversized device is.
#[test]
fn agent_stream_bound_is_shared_by_its_devices() {
    let sft = AgentSpec { iterations: 1, layers: 2, eval_every: 0, ..AgentSpec::preset(Preset::Llm7bSft) };
    let one = agent::generate(&sft).unwrap().ops.len();
    let four = AgentSpec { iterations: 2, devices: 4, ..sft.clone() };
    // Four ranks' chunks in four times one rank's bound: runs, no chunk over the bound.
    let mut stream = AgentStream::within(&four, 4 * one).unwrap();
    let mut chunks = 0;
    while let Some((chunk, _)) = stream.next_chunk().unwrap() {
        assert!(chunk.len() <= 4 * one, "{} events in a chunk over the bound of {}", chunk.len(), 4 * one);
        chunks += 1;
    }
    assert_eq!(chunks, 3, "the weights and two iterations");
    // In twice one rank's bound: refused before anything runs, naming the devices.
    let err = AgentStream::within(&four, 2 * one).err().expect("four ranks in the room of two");
    assert!(err.contains("too large") && err.contains("4 devices") && err.contains("--devices"), "{err}");
    // The whole program says the same.
    let err = agent::generate_within(&four, 2 * one).unwrap_err();
    assert!(err.contains("too large") && err.contains("4 devices"), "{err}");
}

/// Every size-setting dimension at its upper bound at once: no product overflows (the tests
/// run with overflow checks), the program bound ends the generation.
#[test]
fn agent_dimensions_at_their_bounds_do_not_overflow() {
    const K: u64 = 1024;
    let extreme = AgentSpec {
        iterations: 1,
        hidden: 64 * K,
        layers: 1,
        heads: K,
        kv_heads: K,
        intermediate: 256 * K,
        vocab: K * K,
        dtype_bytes: 8,
        vision_hidden: 64 * K,
        vision_layers: 1,
        vision_intermediate: 256 * K,
        patch: 16,
        images_min: 16,
        images_max: 16,
        resolutions: vec![16 * K],
        train_vision: true,
        prompt_median: K * K,
        prompt_max: K * K,
        observation_median: K * K,
        response_min: K * K,
        response_max: K * K,
        rollout_batch: K,
        turns_min: 64,
        turns_max: 64,
        kv_chunk: 1,
        micro_batches: 1,
        sft_batch: K,
        lora_rank: 4 * K,
        ..AgentSpec::preset(Preset::Vlm7b)
    };
    extreme.validate().unwrap();
    let err = agent::generate_within(&extreme, 200_000).unwrap_err();
    assert!(err.contains("too large"), "{err}");
    let sft = AgentSpec { rollout: false, eval_every: 1, ..extreme };
    let p = agent::generate_within(&sft, 200_000).unwrap();
    let largest = p.ops.iter().filter_map(|op| if let Op::Alloc { size, .. } = op { Some(*size) } else { None }).max();
    // Logits of an evaluation batch: 2 x 1024 sequences x 2^20 tokens x 2^20 vocabulary x 8 bytes.
    assert_eq!(largest, Some(2 * K * (K * K) * (K * K) * 8));
}

/// headroom's own flags: an infinite scale or billions of probes were accepted.
#[test]
fn headroom_flags_are_range_checked() {
    use stepalloc_stress::headroom::{self, HeadroomArgs};
    let spec = AgentSpec { iterations: 1, ..AgentSpec::preset(Preset::Vlm7b) };
    let configs = compare::resolve(&["pytorch".into()], &base()).unwrap();
    for (args, expected) in [
        (HeadroomArgs { max_scale: f64::INFINITY, ..Default::default() }, "--max-scale inf"),
        (HeadroomArgs { max_scale: f64::NAN, ..Default::default() }, "--max-scale NaN"),
        (HeadroomArgs { probes: u32::MAX, ..Default::default() }, "--probes 4294967295"),
    ] {
        let err = headroom::run(&spec, &args, &base(), &configs).unwrap_err();
        assert!(err.contains(expected), "{expected}: {err}");
    }
}

// ----- 7. time jumps ------------------------------------------------------------------------

/// A JSON-lines trace whose `t_us` jumps to 2^64-1 once overflowed the simulated clock.
#[test]
fn time_jumps_to_the_end_of_u64_replay() {
    let jsonl = "{\"op\":\"alloc\",\"addr\":1,\"size\":1000,\"t_us\":0}\n\
                 {\"op\":\"alloc\",\"addr\":2,\"size\":1000,\"t_us\":9223372036854775808}\n\
                 {\"op\":\"free\",\"addr\":1,\"t_us\":18446744073709551615}\n\
                 {\"op\":\"free\",\"addr\":2,\"t_us\":18446744073709551615}\n";
    let program = trace::parse(jsonl.as_bytes()).unwrap();
    let total: u64 = program.ops.iter().map(|op| if let Op::Advance { ns } = op { *ns } else { 0 }).sum();
    assert_eq!(total, ops::MAX_TIME_NS, "the jumps are cut at the program's time bound");
    let run = replay::run(&program, &pytorch(), None, None).unwrap();
    assert_eq!(run.errors, 0);
    assert_eq!(run.worst.floor, 2000);
}

#[test]
fn program_builder_bounds_events_phases_and_time() {
    let mut b = ProgramBuilder::new("t").with_max_ops(3);
    for _ in 0..3 {
        b.alloc(1, 0, 0);
    }
    assert!(b.limit_error().is_none());
    b.free(0);
    assert!(b.limit_error().unwrap().contains("more than 3 events"));
    assert!(b.finish().is_err());

    let mut b = ProgramBuilder::new("t");
    for i in 0..stepalloc::step::MAX_PHASES {
        b.step_begin(&format!("p{i}"));
    }
    b.step_begin("p0");
    assert!(b.limit_error().is_none(), "phases already seen are not new");
    b.step_begin("one_more");
    assert!(b.limit_error().unwrap().contains("`one_more`"));

    let mut b = ProgramBuilder::new("t");
    b.advance(u64::MAX);
    b.advance(u64::MAX);
    assert_eq!(b.time_ns(), ops::MAX_TIME_NS);
    assert_eq!(b.finish().unwrap().ops.len(), 1);
}

// ----- 11. stepalloc's own snapshots -----------------------------------------------------

fn recorded_allocator() -> Allocator {
    let a = Allocator::new(Config::parse("backend:sim,trace_entries:10000").unwrap()).unwrap();
    for (phase, n) in [("rollout", 3u64), ("train", 2)] {
        a.step_begin(phase).unwrap();
        let blocks: Vec<_> = (0..n).map(|i| (a.malloc(0, (i + 1) << 20, Stream(0)).unwrap(), (i + 1) << 20)).collect();
        for (ptr, size) in blocks {
            a.free(0, ptr, size).unwrap();
        }
        a.step_end().unwrap();
    }
    a
}

/// A stepalloc snapshot replayed was labelled "PyTorch's native allocator" and its steps were
/// dropped (always 0 steps); its pickle form (with max_split_size 2^64-1 in the default
/// configuration) is read too.
#[test]
fn stepalloc_snapshot_replays_its_steps_under_its_own_name() {
    let a = recorded_allocator();
    let snapshot = a.snapshot();
    let json = serde_json::to_vec(&snapshot).unwrap();
    let pickle = serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new()).unwrap();
    for data in [json, pickle] {
        let program = trace::parse(&data).unwrap();
        assert!(program.notes.format.starts_with("stepalloc snapshot"), "{}", program.notes.format);
        let native = program.notes.native.as_ref().unwrap();
        assert!(native.allocator.contains("stepalloc"), "{}", native.allocator);
        assert_eq!(program.phases, vec!["rollout".to_string(), "train".to_string()]);
        let run = replay::run(&program, &pytorch(), None, None).unwrap();
        assert_eq!(run.steps_count, 2);
        assert_eq!(run.steps[0].peak_requested, (1 + 2 + 3) << 20);
        assert_eq!(run.steps[1].peak_requested, (1 + 2) << 20);
        assert_eq!(run.steps[1].phase, "train");
    }
    // PyTorch's snapshots keep their label.
    let data = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/snapshot_small.json")).unwrap();
    let p = trace::parse(&data).unwrap();
    assert_eq!(p.notes.native.unwrap().allocator, "PyTorch's native allocator");
}

// ----- 12. the metrics endpoint per configuration -----------------------------------------

/// `--metrics-addr` served only the first configuration and kept serving its stale figures;
/// each run now serves on the address and closes it when it ends.
#[test]
fn metrics_endpoint_is_closed_after_each_run() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let program = trace::parse(b"{\"op\":\"alloc\",\"addr\":1,\"size\":1000}\n").unwrap();
    let configs = compare::resolve(&["pytorch".into(), "stepalloc".into()], &base()).unwrap();
    for rc in &configs {
        replay::run(&program, rc, None, Some(&addr)).unwrap();
        assert!(
            std::net::TcpStream::connect(&addr).is_err(),
            "the endpoint of `{}` still listens after its run",
            rc.name
        );
    }
    // An address that cannot be served is an error, not a warning.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let err = replay::run(&program, &configs[0], None, Some(&taken_addr)).unwrap_err();
    assert!(err.contains("--metrics-addr"), "{err}");
}

// ----- 18. errors name the flag the user wrote --------------------------------------------

/// `agent --capacity-mb 0` blamed "--compare `pytorch`: configuration key `sim_capacity_mb`".
#[test]
fn capacity_errors_name_the_capacity_flag() {
    let err = compare::resolve(&["pytorch".into()], &Base { capacity_mb: 0, ..base() }).unwrap_err();
    assert!(err.starts_with("--capacity-mb 0"), "{err}");
    assert!(!err.contains("--compare"), "{err}");
    let (code, err) = stress(&["agent", "--capacity-mb", "0"], Duration::from_secs(60));
    assert_eq!(code, 2);
    assert!(err.contains("--capacity-mb 0") && !err.contains("--compare"), "{err}");
}

// ----- 19. JSON-lines errors and detection ------------------------------------------------

#[test]
fn jsonl_errors_give_one_position() {
    let jsonl = "{\"op\":\"alloc\",\"addr\":1,\"size\":2}\n{\"op\":\"alloc\",\"addr\":x}\n";
    let err = trace::parse(jsonl.as_bytes()).unwrap_err();
    assert_eq!(err.position, "line 2");
    assert!(err.message.starts_with("column 22:"), "{err}");
    assert!(!err.message.contains("at line"), "one position only: {err}");
    // Type errors: serde_json knows no column.
    let jsonl = "{\"op\":\"alloc\",\"addr\":\"one\",\"size\":2}\n";
    let err = trace::parse(jsonl.as_bytes()).unwrap_err();
    assert_eq!(err.position, "line 1");
    assert!(!err.message.contains("column 0"), "{err}");
    assert!(err.message.contains("invalid type"), "{err}");
}

#[test]
fn jsonl_with_too_many_phases_names_the_line() {
    let mut jsonl = String::new();
    for i in 0..33 {
        jsonl.push_str(&format!("{{\"op\":\"step_begin\",\"phase\":\"p{i}\"}}\n{{\"op\":\"step_end\"}}\n"));
    }
    let err = trace::parse(jsonl.as_bytes()).unwrap_err();
    assert_eq!(err.position, "line 65");
    assert!(err.message.contains("32 distinct phases"), "{err}");
}

#[test]
fn jsonl_with_a_long_first_line_or_a_byte_order_mark_is_detected() {
    let padding = "x".repeat(5000);
    let jsonl =
        format!("{{\"note\":\"{padding}\",\"op\":\"alloc\",\"addr\":1,\"size\":2}}\n{{\"op\":\"free\",\"addr\":1}}\n");
    assert_eq!(trace::detect(jsonl.as_bytes()).unwrap(), Format::StepallocJsonl);
    assert_eq!(trace::parse(jsonl.as_bytes()).unwrap().count_allocs(), 1);
    let with_bom = "\u{feff}{\"op\":\"alloc\",\"addr\":1,\"size\":2}\n";
    assert_eq!(trace::detect(with_bom.as_bytes()).unwrap(), Format::StepallocJsonl);
    assert_eq!(trace::parse(with_bom.as_bytes()).unwrap().count_allocs(), 1);
    let csv = "\u{feff}Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,100,0x0\n";
    assert_eq!(trace::parse(csv.as_bytes()).unwrap().count_allocs(), 1);
    // A snapshot whose first key is a long value is still a snapshot.
    let snap = format!("{{\"segments\":[],\"device_traces\":[[{{\"action\":\"alloc\",\"addr\":1,\"size\":2,\"note\":\"{padding}\"}}]]}}");
    assert_eq!(trace::detect(snap.as_bytes()).unwrap(), Format::TorchJson);
    assert_eq!(trace::parse(snap.as_bytes()).unwrap().count_allocs(), 1);
}

// ----- 20. reading only what is needed ----------------------------------------------------

/// `/dev/zero` once consumed memory until the limit; a 2 GB sparse file took 6 s and 2.1 GB
/// to be rejected on its first byte.
#[test]
fn unknown_formats_are_rejected_from_their_first_bytes() {
    let started = Instant::now();
    let err = trace::load(std::path::Path::new("/dev/zero")).unwrap_err();
    assert!(err.message.contains("unknown trace format"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let sparse = dir.path().join("sparse");
    std::fs::File::create(&sparse).unwrap().set_len(2 << 30).unwrap();
    let err = trace::load(&sparse).unwrap_err();
    assert!(err.message.contains("unknown trace format"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    // A JSON-lines line beyond the line limit is an error, not an unbounded buffer.
    let long = format!("{{\"op\":\"alloc\",\"addr\":1,\"size\":2}}\n{}", " ".repeat(trace::jsonl::MAX_LINE + 10));
    let err = trace::parse(long.as_bytes()).unwrap_err();
    assert_eq!(err.position, "line 2");
    assert!(err.message.contains("longer than"), "{err}");
    // A line of exactly the limit (its newline aside) is read.
    let line = "{\"op\":\"alloc\",\"addr\":1,\"size\":2}";
    let exact = format!("{line}{}\n", " ".repeat(trace::jsonl::MAX_LINE - line.len()));
    assert_eq!(trace::parse(exact.as_bytes()).unwrap().count_allocs(), 1);
}
