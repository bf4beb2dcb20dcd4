//! Configuration: one typed table, parsed once from a string in the syntax of
//! `PYTORCH_CUDA_ALLOC_CONF` (`key:value,key:value`). The same string comes from
//! `STEPALLOC_CONF`, `stepalloc_configure` and `stepalloc.install(conf=...)`.
//!
//! PyTorch's own keys keep their meaning; stepalloc's keys are documented in [`KEYS`], which
//! is the single list of accepted keys, their defaults and their one-line docs.

pub mod addr;
mod keys;

pub use keys::{KeyDoc, KEYS};

use crate::error::{Error, Result};
use crate::units::MIB;

/// Number of power-of-two intervals `roundup_power2_divisions` distinguishes: 1 MiB .. 64 GiB,
/// as in PyTorch (`kRoundUpPowerOfTwoIntervals`).
pub const ROUNDUP_INTERVALS: usize = 16;
/// The most trace entries a device keeps (`trace_entries`; 2^26, about 3.5 GiB of records).
pub const MAX_TRACE_ENTRIES: usize = 1 << 26;

/// stepalloc's recommended configuration: the best measured on the agent presets and on
/// real-model traces (docs/performance.md): PyTorch's expandable segments with 2 MiB pages in
/// both pools, and idle pages moved to where they are needed instead of creating memory; past
/// 4 GiB of mapped bytes the large pool grows in 16 MiB pages, which keeps the driver's time
/// on a large heap under 1% of the step time (2 MiB pages throughout took 2–5%); a small
/// request that finds no free small-pool block takes free space in the large pool's pages
/// before the small pool maps a new page; a request that needs pages closes an unmapped hole
/// first; while pages are fine, parameter-sized requests (gradients, optimizer states) have
/// segments of their own, so short-lived tensors leave no partly used pages between them.
/// (One line: the Python package's test reads it from this source.)
#[rustfmt::skip]
pub const RECOMMENDED: &str = "expandable_segments:True,large_segment_size_mb:2,page_reuse:True,big_page_mb:16,pack_small:True,close_holes:True,param_lane:True";

/// The simulated device's largest memory and address space per device, in MiB (16 TiB, its
/// address window).
const MAX_SIM_MB: u64 = 1 << 24;

/// Pages of expandable segments: multiples of the 2 MiB granularity, at most 1 GiB.
const LARGE_PAGE_STEP: u64 = 2 * MIB;
const MAX_LARGE_PAGE: u64 = 1024 * MIB;
/// Largest `page_release_grace` (allocations).
const MAX_PAGE_RELEASE_GRACE: u64 = 1 << 20;

/// Which device backend the allocator drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CUDA when a driver and a device are present, else an error that says why.
    Auto,
    Cuda,
    Sim,
}

/// The parsed configuration. `Default` is the configuration of an empty string.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub max_split_size: u64,
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval (1 MiB, 2 MiB, ..., 32 GiB and above); 0 or 1 = off.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    pub garbage_collection_threshold: f64,
    pub expandable_segments: bool,
    /// Page size of the large pool's expandable segments.
    pub large_page: u64,
    /// Page size of the large pool once the peak of mapped bytes reaches `big_page_after`
    /// (0 = never).
    pub big_page: u64,
    pub big_page_after: u64,
    /// Small requests take free large-pool blocks before the small pool grows.
    pub pack_small: bool,
    /// Expandable segments: a request that needs pages closes a hole first (`close_holes`).
    pub close_holes: bool,
    /// Expandable segments: parameter-sized requests have segments of their own (`param_lane`).
    pub param_lane: bool,
    pub page_reuse: bool,
    pub page_release: bool,
    /// Free-block choice: exact best fit by (size, address) instead of the size-class head.
    pub exact_fit: bool,
    pub backend: BackendKind,
    pub per_process_memory_fraction: f64,
    pub cache_limit_bytes: u64,
    pub cache_limit_fraction: f64,
    pub page_release_grace: u64,
    pub release_idle_steps: u64,
    pub phase_trim: bool,
    pub phase_trim_margin: f64,
    pub trace_entries: usize,
    pub metrics_addr: Option<String>,
    pub sim: SimConfig,
}

