//! `stepalloc-stress advise`: its recommendation is never worse than PyTorch's default on the
//! agent presets' exported traces and the real-model traces, its explanation names the pool and
//! the phase of the peak, a snapshot with frames gives the right call site at the peak (text,
//! JSON, plot and `replay`), the recorded setting is read from `allocator_settings`, and bad
//! input exits 2 with an error naming it.

mod common;

use common::stress;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use stepalloc_stress::advise;
use stepalloc_stress::trace;

const MIB: u64 = 1 << 20;

fn advise_json(path: &Path) -> Value {
    let (code, stdout, stderr) = stress(&["advise", path.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{}: {stderr}", path.display());
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{}: {e}: {stdout}", path.display()))
}

/// The recommendation fits, is never above PyTorch's default, and both explanations name the
/// pool and the phase of the peak.
fn check_recommendation(name: &str, a: &Value, phases: &[&str]) {
    let default = a["pytorch_default"]["peak_reserved"].as_u64().unwrap();
    let best = &a["best_native"];
    assert!(best["fits"].as_bool().unwrap(), "{name}: {best}");
    assert!(best["peak_reserved"].as_u64().unwrap() <= default, "{name}: {best} vs default {default}");
    assert!(a["best_stepalloc"]["fits"].as_bool().unwrap(), "{name}");
    assert_eq!(a["current_label"], "PyTorch default (not recorded)", "{name}");
    assert_eq!(a["current"]["peak_reserved"].as_u64().unwrap(), default, "{name}");
    for key in ["explanation_native", "explanation_stepalloc"] {
        let text = a[key].as_str().unwrap();
        assert!(text.contains("large pool") || text.contains("small pool"), "{name}: {key}: {text}");
        assert!(phases.iter().any(|p| text.contains(&format!("phase `{p}`"))), "{name}: {key}: {text}");
    }
    // The peak moment is the run's own peak reserved.
    for key in ["pytorch_default", "best_native", "best_stepalloc"] {
        let c = &a[key];
        assert_eq!(c["peak"]["device_used"], c["peak_reserved"], "{name}: {key}");
        let attribution = &c["attribution"];
        assert_eq!(attribution["frames_recorded"], false, "{name}");
        assert!(!attribution["groups"].as_array().unwrap().is_empty(), "{name}: {key}");
    }
    let setting = best["setting"].as_str().unwrap();
    assert_eq!(best["env"].as_str().unwrap(), format!("PYTORCH_CUDA_ALLOC_CONF={setting}"), "{name}");
}

#[test]
fn advise_on_real_model_traces_is_never_worse_than_pytorchs_default() {
    for (name, phases) in [
        ("model_llama_sft.jsonl", &["train", "eval"][..]),
        ("model_vlm_agent.jsonl", &["rollout", "train"][..]),
        ("model_vlm_agent_trained_vision.jsonl", &["rollout", "train"][..]),
    ] {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name);
        let a = advise_json(&path);
        check_recommendation(name, &a, phases);
        // Variable shapes fragment PyTorch's default cache: the search finds strictly better.
        assert!(a["best_native"]["peak_reserved"].as_u64() < a["pytorch_default"]["peak_reserved"].as_u64(), "{name}");
    }
}

#[test]
fn advise_on_the_agent_presets_exported_traces_is_never_worse_than_pytorchs_default() {
    let dir = tempfile::tempdir().unwrap();
    for (preset, phases) in [("vlm-7b", &["rollout", "train"][..]), ("llm-7b-sft", &["train", "eval"][..])] {
        let path = dir.path().join(format!("{preset}.jsonl"));
        let (code, _, stderr) = stress(&[
            "gen-trace",
            "--preset",
            preset,
            "--iterations",
            "1",
            "--layers",
            "4",
            "--out",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{stderr}");
        let a = advise_json(&path);
        check_recommendation(preset, &a, phases);
    }
}

fn frame(file: &str, line: u64, name: &str) -> Value {
    json!({"filename": file, "line": line, "name": name})
}

/// A PyTorch snapshot with Python frames: two 30 MiB blocks from `mlp` come and go, then two
/// 200 MiB blocks from `attention` (under torch's own module frame) and a 50 MiB one from
/// `step` (under a C++ and a torch frame) stay live; the peak is at the last allocation under
/// every configuration, with `attention` holding 400 MiB of it.
fn snapshot_with_frames() -> Vec<u8> {
    snapshot_recorded_with("")
}

/// `snapshot_with_frames` with `PYTORCH_CUDA_ALLOC_CONF` recorded as `conf`.
fn snapshot_recorded_with(conf: &str) -> Vec<u8> {
    let torch = frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py", 1750, "_call_impl");
    let attention = json!([torch, frame("model.py", 20, "attention"), frame("train.py", 5, "main")]);
    let mlp = json!([frame("model.py", 10, "mlp"), frame("train.py", 5, "main")]);
    let step = json!([frame("??", 0, "c10::cuda::alloc"), torch, frame("train.py", 30, "step")]);
    let mut trace = Vec::new();
    let mut t = 0u64;
    let mut entry = |action: &str, addr: u64, size: u64, frames: &Value| {
        t += 10;
        trace.push(json!({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                          "frames": frames, "compile_context": "N/A", "user_metadata": ""}));
    };
    entry("alloc", 0x1000_0000, 30 * MIB, &mlp);
    entry("alloc", 0x2000_0000, 30 * MIB, &mlp);
    for addr in [0x1000_0000, 0x2000_0000] {
        entry("free_requested", addr, 30 * MIB, &mlp);
        entry("free_completed", addr, 30 * MIB, &mlp);
    }
    entry("alloc", 0x3000_0000, 200 * MIB, &attention);
    entry("alloc", 0x4000_0000, 200 * MIB, &attention);
    entry("alloc", 0x5000_0000, 50 * MIB, &step);
    let snapshot = json!({
        "segments": [],
        "device_traces": [trace],
        "external_annotations": [],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": conf,
            "max_split_size": 256 * MIB,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": false,
            "roundup_power2_divisions": vec![0; 64],
        },
    });
    serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new()).unwrap()
}

#[test]
fn frames_give_the_call_site_that_holds_the_peak() {
    let data = snapshot_with_frames();
    // The parser keeps one site per allocation: the top user frame.
    let program = trace::parse(&data).unwrap();
    assert!(program.has_sites());
    assert_eq!(program.notes.sites.per_alloc.len(), program.count_allocs());
    let names: Vec<&str> = program.notes.sites.per_alloc.iter().map(|&s| program.site_name(s)).collect();
    assert_eq!(
        names,
        ["model.py:10 mlp", "model.py:10 mlp", "model.py:20 attention", "model.py:20 attention", "train.py:30 step"]
    );
    assert_eq!(program.notes.allocator_conf.as_deref(), Some("max_split_size_mb:256"));
    let last = program.ops.len() as u64 - 1;
    let a = advise::attribute(&program, last, 0, 8, &[]);
    assert!(a.frames_recorded);
    assert_eq!((a.live_bytes, a.live_count), (450 * MIB, 3));
    assert_eq!(
        (a.groups[0].site.as_str(), a.groups[0].bytes, a.groups[0].count),
        ("model.py:20 attention", 400 * MIB, 2)
    );
    assert_eq!((a.groups[1].site.as_str(), a.groups[1].bytes, a.groups[1].count), ("train.py:30 step", 50 * MIB, 1));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("frames.pickle");
    std::fs::write(&path, &data).unwrap();
    let a = advise_json(&path);
    assert_eq!(a["frames_recorded"], true);
    // The recorded setting is the current one, replayed.
    assert_eq!(a["recorded_setting"], "max_split_size_mb:256");
    assert_eq!(a["current_label"], "recorded `max_split_size_mb:256`");
    assert_eq!(a["current"]["setting"], "max_split_size_mb:256");
    for key in ["current", "pytorch_default", "best_native", "best_stepalloc"] {
        let top = &a[key]["attribution"]["groups"][0];
        assert_eq!(top["site"], "model.py:20 attention", "{key}: {}", a[key]);
        assert_eq!(top["bytes"].as_u64(), Some(400 * MIB), "{key}");
        assert_eq!(top["count"].as_u64(), Some(2), "{key}");
    }
    // PyTorch's default: segments of 30, 30, 200, 200 and 50 MiB; the peak at the last one.
    assert_eq!(a["pytorch_default"]["peak_reserved"].as_u64(), Some(510 * MIB));
    assert_eq!(a["pytorch_default"]["peak"]["op"].as_u64(), Some(program.ops.len() as u64 - 1));

    // The text report, the plot and `replay` name the site too.
    let svg = dir.path().join("advise.svg");
    let (code, text, stderr) = stress(&["advise", path.to_str().unwrap(), "--plot", svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(text.contains("by call site (top user frame)"), "{text}");
    assert!(text.contains("model.py:20 attention"), "{text}");
    assert!(text.contains("current: recorded `max_split_size_mb:256`"), "{text}");
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(svg.contains("top: model.py:20 attention (400 MiB)"), "{svg}");
    let (code, text, stderr) = stress(&["replay", path.to_str().unwrap(), "--compare", "pytorch"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(text.contains("live at the peak: 0.44 GiB in 3 allocations, by call site"), "{text}");
}

#[test]
fn traces_without_frames_group_by_size_class_and_say_so() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/snapshot_small.json");
    let program = trace::load(&path).unwrap();
    // Its frames are all `train.py:42 forward`: recorded. A JSON-lines trace has none.
    assert!(program.has_sites());
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stepalloc_small.jsonl");
    let program = trace::load(&path).unwrap();
    assert!(!program.has_sites());
    let last = program.ops.len() as u64 - 1;
    let a = advise::attribute(&program, last, 0, 8, &[]);
    assert!(!a.frames_recorded);
    assert!(a.groups.iter().all(|g| g.site.starts_with('[') && g.site.contains(", ")), "{a:?}");
    assert!(a.describe("x").contains("frames were not recorded"));
}

#[test]
fn bad_input_exits_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pickle");
    let (code, _, stderr) = stress(&["advise", missing.to_str().unwrap()]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("missing.pickle") && stderr.contains("No such file"), "{stderr}");

    let bad = dir.path().join("bad.trace");
    std::fs::write(&bad, b"hello, not a trace\n").unwrap();
    let (code, _, stderr) = stress(&["advise", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("bad.trace") && stderr.contains("unknown trace format"), "{stderr}");

    let cut = dir.path().join("cut.pickle");
    let data = snapshot_with_frames();
    std::fs::write(&cut, &data[..data.len() / 2]).unwrap();
    let (code, _, stderr) = stress(&["advise", cut.to_str().unwrap()]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("cut.pickle") && stderr.contains("byte"), "{stderr}");

    let good = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stepalloc_small.jsonl");
    for value in ["0", "-1", "1e9", "16385", "nan", "inf", "0.0000001"] {
        let (code, _, stderr) = stress(&["advise", good.to_str().unwrap(), "--capacity-gb", value]);
        assert_eq!(code, 2, "{value}: {stderr}");
        assert!(stderr.contains("--capacity-gb") && stderr.contains("(0, 16384]"), "{value}: {stderr}");
    }
    let (code, _, stderr) = stress(&["advise", good.to_str().unwrap(), "--capacity-gb", "lots"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--capacity-gb `lots`: not a number"), "{stderr}");
    // The flag is quoted as typed (it once printed 1e300 as 301 digits), and a long one is cut.
    let (code, _, stderr) = stress(&["advise", good.to_str().unwrap(), "--capacity-gb", "1e300"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--capacity-gb `1e300`: out of range") && stderr.len() < 200, "{stderr}");
    let long = format!("1{}", "0".repeat(5000));
    let (code, _, stderr) = stress(&["advise", good.to_str().unwrap(), "--capacity-gb", &long]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("...`: out of range") && stderr.len() < 200, "{stderr}");
    for args in [&["--backend", "cuda"][..], &["--compare", "pytorch"][..]] {
        let (code, _, stderr) = stress(&[&["advise", good.to_str().unwrap()], args].concat());
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains(args[0]), "{stderr}");
    }
    // A capacity is checked before the trace is read.
    let (code, _, stderr) = stress(&["advise", missing.to_str().unwrap(), "--capacity-gb", "0"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--capacity-gb"), "{stderr}");
}

#[test]
fn a_capacity_too_small_for_the_trace_says_it_does_not_fit() {
    // 450 MiB live at once on a 0.25 GiB device: nothing fits; exit 0 with the figures.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("frames.pickle");
    std::fs::write(&path, snapshot_with_frames()).unwrap();
    let (code, stdout, stderr) = stress(&["advise", path.to_str().unwrap(), "--capacity-gb", "0.25", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let a: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(a["capacity_bytes"].as_u64(), Some(256 * MIB));
    assert_eq!(a["best_native"]["fits"], false);
    assert_eq!(a["best_native"]["headroom_bytes"].as_u64(), Some(0));
    assert!(a["best_native"]["ooms"].as_u64().unwrap() > 0);
}

/// torch shares each frame dict, and each traceback list, between the entries that have it
/// (`py_symbolize`); Python's pickler then writes memo references. serde_pickle handed such a
/// shared object out once and then as None; the snapshot reader keeps them.
#[test]
fn shared_frames_as_torch_pickles_them_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.pickle");
    let script = r#"
import pickle, sys
torch = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1750, "name": "_call_impl"}
main = {"filename": "train.py", "line": 5, "name": "main"}
attention = [torch, {"filename": "model.py", "line": 20, "name": "attention"}, main]
mlp = [torch, {"filename": "model.py", "line": 10, "name": "mlp"}, main]
MIB = 1 << 20
trace = []
for i, (frames, size) in enumerate([(mlp, 1), (attention, 30), (attention, 30), (mlp, 2), (mlp, 3)]):
    trace.append({"action": "alloc", "addr": (i + 1) << 32, "size": size * MIB, "stream": 0,
                  "time_us": i, "frames": frames})
pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1], "wb"), protocol=4)
"#;
    let status = Command::new("python3").arg("-c").arg(script).arg(&path).status().expect("python3 runs");
    assert!(status.success());
    let program = trace::load(&path).unwrap();
    let names: Vec<&str> = program.notes.sites.per_alloc.iter().map(|&s| program.site_name(s)).collect();
    assert_eq!(
        names,
        ["model.py:10 mlp", "model.py:20 attention", "model.py:20 attention", "model.py:10 mlp", "model.py:10 mlp"]
    );
    let a = advise::attribute(&program, program.ops.len() as u64 - 1, 0, 8, &[]);
    assert_eq!((a.groups[0].site.as_str(), a.groups[0].bytes), ("model.py:20 attention", 60 * MIB));
    assert_eq!((a.groups[1].site.as_str(), a.groups[1].bytes), ("model.py:10 mlp", 6 * MIB));
}

/// A real `_dump_snapshot` of PyTorch's own allocator, recorded with Python frames under
/// `max_split_size_mb:64`, on testdrv's host-memory CUDA stand-in (`scripts/test.sh` runs this
/// after `testdrv/build.sh`; skipped without the stand-in or torch): the recorded setting is
/// read and replayed to the recorded peak, and the top group at the peak is the function that
/// allocated the most.
#[test]
fn real_torch_snapshot_with_frames() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let hostcuda = root.join("target/hostcuda");
    let runtime = hostcuda.join("runtime/libcudart.so.13");
    if !runtime.exists() {
        println!("SKIP: testdrv's stand-in is not built (testdrv/build.sh)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("rec.py");
    std::fs::write(
        &script,
        r#"import sys
try:
    import torch
except Exception as e:
    print("SKIP: torch is not importable:", e); sys.exit(0)
torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
MIB = 1 << 20
def attention(n):
    return [torch.empty(2 * n * MIB, dtype=torch.uint8, device="cuda")]
def mlp(n):
    return torch.empty(n * MIB, dtype=torch.uint8, device="cuda")
keep = []
for step in range(3):
    tmp = [mlp(3 + step) for _ in range(4)]
    del tmp
    keep += attention(30 + step)
x = mlp(1)
torch.cuda.memory._dump_snapshot(sys.argv[1])
print("OK")
"#,
    )
    .unwrap();
    let snapshot = dir.path().join("snap.pickle");
    let path = |dirs: &[PathBuf]| std::env::join_paths(dirs).unwrap();
    let out = Command::new("python3")
        .arg(&script)
        .arg(&snapshot)
        .env("LD_PRELOAD", &runtime)
        .env("LD_LIBRARY_PATH", path(&[hostcuda.join("runtime"), hostcuda.clone(), hostcuda.join("standins")]))
        .env("HOSTCUDA_DEVICES", "1")
        .env("HOSTCUDA_CAPACITY_MB", "1024")
        .env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if stdout.contains("SKIP") {
        println!("{stdout}");
        return;
    }
    assert!(stdout.contains("OK"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let (code, json, stderr) = stress(&["advise", snapshot.to_str().unwrap(), "--capacity-gb", "1", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let a: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(a["format"], "torch snapshot (pickle)");
    assert_eq!(a["frames_recorded"], true);
    assert_eq!(a["recorded_setting"], "max_split_size_mb:64");
    assert_eq!(a["current"]["setting"], "max_split_size_mb:64");
    // The replay of the recorded setting reserves what the recording allocator did.
    assert_eq!(a["current"]["peak_reserved"], a["recorded_peak_reserved"], "{a}");
    let top = &a["current"]["attribution"]["groups"][0];
    assert!(top["site"].as_str().unwrap().ends_with("rec.py:9 attention"), "{top}");
    assert_eq!((top["bytes"].as_u64(), top["count"].as_u64()), (Some((30 + 31 + 32) * 2 * MIB), Some(3)), "{top}");
    assert!(a["best_native"]["peak_reserved"].as_u64() <= a["pytorch_default"]["peak_reserved"].as_u64());
}

/// The recorded `backend` key: `native` is PyTorch's own allocator (replayed without the key);
/// CUDA's allocator and an unknown key are not replayed, and the report says why.
#[test]
fn recorded_backends_and_bad_keys() {
    let dir = tempfile::tempdir().unwrap();
    for (conf, current, note) in [
        ("backend:native,max_split_size_mb:128", Some("max_split_size_mb:128"), None),
        ("backend:cudaMallocAsync", None, Some("uses backend `cudaMallocAsync`, which the replay does not model")),
        ("max_split_size_mb:8", None, Some("cannot be replayed")),
    ] {
        let path = dir.path().join("recorded.pickle");
        std::fs::write(&path, snapshot_recorded_with(conf)).unwrap();
        let a = advise_json(&path);
        assert_eq!(a["recorded_setting"], conf);
        match current {
            Some(setting) => {
                assert_eq!(a["current"]["setting"], setting, "{conf}");
                assert!(a.get("note").is_none(), "{conf}: {a}");
            }
            None => {
                assert_eq!(a["current"]["setting"], "", "{conf}");
                let text = a["note"].as_str().unwrap();
                assert!(text.contains(note.unwrap()) && text.contains(conf), "{conf}: {text}");
                assert!(a["current_label"].as_str().unwrap().contains("not replayable"), "{conf}");
            }
        }
    }
}
