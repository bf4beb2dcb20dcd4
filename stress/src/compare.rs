//! Named configurations for `--compare`, and the base keys every run gets.
//!
//! Presets (`PRESETS`): `pytorch` (PyTorch's default rules: the empty configuration),
//! `pytorch_expandable` (PyTorch's `expandable_segments:True`), `split128`
//! (`max_split_size_mb:128`), `empty_cache_every_step` (PyTorch's rules plus a user calling
//! `torch.cuda.empty_cache()` after every step), `stepalloc` (stepalloc's recommended
//! configuration, `STEPALLOC_BEST`), and one column per stepalloc improvement alone on top of
//! expandable segments (`vm_small_pages`, `vm_page_reuse`, `vm_page_release`). Anything else is a raw
//! configuration string, optionally named as `name=conf`.

use crate::replay::RunConfig;

/// stepalloc's recommended configuration (the core's `config::RECOMMENDED`).
pub const STEPALLOC_BEST: &str = stepalloc::config::RECOMMENDED;

/// Every preset: its name and its configuration (without the base keys).
/// PyTorch's presets take exact best fits (`exact_fit`), as PyTorch's ordered free set does.
pub const PRESETS: &[(&str, &str)] = &[
    ("pytorch", "exact_fit:True"),
    ("pytorch_expandable", "exact_fit:True,expandable_segments:True"),
    ("split128", "exact_fit:True,max_split_size_mb:128"),
    ("empty_cache_every_step", "exact_fit:True"),
    ("stepalloc", STEPALLOC_BEST),
    ("vm_small_pages", "expandable_segments:True,large_segment_size_mb:2"),
    ("vm_page_reuse", "expandable_segments:True,page_reuse:True"),
    ("vm_page_release", "expandable_segments:True,page_release:True"),
];

/// The comparison `agent` (and `headroom`) runs when `--compare` is not given.
pub const DEFAULT_AGENT: &[&str] =
    &["pytorch", "pytorch_expandable", "split128", "empty_cache_every_step", "stepalloc"];
/// The comparison `replay` and `random` run when `--compare` is not given.
pub const DEFAULT_OTHER: &[&str] = &["pytorch", "pytorch_expandable", "stepalloc"];

/// Which device the runs use.
#[derive(Clone, Debug, PartialEq)]
pub struct Base {
    pub cuda: bool,
    pub capacity_mb: u64,
    pub devices: u16,
}

impl Base {
    /// Checks the base keys alone, so that an error names the flag they come from, not the
    /// `--compare` entry they are prefixed to.
    pub fn validate(&self) -> Result<(), String> {
        stepalloc::Config::parse(&self.keys()).map(|_| ()).map_err(|e| {
            if self.cuda {
                format!("--backend cuda: {e}")
            } else if self.devices > 1 {
                format!("--capacity-mb {} (the trace uses {} devices): {e}", self.capacity_mb, self.devices)
            } else {
                format!("--capacity-mb {}: {e}", self.capacity_mb)
            }
        })
    }

    fn keys(&self) -> String {
        if self.cuda {
            "backend:cuda".into()
        } else {
            format!("backend:sim,sim_capacity_mb:{},sim_cost_model:True,sim_devices:{}", self.capacity_mb, self.devices)
        }
    }
}

/// A resolved configuration (`RunConfig::conf`) without the base keys `resolve_one` put first:
/// the preset's or the user's own keys.
pub fn without_base<'a>(conf: &'a str, base: &Base) -> &'a str {
    let keys = base.keys();
    conf.strip_prefix(keys.as_str()).map_or(conf, |rest| rest.trim_start_matches(','))
}

/// The configuration of a preset, if `name` is one.
pub fn preset(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, conf)| *conf)
}

/// Resolves one preset name or raw string into a run configuration; an error names the
/// `--compare` entry and what the core refused.
pub fn resolve_one(name: &str, base: &Base) -> Result<RunConfig, String> {
    let (label, conf) = match preset(name) {
        Some(conf) => (name.to_string(), conf.to_string()),
        None => match name.split_once('=') {
            Some((label, conf)) => (label.to_string(), conf.to_string()),
            None => (name.to_string(), name.to_string()),
        },
    };
    base.validate()?;
    let empty = name == "empty_cache_every_step";
    let full = if conf.is_empty() { base.keys() } else { format!("{},{conf}", base.keys()) };
    // Refuse a bad string before any run starts.
    stepalloc::Config::parse(&full).map_err(|e| format!("--compare `{name}`: {e}"))?;
    Ok(RunConfig {
        name: label,
        conf: full,
        empty_cache_every_step: empty,
        explain: false,
        stop_at_first_oom: false,
        track_peak: false,
    })
}

/// Resolves preset names and raw strings into run configurations.
pub fn resolve(names: &[String], base: &Base) -> Result<Vec<RunConfig>, String> {
    base.validate()?;
    names.iter().map(|name| resolve_one(name, base)).collect()
}
