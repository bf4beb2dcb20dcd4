//! A user's `PYTORCH_CUDA_ALLOC_CONF`, read as PyTorch 2.15 reads it, turned into the
//! configuration of the replay's model of PyTorch's allocator (`fit --pytorch-conf`).
//!
//! `reading` reads the string token by token as PyTorch does (its quirks included: what PyTorch
//! accepts is accepted, with the values PyTorch takes, and what it refuses is refused with its
//! reason). Each of PyTorch's keys is then in `KEYS` with what the replay does with it:
//! - `Modelled`: passed to the model as the value PyTorch read;
//! - `Ignored`: no effect on the device memory the caching allocator reserves (pinned host
//!   memory, locking, CUDA graphs' stream reuse, virtual address space); dropped, and said so;
//! - `Refused`: it changes the allocator in a way the model does not follow; an error that says
//!   so, rather than a prediction for another setting.
//!
//! A key given twice keeps its last value, as in PyTorch (`roundup_power2_divisions` given twice
//! is refused: PyTorch merges the two tables, which the model does not follow).
//! `per_process_memory_fraction` is of the device's whole memory in PyTorch, and the replay's
//! device is the usable part (`fit`'s capacity less the memory outside PyTorch): the fraction
//! is rescaled so the limit stays the same number of bytes (capped at the usable memory).
//!
//! Invariant: `translate` either returns a configuration string the core accepts, or an error
//! naming the key and what to do; it never panics and holds no more than the input's size.

mod reading;

use reading::Value;