/// The simulated host link's copy rate unless `sim_copy_mb_s` sets it: 25 GiB/s, about what a
/// pinned `copy_()` reaches over PCIe 5 x16.
pub const DEFAULT_SIM_COPY_BYTES_PER_S: u64 = 25 << 30;

/// Settings of the simulated device.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub devices: usize,
    pub capacity: u64,
    /// Bytes of virtual address space per device (reservations and ranges).
    pub address_space: u64,
    pub event_delay_ns: u64,
    pub fail_nth: u64,
    pub fail_prob: f64,
    pub fail_map_prob: f64,
    pub seed: u64,
    pub cost_model: bool,
    /// Pinned host memory the simulated host may give (0: no limit); beyond it `host_alloc` is
    /// out of memory.
    pub host_capacity: u64,
    /// Bytes per second the copy engine moves between host and device (the cost model's).
    pub copy_bytes_per_s: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: 81920 * MIB,
            address_space: MAX_SIM_MB * MIB,
            event_delay_ns: 0,
            fail_nth: 0,
            fail_prob: 0.0,
            fail_map_prob: 0.0,
            seed: 0,
            cost_model: false,
            host_capacity: 0,
            copy_bytes_per_s: DEFAULT_SIM_COPY_BYTES_PER_S,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            large_page: 20 * MIB,
            big_page: 0,
            big_page_after: 4096 * MIB,
            pack_small: false,
            close_holes: false,
            param_lane: false,
            page_reuse: false,
            page_release: false,
            exact_fit: false,
            backend: BackendKind::Auto,
            per_process_memory_fraction: 1.0,
            cache_limit_bytes: 0,
            cache_limit_fraction: 0.0,
            page_release_grace: 64,
            release_idle_steps: 0,
            phase_trim: false,
            phase_trim_margin: 0.1,
            trace_entries: 0,
            metrics_addr: None,
            sim: SimConfig::default(),
        }
    }
}

impl Config {
    /// Parses a configuration string. Empty entries are ignored; later keys override earlier ones.
    pub fn parse(text: &str) -> Result<Config> {
        let mut config = Config::default();
        config.apply(text)?;
        Ok(config)
    }

    /// [`Config::parse`], with errors that say where the string came from (`source`, e.g.
    /// "STEPALLOC_CONF").
    pub fn parse_from(text: &str, source: &str) -> Result<Config> {
        Config::parse(text).map_err(|e| match e {
            Error::Config { key, message } => Error::Config { key, message: format!("{message} (in {source})") },
            other => other,
        })
    }

    /// Applies a configuration string on top of this configuration.
    pub fn apply(&mut self, text: &str) -> Result<()> {
        // The page size as typed, for the check below: the value kept saturates (PyTorch caps
        // it), so quoting it would not be what the user wrote.
        let mut large_page_text = None;
        for entry in split_entries(text) {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let Some((key, value)) = entry.split_once(':') else {
                return Err(Error::config(entry, "expected `key:value`"));
            };
            // A C caller's string would end at the NUL: refuse it instead of reading less.
            if let Some(at) = entry.find('\0') {
                return Err(Error::config(
                    key.trim(),
                    format!("contains a NUL character (byte {at} of `{}`); remove it", entry.escape_debug()),
                ));
            }
            self.set(key.trim(), value.trim())?;
            if key.trim() == "large_segment_size_mb" {
                large_page_text = Some(value.trim());
            }
        }
        let page_ok = self.large_page % LARGE_PAGE_STEP == 0 && self.large_page <= MAX_LARGE_PAGE;
        if self.expandable_segments && !page_ok {
            return Err(Error::config(
                "large_segment_size_mb",
                format!(
                    "bad value `{}`: with expandable_segments:True it is the large pool's page size, \
                     a multiple of 2 from 2 to 1024",
                    large_page_text.map_or_else(|| (self.large_page / MIB).to_string(), str::to_string)
                ),
            ));
        }
        let big_ok = self.big_page % LARGE_PAGE_STEP == 0 && self.big_page <= MAX_LARGE_PAGE;
        if !big_ok {
            return Err(Error::config(
                "big_page_mb",
                format!("bad value `{}`: expected 0, or a multiple of 2 from 2 to 1024", self.big_page / MIB),
            ));
        }
        // A simulated device (known now, unlike a GPU) smaller than the large pool's page
        // could map no large request: every one would fail with the memory free.
        if self.backend == BackendKind::Sim && self.expandable_segments && self.large_page > self.sim.capacity {
            return Err(Error::config(
                "large_segment_size_mb",
                format!(
                    "a page of {} MiB does not fit in the simulated device's {} MiB (sim_capacity_mb): \
                     every large request would fail with the memory free; use a page of at most the device's memory",
                    self.large_page / MIB,
                    self.sim.capacity / MIB
                ),
            ));
        }
        for (key, on) in [
            ("page_reuse", self.page_reuse),
            ("page_release", self.page_release),
            ("big_page_mb", self.big_page > 0),
            ("pack_small", self.pack_small),
            ("close_holes", self.close_holes),
            ("param_lane", self.param_lane),
        ] {
            if on && !self.expandable_segments {
                return Err(Error::config(key, "works on expandable segments: add `expandable_segments:True`"));
            }
        }
        Ok(())
    }

