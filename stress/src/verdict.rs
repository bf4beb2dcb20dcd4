//! The verdict under the side-by-side table of `agent` and `replay`: one line, computed from
//! the run, that says what it means for the user. It sets stepalloc's best column against
//! PyTorch's default and against the best of PyTorch's settings in the run (peak reserved, by
//! how much and by what share), says which of them ran out of memory, and which retried
//! allocations after freeing its cache (PyTorch's out-of-memory path: a device-wide stall).
//! Without a stepalloc column it sets the best of PyTorch's settings against its default;
//! without a PyTorch column there is no line. Layer: reads run configurations (`replay`) and
//! reports (`report`); prints nothing.
//!
//! "Best" is `report::best`, as `advise` chooses: the lowest peak that fits, else the fewest
//! out-of-memory events. A column's role comes from its configuration (`role`), so raw
//! `--compare` strings are placed as the presets are.

use crate::replay::RunConfig;
use crate::report::{best, fits, size, RunReport};
use stepalloc::config::{split_entries, KEYS};
use stepalloc::Config;

/// What a column stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// PyTorch's allocator as it comes (the `pytorch` preset).
    PytorchDefault,
    /// PyTorch's allocator with other settings, or with `empty_cache()` after every step.
    Pytorch,
    /// stepalloc.
    Stepalloc,
}

/// The role of a configuration. PyTorch's rules are `exact_fit:True` with PyTorch's own keys
/// only, as the PyTorch presets and `advise` replay them; its default is that with nothing else
/// set (and no `empty_cache()` after every step). Keys of the device (`backend`, `sim_*`) and
/// keys that only observe (`trace_entries`, `metrics_addr`) do not count. Anything else is
/// stepalloc.
pub fn role(rc: &RunConfig) -> Role {
    let Ok(config) = Config::parse(&rc.conf) else { return Role::Stepalloc };
    let (neutral, placing): (Vec<&str>, Vec<&str>) = split_entries(&rc.conf)
        .into_iter()
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .partition(|entry| is_neutral(entry.split_once(':').map_or(*entry, |(key, _)| key.trim())));
    let pytorch_keys = placing.iter().all(|entry| {
        let key = entry.split_once(':').map_or(*entry, |(key, _)| key.trim());
        key == "exact_fit" || is_pytorch_key(key)
    });
    if !config.exact_fit || !pytorch_keys {
        return Role::Stepalloc;
    }
    let default = Config::parse(&format!("{},exact_fit:True", neutral.join(",")));
    if !rc.empty_cache_every_step && default.is_ok_and(|d| d == config) {
        Role::PytorchDefault
    } else {
        Role::Pytorch
    }
}

/// A key that says which device runs or what is recorded, not where blocks go.
fn is_neutral(key: &str) -> bool {
    key.starts_with("sim_") || matches!(key, "backend" | "trace_entries" | "metrics_addr")
}

/// One of PyTorch's own keys (`PYTORCH_CUDA_ALLOC_CONF`): `config::KEYS` lists them before
/// stepalloc's, the first of which is `exact_fit`.
fn is_pytorch_key(key: &str) -> bool {
    KEYS.iter().take_while(|k| k.name != "exact_fit").any(|k| k.name == key)
}

