//! The one error type of the crate. Out-of-memory is its own variant, carrying the report a
//! user needs to act on it; every driver failure is mapped to `Driver` once, at the backend.

use crate::units::{format_bytes, format_size};
use std::fmt;

/// Everything a person needs to understand an out-of-memory failure.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct OomReport {
    pub device: usize,
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Bytes after rounding (what a block would have held).
    pub rounded: u64,
    /// Bytes the device reserve would have asked the driver for.
    pub segment_size: u64,
    pub device_total: u64,
    pub device_free: u64,
    /// Bytes held in segments by stepalloc.
    pub reserved: u64,
    /// Bytes in blocks handed out to the caller.
    pub allocated: u64,
    /// The limit set by `per_process_memory_fraction`, if any.
    pub allowed: Option<u64>,
    /// The largest free block in the cache after the OOM path ran.
    pub largest_free_block: u64,
    /// A configuration change that would likely have avoided this failure.
    pub hint: String,
    /// Expandable segments: bytes the out-of-memory path unmapped for this request, or `None`
    /// without virtual memory. What stayed free but mapped is `reserved_unallocated`.
    pub unmapped: Option<u64>,
    /// Expandable segments: the address space, not memory, ran out (a new range found no room).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address_space: Option<AddressSpaceShort>,
}

/// A range of virtual address space that could not be reserved for a new expandable segment.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct AddressSpaceShort {
    /// Bytes of the smallest range tried (the request's pages).
    pub range: u64,
    /// Address space held by the heap's expandable segments then.
    pub reserved: u64,
    /// Their number.
    pub ranges: u64,
}

impl OomReport {
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

/// PyTorch's own allocator refuses a request this large before anything else, with its own
/// sentence (`Tried to allocate more than 1EB memory.`).
const ONE_EXA_BYTE: u64 = 1 << 60;

/// The end of PyTorch's out-of-memory message, word for word (PyTorch 2.15).
const PYTORCH_HINT: &str = "If reserved but unallocated memory is large try setting \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory \
    Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // First PyTorch's message in PyTorch's words and units (users, log scrapers and
        // frameworks' retry logic match them: HF Accelerate looks for "CUDA out of memory."),
        // then stepalloc's own explanation.
        if self.requested >= ONE_EXA_BYTE {
            f.write_str("CUDA out of memory. Tried to allocate more than 1EB memory.")?;
        } else {
            write!(
                f,
                "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
                format_size(self.requested),
                self.device,
                format_size(self.device_total),
                format_size(self.device_free),
            )?;
            if let Some(allowed) = self.allowed {
                write!(f, "{} allowed; ", format_size(allowed))?;
            }
            write!(
                f,
                "Of the allocated memory {} is allocated by PyTorch, and {} is reserved by PyTorch but \
                 unallocated. {PYTORCH_HINT}",
                format_size(self.allocated),
                format_size(self.reserved_unallocated()),
            )?;
        }
        write!(
            f,
            " stepalloc (PyTorch's allocator in this process; its settings are STEPALLOC_CONF's, not \
             PYTORCH_CUDA_ALLOC_CONF's): {} was asked for on device {}; stepalloc has {} reserved, of \
             which {} is allocated and {} is reserved but unallocated; the largest free cached block \
             is {}.",
            format_bytes(self.requested),
            self.device,
            format_bytes(self.reserved),
            format_bytes(self.allocated),
            format_bytes(self.reserved_unallocated()),
            format_bytes(self.largest_free_block),
        )?;
        if let Some(short) = &self.address_space {
            write!(
                f,
                " The device's virtual address space ran out, not its memory: no free range of {} \
                 was left for a new expandable segment; stepalloc holds {} of address space in {} \
                 ranges (one or more per stream and pool).",
                format_bytes(short.range),
                format_bytes(short.reserved),
                short.ranges,
            )?;
        }
        if let Some(allowed) = self.allowed {
            write!(f, " The process may use at most {} (per_process_memory_fraction).", format_bytes(allowed))?;
        }
        if let Some(unmapped) = self.unmapped {
            write!(
                f,
                " Expandable segments: the out-of-memory path unmapped {} of free pages; {} stays \
                 mapped but free (pieces smaller than a page, or pages shared with live blocks).",
                format_bytes(unmapped),
                format_bytes(self.reserved_unallocated()),
            )?;
        }
        if !self.hint.is_empty() {
            write!(f, " {}", self.hint)?;
        }
        Ok(())
    }
}

/// The error of every fallible stepalloc operation.
#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    /// The device could not provide the memory, after the whole OOM path ran. Retryable.
    OutOfMemory(Box<OomReport>),
    /// `free` or `record_stream` of a pointer that is not a live allocation: never allocated,
    /// already freed, or not the start of a block.
    UnknownPointer { device: usize, ptr: u64 },
    /// An argument out of range: a device index, a size that disagrees with the allocation.
    InvalidArgument(String),
    /// A configuration key or value was not accepted.
    Config { key: String, message: String },
    /// A driver call failed for a reason other than out-of-memory.
    Driver { call: &'static str, code: String },
    /// No usable backend: no driver, no device, or an unsupported request.
    Unavailable(String),
    /// The operation needs memory of a tag that is paused (`Allocator::pause`): an allocation
    /// in a paused tag's region. Resume the tag first.
    Paused(String),
}

impl Error {
    pub fn config(key: &str, message: impl Into<String>) -> Self {
        Error::Config { key: key.to_string(), message: message.into() }
    }

    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory(report) => report.fmt(f),
            Error::UnknownPointer { device, ptr } => write!(
                f,
                "pointer {ptr:#x} on device {device} is not a live stepalloc allocation \
                 (never allocated, already freed, or not the start of a block)"
            ),
            Error::InvalidArgument(message) => write!(f, "invalid argument: {message}"),
            Error::Config { key, message } => write!(f, "configuration key `{key}`: {message}"),
            Error::Driver { call, code } => write!(f, "CUDA driver call {call} failed: {code}"),
            Error::Unavailable(message) => write!(f, "stepalloc unavailable: {message}"),
            Error::Paused(message) => write!(f, "tag paused: {message}"),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{GIB, KIB, MIB};

    #[test]
    fn oom_message_starts_with_pytorchs_own() {
        // What PyTorch 2.15's own allocator said over testdrv for the same figures (a 1 GiB
        // device, one 4 KiB tensor in a 2 MiB segment; docs/testing.md, "PyTorch's own tests").
        let pytorch = "CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of \
            1024.00 MiB of which 1022.00 MiB is free. Of the allocated memory 4.00 KiB is allocated by PyTorch, \
            and 2.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try \
            setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation \
            for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-\
            with-pytorch-cuda-alloc-conf)";
        let mut report = OomReport {
            device: 0,
            requested: 800_000_000 * GIB,
            device_total: GIB,
            device_free: 1022 * MIB,
            reserved: 2 * MIB,
            allocated: 4 * KIB,
            largest_free_block: 2 * MIB,
            ..OomReport::default()
        };
        let text = report.to_string();
        assert!(text.starts_with(pytorch), "{text}");
        assert!(text[pytorch.len()..].starts_with(" stepalloc ("), "{text}");
        // PyTorch's sentence for a per-process limit, and its refusal beyond 1 EB.
        report.allowed = Some(512 * MIB);
        assert!(report.to_string().contains("is free. 512.00 MiB allowed; Of the allocated memory"));
        report.requested = 1 << 60;
        assert!(report
            .to_string()
            .starts_with("CUDA out of memory. Tried to allocate more than 1EB memory. stepalloc"));
    }
}
