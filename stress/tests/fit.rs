//! `stepalloc-stress fit`: a recorded trace's `module` and `torch_op` become its sites (and
//! bad ones are errors naming the line), a small hand-written trace fits at one capacity and
//! fails at a smaller one with exactly the figures worked out by hand below, the user's
//! `PYTORCH_CUDA_ALLOC_CONF` is read as PyTorch reads it, bad device sizes are refused, and the
//! page opens in a real browser with every series drawn.
//!
//! The hand-written trace (`tests/data/fit_small.jsonl`), PyTorch's rules: allocations 1 and
//! 2 (6 MiB each) split one 20 MiB segment (6 + 6 + 8 free); freeing 1 leaves free pieces of 6
//! and 8 MiB that do not touch; allocation 3 (10 MiB) fits neither and needs a 10 MiB segment.
//! With 40 MiB usable: 30 MiB reserved at the peak, 10 MiB of headroom. With 24 MiB: the 20 MiB
//! segment holds a live block, so freeing the cache releases nothing, the retry fails, and the
//! out-of-memory finds 20 MiB reserved, 6 MiB allocated, 14 MiB cached free whose largest
//! block is 8 MiB (1 - 8/14 = 3/7 fragmented), 4 MiB of the device free.

mod common;

use common::stress;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use stepalloc_stress::ops::{SiteKind, MAX_SITES};
use stepalloc_stress::trace;

const MIB: u64 = 1 << 20;

fn small() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fit_small.jsonl")
}