/// The verdict for the columns of one run, each with its role, in the table's order; `None`
/// when there is nothing to set against each other.
pub fn verdict(columns: &[(Role, &RunReport)]) -> Option<String> {
    let of = |keep: &dyn Fn(Role) -> bool| -> Vec<(usize, &RunReport)> {
        columns.iter().enumerate().filter(|(_, (role, _))| keep(*role)).map(|(i, &(_, run))| (i, run)).collect()
    };
    let pytorch = of(&|role| role != Role::Stepalloc);
    let ours = of(&|role| role == Role::Stepalloc);
    let default = columns.iter().position(|(role, _)| *role == Role::PytorchDefault);
    let best_pytorch = best(&pytorch)?;
    let several_pytorch = pytorch.len() > 1;
    let label = |i: usize| -> String {
        let role = if Some(i) == default {
            if several_pytorch && i == best_pytorch {
                "PyTorch's default and its best here"
            } else {
                "PyTorch's default"
            }
        } else if i == best_pytorch && columns[i].0 != Role::Stepalloc {
            if several_pytorch {
                "PyTorch's best here"
            } else {
                "PyTorch"
            }
        } else if ours.len() > 1 {
            "stepalloc's best here"
        } else if columns[i].1.name == "stepalloc" {
            return "stepalloc".to_string();
        } else {
            "stepalloc"
        };
        format!("{} ({role})", columns[i].1.name)
    };
    // The column the line speaks of, and those it is set against.
    let (subject, references) = match best(&ours) {
        Some(s) => (s, default.into_iter().chain((Some(best_pytorch) != default).then_some(best_pytorch)).collect()),
        None => match default {
            Some(d) if d != best_pytorch => (best_pytorch, vec![d]),
            _ => return None,
        },
    };
    let run = |i: usize| columns[i].1;
    let s = run(subject);
    let mut parts = Vec::new();
    if fits(s) {
        let against: Vec<String> =
            references.iter().filter(|&&i| fits(run(i))).map(|&i| set_against(s, run(i), &label(i))).collect();
        let mut head = format!("{} peaks at {} reserved", label(subject), size(s.worst.peak_reserved));
        if references.iter().any(|&i| run(i).ooms > 0) {
            head.push_str(" with no out-of-memory");
        }
        if !against.is_empty() {
            head = format!("{head}, {}", against.join(" and "));
        }
        parts.push(head);
        parts.extend(
            references.iter().filter(|&&i| !fits(run(i))).map(|&i| format!("{} {}", label(i), trouble(run(i)))),
        );
    } else {
        parts.push(format!("{} {}", label(subject), trouble(s)));
        parts.extend(references.iter().map(|&i| {
            if fits(run(i)) {
                format!("{} did not, peaking at {} reserved", label(i), size(run(i).worst.peak_reserved))
            } else {
                format!("{} {}", label(i), trouble(run(i)))
            }
        }));
    }
    let retried: Vec<(&str, u64)> = std::iter::once(subject)
        .chain(references)
        .map(|i| (run(i).name.as_str(), run(i).alloc_retries))
        .filter(|&(_, n)| n > 0)
        .collect();
    match retried.as_slice() {
        [] => {}
        [(name, n)] => parts.push(format!("{name} retried {} after freeing its cache", count(*n, "allocation"))),
        several => {
            let each: Vec<String> = several.iter().map(|(name, n)| format!("{name} {n}")).collect();
            parts.push(format!("allocations retried after freeing the cache: {}", each.join(", ")));
        }
    }
    Some(format!("In short: {}.", parts.join("; ")))
}

/// `s`'s peak against `r`'s: by how much and by what share of `r`'s, below or above.
fn set_against(s: &RunReport, r: &RunReport, label: &str) -> String {
    let (ours, theirs) = (s.worst.peak_reserved, r.worst.peak_reserved);
    let (gap, side) = match ours.cmp(&theirs) {
        std::cmp::Ordering::Equal => return format!("the same as {label}"),
        std::cmp::Ordering::Less => (theirs - ours, "below"),
        std::cmp::Ordering::Greater => (ours - theirs, "above"),
    };
    // `theirs` is not 0 here unless ours is above it from nothing.
    match theirs {
        0 => format!("{} {side} {label}", size(gap)),
        _ => format!("{} ({:.1}%) {side} {label}", size(gap), gap as f64 / theirs as f64 * 100.0),
    }
}

/// What stopped a run: its out-of-memory events, else its refused calls.
fn trouble(r: &RunReport) -> String {
    if r.ooms > 0 {
        format!("ran out of memory {}", count(r.ooms, "time"))
    } else {
        format!("had {}", count(r.errors, "refused call"))
    }
}

fn count(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}
