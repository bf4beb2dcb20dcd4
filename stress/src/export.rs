//! Writes a `Program` as a trace file (stepalloc JSON lines, RMM CSV or PyTorch snapshot JSON),
//! with real addresses: the program is played on a large simulated device and each event is
//! written with the address stepalloc gave it. Used to produce replay inputs and benchmarks.

use crate::ops::{Op, Program};
use std::io::Write;
use stepalloc::{Allocator, Config, Stream};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Jsonl,
    Rmm,
    TorchJson,
}

pub fn export(program: &Program, format: ExportFormat, out: &mut dyn Write) -> Result<u64, String> {
    let conf = format!("backend:sim,sim_capacity_mb:{},sim_devices:{}", 1u64 << 24, program.devices.max(1));
    let allocator = Allocator::new(Config::parse(&conf).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let mut live: Vec<Option<(u16, u64, u64, u64)>> = vec![None; program.ids as usize];
    let io = |e: std::io::Error| e.to_string();
    let mut events = 0u64;
    let mut torch_entries: Vec<Vec<String>> = vec![Vec::new(); program.devices.max(1) as usize];
    if format == ExportFormat::Rmm {
        writeln!(out, "Thread,Time,Action,Pointer,Size,Stream").map_err(io)?;
    }
    let mut t_us = 0u64;
    for op in &program.ops {
        t_us += 1;
        match *op {
            Op::Alloc { id, size, stream, device } => {
                let Ok(ptr) = allocator.malloc(device as usize, size, Stream(stream)) else { continue };
                live[id as usize] = Some((device, ptr, size, stream));
                events += 1;
                match format {
                    ExportFormat::Jsonl => writeln!(
                        out,
                        r#"{{"op":"alloc","device":{device},"addr":{ptr},"size":{size},"stream":{stream},"t_us":{t_us}}}"#
                    )
                    .map_err(io)?,
                    ExportFormat::Rmm => {
                        writeln!(out, "1,{t_us},allocate,{ptr:#x},{size},{stream:#x}").map_err(io)?
                    }
                    ExportFormat::TorchJson => torch_entries[device as usize].push(format!(
                        r#"{{"action":"alloc","addr":{ptr},"size":{size},"stream":{stream},"time_us":{t_us},"frames":[]}}"#
                    )),
                }
            }
            Op::Free { id } => {
                let Some((device, ptr, size, stream)) = live[id as usize].take() else { continue };
                allocator.free(device as usize, ptr, size).map_err(|e| e.to_string())?;
                events += 1;
                match format {
                    ExportFormat::Jsonl => writeln!(
                        out,
                        r#"{{"op":"free","device":{device},"addr":{ptr},"size":{size},"stream":{stream},"t_us":{t_us}}}"#
                    )
                    .map_err(io)?,
                    ExportFormat::Rmm => writeln!(out, "1,{t_us},free,{ptr:#x},{size},{stream:#x}").map_err(io)?,
                    ExportFormat::TorchJson => {
                        for action in ["free_requested", "free_completed"] {
                            torch_entries[device as usize].push(format!(
                                r#"{{"action":"{action}","addr":{ptr},"size":{size},"stream":{stream},"time_us":{t_us},"frames":[]}}"#
                            ));
                        }
                    }
                }
            }
            Op::StepBegin { phase } if format == ExportFormat::Jsonl => {
                let name = program.phases.get(phase as usize).map_or("step", String::as_str);
                writeln!(out, r#"{{"op":"step_begin","phase":"{name}","t_us":{t_us}}}"#).map_err(io)?;
                events += 1;
            }
            Op::StepEnd if format == ExportFormat::Jsonl => {
                writeln!(out, r#"{{"op":"step_end","t_us":{t_us}}}"#).map_err(io)?;
                events += 1;
            }
            _ => {}
        }
    }
    if format == ExportFormat::TorchJson {
        write!(out, r#"{{"segments":[],"device_traces":["#).map_err(io)?;
        for (d, entries) in torch_entries.iter().enumerate() {
            if d > 0 {
                write!(out, ",").map_err(io)?;
            }
            write!(out, "[{}]", entries.join(",")).map_err(io)?;
        }
        writeln!(out, "]}}").map_err(io)?;
    }
    Ok(events)
}
