//! The C ABI driven from C and C++ programs that dlopen libstepalloc.so and look up every
//! symbol by name, as PyTorch does, on the simulated device. Each scenario runs in its own
//! process (the configuration is fixed at first use) and must print `ok <scenario>`.
//! The programs check the statistics after every misuse and that a further malloc/free works.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn c_program() -> &'static Path {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(|| common::compile("abi_test.c"))
}

fn scenario(name: &str, env: &[(&str, &str)]) -> String {
    let library = common::library().to_str().expect("UTF-8 path");
    let output = common::run(c_program(), &[library, name], env);
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "scenario {name} failed ({}):\n{stdout}\n{stderr}", output.status);
    assert!(stdout.contains(&format!("ok {name}")), "scenario {name} did not finish:\n{stdout}\n{stderr}");
    stdout
}

#[test]
fn many_threads_on_several_streams_and_devices() {
    scenario("threads", &[]);
}

#[test]
fn edge_cases_and_misuse() {
    scenario("edge", &[]);
}

#[test]
fn invalid_configuration_strings() {
    scenario("bad_config", &[]);
}

#[test]
fn a_snapshot_is_built_once_per_measure_and_fill() {
    scenario("snapshot_once", &[]);
}

#[test]
fn invalid_configuration_in_the_environment() {
    scenario("bad_env", &[("STEPALLOC_CONF", "backend:sim,max_split_size_mb:abc")]);
}

#[test]
fn backend_auto_without_a_driver() {
    let out = scenario("no_backend", &[]);
    if out.contains("skip") {
        eprintln!("{out}");
    }
}

#[test]
fn out_of_memory_through_stepalloc_malloc() {
    scenario("oom", &[]);
}

/// `stepalloc_base_alloc` refuses a block of an expandable segment (as PyTorch's
/// `getBaseAllocation` does) instead of returning the reserved range; many streams run out of
/// address space, not memory, and the error says so.
#[test]
fn expandable_segments_have_no_base_allocation_and_name_the_address_space() {
    scenario("expandable", &[]);
}

#[test]
fn mempool_mode_gives_freed_segments_back_and_a_fraction_of_zero_is_accepted() {
    scenario("mempool", &[]);
}

#[test]
fn ipc_shares_in_pytorchs_format_and_refuses_misuse() {
    scenario("ipc", &[]);
}

#[test]
fn sleep_and_wake_regions_pause_resume_and_their_outcomes() {
    scenario("sleep", &[]);
}

#[test]
fn out_of_memory_through_torch_malloc_is_a_cpp_exception_and_pools_work() {
    let program = common::compile("torch_caller.cpp");
    let library = common::library().to_str().expect("UTF-8 path");
    let output = common::run(&program, &[library], &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "torch_caller failed ({}):\n{stdout}\n{stderr}", output.status);
    assert!(stdout.contains("ok torch"), "{stdout}\n{stderr}");
}