    /// Reads `STEPALLOC_CONF` (empty when unset).
    pub fn from_env() -> Result<Config> {
        match std::env::var("STEPALLOC_CONF") {
            Ok(text) => Config::parse_from(&text, "STEPALLOC_CONF"),
            Err(std::env::VarError::NotPresent) => Ok(Config::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::config("STEPALLOC_CONF", "is not valid UTF-8")),
        }
    }

    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let form = match KEYS.iter().find(|k| k.name == key) {
            Some(doc) => doc.form,
            None => {
                let known: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
                return Err(Error::config(key, format!("unknown key; accepted keys: {}", known.join(", "))));
            }
        };
        let bad = || Error::config(key, format!("bad value `{value}`; expected {form}"));
        match key {
            "max_split_size_mb" => {
                let mb = parse_u64(value).ok_or_else(bad)?;
                // PyTorch's rule: at least the large-segment size (20 MiB); larger values are
                // capped, not refused (a value past what bytes can count means unlimited).
                if mb < 20 {
                    return Err(bad());
                }
                self.max_split_size = mb.saturating_mul(MIB);
            }
            "max_non_split_rounding_mb" => {
                // PyTorch caps too-large values rather than refusing them.
                self.max_non_split_rounding = parse_u64(value).ok_or_else(bad)?.saturating_mul(MIB)
            }
            "roundup_power2_divisions" => {
                self.roundup_power2_divisions = parse_divisions(value)
                    .map_err(|why| Error::config(key, format!("bad value `{value}`: {why}; expected {form}")))?
            }
            "garbage_collection_threshold" => {
                let t = parse_f64(value).ok_or_else(bad)?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(bad());
                }
                self.garbage_collection_threshold = t;
            }
            "expandable_segments" => self.expandable_segments = parse_bool(value).ok_or_else(bad)?,
            "large_segment_size_mb" => {
                // Any size PyTorch accepts (it takes > 10, capped); the page-size rules apply
                // only with expandable segments, checked once every key is read.
                self.large_page = parse_u64(value).filter(|&mb| mb >= 2).ok_or_else(bad)?.saturating_mul(MIB);
            }
            "page_reuse" => self.page_reuse = parse_bool(value).ok_or_else(bad)?,
            "pack_small" => self.pack_small = parse_bool(value).ok_or_else(bad)?,
            "close_holes" => self.close_holes = parse_bool(value).ok_or_else(bad)?,
            "param_lane" => self.param_lane = parse_bool(value).ok_or_else(bad)?,
            "big_page_mb" => self.big_page = parse_u64(value).and_then(|mb| mb.checked_mul(MIB)).ok_or_else(bad)?,
            "big_page_after_mb" => {
                self.big_page_after = parse_u64(value).and_then(|mb| mb.checked_mul(MIB)).ok_or_else(bad)?
            }
            "exact_fit" => self.exact_fit = parse_bool(value).ok_or_else(bad)?,
            "page_release" => self.page_release = parse_bool(value).ok_or_else(bad)?,
            "release_lock_on_cudamalloc"
            | "release_lock_on_hipmalloc"
            | "graph_capture_record_stream_reuse"
            | "pinned_use_cuda_host_register"
            | "pinned_use_hip_host_register"
            | "pinned_use_background_threads" => {
                parse_bool(value).ok_or_else(bad)?;
            }
            "pinned_reserve_segment_size_mb" => {
                parse_u64(value).filter(|&mb| mb > 0).ok_or_else(bad)?;
            }
            "pinned_num_register_threads" => {
                parse_u64(value).ok_or_else(bad)?;
            }
            "backend" => {
                self.backend = match value {
                    // PyTorch's name for its own caching allocator: here, the device's driver.
                    "auto" | "native" => BackendKind::Auto,
                    "cuda" => BackendKind::Cuda,
                    "sim" => BackendKind::Sim,
                    "cudaMallocAsync" | "hipMallocAsync" => {
                        return Err(Error::config(
                            key,
                            format!(
                                "`{value}` is PyTorch's other allocator; stepalloc replaces PyTorch's allocator \
                                 and cannot run on it: remove the key or use {form}"
                            ),
                        ))
                    }
                    _ => return Err(bad()),
                }
            }
            "per_process_memory_fraction" => {
                let f = parse_f64(value).ok_or_else(bad)?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(bad());
                }
                self.per_process_memory_fraction = f;
            }
            "cache_limit_mb" => {
                self.cache_limit_bytes = parse_u64(value).and_then(|mb| mb.checked_mul(MIB)).ok_or_else(bad)?
            }
            "cache_limit_fraction" => self.cache_limit_fraction = parse_unit_interval(value).ok_or_else(bad)?,
            "page_release_grace" => {
                self.page_release_grace = parse_u64(value).filter(|&n| n <= MAX_PAGE_RELEASE_GRACE).ok_or_else(bad)?
            }
            "release_idle_steps" => self.release_idle_steps = parse_u64(value).ok_or_else(bad)?,
            "phase_trim" => self.phase_trim = parse_bool(value).ok_or_else(bad)?,
            "phase_trim_margin" => {
                let m = parse_f64(value).ok_or_else(bad)?;
                if !(m >= 0.0 && m.is_finite()) {
                    return Err(bad());
                }
                self.phase_trim_margin = m;
            }
            "trace_entries" => {
                let n = parse_u64(value).ok_or_else(bad)?;
                if n > MAX_TRACE_ENTRIES as u64 {
                    return Err(bad());
                }
                self.trace_entries = n as usize;
            }
            "metrics_addr" => {
                // Resolved now, as it will be at first use, so that a bad host or port is an
                // error of the configuration rather than a message at the first allocation.
                addr::parse_addr(value, addr::torchrun_local_rank())
                    .map_err(|why| Error::config(key, format!("bad value `{value}`: {why}; expected {form}")))?;
                self.metrics_addr = Some(value.to_string());
            }
            "sim_devices" => {
                let n = parse_u64(value).ok_or_else(bad)?;
                if !(1..=64).contains(&n) {
                    return Err(bad());
                }
                self.sim.devices = n as usize;
            }
            "sim_capacity_mb" => {
                let mb = parse_u64(value).ok_or_else(bad)?;
                // At least the smallest segment and page (2 MiB): a smaller device could serve
                // nothing. At most the simulated address space per device, 2^44 bytes (16 TiB).
                if !(2..=MAX_SIM_MB).contains(&mb) {
                    return Err(bad());
                }
                self.sim.capacity = mb * MIB;
            }
            "sim_address_space_mb" => {
                let mb = parse_u64(value).ok_or_else(bad)?;
                if !(2..=MAX_SIM_MB).contains(&mb) {
                    return Err(bad());
                }
                self.sim.address_space = mb * MIB;
            }
            "sim_event_delay_us" => {
                self.sim.event_delay_ns = parse_u64(value).and_then(|us| us.checked_mul(1000)).ok_or_else(bad)?
            }
            "sim_fail_nth" => self.sim.fail_nth = parse_u64(value).ok_or_else(bad)?,
            "sim_fail_prob" => self.sim.fail_prob = parse_unit_interval(value).ok_or_else(bad)?,
            "sim_fail_map_prob" => self.sim.fail_map_prob = parse_unit_interval(value).ok_or_else(bad)?,
            "sim_seed" => self.sim.seed = parse_u64(value).ok_or_else(bad)?,
            "sim_cost_model" => self.sim.cost_model = parse_bool(value).ok_or_else(bad)?,
            "sim_host_capacity_mb" => {
                self.sim.host_capacity = parse_u64(value).and_then(|mb| mb.checked_mul(MIB)).ok_or_else(bad)?
            }
            "sim_copy_mb_s" => {
                let mb_s = parse_u64(value).ok_or_else(bad)?;
                if !(1..=10_000_000).contains(&mb_s) {
                    return Err(bad());
                }
                self.sim.copy_bytes_per_s = mb_s * 1_000_000;
            }
            _ => unreachable!("every key in KEYS has a setter"),
        }
        Ok(())
    }

    /// The divisions that apply to a request of `size` bytes (PyTorch's interval lookup).
    #[inline]
    pub fn divisions_for(&self, size: u64) -> u64 {
        const INTERVAL_START: u32 = 20; // log2(1 MiB)
        let log_size = 63 - size.max(1).leading_zeros();
        let index = log_size.saturating_sub(INTERVAL_START).min(ROUNDUP_INTERVALS as u32 - 1);
        self.roundup_power2_divisions[index as usize]
    }

    /// Every key with its default, accepted form and doc, one per line.
    pub fn describe() -> String {
        let mut out = String::new();
        for k in KEYS {
            out.push_str(&format!("{:<32} default {:<14} {} ({})\n", k.name, k.default, k.doc, k.form));
        }
        out
    }
}

