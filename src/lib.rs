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
//! Layers, top to bottom: `allocator` (the lock, the process-wide instance) → `heap` (policy)
//! → `freelist` + `bitmap` + `sizeclass` (O(1) lookup) and `segment` (metadata; with `live`,
//! which finds allocated blocks by address) → `backend` (`cuda`, `sim`).
//! Beside them: `config`, `stats`, `step`, `trace`, `snapshot`, `metrics`.

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
mod live;
pub mod metrics;
pub mod segment;
pub mod sizeclass;
pub mod sleep;
pub mod snapshot;
pub mod stats;
pub mod step;
pub mod tags;
pub mod trace;
pub mod units;

pub use allocator::{configure_global, global, Allocator};
pub use backend::{Backend, Stream};
pub use config::{BackendKind, Config};
pub use error::{Error, OomReport, Result};
pub use heap::PoolId;
pub use stats::{DeviceStats, StepFigures};
