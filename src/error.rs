//! The one error type of the crate. Out-of-memory is its own variant, carrying the report a
//! user needs to act on it; every driver failure is mapped to `Driver` once, at the backend.

use crate::units::format_bytes;
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
}

impl OomReport {
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first words match PyTorch's message: tools such as HF Accelerate look for them.
        write!(
            f,
            "CUDA out of memory. Tried to allocate {} on device {}. The device has a total \
             capacity of {} of which {} is free. stepalloc has {} reserved, of which {} is \
             allocated and {} is reserved but unallocated; the largest free cached block is {}.",
            format_bytes(self.requested),
            self.device,
            format_bytes(self.device_total),
            format_bytes(self.device_free),
            format_bytes(self.reserved),
            format_bytes(self.allocated),
            format_bytes(self.reserved_unallocated()),
            format_bytes(self.largest_free_block),
        )?;
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
