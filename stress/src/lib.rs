//! stepalloc-stress as a library: the pieces of the `stepalloc-stress` binary, public so the
//! tests in `stress/tests/` drive them directly.
//!
//! Layers: workloads (`workload::agent`, `workload::random`) and trace readers (`trace`) produce
//! an event stream (`ops::Program`); `replay::run` plays it against one `stepalloc::Allocator`
//! per configuration (`compare`); `report` prints, serialises and plots the results, and
//! `verdict` says in one line what they mean for the user; `headroom`
//! searches the largest workload scale that fits a device, per configuration; `advise` searches
//! the allocator settings that give a trace the lowest peak on the user's device; `fit` says
//! whether a recorded step fits a device under each allocator (`torch_conf` reads the user's
//! `PYTORCH_CUDA_ALLOC_CONF`, `fit_chart` draws it); `output`
//! writes what the binary prints, without panicking on a closed pipe or a full disk.

#![deny(unsafe_code)]

pub mod advise;
pub mod compare;
pub mod export;
pub mod fit;
pub mod fit_chart;
pub mod fragmentation;
pub mod headroom;
pub mod ops;
pub mod output;
pub mod replay;
pub mod report;
pub mod torch_conf;
pub mod trace;
pub mod verdict;
pub mod workload;
