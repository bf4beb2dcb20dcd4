//! A user's `PYTORCH_CUDA_ALLOC_CONF`, read as PyTorch 2.15 reads it, turned into the
//! configuration of the replay's model of PyTorch's allocator (`fit --pytorch-conf`).
//!
//! PyTorch's reading (c10 `ConfigTokenizer`, `AcceleratorAllocatorConfig::parseArgs`,
//! `CUDAAllocatorConfig::parseArgs`, checked against the 2.15 wheel over testdrv/): whitespace
//! anywhere is dropped; entries are `key:value` or `key:[list]` separated by commas; an unknown
//! key is an error ("Unrecognized key"), and so is a boolean other than `True` or `False`.
//! Each of PyTorch's keys is in `KEYS` with what the replay does with it:
//! - `Modelled`: passed to the model (the core's parser checks the value by PyTorch's rules);
//! - `Ignored`: no effect on the device memory the caching allocator reserves (pinned host
//!   memory, locking, CUDA graphs' stream reuse, virtual address space); dropped, and said so;
//! - `Refused`: it changes the allocator in a way the model does not follow; an error that says
//!   so, rather than a prediction for another setting.
//!
//! `per_process_memory_fraction` is of the device's whole memory in PyTorch, and the replay's
//! device is the usable part (`fit`'s capacity less the memory outside PyTorch): the fraction
//! is rescaled so the limit stays the same number of bytes (capped at the usable memory).
//!
//! Invariant: `translate` either returns a configuration string the core accepts, or an error
//! naming the key and what to do; it never panics and holds no more than the input's size.

/// What the replay does with one of PyTorch's keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Treatment {
    Modelled,
    Ignored(&'static str),
    Refused(&'static str),
}
use Treatment::*;

/// PyTorch 2.15's keys (device and host allocators share the variable), whether the value is
/// a boolean (`True` / `False` only), and their treatment.
const KEYS: &[(&str, bool, Treatment)] = &[
    ("max_split_size_mb", false, Modelled),
    ("max_non_split_rounding_mb", false, Modelled),
    ("roundup_power2_divisions", false, Modelled),
    ("garbage_collection_threshold", false, Modelled),
    ("expandable_segments", true, Modelled),
    ("per_process_memory_fraction", false, Modelled),
    // Modelled as expandable segments' page size; without them PyTorch 2.15 makes it the segment
    // size of requests from 1 to 10 MiB, which the model does not follow (checked in `translate`).
    ("large_segment_size_mb", false, Modelled),
    ("backend", false, Modelled),
    ("release_lock_on_cudamalloc", true, Ignored("when the lock is held, not what is reserved")),
    ("release_lock_on_hipmalloc", true, Ignored("when the lock is held, not what is reserved")),
    ("pinned_use_cuda_host_register", true, Ignored("pinned host memory")),
    ("pinned_use_hip_host_register", true, Ignored("pinned host memory")),
    ("pinned_num_register_threads", false, Ignored("pinned host memory")),
    ("pinned_use_background_threads", true, Ignored("pinned host memory")),
    ("pinned_reserve_segment_size_mb", false, Ignored("pinned host memory")),
    ("pinned_max_round_threshold_mb", false, Ignored("pinned host memory")),
    ("pinned_max_cached_size_mb", false, Ignored("pinned host memory")),
    ("pinned_free_catch_all", true, Ignored("pinned host memory")),
    ("graph_capture_record_stream_reuse", true, Ignored("CUDA graph captures, which a trace does not replay")),
    ("expandable_segments_reserve", false, Ignored("virtual address space, not memory")),
    ("expandable_segments_reserve_by_class", false, Ignored("virtual address space, not memory")),
    (
        "throw_on_cudamalloc_oom",
        true,
        Refused(
            "with it PyTorch refuses a request that would pass the device's memory before freeing its cache and \
             retrying, and the replay models only the default out-of-memory path",
        ),
    ),
];

/// The longest `--pytorch-conf` accepted (PyTorch's own strings are a few dozen bytes).
pub const MAX_LEN: usize = 4096;

/// The model's configuration for the user's PyTorch setting.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Translated {
    /// The keys for the core, after `exact_fit:True` (PyTorch's best-fit search).
    pub conf: String,
    /// The setting as PyTorch reads it (whitespace dropped), for reports.
    pub setting: String,
    /// What was dropped and why, one line each.
    pub notes: Vec<String>,
}

