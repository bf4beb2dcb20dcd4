//! Trace readers: every format parsed, totals of a small hand-computed trace exact, malformed
//! and truncated inputs rejected with a position, and a real `_dump_snapshot` pickle read when
//! torch with CUDA is available.

use std::path::PathBuf;
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::ops::Op;
use stepalloc_stress::replay;
use stepalloc_stress::trace::{self, Format};

const MIB: u64 = 1 << 20;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn base() -> Base {
    Base { cuda: false, capacity_mb: 81920, devices: 1 }
}

/// The fixtures hold the same trace (see tests/data/make_snapshot_fixture.py): A 4 MiB, B 3 MiB,
/// free A, C 6 MiB, free B, a free of an address allocated before recording, D 1000 B.
/// Under PyTorch's rules: A and B share a 20 MiB segment, C does not fit A's 4 MiB hole and
/// takes the segment's tail; D gets a 2 MiB small segment.
#[test]
fn every_format_gives_the_hand_computed_totals() {
    let files = [
        ("snapshot_small.pickle", Format::TorchPickle),
        ("snapshot_small.json", Format::TorchJson),
        ("rmm_small.csv", Format::RmmCsv),
        ("stepalloc_small.jsonl", Format::StepallocJsonl),
    ];
    let configs = compare::resolve(&["pytorch".into()], &base()).unwrap();
    for (name, format) in files {
        let bytes = std::fs::read(data(name)).unwrap();
        assert_eq!(trace::detect(&bytes).unwrap(), format, "{name}");
        let program = trace::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(program.count_allocs(), 4, "{name}");
        assert_eq!(program.notes.unknown_frees, 1, "{name}: the free of X is skipped and counted");
        let run = replay::run(&program, &configs[0], None, None).unwrap();
        assert_eq!(run.worst.floor, 9 * MIB, "{name}: floor is B + C");
        assert_eq!(run.worst.stats_peak_requested, 9 * MIB, "{name}");
        assert_eq!(run.worst.peak_allocated, 9 * MIB, "{name}: B + C, both multiples of 512");
        assert_eq!(run.worst.peak_reserved, 22 * MIB, "{name}: one 20 MiB large and one 2 MiB small segment");
        assert_eq!((run.worst.device_mallocs, run.ooms, run.errors), (2, 0, 0), "{name}");
    }
}

#[test]
fn snapshot_reports_the_native_allocators_reserved_bytes() {
    for name in ["snapshot_small.pickle", "snapshot_small.json"] {
        let program = trace::load(&data(name)).unwrap();
        let native = program.notes.native.clone().expect("segments and segment events present");
        assert_eq!(native.current_reserved, Some(22 * MIB), "{name}");
        assert_eq!(native.peak_reserved, Some(22 * MIB), "{name}");
        assert_eq!((native.segment_allocs, native.segment_frees), (2, 0));
        // free_requested is not replayed when free_completed exists: 3 of them are ignored.
        assert_eq!(program.notes.ignored_events, 3, "{name}");
    }
}

#[test]
fn pickle_and_json_snapshots_give_the_same_events() {
    let a = trace::load(&data("snapshot_small.pickle")).unwrap();
    let b = trace::load(&data("snapshot_small.json")).unwrap();
    assert_eq!(a.ops, b.ops);
    assert!(a.ops.iter().any(|op| matches!(op, Op::Advance { .. })), "time_us deltas become simulated time");
}

#[test]
fn free_requested_is_used_when_no_free_completed_exists() {
    let json = r#"{"device_traces":[[
        {"action":"alloc","addr":4096,"size":100,"stream":0,"time_us":1},
        {"action":"free_requested","addr":4096,"size":100,"stream":0,"time_us":2},
        {"action":"alloc","addr":4096,"size":200,"stream":5,"time_us":3}]]}"#;
    let p = trace::parse(json.as_bytes()).unwrap();
    let kinds: Vec<_> = p.ops.iter().filter(|op| !matches!(op, Op::Advance { .. })).copied().collect();
    assert_eq!(
        kinds,
        vec![
            Op::Alloc { id: 0, size: 100, stream: 0, device: 0 },
            Op::Free { id: 0 },
            // A freed id is handed out again.
            Op::Alloc { id: 0, size: 200, stream: 5, device: 0 },
        ]
    );
    assert_eq!(p.notes.duplicate_allocs, 0);
}

