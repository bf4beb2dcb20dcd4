//! Named configurations for `--compare`, and the base keys every run gets.
//!
//! Presets: `pytorch` (PyTorch's default rules: the empty configuration), `split128`
//! (`max_split_size_mb:128`), `empty_cache_every_step` (PyTorch's rules plus a user calling
//! `torch.cuda.empty_cache()` after every step), `stepalloc` (stepalloc's best measured
//! configuration, see `STEPALLOC_BEST`). Anything else is a raw configuration string, optionally
//! named as `name=conf`.

use crate::replay::RunConfig;

/// stepalloc's best configuration on the agent presets (found by sweeping the step-release
/// keys with `--compare`; see the report of issue 6).
pub const STEPALLOC_BEST: &str = "phase_trim:True,release_idle_steps:1,cache_limit_mb:4096";

/// The comparison `agent` runs when `--compare` is not given.
pub const DEFAULT_AGENT: &[&str] = &["pytorch", "split128", "empty_cache_every_step", "stepalloc"];
/// The comparison `replay` and `random` run when `--compare` is not given.
pub const DEFAULT_OTHER: &[&str] = &["pytorch", "stepalloc"];

/// Which device the runs use.
#[derive(Clone, Debug, PartialEq)]
pub struct Base {
    pub cuda: bool,
    pub capacity_mb: u64,
    pub devices: u16,
}

impl Base {
    fn keys(&self) -> String {
        if self.cuda {
            "backend:cuda".into()
        } else {
            format!("backend:sim,sim_capacity_mb:{},sim_cost_model:True,sim_devices:{}", self.capacity_mb, self.devices)
        }
    }
}

/// Resolves preset names and raw strings into run configurations.
pub fn resolve(names: &[String], base: &Base) -> Result<Vec<RunConfig>, String> {
    let mut out = Vec::new();
    for name in names {
        let (label, conf) = match name.as_str() {
            "pytorch" | "empty_cache_every_step" => (name.clone(), String::new()),
            "split128" => (name.clone(), "max_split_size_mb:128".to_string()),
            "stepalloc" => (name.clone(), STEPALLOC_BEST.to_string()),
            raw => match raw.split_once('=') {
                Some((label, conf)) => (label.to_string(), conf.to_string()),
                None => (raw.to_string(), raw.to_string()),
            },
        };
        let empty = name == "empty_cache_every_step";
        let full = if conf.is_empty() { base.keys() } else { format!("{},{conf}", base.keys()) };
        // Refuse a bad string before any run starts.
        stepalloc::Config::parse(&full).map_err(|e| format!("--compare `{name}`: {e}"))?;
        out.push(RunConfig { name: label, conf: full, empty_cache_every_step: empty, explain: false });
    }
    Ok(out)
}