fn fit_json(args: &[&str]) -> Value {
    let small = small();
    let mut all = vec!["fit", small.to_str().unwrap(), "--json"];
    all.extend(args);
    let (code, stdout, stderr) = stress(&all);
    assert_eq!(code, 0, "{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn column<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["configs"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("{name}"))
}

#[test]
fn module_and_torch_op_are_the_allocations_sites() {
    let text = concat!(
        r#"{"op":"alloc","addr":1,"size":512}"#,
        "\n",
        r#"{"op":"alloc","addr":2,"size":1024,"module":"model.layers.3.mlp","torch_op":"aten::mm"}"#,
        "\n",
        r#"{"op":"alloc","addr":3,"size":2048,"module":"","torch_op":"cublas_workspace"}"#,
        "\n",
        r#"{"op":"alloc","addr":4,"size":4096,"module":"model.layers.3.mlp","torch_op":"aten::mm"}"#,
        "\n",
        r#"{"op":"alloc","addr":5,"size":512,"module":null}"#,
        "\n",
    );
    let p = trace::jsonl::parse(text.as_bytes()).unwrap();
    assert!(p.has_sites());
    assert_eq!(p.notes.sites.kind, SiteKind::Modules);
    let sites: Vec<(&str, &str)> = (0..5).map(|n| p.site_of(n)).map(|s| (p.site_name(s), p.site_op(s))).collect();
    assert_eq!(
        sites,
        [
            ("(none)", ""),
            ("model.layers.3.mlp", "aten::mm"),
            ("(none)", "cublas_workspace"),
            ("model.layers.3.mlp", "aten::mm"),
            ("(none)", "")
        ]
    );
    // One site per distinct pair: the fourth allocation shares the second's.
    assert_eq!(p.site_of(1), p.site_of(3));
    // A trace without the fields has no sites, as before.
    let plain = trace::jsonl::parse(b"{\"op\":\"alloc\",\"addr\":1,\"size\":512}\n").unwrap();
    assert!(!plain.has_sites());
}

#[test]
fn bad_module_or_torch_op_is_an_error_naming_the_line_and_the_field() {
    let good = r#"{"op":"alloc","addr":1,"size":512,"module":"m"}"#;
    let long = "x".repeat(trace::jsonl::MAX_SITE_FIELD + 1);
    for (line, want) in [
        (r#"{"op":"alloc","addr":2,"size":512,"module":3}"#.to_string(), "`module` is a number; expected a string"),
        (r#"{"op":"alloc","addr":2,"size":512,"torch_op":["aten::mm"]}"#.to_string(), "`torch_op` is an array"),
        (r#"{"op":"alloc","addr":2,"size":512,"module":{"a":1}}"#.to_string(), "`module` is an object"),
        (r#"{"op":"alloc","addr":2,"size":512,"torch_op":true}"#.to_string(), "`torch_op` is a boolean"),
        (
            format!(r#"{{"op":"alloc","addr":2,"size":512,"module":"{long}"}}"#),
            "`module` is 513 bytes long; at most 512",
        ),
        (r#"{"op":"alloc","addr":2,"size":512,"module":"a\nb"}"#.to_string(), "`module` holds the control character"),
    ] {
        let text = format!("{good}\n\n{line}\n");
        let e = trace::jsonl::parse(text.as_bytes()).unwrap_err();
        assert_eq!(e.position, "line 3", "{line}: {e}");
        assert!(e.message.contains(want), "{line}: {e}");
    }
    // Through the command line: exit 2, the file and the line named.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(&path, format!("{good}\n{}\n", r#"{"op":"alloc","addr":2,"size":512,"module":7}"#)).unwrap();
    let (code, _, stderr) = stress(&["fit", path.to_str().unwrap(), "--capacity-gb", "1"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("bad.jsonl: at line 2: `module` is a number"), "{stderr}");
}

#[test]
fn more_distinct_sites_than_the_bound_is_an_error() {
    let mut text = String::new();
    for i in 0..MAX_SITES {
        text.push_str(&format!("{{\"op\":\"alloc\",\"addr\":{i},\"size\":512,\"module\":\"m{i}\"}}\n"));
    }
    // Site 0 is "none": MAX_SITES - 1 named sites fit, the next distinct one does not.
    let e = trace::jsonl::parse(text.as_bytes()).unwrap_err();
    assert_eq!(e.position, format!("line {MAX_SITES}"), "{e}");
    assert!(e.message.contains("more than 65536 distinct allocation sites"), "{e}");
    // Repeating known sites costs nothing.
    let mut text = String::new();
    for i in 0..(2 * MAX_SITES) {
        text.push_str(&format!("{{\"op\":\"alloc\",\"addr\":{i},\"size\":512,\"module\":\"m{}\"}}\n", i % 100));
    }
    assert!(trace::jsonl::parse(text.as_bytes()).is_ok());
}

#[test]
fn replay_and_advise_attribute_a_recorded_trace_by_module() {
    let small = small();
    let (code, text, stderr) = stress(&["replay", small.to_str().unwrap(), "--compare", "pytorch"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(text.contains("live at the peak: 0.02 GiB in 2 allocations, by module:"), "{text}");
    assert!(text.contains("model.layers.0.mlp (backward)"), "{text}");
    let (code, out, stderr) = stress(&["advise", small.to_str().unwrap(), "--json", "--capacity-gb", "1"]);
    assert_eq!(code, 0, "{stderr}");
    let a: Value = serde_json::from_str(&out).unwrap();
    let attribution = &a["pytorch_default"]["attribution"];
    assert_eq!(attribution["grouping"], "by module");
    assert_eq!(attribution["groups"][0]["site"], "model.layers.0.mlp (backward)");
}

#[test]
fn fits_with_room_and_runs_out_of_memory_on_a_smaller_device_exactly() {
    // 1 GiB less 984 MiB outside PyTorch: 40 MiB usable.
    let r = fit_json(&["--capacity-gb", "1", "--outside-mb", "984"]);
    assert_eq!(r["device"]["capacity_bytes"], 1024 * MIB);
    assert_eq!(r["device"]["outside_bytes"], 984 * MIB);
    assert_eq!(r["device"]["usable_bytes"], 40 * MIB);
    assert_eq!(r["trace"]["allocations"], 3);
    assert_eq!(r["trace"]["frees"], 3);
    assert_eq!(r["trace"]["steps"], 1);
    assert_eq!(r["trace"]["floor_bytes"], 16 * MIB);
    assert_eq!(r["trace"]["sites"], "modules");
    let names: Vec<&str> = r["configs"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["pytorch", "pytorch_expandable", "split128", "stepalloc"]);
    let p = column(&r, "pytorch");
    assert_eq!(p["fits"], true);
    assert_eq!(p["env"], "PYTORCH_CUDA_ALLOC_CONF=");
    assert_eq!(p["peak_reserved_bytes"], 30 * MIB);
    assert_eq!(p["peak_allocated_bytes"], 16 * MIB);
    assert_eq!(p["peak_requested_bytes"], 16 * MIB);
    assert_eq!(p["headroom_bytes"], 10 * MIB);
    assert_eq!((p["alloc_retries"].as_u64(), p["ooms"].as_u64()), (Some(0), Some(0)));
    assert_eq!(p["first_oom"], Value::Null);
    assert_eq!(p["peak_allocation"], 3);
    assert_eq!((p["peak_step"].as_u64(), p["peak_phase"].as_str()), (Some(1), Some("train")));
    assert_eq!(
        p["peak_top_modules"],
        serde_json::json!([
            {"module": "model.layers.0.mlp (backward)", "bytes": 10 * MIB},
            {"module": "model.layers.0.mlp", "bytes": 6 * MIB}
        ])
    );
    assert_eq!(column(&r, "pytorch_expandable")["peak_reserved_bytes"], 40 * MIB); // two 20 MiB pages
    assert_eq!(column(&r, "stepalloc")["env"], format!("STEPALLOC_CONF={}", stepalloc::config::RECOMMENDED));

    // 24 MiB usable: PyTorch's default runs out of memory at allocation 3.
    let r = fit_json(&["--capacity-gb", "1", "--outside-mb", "1000"]);
    let p = column(&r, "pytorch");
    assert_eq!(p["fits"], false);
    assert_eq!((p["alloc_retries"].as_u64(), p["ooms"].as_u64()), (Some(1), Some(1)));
    assert_eq!(p["headroom_bytes"], 0);
    assert_eq!(p["peak_reserved_bytes"], 20 * MIB);
    assert_eq!(
        p["first_oom"],
        serde_json::json!({
            "allocation": 3, "size": 10 * MIB, "stream": 0, "step": 1, "phase": "train",
            "module": "model.layers.0.mlp (backward)", "torch_op": "aten::addmm",
            "allocated_bytes": 6 * MIB, "reserved_bytes": 20 * MIB, "free_device_bytes": 4 * MIB,
            "cached_free_bytes": 14 * MIB, "largest_free_block_bytes": 8 * MIB,
            "external_fragmentation": 1.0 - 8.0 / 14.0
        })
    );
    // The skipped allocation is not live at the peak (allocation 1, the 20 MiB segment's first).
    assert_eq!(p["peak_allocation"], 1);
    assert_eq!(p["peak_top_modules"], serde_json::json!([{"module": "model.layers.0.self_attn", "bytes": 6 * MIB}]));
    // The table says it in a line.
    let small = small();
    let (code, text, _) = stress(&["fit", small.to_str().unwrap(), "--capacity-gb", "1", "--outside-mb", "1000"]);
    assert_eq!(code, 0);
    assert!(
        text.contains(
            "pytorch: out of memory at allocation 3 (10.00 MiB, aten::addmm in model.layers.0.mlp (backward), train \
             step 1): 14.00 MiB cached free, largest free block 8.00 MiB, 43% fragmented; 4.00 MiB of the device free"
        ),
        "{text}"
    );
    assert!(text.contains("device: 1.00 GiB, of which 1000.00 MiB outside PyTorch (--outside-mb)"), "{text}");
}

#[test]
fn the_default_outside_memory_is_stated() {
    let r = fit_json(&["--capacity-gb", "2"]);
    assert_eq!(r["device"]["outside_bytes"], 512 * MIB);
    assert_eq!(r["device"]["outside_default"], true);
    assert_eq!(r["device"]["usable_bytes"], 1536 * MIB);
    let small = small();
    let (_, text, _) = stress(&["fit", small.to_str().unwrap(), "--capacity-gb", "2"]);
    assert!(
        text.contains("512.00 MiB outside PyTorch (the default for a CUDA context; --outside-mb sets it)"),
        "{text}"
    );
}

#[test]
fn the_users_setting_is_a_column_read_as_pytorch_reads_it() {
    let r = fit_json(&["--capacity-gb", "1", "--outside-mb", "984", "--pytorch-conf", " expandable_segments : True "]);
    let yours = column(&r, "yours");
    let expandable = column(&r, "pytorch_expandable");
    assert_eq!(yours["allocator"], "pytorch");
    assert_eq!(yours["conf"], "expandable_segments:True");
    assert_eq!(yours["env"], "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
    for key in ["fits", "peak_reserved_bytes", "peak_allocated_bytes", "alloc_retries", "first_oom"] {
        assert_eq!(yours[key], expandable[key], "{key}");
    }
    // per_process_memory_fraction is of the whole device: 0.025 of 1024 MiB is 25.6 MiB, below
    // the 30 MiB the trace needs, so it runs out of memory on the 40 MiB usable.
    let r =
        fit_json(&["--capacity-gb", "1", "--outside-mb", "984", "--pytorch-conf", "per_process_memory_fraction:0.025"]);
    let yours = column(&r, "yours");
    assert_eq!(yours["fits"], false);
    assert_eq!(yours["first_oom"]["allocation"], 3);
    assert_eq!(column(&r, "pytorch")["fits"], true);
    let r =
        fit_json(&["--capacity-gb", "1", "--outside-mb", "984", "--pytorch-conf", "per_process_memory_fraction:0.03"]);
    assert_eq!(column(&r, "yours")["fits"], true);
    // Keys of pinned host memory do not change the device's memory: left out, and said so.
    let r = fit_json(&["--capacity-gb", "1", "--pytorch-conf", "pinned_use_background_threads:True"]);
    assert_eq!(r["notes"][0], "`pinned_use_background_threads` left out: it concerns pinned host memory");
    // --compare replaces the default columns; yours comes last.
    let r = fit_json(&["--capacity-gb", "1", "--compare", "split128", "--pytorch-conf", "max_split_size_mb:64"]);
    let names: Vec<&str> = r["configs"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["split128", "yours"]);
    // What PyTorch would refuse is refused, naming the key.
    let small = small();
    for (conf, want) in [
        ("expandable_segments:true", "PyTorch would refuse it (it takes `True` or `False` only)"),
        ("page_reuse:True", "`page_reuse` is not one of PyTorch 2.15's keys"),
        ("max_split_size_mb:8", "max_split_size_mb"),
        ("backend:cudaMallocAsync", "is not modelled"),
    ] {
        let (code, _, stderr) = stress(&["fit", small.to_str().unwrap(), "--capacity-gb", "1", "--pytorch-conf", conf]);
        assert_eq!(code, 2, "{conf}: {stderr}");
        assert!(stderr.contains("--pytorch-conf") && stderr.contains(want), "{conf}: {stderr}");
    }
}

#[test]
fn bad_device_sizes_are_refused_naming_the_flag() {
    let small = small();
    let s = small.to_str().unwrap();
    for (args, want) in [
        (vec!["--capacity-gb", "0"], "--capacity-gb `0`: out of range"),
        (vec!["--capacity-gb", "-3"], "--capacity-gb `-3`: out of range"),
        (vec!["--capacity-gb", "lots"], "--capacity-gb `lots`: not a number"),
        (vec!["--capacity-gb", "nan"], "--capacity-gb `nan`: out of range"),
        (
            vec!["--capacity-gb", "1", "--outside-mb", "2048"],
            "--outside-mb 2048: the memory outside PyTorch leaves nothing",
        ),
        (
            vec!["--capacity-gb", "1", "--outside-mb", "1024"],
            "--outside-mb 1024: the memory outside PyTorch leaves nothing",
        ),
        (vec!["--capacity-gb", "1", "--outside-mb", "1023"], "leaves 1 MiB of the device's 1024 MiB"),
    ] {
        let mut all = vec!["fit", s];
        all.extend(args.iter());
        let (code, _, stderr) = stress(&all);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    // No capacity at all: clap names the flag.
    let (code, _, stderr) = stress(&["fit", s]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--capacity-gb"), "{stderr}");
}

/// Debian's chromium, when installed (CI installs it; see .ci/run).
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser"].iter().find_map(|name| {
        std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(name)).find(|p| p.is_file())
    })
}

fn headless(browser: &Path, profile: &Path, args: &[&str]) -> std::process::Output {
    Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            &format!("--user-data-dir={}", profile.display()),
        ])
        .args(args)
        .output()
        .unwrap()
}

/// Width and height of a PNG, from its IHDR chunk.
fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
    if bytes.len() < 24 || &bytes[..8] != b"\x89PNG\r\n\x1a\n" || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&bytes[16..20]), be(&bytes[20..24])))
}

#[test]
fn the_page_opens_in_a_real_browser_with_every_series_drawn() {
    let Some(browser) = chromium() else {
        assert!(std::env::var_os("CI").is_none(), "CI must install chromium (.ci/run)");
        eprintln!("skipped: no chromium on PATH (apt-get install chromium)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("fit.html");
    let picture = dir.path().join("fit.svg");
    let small = small();
    let (code, _, stderr) = stress(&[
        "fit",
        small.to_str().unwrap(),
        "--capacity-gb",
        "1",
        "--outside-mb",
        "1000",
        "--pytorch-conf",
        "max_split_size_mb:20",
        "--html",
        page.to_str().unwrap(),
        "--svg",
        picture.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let html = std::fs::read_to_string(&page).unwrap();
    // Self-contained: nothing fetched from anywhere.
    for needle in ["http://", "https://", "<link", "src=", "@import", "url(http"] {
        let found = html.replace("http://www.w3.org/2000/svg", "");
        assert!(!found.contains(needle), "the page refers to `{needle}`");
    }
    let svg = std::fs::read_to_string(&picture).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains(r#"data-series="5""#), "{svg}");
    assert!(html.contains(svg.trim_end()), "the page holds the same chart as --svg");

    let url = format!("file://{}", page.display());
    let dom = headless(&browser, &dir.path().join("profile-dom"), &["--dump-dom", &url]);
    let dom_text = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.status.success(), "{}", String::from_utf8_lossy(&dom.stderr));
    assert!(
        dom_text.contains(r#"id="check" data-ok="true">check: all 5 series drawn, 5 peaks marked<"#),
        "the page's own check: {}",
        dom_text.lines().find(|l| l.contains("id=\"check\"")).unwrap_or("(no #check)")
    );
    for name in ["pytorch", "pytorch_expandable", "split128", "stepalloc", "yours"] {
        assert!(dom_text.contains(&format!(r#"class="series" data-config="{name}""#)), "{name}");
    }
    assert!(dom_text.contains("model.layers.*.self_attn"), "the module at the peak is named");
    assert!(dom_text.contains("out of memory at allocation 3"), "the first out-of-memory is named");

    let shot = dir.path().join("fit.png");
    let out = headless(
        &browser,
        &dir.path().join("profile-shot"),
        &[&format!("--screenshot={}", shot.display()), "--window-size=1100,900", &url],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(png_size(&png), Some((1100, 900)));
    // A blank page compresses to a few kilobytes; the chart and its text do not.
    assert!(png.len() > 30_000, "the screenshot is {} bytes: nothing drawn?", png.len());
    if let Some(keep) = std::env::var_os("STEPALLOC_FIT_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
}