#[test]
fn truncated_pickles_are_rejected_with_a_byte_offset() {
    let bytes = std::fs::read(data("snapshot_small.pickle")).unwrap();
    for cut in 1..bytes.len() {
        let err = trace::parse(&bytes[..cut]).expect_err("a truncated pickle must not parse");
        assert!(err.position.starts_with("byte "), "cut {cut}: {err}");
        let at: u64 = err.position["byte ".len()..].parse().unwrap();
        assert!(at <= cut as u64, "cut {cut}: position {at} beyond the data");
    }
}

#[test]
fn corrupted_pickle_is_rejected_not_panicking() {
    let mut bytes = std::fs::read(data("snapshot_small.pickle")).unwrap();
    // An opcode pickle does not know where the top-level dict should begin (after PROTO 4 and
    // the 9-byte FRAME header).
    assert_eq!(bytes[11], b'}', "EMPTY_DICT opens the snapshot");
    bytes[11] = 0xff;
    let err = trace::parse(&bytes).expect_err("garbage opcode");
    assert!(err.position.starts_with("byte "), "{err}");
    // A pickle of something else than a snapshot dict.
    let list = [0x80, 0x04, b']', b'.'];
    let err = trace::parse(&list).expect_err("a list is not a snapshot");
    assert!(err.message.contains("no device_traces"), "{err}");
    // A dict whose device_traces is a string.
    let bad = b"\x80\x04}\x94\x8c\x0ddevice_traces\x94\x8c\x03abc\x94s.";
    let err = trace::parse(bad).expect_err("device_traces must be a list");
    assert!(err.message.contains("not a PyTorch memory snapshot"), "{err}");
}

#[test]
fn malformed_text_traces_name_the_line() {
    let json = std::fs::read(data("snapshot_small.json")).unwrap();
    let err = trace::parse(&json[..json.len() / 2]).expect_err("truncated JSON");
    assert_eq!(err.position, "line 1");
    assert!(err.message.contains("column"), "{err}");

    let csv = "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,100,0x0\n1,1,allocate,0xZZ,100,0x0\n";
    let err = trace::parse(csv.as_bytes()).expect_err("bad pointer");
    assert_eq!(err.position, "line 3");
    assert!(err.message.contains("pointer"), "{err}");

    let csv = "Thread,Time,Action,Pointer,Size,Stream\n1,0,reallocate,0x10,100,0x0\n";
    assert_eq!(trace::parse(csv.as_bytes()).unwrap_err().position, "line 2");

    let csv = "Thread,Time,Action,Pointer,Size\n1,0,allocate,0x10,100\n";
    let err = trace::parse(csv.as_bytes()).unwrap_err();
    assert!(err.message.contains("Stream"), "{err}");

    let jsonl = "{\"op\":\"alloc\",\"addr\":1,\"size\":2}\n{\"op\":\"alloc\",\"addr\":\n";
    assert_eq!(trace::parse(jsonl.as_bytes()).unwrap_err().position, "line 2");
    let jsonl = "{\"op\":\"alloc\",\"addr\":1,\"size\":2}\n\n{\"op\":\"resize\",\"addr\":1}\n";
    assert_eq!(trace::parse(jsonl.as_bytes()).unwrap_err().position, "line 3");
    let jsonl = "{\"op\":\"step_begin\",\"phase\":\"bad phase!\"}\n";
    assert_eq!(trace::parse(jsonl.as_bytes()).unwrap_err().position, "line 1");

    assert_eq!(trace::parse(b"   ").unwrap_err().position, "byte 0");
    assert_eq!(trace::parse(b"  hello").unwrap_err().position, "byte 2");
}

#[test]
fn truncated_text_traces_never_panic() {
    for name in ["snapshot_small.json", "rmm_small.csv", "stepalloc_small.jsonl"] {
        let bytes = std::fs::read(data(name)).unwrap();
        for cut in 0..bytes.len() {
            if let Err(e) = trace::parse(&bytes[..cut]) {
                assert!(!e.position.is_empty(), "{name} cut {cut}");
            }
        }
    }
}

/// Produces a real snapshot with torch on a CUDA device and replays it. Skipped (with the
/// reason printed) where torch or a GPU is missing.
#[test]
fn real_torch_snapshot_pickle_replays() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("torch_snapshot.pickle");
    let script = r#"
