//! The command line's output errors, with real child processes: a stdout whose reader has gone
//! (`| head`) ends the command quietly with status 0; a full disk (`> /dev/full`) ends it with
//! `error: …` and status 2; neither panics (a panic exits 101 with a backtrace).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn trace() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stepalloc_small.jsonl").display().to_string()
}

/// Each command writes a report to stdout.
fn commands() -> Vec<Vec<String>> {
    let t = trace();
    [
        vec!["agent", "--iterations", "2", "--per-step"],
        vec!["replay", &t, "--per-step"],
        vec!["replay", &t, "--json"],
        vec!["advise", &t],
        vec!["advise", &t, "--json"],
        vec!["random", "--threads", "1", "--ops", "2000"],
    ]
    .into_iter()
    .map(|args| args.into_iter().map(String::from).collect())
    .collect()
}

fn stress(args: &[String]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"));
    cmd.args(args).stdin(Stdio::null()).stderr(Stdio::piped());
    cmd
}

/// The reader closes the pipe before the command writes anything: every write fails with
/// `BrokenPipe`, deterministically.
#[test]
fn a_pipe_closed_before_the_report_ends_the_command_quietly() {
    for args in commands() {
        let mut child = stress(&args).stdout(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("error"), "{args:?}: {stderr}");
    }
}

/// `| head -1`: the reader takes one line and goes; the command ends with status 0 whether
/// the rest was still to write or already in the pipe's buffer.
#[test]
fn a_pipe_closed_after_one_line_ends_the_command_quietly() {
    for args in commands() {
        let mut child = stress(&args).stdout(Stdio::piped()).spawn().unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        assert!(!first.is_empty(), "{args:?}");
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// `> /dev/full`: every write fails with "No space left on device".
#[test]
fn a_full_disk_is_an_error_not_a_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped a_full_disk_is_an_error_not_a_panic: no /dev/full");
        return;
    };
    for args in commands() {
        let out = stress(&args).stdout(full.try_clone().unwrap()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: writing to stdout:"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // The plot is still written, and said so, when the report could not be.
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("p.svg");
    let args: Vec<String> = ["replay", &trace(), "--plot", plot.to_str().unwrap()].map(String::from).to_vec();
    let out = stress(&args).stdout(full).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(std::fs::read_to_string(&plot).unwrap().starts_with("<svg"), "{stderr}");
}

/// A full disk under stderr too: the notes are dropped, the status still says what happened.
#[test]
fn a_full_stderr_does_not_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped a_full_stderr_does_not_panic: no /dev/full");
        return;
    };
    let t = trace();
    let ok = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"))
        .args(["replay", &t, "--timing"])
        .stdout(Stdio::null())
        .stderr(full.try_clone().unwrap())
        .status()
        .unwrap();
    assert_eq!(ok.code(), Some(0));
    let bad = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"))
        .args(["replay", "/nonexistent/trace.jsonl"])
        .stdout(Stdio::null())
        .stderr(full)
        .status()
        .unwrap();
    assert_eq!(bad.code(), Some(2));
}
