//! stepalloc: a CUDA caching allocator for PyTorch with step-boundary release and
//! fragmentation metrics.
//!
//! Glossary
//! - **segment**: one device reservation (`cuMemAlloc`), 2 MiB in the small pool, 20 MiB or the
//!   request rounded to 2 MiB in the large pool.
//! - **block**: a piece of a segment; blocks tile their segment. A block is allocated (handed
//!   out), pending (freed, waiting for other streams' events), or free (cached).
//! - **bin**: a size class of free blocks; 16 bins per power of two (see `sizeclass`).
//! - **pool**: small (requests ≤ 1 MiB) or large; plus private pools of CUDA graphs.
//! - **stream list**: the free blocks of one (pool, stream); a block is reused by the stream
//!   it was allocated on, or by any stream once the events recorded at its free completed.
//! - **step / phase**: a step of the user's loop and its label (`rollout`, `train`); release
//!   policies run at step boundaries.
//! - **tag / region**: what a `pause` gives back: allocations made inside a region carry its tag
//!   (`tags`) and live in virtual ranges of their own; `sleep` pauses and resumes them.
//!
//! Layers, top to bottom: `process` (the process-wide instance; starts its metrics endpoint)
//! → `metrics`, `sleep` (pause and resume by tag name across devices) → `allocator` (one lock
//! per device, std's mutex; its rules for holders) → `snapshot` → `heap` (policy; its
//! step-boundary policies in `heap/steps.rs`, sleep and wake of tagged memory in `heap/sleep/`)
//! → `freelist` + `bitmap` + `sizeclass` (O(1) lookup), `segment` (metadata; its `live` index
//! finds allocated blocks by address), `step` (step bookkeeping as plain data), `stats`,
//! `trace`, `ipc` (PyTorch's CUDA IPC handle format), `tags` (the registry of tag names) →
//! `backend` (`cuda`, `sim`) → `config` (with `config::addr`, the metrics address), `error`,
//! `units`. A module uses only modules below it (and its parent's items);
//! `scripts/import_cycles.py` checks that no modules use each other, directly or around a
//! circle.

#![deny(clippy::unwrap_used)]
#![cfg_attr(test, allow(clippy::unwrap_used))]
#![deny(unsafe_code)]

pub mod allocator;
pub mod backend;
pub mod bitmap;
pub mod config;
pub mod error;
pub mod freelist;
pub mod heap;
pub mod ipc;
pub mod metrics;
pub mod process;
pub mod segment;
pub mod sizeclass;
pub mod sleep;
pub mod snapshot;
pub mod stats;
pub mod step;
pub mod tags;
pub mod trace;
pub mod units;

pub use allocator::Allocator;
pub use backend::{Backend, Stream};
pub use config::{BackendKind, Config};
pub use error::{Error, OomReport, Result};
pub use heap::{CheckpointBlock, PoolCheckpoint, PoolId, RestoreDelta, SegmentListener, SegmentSource};
pub use process::{configure_global, global};
pub use stats::{DeviceStats, StepFigures};