/// Splits a configuration string into its `key:value` entries: on commas that are not inside
/// `[...]` (a `roundup_power2_divisions` list).
pub fn split_entries(text: &str) -> Vec<&str> {
    let mut entries = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                entries.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    entries.push(&text[start..]);
    entries
}

fn parse_u64(value: &str) -> Option<u64> {
    value.parse().ok()
}

fn parse_f64(value: &str) -> Option<f64> {
    value.parse::<f64>().ok().filter(|v| v.is_finite())
}

fn parse_unit_interval(value: &str) -> Option<f64> {
    parse_f64(value).filter(|v| (0.0..=1.0).contains(v))
}

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "True" | "true" | "1" => Some(true),
        "False" | "false" | "0" => Some(false),
        _ => None,
    }
}

/// A byte count as PyTorch's `int64_t` fields hold it (`max_split_size` in `memory_stats()` and
/// in a snapshot's `allocator_settings`): `SIZE_MAX` (unlimited) and anything past `i64::MAX`
/// read as -1, as PyTorch's cast makes them.
pub fn torch_int64(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(-1)
}

/// PyTorch's two forms (`parseRoundUpPower2Divisions`): one value for every interval, or a list
/// `[MiB:div, ..., >:div]` whose keys are powers of two in MiB. A division count is 0 (no
/// rounding) or a power of two. A list's first key also sets every interval below it; `>`
/// sets every interval after the last key given before it (after the first interval when
/// none was), as PyTorch does.
fn parse_divisions(value: &str) -> std::result::Result<[u64; ROUNDUP_INTERVALS], String> {
    let divisions = |text: &str| -> std::result::Result<u64, String> {
        let text = text.trim();
        let d: u64 = text.parse().map_err(|_| format!("`{text}` is not a whole number"))?;
        if d == 0 || d.is_power_of_two() {
            Ok(d)
        } else {
            Err(format!("{d} divisions is neither 0 nor a power of 2"))
        }
    };
    let mut table = [0u64; ROUNDUP_INTERVALS];
    let Some(list) = value.strip_prefix('[') else {
        table.fill(divisions(value)?);
        return Ok(table);
    };
    let list = list.strip_suffix(']').ok_or("the list does not end with `]`")?;
    let (mut first, mut last_index) = (true, 0usize);
    for item in list.split(',').map(str::trim).filter(|item| !item.is_empty()) {
        let (interval, count) = item.split_once(':').ok_or_else(|| format!("`{item}` is not `MiB:div`"))?;
        let count = divisions(count)?;
        let interval = interval.trim();
        if interval == ">" {
            table[(last_index + 1).min(ROUNDUP_INTERVALS)..].fill(count);
            continue;
        }
        let mb: u64 = interval
            .parse()
            .ok()
            .filter(|mb: &u64| mb.is_power_of_two())
            .ok_or_else(|| format!("interval `{interval}` is not a power of 2 in MiB"))?;
        let index = (63 - mb.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if first {
            table[..index].fill(count);
            first = false;
        }
        table[index] = count;
        last_index = index;
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_string_is_the_default() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::parse(" , ").unwrap(), Config::default());
    }

    #[test]
    fn pytorch_keys_keep_their_meaning() {
        let c = Config::parse("max_split_size_mb:128,max_non_split_rounding_mb:64,garbage_collection_threshold:0.6")
            .unwrap();
        assert_eq!(c.max_split_size, 128 * MIB);
        assert_eq!(c.max_non_split_rounding, 64 * MIB);
        assert_eq!(c.garbage_collection_threshold, 0.6);
    }

    #[test]
    fn divisions_single_value_fills_every_interval() {
        let c = Config::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; ROUNDUP_INTERVALS]);
    }

    #[test]
    fn divisions_list_form() {
        let c = Config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],backend:sim").unwrap();
        let mut expected = [1u64; ROUNDUP_INTERVALS];
        expected[9] = 2;
        expected[10] = 4;
        expected[11..].fill(8);
        assert_eq!(c.roundup_power2_divisions, expected);
        assert_eq!(c.backend, BackendKind::Sim);
        assert_eq!(c.divisions_for(100 * MIB), 1);
        assert_eq!(c.divisions_for(600 * MIB), 2);
        assert_eq!(c.divisions_for(1024 * MIB), 4);
        assert_eq!(c.divisions_for(1 << 40), 8);
        assert_eq!(c.divisions_for(1), 1);
    }

    #[test]
    fn errors_name_the_key_and_the_form() {
        let e = Config::parse("max_split_size_mb:abc").unwrap_err();
        assert_eq!(e.to_string(), "configuration key `max_split_size_mb`: bad value `abc`; expected integer MiB >= 20");
        let e = Config::parse("max_split_size_mb:19").unwrap_err();
        assert!(matches!(e, Error::Config { ref key, .. } if key == "max_split_size_mb"));
        let e = Config::parse("no_such_key:1").unwrap_err();
        assert!(e
            .to_string()
            .starts_with("configuration key `no_such_key`: unknown key; accepted keys: max_split_size_mb"));
        let e = Config::parse("backend").unwrap_err();
        assert!(e.to_string().contains("expected `key:value`"));
        for bad in [
            "roundup_power2_divisions:3",
            "roundup_power2_divisions:[256:3]",
            "roundup_power2_divisions:[100:2]",
            "roundup_power2_divisions:[256:2",
            "garbage_collection_threshold:1.5",
            "per_process_memory_fraction:0",
            "sim_fail_prob:2",
            "sim_devices:0",
            "metrics_addr:nowhere",
            "expandable_segments:maybe",
            "large_segment_size_mb:0",
            "large_segment_size_mb:1",
            "page_reuse:True",
            "page_release:True,backend:sim",
            "phase_trim:maybe",
        ] {
            let e = Config::parse(bad).unwrap_err();
            let key = bad.split(':').next().unwrap();
            assert!(matches!(e, Error::Config { key: ref k, .. } if k == key), "{bad}: {e}");
        }
    }

    /// Strings PyTorch's parser (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp)
    /// accepts must be accepted unchanged.
    #[test]
    fn pytorch_strings_are_accepted() {
        for text in [
            "roundup_power2_divisions:0",
            "roundup_power2_divisions:[256:0,>:4]",
            "roundup_power2_divisions:[]",
            "roundup_power2_divisions:[256:1,]",
            "roundup_power2_divisions:[ 64:8, 256:4, 1024:4, >:1 ]",
            "roundup_power2_divisions:9223372036854775808",
            "max_split_size_mb:20",
            "max_split_size_mb:18446744073709551615",
            "max_non_split_rounding_mb:18446744073709551615",
            "backend:native",
            "release_lock_on_cudamalloc:True,release_lock_on_hipmalloc:False",
            "pinned_use_cuda_host_register:True,pinned_use_hip_host_register:False,pinned_num_register_threads:8",
            "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:64",
            "graph_capture_record_stream_reuse:True",
            "expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:512",
        ] {
            assert!(Config::parse(text).is_ok(), "{text}: {:?}", Config::parse(text));
        }
        let c = Config::parse("max_split_size_mb:20").unwrap();
        assert_eq!(c.max_split_size, 20 * MIB);
        let c = Config::parse("max_split_size_mb:18446744073709551615").unwrap();
        assert_eq!(c.max_split_size, u64::MAX, "too large for bytes: unlimited, as PyTorch caps it");
        assert_eq!(Config::parse("backend:native").unwrap().backend, BackendKind::Auto);
    }

    #[test]
    fn divisions_tables_match_pytorch() {
        let table = |text: &str| Config::parse(text).unwrap().roundup_power2_divisions;
        assert_eq!(table("roundup_power2_divisions:0"), [0; ROUNDUP_INTERVALS]);
        // 0 in a list switches rounding off for that interval (and below it, as the first key).
        let mut expected = [0u64; ROUNDUP_INTERVALS];
        expected[9..].fill(4);
        assert_eq!(table("roundup_power2_divisions:[256:0,>:4]"), expected);
        // `>` first: PyTorch fills from the second interval; the first keeps its 0.
        let mut expected = [4u64; ROUNDUP_INTERVALS];
        expected[0] = 0;
        assert_eq!(table("roundup_power2_divisions:[>:4]"), expected);
        // `>` fills after the last key before it, again if repeated.
        let mut expected = [2u64; ROUNDUP_INTERVALS];
        expected[5..].fill(8);
        assert_eq!(table("roundup_power2_divisions:[16:2,>:4,>:8]"), expected);
        assert_eq!(table("roundup_power2_divisions:[]"), [0; ROUNDUP_INTERVALS]);
    }

    /// Errors name the key, the value and the accepted range, and where
    /// the string came from when the caller says.
    #[test]
    fn errors_name_the_value_and_the_range() {
        // A simulated device smaller than a page (2 MiB) could serve nothing: refused too.
        for bad in ["sim_capacity_mb:0", "sim_capacity_mb:1", "sim_capacity_mb:16777217"] {
            let e = Config::parse(bad).unwrap_err().to_string();
            let value = bad.split(':').nth(1).unwrap();
            assert!(e.contains("`sim_capacity_mb`") && e.contains(&format!("`{value}`")), "{e}");
            assert!(e.contains("2..16777216"), "{e}");
        }
        for bad in ["sim_address_space_mb:1", "sim_address_space_mb:16777217"] {
            let e = Config::parse(bad).unwrap_err().to_string();
            assert!(e.contains("`sim_address_space_mb`") && e.contains("2..16777216"), "{e}");
        }
        // A page larger than the simulated device: named, with both sizes.
        let e = Config::parse("backend:sim,sim_capacity_mb:64,expandable_segments:True,large_segment_size_mb:1024")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`large_segment_size_mb`") && e.contains("1024 MiB") && e.contains("64 MiB"), "{e}");
        // On a GPU the memory is not known when configured: accepted (the out-of-memory error
        // names the page then).
        Config::parse("backend:cuda,sim_capacity_mb:64,expandable_segments:True,large_segment_size_mb:1024").unwrap();
        let e = Config::parse_from("sim_capacity_mb:0", "STEPALLOC_CONF").unwrap_err().to_string();
        assert!(e.ends_with("(in STEPALLOC_CONF)"), "{e}");
        let e = Config::parse("trace_entries:67108865").unwrap_err().to_string();
        assert!(e.contains("0..67108864"), "{e}");
        let e = Config::parse("roundup_power2_divisions:[256:3]").unwrap_err().to_string();
        assert!(e.contains("3 divisions is neither 0 nor a power of 2"), "{e}");
        let e = Config::parse("backend:cudaMallocAsync").unwrap_err().to_string();
        assert!(e.contains("PyTorch's other allocator"), "{e}");
    }

    #[test]
    fn metrics_addr_is_checked_when_configured() {
        // A bare port is loopback:port, as `stepalloc_metrics_serve` takes it.
        assert_eq!(Config::parse("metrics_addr:9835").unwrap().metrics_addr.as_deref(), Some("9835"));
        assert!(Config::parse("metrics_addr::9835").is_ok());
        assert!(Config::parse("metrics_addr:127.0.0.1:0").is_ok());
        assert!(Config::parse("metrics_addr:0.0.0.0:9835").is_ok(), "an explicit IP address may be public");
        for bad in ["metrics_addr:nowhere.invalid:9835", "metrics_addr:127.0.0.1:65536", "metrics_addr:host:port"] {
            let e = Config::parse(bad).unwrap_err();
            assert!(matches!(e, Error::Config { ref key, .. } if key == "metrics_addr"), "{bad}: {e}");
        }
        let e = Config::parse("metrics_addr:nowhere.invalid:9835").unwrap_err().to_string();
        assert!(e.contains("cannot resolve the host `nowhere.invalid`"), "{e}");
    }

    #[test]
    fn an_embedded_nul_is_an_error_not_a_truncation() {
        // "backend:sim\0garbage" must not be read as "backend:sim" by a C caller.
        for bad in ["backend:sim\0garbage", "sim_capacity_mb:1\0", "max_split_size_mb\0:128"] {
            let e = Config::parse(bad).unwrap_err().to_string();
            assert!(e.contains("NUL character"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn big_page_keys() {
        let c = Config::parse(&format!("backend:sim,{RECOMMENDED}")).unwrap();
        assert_eq!((c.large_page, c.big_page, c.big_page_after, c.pack_small), (2 * MIB, 16 * MIB, 4096 * MIB, true));
        let d = Config::parse("expandable_segments:True,big_page_mb:0,big_page_after_mb:0").unwrap();
        assert_eq!((d.big_page, d.big_page_after), (0, 0));
        for (bad, expected) in [
            ("big_page_mb:16", "expandable_segments:True"),
            ("pack_small:True", "expandable_segments:True"),
            ("expandable_segments:True,pack_small:yes", "bad value `yes`"),
            ("param_lane:True", "expandable_segments:True"),
            ("expandable_segments:True,param_lane:2", "bad value `2`"),
            ("expandable_segments:True,big_page_mb:3", "bad value `3`"),
            ("expandable_segments:True,big_page_mb:2048", "bad value `2048`"),
            ("expandable_segments:True,big_page_mb:-2", "bad value `-2`"),
            ("expandable_segments:True,big_page_after_mb:18446744073709551615", "bad value"),
        ] {
            let e = Config::parse(bad).unwrap_err();
            let keys = ["big_page_after_mb", "pack_small", "big_page_mb", "param_lane"];
            let key = keys.into_iter().find(|k| bad.contains(k)).unwrap();
            assert!(matches!(e, Error::Config { key: ref k, .. } if k == key), "{bad}: {e}");
            assert!(e.to_string().contains(expected), "{bad}: {e}");
        }
    }

    #[test]
    fn virtual_memory_keys() {
        let c = Config::parse("expandable_segments:True,large_segment_size_mb:2,page_reuse:True,page_release:True")
            .unwrap();
        assert!(c.expandable_segments && c.page_reuse && c.page_release);
        assert_eq!(c.large_page, 2 * MIB);
        let d = Config::parse("expandable_segments:True").unwrap();
        assert_eq!((d.large_page, d.page_reuse, d.page_release), (20 * MIB, false, false));
        let e = Config::parse("page_reuse:True").unwrap_err();
        assert!(e.to_string().contains("expandable_segments:True"), "{e}");
        // PyTorch's sizes are accepted; the page rules hold with expandable segments only.
        assert_eq!(Config::parse("large_segment_size_mb:33").unwrap().large_page, 33 * MIB);
        assert!(Config::parse("large_segment_size_mb:4096").is_ok());
        for bad in
            ["large_segment_size_mb:33,expandable_segments:True", "expandable_segments:True,large_segment_size_mb:2048"]
        {
            let e = Config::parse(bad).unwrap_err();
            assert!(matches!(e, Error::Config { ref key, .. } if key == "large_segment_size_mb"), "{bad}: {e}");
            assert!(e.to_string().contains("from 2 to 1024"), "{e}");
        }
        // The refusal quotes what was typed, not the saturated number of MiB it was kept as.
        let e = Config::parse("expandable_segments:True,large_segment_size_mb:18446744073709551615").unwrap_err();
        assert!(e.to_string().contains("bad value `18446744073709551615`"), "{e}");
    }

    #[test]
    fn describe_lists_every_key() {
        let text = Config::describe();
        for k in KEYS {
            assert!(text.contains(k.name));
        }
        assert_eq!(text.lines().count(), KEYS.len());
    }
}
