//! Workloads: synthetic event streams generated from a seed.
//! - `agent`: a multimodal agent-training loop (rollouts with a growing KV cache alternating
//!   with training steps), generated from model dimensions;
//! - `colocated`: a rollout engine and a trainer taking turns on one device, under four ways
//!   of sharing it;
//! - `random`: many threads and streams hammering one allocator, with integrity checks.

pub mod agent;
pub mod colocated;
pub mod random;

use rand::RngExt;

/// A sample of a log-normal distribution with the given median, clamped to [lo, hi].
pub fn lognormal<R: rand::Rng>(rng: &mut R, median: f64, sigma: f64, lo: u64, hi: u64) -> u64 {
    // Box–Muller: one standard normal from two uniforms.
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    let x = (median.ln() + sigma * z).exp();
    (x.round() as u64).clamp(lo, hi.max(lo))
}
