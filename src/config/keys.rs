//! The table of accepted configuration keys: each key's name, default, accepted form and
//! one-line doc, in the order `Config::describe` (`stepalloc_config_help`) prints them. The
//! single list: `Config::set` has a setter for each key here and refuses any other.

/// One accepted key: its name, default, accepted form and what it does.
pub struct KeyDoc {
    pub name: &'static str,
    pub default: &'static str,
    pub form: &'static str,
    pub doc: &'static str,
}

/// Every key stepalloc accepts, in the order `describe()` prints them.
pub const KEYS: &[KeyDoc] = &[
    // PyTorch's keys, same meaning.
    KeyDoc {
        name: "max_split_size_mb",
        default: "unlimited",
        form: "integer MiB >= 20",
        doc: "cached blocks at least this large are never split",
    },
    KeyDoc {
        name: "max_non_split_rounding_mb",
        default: "20",
        form: "integer MiB",
        doc: "an unsplittable block serves only requests at most this much smaller",
    },
    KeyDoc {
        name: "roundup_power2_divisions",
        default: "0",
        form: "0 or a power of 2, or [MiB:div,...,>:div] with MiB a power of 2 and div 0 (off) or a power of 2",
        doc: "round request sizes up to one of N divisions of their power-of-two interval",
    },
    KeyDoc {
        name: "garbage_collection_threshold",
        default: "0",
        form: "number in (0, 1)",
        doc: "with a memory fraction set, release old cached blocks when reserved exceeds this share of it",
    },
    KeyDoc {
        name: "expandable_segments",
        default: "False",
        form: "True or False",
        doc: "PyTorch's expandable segments: one growing virtual range per stream and pool, pages mapped on demand",
    },
    KeyDoc {
        name: "large_segment_size_mb",
        default: "20",
        form: "integer MiB >= 2; with expandable segments a multiple of 2, 2..1024",
        doc: "with expandable segments: page size of the large pool (the small pool's is 2 MiB)",
    },
    KeyDoc {
        name: "release_lock_on_cudamalloc",
        default: "False",
        form: "True or False",
        doc: "accepted for PyTorch compatibility; no effect",
    },
    KeyDoc {
        name: "release_lock_on_hipmalloc",
        default: "False",
        form: "True or False",
        doc: "accepted for PyTorch compatibility (its ROCm spelling); no effect",
    },
    KeyDoc {
        name: "graph_capture_record_stream_reuse",
        default: "False",
        form: "True or False",
        doc: "accepted for PyTorch compatibility; no effect",
    },
    KeyDoc {
        name: "pinned_use_cuda_host_register",
        default: "False",
        form: "True or False",
        doc: "accepted for PyTorch compatibility (pinned host memory); no effect",
    },
    KeyDoc {
        name: "pinned_use_hip_host_register",
        default: "False",
        form: "True or False",
        doc: "accepted for PyTorch compatibility (pinned host memory, ROCm spelling); no effect",
    },
    KeyDoc {
        name: "pinned_reserve_segment_size_mb",
        default: "0",
        form: "integer MiB > 0",
        doc: "accepted for PyTorch compatibility (pinned host memory); no effect",
    },
    KeyDoc {
        name: "pinned_num_register_threads",
        default: "1",
        form: "integer",
        doc: "accepted for PyTorch compatibility (pinned host memory); no effect",
    },
    KeyDoc {
        name: "pinned_use_background_threads",
        default: "False",
        form: "True or False",
        doc: "accepted for PyTorch compatibility (pinned host memory); no effect",
    },
    // stepalloc's keys.
    KeyDoc {
        name: "exact_fit",
        default: "False",
        form: "True or False",
        doc: "take the smallest free block that fits, lowest address first, as PyTorch's ordered set does, and keep PyTorch's out-of-memory sequence (default: the O(1) size-class lookup, within 1/16 of the smallest; out of memory, the cache is searched again after waiting for events and pools in use are released as empty_cache releases them)",
    },
    KeyDoc {
        name: "page_reuse",
        default: "False",
        form: "True or False",
        doc: "with expandable segments: move idle free pages to where a request needs them before creating memory",
    },
    KeyDoc {
        name: "big_page_mb",
        default: "0 (off)",
        form: "0, or a multiple of 2 from 2 to 1024, with expandable_segments:True",
        doc: "with expandable segments: once the device's peak of mapped bytes reaches big_page_after_mb, the large pool grows in segments with pages of this size (fewer driver calls for a large heap; a small one keeps large_segment_size_mb); a tagged region's large blocks take them from the start (fewer calls per pause and resume)",
    },
    KeyDoc {
        name: "big_page_after_mb",
        default: "4096",
        form: "integer MiB 0..17592186044415",
        doc: "with big_page_mb: the peak of mapped bytes from which large-pool pages are big_page_mb",
    },
    KeyDoc {
        name: "pack_small",
        default: "False",
        form: "True or False, with expandable_segments:True",
        doc: "a small request (at most 1 MiB) that finds no free small-pool block takes a free block of the large pool before the small pool maps a new page (counted in the large pool)",
    },
    KeyDoc {
        name: "close_holes",
        default: "False",
        form: "True or False, with expandable_segments:True",
        doc: "a request that needs pages goes first to the smallest unmapped hole it fills up to the free block after it (joining two mapped runs and their partly used end pages), then to PyTorch's first hole with room",
    },
    KeyDoc {
        name: "param_lane",
        default: "False",
        form: "True or False, with expandable_segments:True",
        doc: "a request of the size of a block live when the first step began (a parameter: gradients and optimizer states have its size) is placed in expandable segments of its own while large-pool pages are large_segment_size_mb, so that a step's short-lived tensors do not leave free partly used pages between long-lived ones; without step markers it does nothing",
    },
    KeyDoc {
        name: "page_release",
        default: "False",
        form: "True or False",
        doc: "with expandable segments: unmap free pages idle for a whole step at step end, and under the cache limit",
    },
    KeyDoc {
        name: "backend",
        default: "auto",
        form: "auto, cuda, sim, or PyTorch's native (= auto)",
        doc: "device backend: CUDA driver, or the simulated device",
    },
    KeyDoc {
        name: "per_process_memory_fraction",
        default: "1",
        form: "number in (0, 1]",
        doc: "share of each device's memory stepalloc may reserve",
    },
    KeyDoc {
        name: "cache_limit_mb",
        default: "0 (none)",
        form: "integer MiB 0..17592186044415",
        doc: "release whole free segments when cached free bytes exceed this",
    },
    KeyDoc {
        name: "cache_limit_fraction",
        default: "0 (none)",
        form: "number in [0, 1]",
        doc: "the same limit as a share of device memory",
    },
    KeyDoc {
        name: "page_release_grace",
        default: "64",
        form: "integer 0..1048576",
        doc: "with page_release and a cache limit: free pages over the limit go back after this many allocations (0: at the free); free bytes in pages that hold live blocks do not count",
    },
    KeyDoc {
        name: "release_idle_steps",
        default: "0 (off)",
        form: "integer",
        doc: "at step end, release free segments no allocation touched for this many steps",
    },
    KeyDoc {
        name: "phase_trim",
        default: "False",
        form: "True or False",
        doc: "at a phase switch, trim the cache to the next phase's recorded need, other phases' segments first",
    },
    KeyDoc {
        name: "phase_trim_margin",
        default: "0.1",
        form: "number >= 0",
        doc: "headroom kept above the next phase's recorded peak when trimming",
    },
    KeyDoc {
        name: "trace_entries",
        default: "0 (off)",
        form: "integer 0..67108864 (memory is taken as entries are recorded)",
        doc: "size of the event ring kept for snapshots and trace recording",
    },
    KeyDoc {
        name: "metrics_addr",
        default: "unset (off)",
        form: "host:port, :port or port (loopback); a host other than loopback only as an IP address",
        doc: "serve Prometheus metrics there at first use (port + LOCAL_RANK under torchrun)",
    },
    KeyDoc { name: "sim_devices", default: "1", form: "integer 1..64", doc: "simulated device: number of devices" },
    KeyDoc {
        name: "sim_capacity_mb",
        default: "81920",
        form: "integer MiB 2..16777216 (2 MiB, the smallest segment and page, to 16 TiB, the simulated address window)",
        doc: "simulated device: memory per device",
    },
    KeyDoc {
        name: "sim_address_space_mb",
        default: "16777216",
        form: "integer MiB 2..16777216 (16 TiB)",
        doc: "simulated device: virtual address space per device (a small one runs out first)",
    },
    KeyDoc {
        name: "sim_event_delay_us",
        default: "0",
        form: "integer microseconds 0..18446744073709551",
        doc: "simulated device: time from recording an event to its completion",
    },
    KeyDoc {
        name: "sim_fail_nth",
        default: "0 (off)",
        form: "integer",
        doc: "simulated device: the Nth device reserve fails (out of memory)",
    },
    KeyDoc {
        name: "sim_fail_prob",
        default: "0",
        form: "number in [0, 1]",
        doc: "simulated device: each device reserve fails with this probability",
    },
    KeyDoc {
        name: "sim_fail_map_prob",
        default: "0",
        form: "number in [0, 1]",
        doc: "simulated device: each virtual-memory map fails (out of memory) with this probability",
    },
    KeyDoc { name: "sim_seed", default: "0", form: "integer", doc: "simulated device: seed for failure injection" },
    KeyDoc {
        name: "sim_cost_model",
        default: "False",
        form: "True or False",
        doc: "simulated device: charge modelled time for driver calls (reported in statistics)",
    },
    KeyDoc {
        name: "sim_host_capacity_mb",
        default: "0 (no limit)",
        form: "integer",
        doc: "simulated device: pinned host memory it gives for backups; beyond it a host allocation fails (out of memory)",
    },
    KeyDoc {
        name: "sim_copy_mb_s",
        default: "26843 (25 GiB/s)",
        form: "integer 1..=10000000",
        doc: "simulated device: the host link's copy rate for backups, in MB/s (10^6 bytes per second), under the cost model",
    },
];