/// What the replay does with one of PyTorch's keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Treatment {
    Modelled,
    Ignored(&'static str),
    Refused(&'static str),
}
use Treatment::*;

/// PyTorch 2.15's keys (device and host allocators share the variable) and their treatment.
const KEYS: &[(&str, Treatment)] = &[
    ("max_split_size_mb", Modelled),
    ("max_non_split_rounding_mb", Modelled),
    ("roundup_power2_divisions", Modelled),
    ("garbage_collection_threshold", Modelled),
    ("expandable_segments", Modelled),
    ("per_process_memory_fraction", Modelled),
    // Modelled as expandable segments' page size; without them PyTorch 2.15 makes it the segment
    // size of requests from 1 to 10 MiB, which the model does not follow (checked in `translate`).
    ("large_segment_size_mb", Modelled),
    ("backend", Modelled),
    ("release_lock_on_cudamalloc", Ignored("when the lock is held, not what is reserved")),
    ("release_lock_on_hipmalloc", Ignored("when the lock is held, not what is reserved")),
    ("pinned_use_cuda_host_register", Ignored("pinned host memory")),
    ("pinned_use_hip_host_register", Ignored("pinned host memory")),
    ("pinned_num_register_threads", Ignored("pinned host memory")),
    ("pinned_use_background_threads", Ignored("pinned host memory")),
    ("pinned_reserve_segment_size_mb", Ignored("pinned host memory")),
    ("pinned_max_round_threshold_mb", Ignored("pinned host memory")),
    ("pinned_max_cached_size_mb", Ignored("pinned host memory")),
    ("pinned_free_catch_all", Ignored("pinned host memory")),
    ("graph_capture_record_stream_reuse", Ignored("CUDA graph captures, which a trace does not replay")),
    ("expandable_segments_reserve", Ignored("virtual address space, not memory")),
    ("expandable_segments_reserve_by_class", Ignored("virtual address space, not memory")),
    (
        "throw_on_cudamalloc_oom",
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
    // PyTorch's tokenizer drops C's whitespace everywhere.
    let setting: String = text.chars().filter(|c| !matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')).collect();
    let entries = reading::read(text).map_err(|why| format!("--pytorch-conf: {why}"))?;
    // The last value of each key, in the order the keys first appear.
    let mut last: Vec<(&'static str, Value)> = Vec::new();
    for (key, value) in entries {
        match last.iter_mut().find(|(k, _)| *k == key) {
            Some(_) if key == "roundup_power2_divisions" => {
                return Err(
                    "--pytorch-conf: `roundup_power2_divisions` given twice is not modelled: PyTorch merges the two \
                     tables; give it once"
                        .to_string(),
                )
            }
            Some(entry) => entry.1 = value,
            None => last.push((key, value)),
        }
    }
    let mut keys: Vec<String> = vec!["exact_fit:True".to_string()];
    let mut notes = Vec::new();
    let expandable = last.iter().any(|(k, v)| *k == "expandable_segments" && *v == Value::Bool(true));
    for (key, value) in &last {
        let treatment = KEYS.iter().find(|(k, _)| k == key).map_or(Modelled, |&(_, t)| t);
        match (treatment, value) {
            (Ignored(why), _) => notes.push(format!("`{key}` left out: it concerns {why}")),
            (Refused(_), Value::Bool(false)) => {} // PyTorch's default: nothing to model
            (Refused(why), _) => {
                return Err(format!(
                    "--pytorch-conf: `{key}` is not modelled: {why}; leave it out to predict PyTorch without it"
                ))
            }
            (Modelled, Value::Text(backend)) if backend == "native" => {}
            (Modelled, Value::Text(backend)) => {
                return Err(format!(
                    "--pytorch-conf: `backend:{backend}` is not modelled: the replay models PyTorch's native caching \
                     allocator only (`backend:native`, the default)"
                ))
            }
            (Modelled, Value::Double(f)) if *key == "per_process_memory_fraction" => {
                keys.push(format!("{key}:{}", rescale_fraction(*f, capacity_mb, usable_mb)?));
            }
            (Modelled, Value::Double(x)) => keys.push(format!("{key}:{x:?}")),
            (Modelled, Value::Bool(b)) => keys.push(format!("{key}:{}", if *b { "True" } else { "False" })),
            (Modelled, Value::Size(n)) if *key == "large_segment_size_mb" && !expandable => {
                return Err(format!(
                    "--pytorch-conf: `large_segment_size_mb:{n}` without `expandable_segments:True` is not modelled: \
                     PyTorch 2.15 then makes it the segment size of requests from 1 to 10 MiB, which the replay keeps at \
                     20 MiB"
                ))
            }
            (Modelled, Value::Size(n)) => keys.push(format!("{key}:{}", reading::mib_capped(*n))),
            (Modelled, Value::Divisions(d)) => keys.push(format!("{key}:{d}")),
        }
    }
    let conf = keys.join(",");
    stepalloc::Config::parse(&conf).map_err(|e| {
        format!("--pytorch-conf `{setting}`: PyTorch accepts it, but the replay's model does not follow it ({e}): not modelled")
    })?;
    Ok(Translated { conf, setting, notes })
}

/// PyTorch's fraction of the whole device, as a fraction of the usable part (at most 1). A
/// fraction of 0 lets PyTorch allocate nothing.
fn rescale_fraction(f: f64, capacity_mb: u64, usable_mb: u64) -> Result<String, String> {
    if f <= 0.0 {
        return Err(
            "--pytorch-conf: `per_process_memory_fraction:0` is not modelled: PyTorch 2.15 then allows 0 bytes \
                    and every allocation raises out of memory; nothing to predict"
                .to_string(),
        );
    }
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
        // PyTorch's own quirks: a sign wraps, digits stop at the first other byte, a key's
        // last value holds, an explicit default of a refused key is no setting at all.
        let t = translate("max_split_size_mb:-1,expandable_segments:True,expandable_segments:False", 1024, 1024);
        assert_eq!(t.unwrap().conf, "exact_fit:True,max_split_size_mb:17592186044415,expandable_segments:False");
        let t = translate(
            "max_split_size_mb:128abc,garbage_collection_threshold:0x1p-1,throw_on_cudamalloc_oom:False",
            1024,
            1024,
        );
        assert_eq!(t.unwrap().conf, "exact_fit:True,max_split_size_mb:128,garbage_collection_threshold:0.5");
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
            ("expandable_segments:true", "it takes `True` or `False` only"),
            ("bogus:1", "`bogus` is not one of PyTorch 2.15's keys"),
            ("page_reuse:True", "`page_reuse` is not one of PyTorch 2.15's keys"),
            ("max_split_size_mb:10", "must be at least the large segment size, 20"),
            (
                "max_split_size_mb:32,large_segment_size_mb:64,expandable_segments:True",
                "at least the large segment size, 64",
            ),
            ("throw_on_cudamalloc_oom:True", "is not modelled"),
            ("backend:cudaMallocAsync", "`backend:cudaMallocAsync` is not modelled"),
            ("large_segment_size_mb:40", "without `expandable_segments:True` is not modelled"),
            ("max_split_size_mb", "fails an internal assertion"),
            ("roundup_power2_divisions:[256:1", "fails an internal assertion"),
            ("a]", "`a` is not one of PyTorch 2.15's keys"),
            ("per_process_memory_fraction:2", "set it in [0.0, 1.0]"),
            ("per_process_memory_fraction:0", "allows 0 bytes"),
            (",expandable_segments:True", "Unrecognized key ','"),
            ("roundup_power2_divisions:4,roundup_power2_divisions:[256:1]", "given twice"),
        ] {
            let e = translate(text, 1024, 1024).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
        assert!(translate(&"a".repeat(MAX_LEN + 1), 1024, 1024).unwrap_err().contains("at most 4096"));
    }
}
