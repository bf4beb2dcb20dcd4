//! Test support shared by the stress tool's integration tests (`mod common;` at the top of a
//! test file): running the built binary, and the small agent workload several files use.
//!
//! Each test binary compiles this file by itself and uses a part of it.
#![allow(dead_code)]

use std::process::Command;

/// Runs `stepalloc-stress` with `args`: its exit status (-1 when killed), stdout and stderr.
pub fn stress(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A small agent workload: one iteration of a two-layer decoder (flags that apply to both
/// presets only, so that `--preset llm-7b-sft` and `--rollout false` apply to it).
pub const TINY_AGENT: &[&str] = &[
    "--iterations",
    "1",
    "--layers",
    "2",
    "--hidden",
    "256",
    "--heads",
    "32",
    "--intermediate",
    "512",
    "--vocab",
    "1000",
];
