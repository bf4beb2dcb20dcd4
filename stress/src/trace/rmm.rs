//! RMM's logging resource adaptor CSV: `Thread,Time,Action,Pointer,Size,Stream`, actions
//! `allocate`, `free`, `allocate failure`. Pointers and streams are hexadecimal (`0x...`) or
//! decimal; the replay keeps each row's stream.

use super::TraceError;
use crate::ops::{AddressMap, Program, ProgramBuilder};

fn number(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None if t.is_empty() => Some(0),
        None => t.parse().ok(),
    }
}

pub fn parse(data: &[u8]) -> Result<Program, TraceError> {
    read(data)
}

/// Reads the log row by row from `input` (memory: the program plus one row).
pub fn read<R: std::io::Read>(input: R) -> Result<Program, TraceError> {
    let mut reader = csv::ReaderBuilder::new().has_headers(true).trim(csv::Trim::All).from_reader(input);
    let headers = reader.headers().map_err(|e| TraceError::at_line(1, format!("bad RMM CSV header: {e}")))?.clone();
    let col = |name: &str| -> Result<usize, TraceError> {
        headers.iter().position(|h| h == name).ok_or_else(|| {
            TraceError::at_line(
                1,
                format!("RMM CSV header lacks `{name}` (expected Thread,Time,Action,Pointer,Size,Stream)"),
            )
        })
    };
    let (action, pointer, size, stream) = (col("Action")?, col("Pointer")?, col("Size")?, col("Stream")?);
    let mut b = ProgramBuilder::new("RMM log (CSV)");
    let mut map = AddressMap::default();
    let mut record = csv::StringRecord::new();
    loop {
        match reader.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line());
                return Err(TraceError::at_line(line, format!("bad RMM CSV row: {e}")));
            }
        }
        let line = record.position().map_or(0, |p| p.line());
        let field = |i: usize| record.get(i).unwrap_or("");
        let parse_num = |i: usize, what: &str| {
            number(field(i)).ok_or_else(|| TraceError::at_line(line, format!("bad {what} `{}`", field(i))))
        };
        match field(action) {
            "allocate" => {
                let (ptr, bytes, s) =
                    (parse_num(pointer, "pointer")?, parse_num(size, "size")?, parse_num(stream, "stream")?);
                map.alloc(&mut b, 0, ptr, bytes, s);
            }
            "free" => {
                let ptr = parse_num(pointer, "pointer")?;
                map.free(&mut b, 0, ptr);
            }
            "allocate failure" => b.notes_mut().recorded_failures += 1,
            other => {
                return Err(TraceError::at_line(
                    line,
                    format!("unknown RMM action `{other}` (expected allocate, free or allocate failure)"),
                ))
            }
        }
        if let Some(e) = b.limit_error() {
            return Err(TraceError::at_line(line, e.to_string()));
        }
    }
    b.finish().map_err(|e| TraceError { position: "file".into(), message: e })
}
