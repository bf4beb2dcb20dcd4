//! The `agent` workload: a multimodal agent-training loop generated from model dimensions.
//!
//! Shape (every dimension is a flag, presets give defaults):
//! - weights allocated once (decoder, vision encoder, projector, LoRA adapters);
//! - rollout steps (`step_begin("rollout")`): a batch of episodes generated in lockstep, each of
//!   1–3 turns; a turn runs the vision encoder (no grad) over the turn's images at their
//!   resolution, prefills the new tokens and decodes the response token by token; the KV cache
//!   (one K and one V tensor per layer) is reallocated in chunks as the sequence grows and freed
//!   when the episode ends; image pixels arrive on a copy stream (`record_stream` onto compute);
//! - training steps (`step_begin("train")`): a no-grad log-prob pass, then micro-batches of the
//!   episodes' sequences (packed, so lengths vary) through forward (saved activations per layer,
//!   or only layer inputs under gradient checkpointing, with recomputation in backward) and
//!   backward; gradients live until the optimizer step; optimizer state (Adam, fp32 moments)
//!   is created at the first step and kept;
//! - the `llm-7b-sft` preset has no rollouts: text-only SFT steps with padded batches of
//!   variable lengths and a periodic no-grad evaluation step (`step_begin("eval")`).
//!
//! Determinism: the same spec and seed give the same event stream (one seeded generator, no
//! hash-map iteration).
//!
//! Several devices (`--devices N`): N data-parallel ranks in lockstep, rank r with seed
//! `seed + r` on device r (`AgentStream`); each device sees exactly its rank's events alone.
//! Each step's GPU compute time is modelled from the same shapes as it is generated (`time`):
//! `AgentStream::step_compute_s` hands it to the runner, which sets the driver's time against it.
//!
//! The parts: `spec` (the dimensions and presets), `model` (the model's shapes and its
//! weights), `forward` (passes without grad), `rollout` (the rollout step: sampled episodes,
//! prefill and decoding with the KV cache), `train` (a micro-batch's forward and backward, the
//! optimizer step), `phases` (which steps an iteration runs, the training and evaluation
//! steps), `stream` (the iteration-at-a-time stream and the ranks in lockstep), `time` (each
//! step's modelled compute time). This file holds the entry points and the generator's state.

mod forward;
mod model;
mod phases;
mod rollout;
mod spec;
mod stream;
pub mod time;
mod train;

pub use spec::{AgentArgs, AgentSpec, Optimizer, Preset};
pub use stream::AgentStream;
pub use time::Gpu;

use crate::ops::{Program, ProgramBuilder};
use model::Trainable;
use rand::SeedableRng;
use rand_xorshift::XorShiftRng;

const COMPUTE: u64 = 0;
/// The host-to-device copy stream of the data loader.
const COPY: u64 = 7;

/// Generates the whole event stream of `spec` as one program (for exports, headroom and tests;
/// runs use `AgentStream`, which never holds more than an iteration). Errors: a dimension out
/// of its range (`AgentSpec::validate`), or a program over the bounds of `ops`
/// (`ops::MAX_OPS` events), named with the iteration where it was reached.
pub fn generate(spec: &AgentSpec) -> Result<Program, String> {
    generate_within(spec, crate::ops::MAX_OPS)
}

/// `generate` with at most `max_ops` events (below `ops::MAX_OPS`).
pub fn generate_within(spec: &AgentSpec, max_ops: usize) -> Result<Program, String> {
    spec.validate()?;
    if spec.devices > 1 {
        return stream::generate_ranks(spec, max_ops);
    }
    let mut g = Gen::new(spec);
    g.b = std::mem::take(&mut g.b).with_max_ops(max_ops);
    g.weights();
    for i in 0..spec.iterations {
        g.iteration(i);
        if let Some(e) = g.b.limit_error() {
            return Err(format!(
                "the agent workload is too large: {e} (reached in iteration {} of {}); lower --iterations or the \
                 workload's dimensions",
                i + 1,
                spec.iterations
            ));
        }
    }
    g.b.finish().map_err(|e| format!("the agent workload is too large: {e}"))
}

/// The workload's name in reports: its preset and seed, and with several devices their seeds.
pub fn stream_name(spec: &AgentSpec) -> String {
    if spec.devices > 1 {
        format!(
            "agent {} (seeds {}..={}, one per device, {} devices)",
            spec.preset,
            spec.seed,
            spec.seed.wrapping_add(spec.devices - 1),
            spec.devices
        )
    } else {
        format!("agent {} (seed {})", spec.preset, spec.seed)
    }
}

/// One rank's generator: the program it builds, its random draws, its trainable tensors and
/// optimizer state, and its step clock. Its steps are in `phases`, `rollout` and `train`.
struct Gen<'a> {
    s: &'a AgentSpec,
    /// The rank's device (0 on one device).
    device: u16,
    b: ProgramBuilder,
    rng: XorShiftRng,
    trainables: Vec<Trainable>,
    /// Adam moments, created at the first optimizer step and kept.
    optimizer_state: Vec<u32>,
    /// Modelled compute time of the steps (`time`).
    clock: time::StepClock,
    shapes: time::Shapes,
}

impl<'a> Gen<'a> {
    fn new(s: &'a AgentSpec) -> Gen<'a> {
        Gen::rank(s, 0)
    }

    /// Rank `rank`: device `rank`, seed `s.seed + rank` (wrapping).
    fn rank(s: &'a AgentSpec, rank: u16) -> Gen<'a> {
        Gen {
            s,
            device: rank,
            b: ProgramBuilder::new(&format!("agent {} (seed {})", s.preset, s.seed)),
            rng: XorShiftRng::seed_from_u64(s.seed.wrapping_add(u64::from(rank))),
            trainables: Vec::new(),
            optimizer_state: Vec::new(),
            clock: time::StepClock::new(s.gpu),
            shapes: time::Shapes::of(s),
        }
    }

    /// Closes a step of the program and of the step clock.
    pub(super) fn end_step(&mut self) {
        self.b.step_end();
        self.clock.end_step();
    }

    pub(super) fn alloc(&mut self, bytes: u64) -> u32 {
        self.b.alloc(bytes, COMPUTE, self.device)
    }

    pub(super) fn free(&mut self, id: u32) {
        self.b.free(id);
    }
}
