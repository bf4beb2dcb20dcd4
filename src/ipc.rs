//! PyTorch's CUDA IPC handle format (c10 `shareIpcHandle` / `getIpcDevPtr`, torch 2.15), which
//! `torch.multiprocessing.reductions.rebuild_cuda_tensor` passes from a producer to a receiver.
//! Layer: plain data beside the heap; no device calls. The heap fills a `Shareable` for a block
//! (`heap::ipc`), the C ABI encodes it for Python, and a receiver parses what any PyTorch sent.
//!
//! Wire format (what torch 2.15's own allocator writes, checked against it over testdrv):
//! - a bare 64-byte `cudaIpcMemHandle_t`: an old PyTorch's handle of a `cudaMalloc` segment;
//! - otherwise a version byte (at most `VERSION`), a type byte, then
//!   - `'c'`: the 64-byte `cudaIpcMemHandle_t` of the segment's base (plain segments);
//!   - `'e'`: an expandable segment's `ShareHeader` — `pid_t pid` (4 bytes + 4 of padding),
//!     `size_t segment_size` (the page size), `size_t num_handles`, and from version 3 the
//!     handle type (`int`, 1 = POSIX file descriptor, + 4 of padding) — then one `int` file
//!     descriptor per page, numbers in the producer's descriptor table, which the receiver
//!     takes with `pidfd_getfd`.
//!
//! The offset of the block in the shared range travels beside the handle (PyTorch's
//! `storage_offset_bytes`). Invariants: `parse` never panics and bounds every count by the
//! input's length; `encode` writes padding as zeros, so equal handles are equal bytes.

use crate::error::{Error, Result};

/// The handle version torch 2.15 writes and the newest this parser reads.
pub const VERSION: u8 = 3;
/// `sizeof(cudaIpcMemHandle_t)`.
pub const LEGACY_HANDLE_BYTES: usize = 64;
/// `Expandable_Segments_Handle_Type::POSIX_FD`.
pub const HANDLE_TYPE_POSIX_FD: u32 = 1;
const TYPE_CUDA_MALLOC: u8 = b'c';
const TYPE_EXPANDABLE: u8 = b'e';
/// `ShareHeader` up to and including `num_handles` (version 2), and with the handle type (3).
const HEADER_V2: usize = 24;
const HEADER_V3: usize = 32;

/// What a shared block's memory is, as PyTorch names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shareable {
    /// A `cudaIpcMemHandle_t` of a `cuMemAlloc` segment's base.
    Legacy([u8; LEGACY_HANDLE_BYTES]),
    /// Pages of an expandable segment, each `page` bytes, one POSIX file descriptor (a number in
    /// process `pid`) per page, mapped one after the other by the receiver.
    Expandable { pid: i32, page: u64, fds: Vec<i32> },
}

impl Shareable {
    /// The handle bytes torch 2.15's `rebuild_cuda_tensor` opens (the newest version).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(VERSION)
    }

    /// The handle bytes in the layout of handle `version` (2: torch 2.4 to 2.12, whose
    /// expandable header has no handle type; 3: torch 2.13 on), for the receiver's torch: a
    /// stock PyTorch refuses a newer version than its own ("from a future version of torch").
    /// Any other version is written as the newest.
    pub fn encode_as(&self, version: u8) -> Vec<u8> {
        let version = if version == 2 { 2 } else { VERSION };
        match self {
            Shareable::Legacy(handle) => {
                let mut out = vec![version, TYPE_CUDA_MALLOC];
                out.extend_from_slice(handle);
                out
            }
            Shareable::Expandable { pid, page, fds } => {
                let mut out = Vec::with_capacity(2 + HEADER_V3 + 4 * fds.len());
                out.extend_from_slice(&[version, TYPE_EXPANDABLE]);
                out.extend_from_slice(&pid.to_ne_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&page.to_ne_bytes());
                out.extend_from_slice(&(fds.len() as u64).to_ne_bytes());
                if version >= 3 {
                    out.extend_from_slice(&HANDLE_TYPE_POSIX_FD.to_ne_bytes());
                    out.extend_from_slice(&[0; 4]);
                }
                for fd in fds {
                    out.extend_from_slice(&fd.to_ne_bytes());
                }
                out
            }
        }
    }

    /// Reads a handle from any PyTorch (or stepalloc) producer; an unknown version or type, a
    /// fabric handle, a zero page size or a length that does not match is `InvalidArgument`.
    pub fn parse(bytes: &[u8]) -> Result<Shareable> {
        let bad = |why: String| Error::InvalidArgument(format!("CUDA IPC handle ({} bytes): {why}", bytes.len()));
        if bytes.len() == LEGACY_HANDLE_BYTES {
            return Ok(Shareable::Legacy(legacy(bytes)));
        }
        let [version, kind, rest @ ..] = bytes else {
            return Err(bad("too short".into()));
        };
        if *version > VERSION || *version < 2 {
            return Err(bad(format!(
                "version {version}; this stepalloc reads versions 2 to {VERSION} (torch 2.4 to 2.15)"
            )));
        }
        match *kind {
            TYPE_CUDA_MALLOC if rest.len() == LEGACY_HANDLE_BYTES => Ok(Shareable::Legacy(legacy(rest))),
            TYPE_CUDA_MALLOC => Err(bad("a cudaIpcMemHandle_t is 64 bytes".into())),
            TYPE_EXPANDABLE => parse_expandable(*version, rest).map_err(bad),
            other => Err(bad(format!("unknown handle type {other:#x}"))),
        }
    }
}

