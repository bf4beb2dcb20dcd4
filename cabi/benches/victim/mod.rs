//! The random-victim churn through the C ABI, shared by the `random_victim` bench and the
//! `random_victim` example (the cachegrind driver): free a *random* live block and allocate
//! the same size again, as a real heap does (the freed block's record is then rarely in cache,
//! unlike a bench that frees the block it just allocated). Also what both C ABI benches share:
//! the library loaded as PyTorch loads it (`CAbi`) and the timing of a pair (`median_pair_ns`).
//! `CAbi::load_torch` puts PyTorch's own caching allocator behind the same two calls
//! (`torch_alloc.cpp`, built and run by scripts/torch_victim.sh), so both allocators run one churn.
//!
//! Sizes: 70% up to 64 KiB, 25% above that up to 2 MiB, 5% above that up to 16 MiB.
//! Everything is driven by one xorshift generator, so a run is the same sequence every time.

#![allow(dead_code)] // the benches and the example each use a part

use std::ffi::{c_char, c_int, c_void};
use std::path::Path;
use std::time::Instant;

/// 16 TiB simulated device, so 100 k live blocks fit whatever their sizes.
pub const CONF: &str = "backend:sim,sim_capacity_mb:16777216";
const KIB: u64 = 1024;

/// `CONF`, then `STEPALLOC_VICTIM_CONF` when set (`recommended` names `config::RECOMMENDED`):
/// the configuration every stepalloc library of the run gets.
pub fn conf() -> String {
    match std::env::var("STEPALLOC_VICTIM_CONF") {
        Ok(extra) if extra == "recommended" => format!("{CONF},{}", stepalloc::config::RECOMMENDED),
        Ok(extra) if !extra.is_empty() => format!("{CONF},{extra}"),
        _ => CONF.to_string(),
    }
}

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type ConfigureFn = unsafe extern "C" fn(*const c_char) -> c_int;
type InitFn = unsafe extern "C" fn() -> c_int;

/// libstepalloc.so loaded as PyTorch loads it, configured with `CONF`: `stepalloc_malloc` and
/// `stepalloc_free` looked up by name and called by pointer.
pub struct CAbi {
    malloc: MallocFn,
    free: FreeFn,
    _library: libloading::Library,
}

impl CAbi {
    pub fn load(library: &Path) -> CAbi {
        // Safety: loading our own library runs no initialiser with preconditions.
        let library = unsafe { libloading::Library::new(library) }.expect("dlopen libstepalloc.so");
        // Safety: the symbol types are the header's declarations; the strings are NUL-terminated.
        unsafe {
            let configure = *library.get::<ConfigureFn>(b"stepalloc_configure\0").expect("dlsym");
            let conf = std::ffi::CString::new(conf()).expect("no NUL");
            assert_eq!(configure(conf.as_ptr()), 0, "configure");
            let malloc = *library.get::<MallocFn>(b"stepalloc_malloc\0").expect("dlsym");
            let free = *library.get::<FreeFn>(b"stepalloc_free\0").expect("dlsym");
            CAbi { malloc, free, _library: library }
        }
    }

    /// PyTorch's CUDA caching allocator through `torch_alloc.cpp`'s shim (`libtorch_victim.so`),
    /// called by pointer as `load`'s library is. Needs a CUDA device or testdrv's stub runtime.
    pub fn load_torch(shim: &Path) -> CAbi {
        // Safety: the shim's initialisers are torch's, which need no arguments.
        let library = unsafe { libloading::Library::new(shim) }.expect("dlopen libtorch_victim.so");
        // Safety: the symbol types are torch_alloc.cpp's declarations.
        unsafe {
            let init = *library.get::<InitFn>(b"torch_victim_init\0").expect("dlsym");
            assert_eq!(init(), 0, "torch_victim_init (its message is above)");
            let malloc = *library.get::<MallocFn>(b"torch_victim_malloc\0").expect("dlsym");
            let free = *library.get::<FreeFn>(b"torch_victim_free\0").expect("dlsym");
            CAbi { malloc, free, _library: library }
        }
    }

    #[inline]
    pub fn malloc(&self, size: u64) -> u64 {
        // Safety: the library's malloc with valid arguments; NULL is the default stream.
        let p = unsafe { (self.malloc)(size as usize, 0, std::ptr::null_mut()) };
        assert!(!p.is_null(), "malloc of {size} bytes failed");
        p as u64
    }

    #[inline]
    pub fn free(&self, ptr: u64, size: u64) {
        // Safety: `ptr` came from this library's malloc with this size.
        unsafe { (self.free)(ptr as *mut c_void, size as usize, 0, std::ptr::null_mut()) }
    }
}

/// Median nanoseconds per pair over 21 samples of 20 000 pairs; `pairs(n)` runs n pairs.
pub fn median_pair_ns(mut pairs: impl FnMut(u64)) -> f64 {
    const PAIRS: u64 = 20_000;
    let mut samples: Vec<f64> = (0..21)
        .map(|_| {
            let start = Instant::now();
            pairs(PAIRS);
            start.elapsed().as_nanos() as f64 / PAIRS as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The churn: the library and its live blocks.
pub struct Churn {
    abi: CAbi,
    /// Live blocks: (pointer, size asked for).
    pub live: Vec<(u64, u64)>,
    state: u64,
}

impl Churn {
    pub fn load(library: &Path) -> Churn {
        Churn::new(CAbi::load(library))
    }

    /// The same churn (same seed, so the same sizes and victims) on any allocator.
    pub fn new(abi: CAbi) -> Churn {
        Churn { abi, live: Vec::new(), state: 0x9E37_79B9_7F4A_7C15 }
    }

    #[inline]
    fn next(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }

    /// A request size of the mix.
    fn size(&mut self) -> u64 {
        let x = self.next();
        match x % 100 {
            0..=69 => 1 + (x >> 8) % (64 * KIB),
            70..=94 => 64 * KIB + 1 + (x >> 8) % (2048 * KIB - 64 * KIB),
            _ => 2048 * KIB + 1 + (x >> 8) % (16384 * KIB - 2048 * KIB),
        }
    }

    /// Allocates or frees random blocks until `count` are live.
    pub fn resize(&mut self, count: usize) {
        while self.live.len() < count {
            let size = self.size();
            let p = self.abi.malloc(size);
            self.live.push((p, size));
        }
        while self.live.len() > count {
            let i = (self.next() % self.live.len() as u64) as usize;
            let (p, size) = self.live.swap_remove(i);
            self.abi.free(p, size);
        }
    }

    /// One pair: frees a random live block and allocates the same size again.
    #[inline]
    pub fn pair(&mut self) {
        let i = (self.next() % self.live.len() as u64) as usize;
        let (p, size) = self.live[i];
        self.abi.free(p, size);
        self.live[i] = (self.abi.malloc(size), size);
    }

    pub fn pairs(&mut self, n: u64) {
        for _ in 0..n {
            self.pair();
        }
    }
}