import sys
try:
    import torch
except Exception as e:
    print("SKIP: torch is not importable:", e); sys.exit(0)
if not torch.cuda.is_available():
    print("SKIP: torch", torch.__version__, "has no CUDA device"); sys.exit(0)
torch.cuda.memory._record_memory_history(max_entries=100000)
xs = [torch.empty(n * 1024, device="cuda") for n in (1, 300, 5000, 20000)]
del xs[1]
y = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
del xs
torch.cuda.memory._dump_snapshot(sys.argv[1])
print("OK")
"#;
    let out = std::process::Command::new("python3").arg("-c").arg(script).arg(&path).output();
    let Ok(out) = out else {
        println!("SKIP: python3 not found");
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !stdout.contains("OK") {
        println!("{}{}", stdout.trim(), String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
        assert!(stdout.contains("SKIP"), "the torch script failed: {stdout}");
        return;
    }
    let program = trace::load(&path).unwrap();
    assert_eq!(trace::detect(&std::fs::read(&path).unwrap()).unwrap(), Format::TorchPickle);
    assert!(program.count_allocs() >= 4, "torch recorded the allocations");
    let native = program.notes.native.clone().expect("torch snapshots hold segments");
    assert!(native.current_reserved.unwrap_or(0) > 0);
    let configs = compare::resolve(&["pytorch".into()], &base()).unwrap();
    let run = replay::run(&program, &configs[0], None, None).unwrap();
    assert!(run.worst.floor >= 20000 * 1024 * 4, "the 80 MB tensor was live");
}

/// stepalloc's own recordings: `Allocator::trace_jsonl` and `Allocator::snapshot` (PyTorch's
/// layout) of a real run replay to the run's own figures.
#[test]
fn stepalloc_recordings_replay_to_the_recorded_run() {
    use stepalloc::{Allocator, Config, Stream};
    // PyTorch's block choice, as the `pytorch` preset it is replayed under.
    let a = Allocator::new(Config::parse("backend:sim,trace_entries:100000,exact_fit:True").unwrap()).unwrap();
    let mut live = Vec::new();
    a.step_begin("rollout").unwrap();
    for i in 0..200u64 {
        let size = (i * 7919 % 97 + 1) * 65536 + i;
        live.push((a.malloc(0, size, Stream(i % 3)).unwrap(), size));
        if i % 3 == 2 {
            let (ptr, size) = live.swap_remove((i as usize * 31) % live.len());
            a.free(0, ptr, size).unwrap();
        }
    }
    a.step_end().unwrap();
    a.step_begin("train").unwrap();
    for (ptr, size) in live.drain(..100) {
        a.free(0, ptr, size).unwrap();
    }
    a.step_end().unwrap();
    let stats = a.stats(0).unwrap();
    let configs = compare::resolve(&["pytorch".into()], &base()).unwrap();

    let jsonl = a.trace_jsonl();
    assert_eq!(trace::detect(jsonl.as_bytes()).unwrap(), Format::StepallocJsonl);
    let program = trace::parse(jsonl.as_bytes()).unwrap();
    assert_eq!(program.phases, vec!["rollout".to_string(), "train".to_string()]);
    let run = replay::run(&program, &configs[0], None, None).unwrap();
    assert_eq!(run.worst.floor, stats.heap.requested_bytes.all.peak);
    assert_eq!(run.worst.peak_allocated, stats.heap.allocated_bytes.all.peak);
    assert_eq!(run.worst.peak_reserved, stats.heap.reserved_bytes.all.peak);
    assert_eq!(run.steps_count, 2);

    let snapshot = serde_json::to_vec(&a.snapshot()).unwrap();
    assert_eq!(trace::detect(&snapshot).unwrap(), Format::TorchJson);
    let program = trace::parse(&snapshot).unwrap();
    let run = replay::run(&program, &configs[0], None, None).unwrap();
    assert_eq!(run.worst.floor, stats.heap.requested_bytes.all.peak);
    assert_eq!(run.worst.peak_reserved, stats.heap.reserved_bytes.all.peak);
    let native = program.notes.native.expect("the snapshot has segments and segment events");
    assert_eq!(native.current_reserved, Some(stats.heap.reserved_bytes.all.current));
    assert_eq!(native.peak_reserved, Some(stats.heap.reserved_bytes.all.peak));
}
