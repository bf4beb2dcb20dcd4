//! How the cost of growing the heap scales with the blocks already live: N allocations of
//! 8 bytes through the C ABI (`stepalloc_malloc(8, 0, NULL)`), nothing freed, as a loop that
//! builds a large structure of tiny tensors does. Every 2 MiB small-pool page holds 4096 such
//! blocks, so the loop maps a page (expandable segments) or reserves a segment (plain ones)
//! every 4096 allocations; the cost of each must not depend on the blocks live.
//!
//! `live_blocks CONF N...`: for each N, allocates N blocks on a fresh device state (everything
//! freed and the cache emptied between runs) and prints the total time and the time per
//! allocation over the last tenth (where the most blocks are live). CONF is a configuration
//! string (`plain` for none, `recommended` for stepalloc's recommended one).
//!
//! ```text
//! cargo build --release -p stepalloc-cabi --example live_blocks
//! for c in plain expandable_segments:True recommended; do
//!     target/release/examples/live_blocks $c 10000 100000 1000000 1500000; done
//! ```
//!
//! The library is `libstepalloc.so` of the same profile (`STEPALLOC_LIBRARY` overrides it).

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type ConfigureFn = unsafe extern "C" fn(*const c_char) -> c_int;
type EmptyCacheFn = unsafe extern "C" fn();

/// The recommended configuration (`stepalloc::config::RECOMMENDED`; this crate does not link
/// the core as Rust).
const RECOMMENDED: &str = "expandable_segments:True,large_segment_size_mb:2,page_reuse:True,big_page_mb:16,\
                           pack_small:True,close_holes:True,param_lane:True";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: live_blocks CONF N...  (CONF: plain, recommended or key:value,...)";
    let Some(conf) = args.get(1) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let mut counts = Vec::new();
    for a in &args[2..] {
        match a.parse::<usize>() {
            Ok(n) if n > 0 => counts.push(n),
            _ => {
                eprintln!("live_blocks: N ({a}) must be a positive integer; {usage}");
                return ExitCode::from(2);
            }
        }
    }
    let settings = match conf.as_str() {
        "plain" => String::new(),
        "recommended" => RECOMMENDED.to_string(),
        other => other.to_string(),
    };
    let library = std::env::var_os("STEPALLOC_LIBRARY").map(PathBuf::from).unwrap_or_else(|| {
        // target/<profile>/examples/live_blocks -> target/<profile>/libstepalloc.so
        let exe = std::env::current_exe().expect("current_exe");
        exe.parent().and_then(|p| p.parent()).expect("target/<profile>/examples").join("libstepalloc.so")
    });
    // Safety: loading our own library runs no initialiser with preconditions; the symbol types
    // are the header's declarations and the configuration string is NUL-terminated.
    let (malloc, free, empty_cache, _library) = unsafe {
        let library = libloading::Library::new(&library).expect("dlopen libstepalloc.so");
        let configure = *library.get::<ConfigureFn>(b"stepalloc_configure\0").expect("dlsym");
        let text = std::ffi::CString::new(format!("backend:sim,{settings}")).expect("no NUL");
        if configure(text.as_ptr()) != 0 {
            eprintln!("live_blocks: configuration `{settings}` refused");
            return ExitCode::from(2);
        }
        let malloc = *library.get::<MallocFn>(b"stepalloc_malloc\0").expect("dlsym");
        let free = *library.get::<FreeFn>(b"stepalloc_free\0").expect("dlsym");
        let empty_cache = *library.get::<EmptyCacheFn>(b"stepalloc_empty_cache\0").expect("dlsym");
        (malloc, free, empty_cache, library)
    };
    for n in counts {
        let mut live = Vec::with_capacity(n);
        let tail = n - n / 10;
        let start = Instant::now();
        let mut tail_start = start;
        for i in 0..n {
            if i == tail {
                tail_start = Instant::now();
            }
            // Safety: the library's malloc with valid arguments; NULL is the default stream.
            let p = unsafe { malloc(8, 0, std::ptr::null_mut()) };
            assert!(!p.is_null(), "allocation {i} of 8 bytes failed");
            live.push(p);
        }
        let total = start.elapsed();
        let per_tail = tail_start.elapsed().as_nanos() as f64 / (n - tail) as f64;
        println!("{conf}: {n} live blocks in {:.3} s; last tenth {per_tail:.0} ns per allocation", total.as_secs_f64());
        for p in live {
            // Safety: `p` came from this library's malloc of 8 bytes on the default stream.
            unsafe { free(p, 8, 0, std::ptr::null_mut()) };
        }
        // Safety: takes no arguments; the library is configured.
        unsafe { empty_cache() };
    }
    ExitCode::SUCCESS
}