/// Reads `text` as PyTorch would, for a device of `capacity_mb` of which `usable_mb` is the
/// replay's device.
pub fn translate(text: &str, capacity_mb: u64, usable_mb: u64) -> Result<Translated, String> {
    if text.len() > MAX_LEN {
        return Err(format!("--pytorch-conf is {} bytes long; at most {MAX_LEN} are accepted", text.len()));
    }
    // PyTorch's tokenizer drops whitespace everywhere.
    let setting: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let mut keys: Vec<String> = vec!["exact_fit:True".to_string()];
    let mut notes = Vec::new();
    let mut expandable = false;
    let mut large_segment = None;
    for entry in entries(&setting)? {
        let Some((key, value)) = entry.split_once(':') else {
            return Err(format!("--pytorch-conf: `{entry}` is not `key:value`; PyTorch would refuse it"));
        };
        let Some(&(_, boolean, treatment)) = KEYS.iter().find(|(k, _, _)| *k == key) else {
            return Err(format!(
                "--pytorch-conf: `{key}` is not one of PyTorch 2.15's keys (it would refuse it: \"Unrecognized key \
                 '{key}' in CUDA allocator config\"); its keys: {}",
                KEYS.iter().map(|k| k.0).collect::<Vec<_>>().join(", ")
            ));
        };
        if boolean && value != "True" && value != "False" {
            return Err(format!(
                "--pytorch-conf: `{key}:{value}`: PyTorch takes `True` or `False` only (it would refuse `{value}`)"
            ));
        }
        match treatment {
            Ignored(why) => {
                notes.push(format!("`{key}` left out: it concerns {why}"));
                continue;
            }
            Refused(why) => {
                return Err(format!(
                    "--pytorch-conf: `{key}:{value}` is not modelled: {why}; leave it out to predict PyTorch without it"
                ))
            }
            Modelled => {}
        }
        match key {
            "backend" if value == "native" => continue,
            "backend" => {
                return Err(format!(
                    "--pytorch-conf: `backend:{value}` is not modelled: the replay models PyTorch's native caching \
                     allocator only (`backend:native`, the default)"
                ))
            }
            "expandable_segments" => expandable = value == "True",
            "large_segment_size_mb" => large_segment = Some(value.to_string()),
            "per_process_memory_fraction" => {
                keys.push(format!("{key}:{}", rescale_fraction(value, capacity_mb, usable_mb)?));
                continue;
            }
            _ => {}
        }
        keys.push(format!("{key}:{value}"));
    }
    if let (Some(value), false) = (&large_segment, expandable) {
        return Err(format!(
            "--pytorch-conf: `large_segment_size_mb:{value}` without `expandable_segments:True` is not modelled: \
             PyTorch 2.15 then makes it the segment size of requests from 1 to 10 MiB, which the replay keeps at \
             20 MiB"
        ));
    }
    let conf = keys.join(",");
    stepalloc::Config::parse(&conf).map_err(|e| format!("--pytorch-conf `{setting}`: {e}"))?;
    Ok(Translated { conf, setting, notes })
}

/// Splits `key:value,key:[a,b],...` at the commas outside brackets; brackets must pair.
fn entries(setting: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in setting.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth.checked_sub(1).ok_or_else(|| {
                    format!("--pytorch-conf: a `]` at byte {i} closes no `[`; PyTorch would refuse it")
                })?
            }
            ',' if depth == 0 => {
                out.push(&setting[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err("--pytorch-conf: a `[` is never closed; PyTorch would refuse it".to_string());
    }
    out.push(&setting[start..]);
    Ok(out.into_iter().filter(|e| !e.is_empty()).collect())
}

/// PyTorch's fraction of the whole device, as a fraction of the usable part (at most 1).
fn rescale_fraction(value: &str, capacity_mb: u64, usable_mb: u64) -> Result<String, String> {
    let f: f64 =
        value.parse().ok().filter(|f: &f64| f.is_finite() && *f > 0.0 && *f <= 1.0).ok_or_else(|| {
            format!("--pytorch-conf: `per_process_memory_fraction:{value}`: expected a number in (0, 1]")
        })?;
    let scaled = (f * capacity_mb as f64 / usable_mb.max(1) as f64).min(1.0);
    Ok(format!("{scaled}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_as_pytorch_reads_them() {
        let t = translate(" max_split_size_mb : 128 , expandable_segments:True", 1024, 1024).unwrap();
        assert_eq!(t.conf, "exact_fit:True,max_split_size_mb:128,expandable_segments:True");
        assert_eq!(t.setting, "max_split_size_mb:128,expandable_segments:True");
        let t =
            translate("roundup_power2_divisions:[256:1,512:2,>:4],pinned_num_register_threads:4", 1024, 1024).unwrap();
        assert_eq!(t.conf, "exact_fit:True,roundup_power2_divisions:[256:1,512:2,>:4]");
        assert_eq!(t.notes, ["`pinned_num_register_threads` left out: it concerns pinned host memory"]);
        assert_eq!(translate("", 1024, 1024).unwrap().conf, "exact_fit:True");
        assert_eq!(translate("backend:native", 1024, 1024).unwrap().conf, "exact_fit:True");
    }

    #[test]
    fn the_fraction_keeps_its_bytes_on_the_usable_part() {
        let t = translate("per_process_memory_fraction:0.5", 1000, 800).unwrap();
        assert_eq!(t.conf, "exact_fit:True,per_process_memory_fraction:0.625");
        let t = translate("per_process_memory_fraction:0.9", 1000, 800).unwrap();
        assert_eq!(t.conf, "exact_fit:True,per_process_memory_fraction:1");
    }

    #[test]
    fn what_pytorch_refuses_or_the_model_does_not_follow_is_an_error_naming_it() {
        for (text, want) in [
            ("expandable_segments:true", "PyTorch takes `True` or `False` only"),
            ("bogus:1", "`bogus` is not one of PyTorch 2.15's keys"),
            ("page_reuse:True", "`page_reuse` is not one of PyTorch 2.15's keys"),
            ("max_split_size_mb:10", "max_split_size_mb"),
            ("throw_on_cudamalloc_oom:True", "is not modelled"),
            ("backend:cudaMallocAsync", "`backend:cudaMallocAsync` is not modelled"),
            ("large_segment_size_mb:40", "without `expandable_segments:True` is not modelled"),
            ("max_split_size_mb", "is not `key:value`"),
            ("roundup_power2_divisions:[256:1", "never closed"),
            ("a]", "closes no"),
            ("per_process_memory_fraction:2", "expected a number in (0, 1]"),
        ] {
            let e = translate(text, 1024, 1024).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
        assert!(translate(&"a".repeat(MAX_LEN + 1), 1024, 1024).unwrap_err().contains("at most 4096"));
    }
}
