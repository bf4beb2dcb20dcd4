//! Helpers of the C ABI tests and benchmark: build libstepalloc.so and compile the C / C++
//! test programs with the system compilers (`CC` / `CXX`, default `cc` / `c++`).

#![allow(dead_code)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The profile's output folder (`target/debug` or `target/release`), from this executable's
/// place in `target/<profile>/deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// libstepalloc.so, freshly built. `cargo test` does not build a cdylib-only library for its
/// integration tests, so the first caller runs `cargo build` for this package and profile.
pub fn library() -> &'static Path {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--quiet", "-p", "stepalloc-cabi"]).current_dir(manifest_dir());
        let profile_dir = profile_dir();
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        // The same target folder as this test, whether it came from the default, the
        // environment or a --target-dir flag.
        cargo.arg("--target-dir").arg(profile_dir.parent().expect("target/<profile>"));
        let status = cargo.status().expect("run cargo build");
        assert!(status.success(), "cargo build -p stepalloc-cabi failed");
        let path = profile_dir.join("libstepalloc.so");
        assert!(path.exists(), "{} was not built", path.display());
        path
    })
}

/// Compiles one test program (C or C++ by its extension) into the test's temporary folder.
pub fn compile(source: &str) -> PathBuf {
    let src = manifest_dir().join("tests/c").join(source);
    let stem = Path::new(source).file_stem().expect("file name").to_string_lossy().to_string();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("stepalloc-{stem}"));
    let cpp = source.ends_with(".cpp");
    let compiler = if cpp {
        std::env::var("CXX").unwrap_or_else(|_| "c++".into())
    } else {
        std::env::var("CC").unwrap_or_else(|_| "cc".into())
    };
    let mut cmd = Command::new(&compiler);
    cmd.arg(if cpp { "-std=c++17" } else { "-std=gnu11" })
        .args(["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread", "-I"])
        .arg(manifest_dir().join("include"))
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .arg("-ldl");
    let output = cmd.output().unwrap_or_else(|e| panic!("run {compiler}: {e}"));
    assert!(
        output.status.success(),
        "{compiler} failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    out
}

/// Runs a test program with `args` and extra environment, without inheriting STEPALLOC_CONF.
pub fn run(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args).env_remove("STEPALLOC_CONF");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}
