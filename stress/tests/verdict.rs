//! The verdict under the table of `agent` and `replay` (`src/verdict.rs`): the exact line on
//! small runs of the command (the default comparison, out-of-memory and retries, other
//! `--compare` lists, no PyTorch or no stepalloc column, a trace), the roles the columns get
//! from their configurations, and, on hand-made reports, the cases a small run does not reach.

mod common;

use common::TINY_AGENT;
use std::process::Command;
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::report::RunReport;
use stepalloc_stress::verdict::{role, verdict, Role};

/// The command's verdict line (`None` when it prints none); the command must succeed.
fn verdict_of(args: &[&str]) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress")).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines().filter(|l| l.starts_with("In short: "));
    let line = lines.next().map(str::to_string);
    assert!(lines.next().is_none(), "{args:?}: one verdict line at most:\n{text}");
    if let Some(line) = &line {
        // Right under the table.
        let above = text.lines().take_while(|l| l != line).last().unwrap_or_default();
        assert!(above.starts_with('└'), "{args:?}: the verdict follows the table, not `{above}`");
    }
    line
}

fn tiny(extra: &[&str]) -> Option<String> {
    verdict_of(&[&["agent"], TINY_AGENT, extra].concat())
}

#[test]
fn the_default_comparison_sets_stepalloc_against_pytorchs_default_and_best() {
    assert_eq!(
        tiny(&[]).as_deref(),
        Some(
            "In short: stepalloc peaks at 856.0 MiB reserved, 182.0 MiB (17.5%) below pytorch (PyTorch's default) and \
             84.0 MiB (8.9%) below pytorch_expandable (PyTorch's best here)."
        )
    );
}

#[test]
fn out_of_memory_and_retries_are_named() {
    // PyTorch's default retries once and fits.
    assert_eq!(
        tiny(&["--capacity-mb", "1000"]).as_deref(),
        Some(
            "In short: stepalloc peaks at 856.0 MiB reserved, 144.0 MiB (14.4%) below pytorch (PyTorch's default) and \
             84.0 MiB (8.9%) below pytorch_expandable (PyTorch's best here); pytorch retried 1 allocation after \
             freeing its cache."
        )
    );
    // PyTorch runs out of memory under both settings; stepalloc does not.
    assert_eq!(
        tiny(&["--capacity-mb", "870"]).as_deref(),
        Some(
            "In short: stepalloc peaks at 856.0 MiB reserved with no out-of-memory; pytorch (PyTorch's default) ran \
             out of memory 3 times; pytorch_expandable (PyTorch's best here) ran out of memory 2 times; allocations \
             retried after freeing the cache: pytorch 5, pytorch_expandable 4."
        )
    );
    // Every configuration runs out of memory: no peak is compared, stepalloc's count is given
    // as it is, here the worse one.
    assert_eq!(
        tiny(&["--capacity-mb", "400"]).as_deref(),
        Some(
            "In short: stepalloc ran out of memory 14739 times; pytorch (PyTorch's default and its best here) ran out \
             of memory 6915 times; allocations retried after freeing the cache: stepalloc 14739, pytorch 6915."
        )
    );
}

#[test]
fn other_comparisons_name_the_columns_they_set_against_each_other() {
    // Several stepalloc columns: the best one speaks.
    assert_eq!(
        tiny(&["--compare", "pytorch", "pytorch_expandable", "vm_page_release", "vm_small_pages"]).as_deref(),
        Some(
            "In short: vm_small_pages (stepalloc's best here) peaks at 922.0 MiB reserved, 116.0 MiB (11.2%) below \
             pytorch (PyTorch's default) and 18.0 MiB (1.9%) below pytorch_expandable (PyTorch's best here)."
        )
    );
    // A stepalloc configuration that is not the best: the same as one, above the other.
    assert_eq!(
        tiny(&["--compare", "pytorch", "pytorch_expandable", "plain="]).as_deref(),
        Some(
            "In short: plain (stepalloc) peaks at 1.01 GiB reserved, the same as pytorch (PyTorch's default) and 98.0 \
             MiB (10.4%) above pytorch_expandable (PyTorch's best here)."
        )
    );
    // No PyTorch default: the best of PyTorch's settings alone; a raw string of PyTorch's keys
    // with exact fits is one of PyTorch's settings.
    assert_eq!(
        tiny(&["--compare", "split256=exact_fit:True,max_split_size_mb:256", "stepalloc"]).as_deref(),
        Some("In short: stepalloc peaks at 856.0 MiB reserved, 182.0 MiB (17.5%) below split256 (PyTorch).")
    );
    // No stepalloc column: PyTorch's best setting against its default, or nothing to say.
    assert_eq!(
        tiny(&["--compare", "pytorch", "pytorch_expandable"]).as_deref(),
        Some(
            "In short: pytorch_expandable (PyTorch's best here) peaks at 940.0 MiB reserved, 98.0 MiB (9.4%) below \
             pytorch (PyTorch's default)."
        )
    );
    assert_eq!(tiny(&["--compare", "pytorch_expandable", "split128"]), None);
    // No PyTorch column: nothing to set stepalloc against.
    assert_eq!(tiny(&["--compare", "stepalloc", "vm_page_reuse"]), None);
}

