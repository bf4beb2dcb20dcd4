//! Sixth adversarial pass on `stepalloc-stress fit`: hostile JSON-lines traces (bad text, deep
//! nesting, frees of unknown addresses, duplicate addresses, zero and enormous sizes, out-of-range
//! devices, long lines, a stream per allocation), module names that try to write markup into
//! the page and the chart, and output paths that are the trace itself, the other picture or a
//! directory. Each must end in a report or a clear error (exit 2) naming what is wrong, never a
//! panic, a page that runs injected script, or a destroyed trace.

mod common;

use common::stress;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A scratch directory of this test (removed first).
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("adversarial_fit_{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn fit(trace: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["fit", trace.to_str().unwrap(), "--capacity-gb", "1", "--outside-mb", "0", "--json"];
    args.extend(extra);
    stress(&args)
}

const ALLOC_1MIB: &str = r#"{"op":"alloc","device":0,"addr":1,"size":1048576,"stream":0}"#;

#[test]
fn hostile_traces_end_in_a_report_or_an_error_naming_the_line() {
    let dir = scratch("traces");
    let deep = format!(
        r#"{{"op":"alloc","device":0,"addr":1,"size":1,"stream":0,"x":{}{}}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let refused: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "invalid_utf8",
            b"{\"op\":\"alloc\",\"device\":0,\"addr\":1,\"size\":10,\"stream\":0,\"module\":\"\xff\xfe\"}\n".to_vec(),
            "line 1: not UTF-8",
        ),
        ("deep", deep.into_bytes(), "recursion limit"),
        ("negative", br#"{"op":"alloc","device":0,"addr":1,"size":-10,"stream":0}"#.to_vec(), "line 1"),
        ("float", br#"{"op":"alloc","device":0,"addr":1,"size":1e30,"stream":0}"#.to_vec(), "line 1"),
        ("device", br#"{"op":"alloc","device":65535,"addr":1,"size":10,"stream":0}"#.to_vec(), "device 65535"),
        (
            "long_line",
            format!("{ALLOC_1MIB}\n{{\"op\":\"step_begin\",\"phase\":\"{}\"}}\n", "x".repeat(2 << 20)).into_bytes(),
            "line 2",
        ),
        (
            "module_too_long",
            format!(r#"{{"op":"alloc","device":0,"addr":1,"size":1,"stream":0,"module":"{}"}}"#, "m".repeat(600))
                .into_bytes(),
            "module",
        ),
        ("empty", Vec::new(), "empty"),
    ];
    for (name, bytes, want) in refused {
        let (code, _, stderr) = fit(&write(&dir, name, &bytes), &[]);
        assert_eq!(code, 2, "{name}: {stderr}");
        assert!(stderr.contains(want), "{name}: {stderr}");
    }
    // Frees of unknown addresses, a double free, an address reused while live and zero sizes are
    // skipped; enormous sizes run out of memory. Each column reports.
    let odd = [
        ALLOC_1MIB,
        r#"{"op":"free","device":0,"addr":7}"#,
        r#"{"op":"free","device":0,"addr":1}"#,
        r#"{"op":"free","device":0,"addr":1}"#,
        r#"{"op":"alloc","device":0,"addr":2,"size":0,"stream":0}"#,
        r#"{"op":"free","device":0,"addr":2}"#,
        r#"{"op":"alloc","device":0,"addr":3,"size":4096,"stream":0}"#,
        r#"{"op":"alloc","device":0,"addr":3,"size":8192,"stream":0}"#,
        r#"{"op":"step_end"}"#,
    ]
    .join("\n");
    let (code, stdout, stderr) = fit(&write(&dir, "odd", odd.as_bytes()), &[]);
    assert_eq!(code, 0, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    for c in report["configs"].as_array().unwrap() {
        assert_eq!(c["fits"], true, "{c}");
    }
    let huge = [
        r#"{"op":"alloc","device":0,"addr":1,"size":18446744073709551615,"stream":0}"#,
        r#"{"op":"alloc","device":0,"addr":2,"size":9223372036854775808,"stream":0}"#,
        ALLOC_1MIB.replace("\"addr\":1", "\"addr\":3").as_str(),
    ]
    .join("\n");
    let (code, stdout, stderr) = fit(&write(&dir, "huge", huge.as_bytes()), &[]);
    assert_eq!(code, 0, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    for c in report["configs"].as_array().unwrap() {
        assert_eq!((c["fits"].as_bool(), c["ooms"].as_u64()), (Some(false), Some(2)), "{c}");
        assert_eq!(c["first_oom"]["allocation"], 1, "{c}");
    }
    // A stream per allocation: a segment each, until the device is full; bounded, reported.
    let streams: String = (0..20_000)
        .map(|i| format!(r#"{{"op":"alloc","device":0,"addr":{i},"size":512,"stream":{i}}}"#) + "\n")
        .collect();
    let (code, stdout, stderr) = fit(&write(&dir, "streams", streams.as_bytes()), &[]);
    assert_eq!(code, 0, "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["configs"][0]["fits"], false);
}

#[test]
fn markup_in_module_names_is_text_in_the_page_and_the_chart() {
    let dir = scratch("markup");
    let lines = [
        r#"{"op":"alloc","device":0,"addr":1,"size":268435456,"stream":0,"module":"</text><script>alert(1)</script>","torch_op":"\" onmouseover=\"alert(2)"}"#,
        r#"{"op":"alloc","device":0,"addr":2,"size":1073741824,"stream":0,"module":"a</title><svg onload=alert(3)>&amp;","torch_op":"';alert(4);//"}"#,
    ]
    .join("\n");
    let trace = write(&dir, "t.jsonl", lines.as_bytes());
    let (html, svg) = (dir.join("t.html"), dir.join("t.svg"));
    let (code, _, stderr) = fit(&trace, &["--html", html.to_str().unwrap(), "--svg", svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    let page = std::fs::read_to_string(&html).unwrap();
    let chart = std::fs::read_to_string(&svg).unwrap();
    for text in [&page, &chart] {
        for injected in ["<script>alert", "onmouseover=\"alert", "<svg onload", "</title><svg"] {
            assert!(!text.contains(injected), "{injected} reached the markup");
        }
    }
    // The page's one script is its own check; the names are there, escaped.
    assert_eq!(page.matches("<script").count(), 1);
    assert!(page.contains("a&lt;/title&gt;&lt;svg onload=alert(3)&gt;&amp;amp;"));
    assert!(chart.contains("&lt;/text&gt;&lt;script&gt;alert(1)&lt;/script&gt;"));
}

#[test]
fn an_output_that_is_the_trace_or_the_other_picture_is_refused_and_the_trace_kept() {
    let dir = scratch("outputs");
    let trace = write(&dir, "step.jsonl", ALLOC_1MIB.as_bytes());
    std::os::unix::fs::symlink(&trace, dir.join("link.jsonl")).unwrap();
    let t = trace.to_str().unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["fit".into(), t.into(), "--capacity-gb".into(), "1".into(), "--html".into(), t.into()], "--html"),
        (
            vec![
                "fit".into(),
                t.into(),
                "--capacity-gb".into(),
                "1".into(),
                "--svg".into(),
                dir.join("link.jsonl").display().to_string(),
            ],
            "--svg",
        ),
        (
            vec![
                "fit".into(),
                t.into(),
                "--capacity-gb".into(),
                "1".into(),
                "--html".into(),
                dir.join("p").display().to_string(),
                "--svg".into(),
                format!("{}/./p", dir.display()),
            ],
            "--html writes that file too",
        ),
        (vec!["replay".into(), t.into(), "--plot".into(), t.into()], "--plot"),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, _, stderr) = stress(&args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(want) && !stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(std::fs::read_to_string(&trace).unwrap(), ALLOC_1MIB, "{args:?} changed the trace");
    }
    // A directory, a missing folder: the error names the path.
    for out in [dir.display().to_string(), dir.join("no/such/x.html").display().to_string()] {
        let (code, _, stderr) = stress(&["fit", t, "--capacity-gb", "1", "--html", &out]);
        assert_eq!(code, 2, "{out}: {stderr}");
        assert!(stderr.contains(&out), "{out}: {stderr}");
    }
}