/// Whether `size` bytes at `offset` lie inside a shared mapping of `mapped` bytes; a receiver
/// checks this before it hands out memory, since offset and size travel beside the handle and
/// nothing else bounds them (a storage past the mapping faults at its first use, or reads
/// another allocation's bytes).
pub fn check_range(offset: u64, size: u64, mapped: u64) -> Result<()> {
    match offset.checked_add(size) {
        Some(end) if end <= mapped => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "CUDA IPC: the received storage ({size} bytes at offset {offset}) lies outside the shared \
             mapping ({mapped} bytes); the handle's offset or size does not belong to it"
        ))),
    }
}

fn legacy(bytes: &[u8]) -> [u8; LEGACY_HANDLE_BYTES] {
    let mut handle = [0; LEGACY_HANDLE_BYTES];
    handle.copy_from_slice(&bytes[..LEGACY_HANDLE_BYTES]);
    handle
}

fn word<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

fn parse_expandable(version: u8, rest: &[u8]) -> std::result::Result<Shareable, String> {
    let header = if version >= 3 { HEADER_V3 } else { HEADER_V2 };
    if rest.len() < header {
        return Err("shorter than an expandable segment's header".into());
    }
    let pid = i32::from_ne_bytes(word(rest, 0));
    let page = u64::from_ne_bytes(word(rest, 8));
    let count = u64::from_ne_bytes(word(rest, 16));
    if version >= 3 {
        let kind = u32::from_ne_bytes(word(rest, 24));
        if kind != HANDLE_TYPE_POSIX_FD {
            return Err(format!(
                "handle type {kind}; stepalloc opens POSIX file descriptors (1) only, not fabric handles"
            ));
        }
    }
    let fds = &rest[header..];
    if page == 0 || pid <= 0 || count == 0 || count.checked_mul(4) != Some(fds.len() as u64) {
        return Err(format!("pid {pid}, page {page}, {count} pages for {} descriptor bytes", fds.len()));
    }
    let fds = fds.chunks_exact(4).map(|c| i32::from_ne_bytes(word(c, 0))).collect();
    Ok(Shareable::Expandable { pid, page, fds })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handle written for torch before 2.13 (`stepalloc.ipc.handle_for_torch`: version 2, the
    /// expandable header without its handle type) reads as the same memory.
    #[test]
    fn reads_version_2_handles() {
        let e = Shareable::Expandable { pid: 77, page: 2 << 20, fds: vec![5, 6, 7] };
        let v3 = e.encode();
        let mut v2 = vec![2, b'e'];
        v2.extend_from_slice(&v3[2..2 + HEADER_V3 - 8]);
        v2.extend_from_slice(&v3[2 + HEADER_V3..]);
        assert_eq!(v2.len(), 2 + HEADER_V2 + 12);
        assert_eq!(Shareable::parse(&v2).unwrap(), e);
        let c = Shareable::Legacy([9; LEGACY_HANDLE_BYTES]);
        let mut v2 = c.encode();
        v2[0] = 2;
        assert_eq!(Shareable::parse(&v2).unwrap(), c);
    }

    /// What a producer writes for a receiver's torch before 2.13: version 2, the same `'c'`
    /// payload, the expandable header less its handle type; any other version is the newest.
    #[test]
    fn encodes_each_version_exactly() {
        let c = Shareable::Legacy(std::array::from_fn(|i| i as u8));
        let mut want = vec![2, b'c'];
        want.extend(0..64u8);
        assert_eq!(c.encode_as(2), want);
        assert_eq!(c.encode_as(3), c.encode());
        assert_eq!(c.encode_as(0), c.encode(), "0: the newest");
        let e = Shareable::Expandable { pid: 77, page: 2 << 20, fds: vec![5, 6] };
        let mut want = vec![2, b'e'];
        want.extend_from_slice(&77i32.to_ne_bytes());
        want.extend_from_slice(&[0; 4]);
        want.extend_from_slice(&(2u64 << 20).to_ne_bytes());
        want.extend_from_slice(&2u64.to_ne_bytes());
        want.extend_from_slice(&5i32.to_ne_bytes());
        want.extend_from_slice(&6i32.to_ne_bytes());
        assert_eq!(e.encode_as(2), want);
        assert_eq!(Shareable::parse(&want).unwrap(), e);
        assert_eq!(e.encode_as(9), e.encode());
    }

    #[test]
    fn a_range_must_lie_inside_the_mapping() {
        assert!(check_range(0, 100, 100).is_ok());
        assert!(check_range(100, 0, 100).is_ok());
        assert!(check_range(40, 60, 100).is_ok());
        for (offset, size) in [(1, 100), (101, 0), (1 << 40, 1), (0, 1 << 40), (u64::MAX, 2), (2, u64::MAX)] {
            let e = check_range(offset, size, 100).unwrap_err().to_string();
            assert!(e.contains(&format!("{size} bytes at offset {offset}")) && e.contains("(100 bytes)"), "{e}");
        }
    }

    /// torch 2.15's own handles, as its allocator wrote them over testdrv (the padding after
    /// the pid and the handle type was whatever the stack held).
    #[test]
    fn reads_torch_2_15_handles() {
        let expandable = "03653f1100009e7f00000000200000000000010000000000000001000000fe7f000009000000";
        let bytes: Vec<u8> =
            (0..expandable.len() / 2).map(|i| u8::from_str_radix(&expandable[2 * i..2 * i + 2], 16).unwrap()).collect();
        assert_eq!(Shareable::parse(&bytes).unwrap(), Shareable::Expandable { pid: 4415, page: 2 << 20, fds: vec![9] });
        let mut legacy = vec![3, b'c'];
        legacy.extend((0..64).map(|i| i as u8));
        let Shareable::Legacy(h) = Shareable::parse(&legacy).unwrap() else { panic!() };
        assert_eq!(h[63], 63);
        assert_eq!(Shareable::parse(&legacy[2..]).unwrap(), Shareable::Legacy(h), "an old PyTorch's bare handle");
    }

    #[test]
    fn encode_then_parse_is_identity_and_padding_is_zero() {
        let cases = [Shareable::Legacy([7; 64]), Shareable::Expandable { pid: 12, page: 20 << 20, fds: vec![3, 4, 5] }];
        for case in cases {
            let bytes = case.encode();
            assert_eq!(Shareable::parse(&bytes).unwrap(), case);
            assert_eq!(bytes, case.encode());
        }
        let e = Shareable::Expandable { pid: 1, page: 2 << 20, fds: vec![9] }.encode();
        assert_eq!(e.len(), 2 + 32 + 4);
        assert_eq!(&e[6..10], &[0; 4]);
        assert_eq!(&e[30..34], &[0; 4]);
    }

    #[test]
    fn refuses_what_it_cannot_open() {
        let good = Shareable::Expandable { pid: 5, page: 2 << 20, fds: vec![3, 4] }.encode();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "too short"),
            (vec![4, b'c'], "version 4"),
            (vec![3, b'x'], "unknown handle type"),
            (vec![3, b'c', 1, 2], "64 bytes"),
            (good[..good.len() - 1].to_vec(), "descriptor bytes"),
            (good[..20].to_vec(), "header"),
            (
                {
                    let mut g = good.clone();
                    g[26] = 2;
                    g
                },
                "fabric",
            ),
            (
                {
                    let mut g = good.clone();
                    g[18..26].copy_from_slice(&u64::MAX.to_ne_bytes());
                    g
                },
                "descriptor bytes",
            ),
        ];
        for (bytes, says) in cases {
            let e = Shareable::parse(&bytes).unwrap_err().to_string();
            assert!(e.contains(says), "{bytes:?}: {e}");
        }
    }
}