#[test]
fn replay_json_and_random() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/stepalloc_small.jsonl");
    assert_eq!(
        verdict_of(&["replay", trace]).as_deref(),
        Some("In short: stepalloc peaks at 10.0 MiB reserved, 12.0 MiB (54.5%) below pytorch (PyTorch's default and its best here).")
    );
    let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"))
        .args([&["agent"], TINY_AGENT, &["--json", "--compare", "pytorch", "stepalloc"]].concat())
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["verdict"],
        "In short: stepalloc peaks at 856.0 MiB reserved, 182.0 MiB (17.5%) below pytorch (PyTorch's default)."
    );
    // `random` compares no memory (the threads interleave differently per column): no verdict.
    assert_eq!(verdict_of(&["random", "--threads", "1", "--ops", "2000"]), None);
}

#[test]
fn roles_follow_the_configuration() {
    let base = Base { cuda: false, capacity_mb: 81920, devices: 1 };
    let role_of = |name: &str| role(&compare::resolve_one(name, &base).unwrap());
    assert_eq!(role_of("pytorch"), Role::PytorchDefault);
    for name in ["pytorch_expandable", "split128", "empty_cache_every_step"] {
        assert_eq!(role_of(name), Role::Pytorch, "{name}");
    }
    for name in ["stepalloc", "vm_small_pages", "vm_page_reuse", "vm_page_release"] {
        assert_eq!(role_of(name), Role::Stepalloc, "{name}");
    }
    // Raw strings: PyTorch's rules are exact fits with PyTorch's keys only (a list value
    // included); PyTorch's defaults written out are its default; the device's keys and
    // observing ones do not count.
    assert_eq!(role_of("a=exact_fit:True,expandable_segments:False,trace_entries:100"), Role::PytorchDefault);
    assert_eq!(role_of("b=exact_fit:True,roundup_power2_divisions:[256:1,512:2],sim_event_delay_us:5"), Role::Pytorch);
    assert_eq!(role_of("c=max_split_size_mb:128"), Role::Stepalloc);
    assert_eq!(role_of("d=exact_fit:True,expandable_segments:True,page_reuse:True"), Role::Stepalloc);
    assert_eq!(role_of("e="), Role::Stepalloc);
}

/// A report with the figures the verdict reads.
fn run(name: &str, peak_mib: u64, ooms: u64, retries: u64, errors: u64) -> RunReport {
    let mut r = RunReport { name: name.into(), ooms, alloc_retries: retries, errors, ..Default::default() };
    r.worst.peak_reserved = peak_mib << 20;
    r
}

#[test]
fn cases_a_small_run_does_not_reach() {
    let default = run("pytorch", 3000, 0, 2, 0);
    let expandable = run("pytorch_expandable", 2500, 0, 0, 0);
    // stepalloc runs out of memory where PyTorch's settings fit.
    let ours = run("stepalloc", 2900, 1, 1, 0);
    let columns = [(Role::PytorchDefault, &default), (Role::Pytorch, &expandable), (Role::Stepalloc, &ours)];
    assert_eq!(
        verdict(&columns).as_deref(),
        Some(
            "In short: stepalloc ran out of memory 1 time; pytorch (PyTorch's default) did not, peaking at 2.93 GiB \
             reserved; pytorch_expandable (PyTorch's best here) did not, peaking at 2.44 GiB reserved; allocations \
             retried after freeing the cache: stepalloc 1, pytorch 2."
        )
    );
    // Refused calls (not out of memory) keep a column from fitting, and are named.
    let refused = run("pytorch", 3000, 0, 0, 3);
    let ours = run("stepalloc", 2048, 0, 0, 0);
    let columns = [(Role::PytorchDefault, &refused), (Role::Pytorch, &expandable), (Role::Stepalloc, &ours)];
    assert_eq!(
        verdict(&columns).as_deref(),
        Some(
            "In short: stepalloc peaks at 2.00 GiB reserved, 452.0 MiB (18.1%) below pytorch_expandable (PyTorch's \
             best here); pytorch (PyTorch's default) had 3 refused calls."
        )
    );
    // A PyTorch column alone (the best is the default): nothing to set against it.
    assert_eq!(verdict(&[(Role::PytorchDefault, &default)]), None);
    assert_eq!(verdict(&[]), None);
}
