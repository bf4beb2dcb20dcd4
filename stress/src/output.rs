//! What the command line writes, and how a failed write ends it. Layer: the binary's edge.
//!
//! Invariants:
//! - Every report goes to stdout through `out`, a fallible write: `print!` panics when stdout
//!   is a closed pipe or a full disk.
//! - A closed pipe (`| head`: the reader has what it wanted) is `Failure::ClosedPipe`: the command
//!   stops writing and exits quietly with the status it would have had. Rust ignores SIGPIPE,
//!   so the write reports `BrokenPipe` instead of the process dying with status 141 (GNU tools'
//!   way); ripgrep exits quietly too. Any other write error is an `error: …` with status 2.
//! - Notes on stderr (`note!`: timing, where a file went) ignore write errors: stderr is where
//!   such an error would be reported.

use std::io::{self, Write};

/// Why a command stopped before its end.
#[derive(Debug)]
pub enum Failure {
    /// Bad input, or a write that failed: `error: …` on stderr, exit status 2.
    Error(String),
    /// stdout's reader went away: nothing more to write.
    ClosedPipe,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::Error(message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Failure {
        Failure::Error(message.to_string())
    }
}

/// Writes `text` to stdout whole and flushes it.
pub fn out(text: &str) -> Result<(), Failure> {
    let mut stdout = io::stdout().lock();
    stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()).map_err(|e| match e.kind() {
        io::ErrorKind::BrokenPipe => Failure::ClosedPipe,
        _ => Failure::Error(format!("writing to stdout: {e}")),
    })
}

/// `value` as pretty JSON and a newline, to stdout (`out`).
pub fn out_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<(), Failure> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    text.push('\n');
    out(&text)
}

/// A line on stderr; a failed write is dropped (see the module docs).
pub fn note(line: std::fmt::Arguments) {
    let mut stderr = io::stderr().lock();
    let _ = stderr.write_fmt(line).and_then(|()| stderr.write_all(b"\n"));
}

/// `eprintln!` that never panics: `note!("wrote {n} events")`.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::output::note(format_args!($($arg)*))
    };
}
