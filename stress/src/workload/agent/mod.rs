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

mod spec;
pub mod time;

pub use spec::{AgentArgs, AgentSpec, Optimizer, Preset};
pub use time::Gpu;

use super::lognormal;
use crate::ops::{Op, Program, ProgramBuilder, SourceNotes};
use crate::replay::{Chunk, OpSource};
use rand::{RngExt, SeedableRng};
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
        return generate_ranks(spec, max_ops);
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

/// `generate` of several ranks: the lockstep stream's chunks gathered into one program.
fn generate_ranks(spec: &AgentSpec, max_ops: usize) -> Result<Program, String> {
    let mut stream = AgentStream::within(spec, max_ops)?;
    let mut ops = Vec::new();
    while let Some((chunk, _)) = stream.next_chunk()? {
        if ops.len().saturating_add(chunk.len()) > max_ops {
            return Err(format!(
                "the agent workload is too large: more than {max_ops} events over its {} devices; lower --iterations, \
                 --devices or the workload's dimensions",
                spec.devices
            ));
        }
        ops.extend_from_slice(chunk);
    }
    Ok(Program {
        ops,
        phases: stream.phases.clone(),
        ids: stream.ids(),
        devices: stream.devices(),
        notes: SourceNotes { format: stream_name(spec), ..Default::default() },
    })
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

/// The agent workload generated one iteration at a time, as the runner consumes it: memory is
/// one iteration's events (the bound of `ops::MAX_OPS` applies per iteration, over all ranks:
/// each rank has an equal share), whatever `--iterations`. Same spec, same events as `generate`.
///
/// With `devices` > 1 it runs one rank per device in lockstep, as data-parallel ranks do: rank
/// `r` is the workload with seed `seed + r` on device `r`; every step's events of every rank
/// lie between the same step markers (see `lockstep`), so each device sees exactly the events,
/// in the same order and steps, as that rank run alone on one device.
pub struct AgentStream<'a> {
    /// One generator per rank; rank `r` allocates on device `r`.
    ranks: Vec<Gen<'a>>,
    next_iteration: u64,
    /// Chunks generated ahead: the weights and the first iteration (to estimate the total).
    ready: std::collections::VecDeque<Vec<Op>>,
    chunk: Vec<Op>,
    /// The merged stream's phases (several ranks; one rank hands out its builder's).
    phases: Vec<String>,
    /// Several ranks: each step's modelled compute time, the slowest rank's (data-parallel
    /// ranks wait for each other at every step); one rank hands out its own clock's.
    step_compute: Vec<f64>,
    len_hint: u64,
}

impl<'a> AgentStream<'a> {
    pub fn new(spec: &'a AgentSpec) -> Result<AgentStream<'a>, String> {
        AgentStream::within(spec, crate::ops::MAX_OPS)
    }

    /// A stream whose chunks (the weights, each iteration) hold at most `max_ops` events, over
    /// all ranks: each rank holds at most `max_ops / devices`.
    pub fn within(spec: &'a AgentSpec, max_ops: usize) -> Result<AgentStream<'a>, String> {
        spec.validate()?;
        // Validated: 1..=ops::MAX_DEVICES.
        let devices = u16::try_from(spec.devices).unwrap_or(1);
        let max_ops = (max_ops / usize::from(devices)).max(1);
        let mut stream = AgentStream {
            ranks: Vec::with_capacity(devices as usize),
            next_iteration: 0,
            ready: std::collections::VecDeque::new(),
            chunk: Vec::new(),
            phases: Vec::new(),
            step_compute: Vec::new(),
            len_hint: 0,
        };
        let mut weights = Vec::with_capacity(devices as usize);
        for rank in 0..devices {
            let mut g = Gen::rank(spec, rank);
            g.b = std::mem::take(&mut g.b).with_max_ops(max_ops);
            g.weights();
            if let Some(e) = g.b.limit_error() {
                return Err(format!("the agent workload's weights are too many: {}", shared(e, devices)));
            }
            weights.push(g.b.take_ops());
            stream.ranks.push(g);
        }
        let weights = stream.merge(weights)?;
        stream.len_hint = weights.len() as u64;
        stream.ready.push_back(weights);
        if spec.iterations > 0 {
            let first = stream.iteration()?;
            stream.len_hint = stream.len_hint.saturating_add((first.len() as u64).saturating_mul(spec.iterations));
            stream.ready.push_back(first);
        }
        Ok(stream)
    }

    fn iteration(&mut self) -> Result<Vec<Op>, String> {
        let i = self.next_iteration;
        self.next_iteration += 1;
        let mut chunks = Vec::with_capacity(self.ranks.len());
        let devices = self.ranks.len() as u16;
        for g in &mut self.ranks {
            g.iteration(i);
            if let Some(e) = g.b.limit_error() {
                return Err(format!(
                    "iteration {} of the agent workload is too large: {}; lower the workload's dimensions",
                    i + 1,
                    shared(e, devices)
                ));
            }
            chunks.push(g.b.take_ops());
        }
        if self.ranks.len() > 1 {
            // The steps this iteration added, each the slowest rank's (ranks run in lockstep).
            let steps = self.ranks.iter().map(|g| g.clock.steps.len()).max().unwrap_or(0);
            for k in self.step_compute.len()..steps {
                let slowest = self.ranks.iter().filter_map(|g| g.clock.steps.get(k)).fold(0.0, |a: f64, &b| a.max(b));
                self.step_compute.push(slowest);
            }
        }
        self.merge(chunks)
    }

    /// One chunk per rank into the stream's chunk: one rank's as it is, several in lockstep.
    fn merge(&mut self, mut chunks: Vec<Vec<Op>>) -> Result<Vec<Op>, String> {
        if chunks.len() == 1 {
            return Ok(chunks.pop().unwrap_or_default());
        }
        lockstep(&chunks, &self.ranks, &mut self.phases)
    }

    /// Ids handed out so far (every id of the merged stream is below it).
    fn ids(&self) -> u32 {
        let most = self.ranks.iter().map(|g| g.b.ids()).max().unwrap_or(0);
        most.saturating_mul(self.ranks.len() as u32)
    }
}

/// A rank's bound error, saying that the bound is shared by the devices.
fn shared(e: &str, devices: u16) -> String {
    if devices > 1 {
        format!("{e} (each of its {devices} devices has 1/{devices} of it: lower --devices)")
    } else {
        e.to_string()
    }
}

impl OpSource for AgentStream<'_> {
    fn next_chunk(&mut self) -> Result<Option<Chunk<'_>>, String> {
        self.chunk = match self.ready.pop_front() {
            Some(chunk) => chunk,
            None if self.next_iteration < self.ranks[0].s.iterations => self.iteration()?,
            None => return Ok(None),
        };
        let phases = if self.ranks.len() == 1 { self.ranks[0].b.phases() } else { &self.phases };
        Ok(Some((&self.chunk, phases)))
    }

    fn len_hint(&self) -> u64 {
        self.len_hint
    }

    fn devices(&self) -> u16 {
        self.ranks.len() as u16
    }

    fn step_compute_s(&self) -> &[f64] {
        if self.ranks.len() == 1 {
            &self.ranks[0].clock.steps
        } else {
            &self.step_compute
        }
    }
}

/// A step marker of one rank: `Some(phase)` a step begins, `None` a step ends.
type Marker<'p> = Option<&'p str>;

/// Interleaves one chunk of every rank in lockstep: each rank's events up to its next step
/// marker, in rank order, then that marker once, so every device's events stay between the
/// same step boundaries as when its rank runs alone. Rank `r`'s id `i` becomes `i * ranks + r`
/// (dense, and no two ranks share one). Every rank must reach the same markers: the phase
/// sequence of the workload does not depend on its seed.
fn lockstep(chunks: &[Vec<Op>], ranks: &[Gen], phases: &mut Vec<String>) -> Result<Vec<Op>, String> {
    let n = chunks.len() as u32;
    let remap = |id: u32, rank: usize| {
        id.checked_mul(n).and_then(|v| v.checked_add(rank as u32)).ok_or_else(|| {
            format!("the agent workload is too large: more than {} blocks live at once over {n} devices", u32::MAX)
        })
    };
    let mut out = Vec::with_capacity(chunks.iter().map(Vec::len).sum());
    let mut pos = vec![0usize; chunks.len()];
    loop {
        // `None`: every rank reached the end of its chunk.
        let mut first: Option<Marker> = None;
        for (r, chunk) in chunks.iter().enumerate() {
            let rest = &chunk[pos[r]..];
            let k = rest.iter().position(|op| matches!(op, Op::StepBegin { .. } | Op::StepEnd)).unwrap_or(rest.len());
            for &op in &rest[..k] {
                out.push(match op {
                    Op::Alloc { id, size, stream, device } => Op::Alloc { id: remap(id, r)?, size, stream, device },
                    Op::Free { id } => Op::Free { id: remap(id, r)? },
                    Op::RecordStream { id, stream } => Op::RecordStream { id: remap(id, r)?, stream },
                    other => other,
                });
            }
            pos[r] += k;
            let this: Option<Marker> = match chunk.get(pos[r]) {
                Some(Op::StepBegin { phase }) => {
                    Some(Some(ranks[r].b.phases().get(*phase as usize).map_or("step", String::as_str)))
                }
                Some(_) => Some(None),
                None => None,
            };
            if r == 0 {
                first = this;
            } else if this != first {
                return Err(format!(
                    "the agent workload's ranks are out of step: rank {r} reaches {} where rank 0 reaches {}",
                    describe(this),
                    describe(first)
                ));
            }
        }
        match first {
            None => return Ok(out),
            Some(None) => out.push(Op::StepEnd),
            Some(Some(name)) => {
                let index = match phases.iter().position(|p| p == name) {
                    Some(i) => i,
                    None => {
                        phases.push(name.to_string());
                        phases.len() - 1
                    }
                };
                // Each rank's builder bounds its phases (MAX_PHASES), and the ranks share them.
                let phase = u16::try_from(index).map_err(|_| format!("more than {} phases", u16::MAX))?;
                out.push(Op::StepBegin { phase });
            }
        }
        for p in &mut pos {
            *p += 1;
        }
    }
}

fn describe(marker: Option<Marker>) -> String {
    match marker {
        None => "the end of the iteration".into(),
        Some(None) => "a step end".into(),
        Some(Some(phase)) => format!("a `{phase}` step"),
    }
}

/// A sequence of a finished episode, as training sees it.
#[derive(Clone, Debug)]
struct Sequence {
    tokens: u64,
    /// Image token counts (one per image).
    images: Vec<u64>,
}

/// A trainable tensor: its parameter elements (grads and optimizer state follow from it).
struct Trainable {
    elements: u64,
    /// Bytes per element of the parameter and its gradient.
    grad_bytes: u64,
}

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
    fn end_step(&mut self) {
        self.b.step_end();
        self.clock.end_step();
    }

    /// Charges a training or no-grad pass of the decoder over `seqs` (sequence lengths): the
    /// layers below the first trained one forward only, the trained ones forward and
    /// `backward` (a multiple of their forward, 0 without grad), the LM head over every token
    /// forward and, with a backward, its input gradient.
    fn charge_decoder(&mut self, seqs: impl Iterator<Item = u64> + Clone, backward: f64) {
        let sh = &self.shapes;
        let layers = self.s.layers as f64;
        let frozen = if backward > 0.0 { self.first_trainable_layer() as f64 } else { layers };
        let mut flops = 0.0;
        for len in seqs.clone() {
            let len = len as f64;
            flops += sh.decoder_forward(1.0, len, 0.0, frozen)
                + (1.0 + backward) * sh.decoder_forward(1.0, len, 0.0, layers - frozen);
        }
        let tokens: f64 = seqs.map(|l| l as f64).sum();
        let head = if backward > 0.0 { 2.0 } else { 1.0 };
        flops += head * sh.head_forward(tokens);
        let bytes = (1.0 + backward) * sh.weight_bytes();
        self.clock.pass(flops, bytes);
    }

    fn alloc(&mut self, bytes: u64) -> u32 {
        self.b.alloc(bytes, COMPUTE, self.device)
    }

    fn free(&mut self, id: u32) {
        self.b.free(id);
    }

    fn kv_width(&self) -> u64 {
        self.s.hidden / self.s.heads * self.s.kv_heads
    }

    /// (in, out) of every projection of a decoder layer.
    fn decoder_mats(&self) -> [(u64, u64); 7] {
        let (h, kv, i) = (self.s.hidden, self.kv_width(), self.s.intermediate);
        [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    }

    fn first_trainable_layer(&self) -> u64 {
        match self.s.optimizer {
            Optimizer::Partial => self.s.layers.saturating_sub(self.s.trainable_layers),
            _ => 0,
        }
    }

    /// Iteration `i` (0-based): a rollout and a training step, or an SFT step and maybe an
    /// evaluation.
    fn iteration(&mut self, i: u64) {
        if self.s.rollout {
            let seqs = self.rollout_step();
            self.train_step_rl(&seqs);
        } else {
            self.train_step_sft();
            if self.s.eval_every > 0 && (i + 1) % self.s.eval_every == 0 {
                self.eval_step();
            }
        }
    }

    // ----- weights ---------------------------------------------------------------------------

    fn weights(&mut self) {
        let s = self.s;
        let e = s.dtype_bytes;
        self.alloc(s.vocab * s.hidden * e); // embedding
        let first_trainable = self.first_trainable_layer();
        for layer in 0..s.layers {
            self.alloc(s.hidden * e); // input norm
            for (fan_in, fan_out) in self.decoder_mats() {
                self.alloc(fan_in * fan_out * e);
                match s.optimizer {
                    Optimizer::Lora => {
                        // Adapters A (r x in) and B (out x r), fp32.
                        for n in [s.lora_rank * fan_in, fan_out * s.lora_rank] {
                            self.alloc(n * 4);
                            self.trainables.push(Trainable { elements: n, grad_bytes: 4 });
                        }
                    }
                    Optimizer::Partial if layer < first_trainable => {}
                    Optimizer::Partial | Optimizer::Full => {
                        self.trainables.push(Trainable { elements: fan_in * fan_out, grad_bytes: e })
                    }
                }
            }
            self.alloc(s.hidden * e); // post-attention norm
        }
        self.alloc(s.hidden * e); // final norm
        self.alloc(s.vocab * s.hidden * e); // lm head
        if s.vision {
            let (vh, vi) = (s.vision_hidden, s.vision_intermediate);
            self.alloc(3 * s.patch * s.patch * vh * e); // patch embedding
            let max_res = s.resolutions.iter().copied().max().unwrap_or(336);
            self.alloc(((max_res / s.patch).pow(2) + 1) * vh * e); // position embedding
            for _ in 0..s.vision_layers {
                for (n, bias) in [(vh * 3 * vh, 3 * vh), (vh * vh, vh), (vh * vi, vi), (vi * vh, vh)] {
                    self.alloc(n * e);
                    self.alloc(bias * e);
                    if s.train_vision {
                        self.trainables.push(Trainable { elements: n, grad_bytes: e });
                    }
                }
                self.alloc(2 * vh * e); // norms
                self.alloc(2 * vh * e);
            }
            // Projector: a two-layer MLP from the vision width to the decoder width.
            self.alloc(vh * s.hidden * e);
            self.alloc(s.hidden * s.hidden * e);
        }
    }

    // ----- sampling ------------------------------------------------------------------------

    fn image_tokens(&mut self) -> u64 {
        let s = self.s;
        let r = s.resolutions[self.rng.random_range(0..s.resolutions.len())];
        (r / s.patch).pow(2)
    }

    fn images(&mut self, first_turn: bool) -> Vec<u64> {
        let s = self.s;
        if !s.vision {
            return Vec::new();
        }
        let n = if first_turn {
            self.rng.random_range(s.images_min..=s.images_max)
        } else {
            // A tool observation is a screenshot about a third of the time.
            u64::from(self.rng.random_bool(0.3))
        };
        (0..n).map(|_| self.image_tokens()).collect()
    }

    fn response_len(&mut self) -> u64 {
        let s = self.s;
        let u: f64 = self.rng.random();
        s.response_min + ((s.response_max - s.response_min) as f64 * u * u) as u64
    }

    // ----- vision encoder ------------------------------------------------------------------

    /// Encodes one image of `n` patches without grad; returns the projected embeddings.
    fn vision_forward_nograd(&mut self, n: u64) -> u32 {
        let s = self.s;
        let e = s.dtype_bytes;
        let (flops, bytes) = self.shapes.vision_forward(n as f64);
        self.clock.pass(flops, bytes);
        let side = (n as f64).sqrt() as u64 * s.patch;
        // Pixels arrive on the copy stream and are handed to the compute stream.
        let pixels = self.b.alloc(3 * side * side * e, COPY, self.device);
        self.b.record_stream(pixels, COMPUTE);
        let mut x = self.alloc((n + 1) * s.vision_hidden * e);
        self.free(pixels);
        for _ in 0..s.vision_layers {
            x = self.vision_layer_nograd(n + 1, x);
        }
        let mid = self.alloc(n * s.hidden * e);
        self.free(x);
        let out = self.alloc(n * s.hidden * e);
        self.free(mid);
        out
    }

    fn vision_layer_nograd(&mut self, n: u64, input: u32) -> u32 {
        let (vh, vi, e) = (self.s.vision_hidden, self.s.vision_intermediate, self.s.dtype_bytes);
        let norm = self.alloc(n * vh * e);
        let qkv = self.alloc(n * 3 * vh * e);
        self.free(norm);
        let attn = self.alloc(n * vh * e);
        self.free(qkv);
        let res = self.alloc(n * vh * e);
        self.free(attn);
        self.free(input);
        let fc1 = self.alloc(n * vi * e);
        let out = self.alloc(n * vh * e);
        self.free(fc1);
        self.free(res);
        out
    }

    /// Trained vision encoder: saves every layer's activations for backward.
    fn vision_forward_train(&mut self, n: u64, saved: &mut Vec<(u32, u64)>) -> u32 {
        let s = self.s;
        let (vh, vi, e) = (s.vision_hidden, s.vision_intermediate, s.dtype_bytes);
        // Forward, then (in `micro_batch`'s backward) activation and weight gradients: 3x.
        let (flops, bytes) = self.shapes.vision_forward(n as f64);
        self.clock.pass(3.0 * flops, 3.0 * bytes);
        let side = (n as f64).sqrt() as u64 * s.patch;
        let pixels = self.b.alloc(3 * side * side * e, COPY, self.device);
        self.b.record_stream(pixels, COMPUTE);
        let n = n + 1;
        saved.push((self.alloc(n * vh * e), n * vh * e));
        self.free(pixels);
        for _ in 0..s.vision_layers {
            for bytes in [n * vh * e, n * 3 * vh * e, n * vh * e, n * vh * e, n * vh * e, n * vi * e, n * vi * e] {
                saved.push((self.alloc(bytes), bytes));
            }
        }
        self.alloc((n - 1) * s.hidden * e)
    }

    // ----- decoder ---------------------------------------------------------------------------

    /// One decoder layer over `t` tokens without grad (prefill, log-probs, eval, frozen layers).
    fn layer_nograd(&mut self, t: u64, input: u32) -> u32 {
        let s = self.s;
        let (h, kv, i, e) = (s.hidden, self.kv_width(), s.intermediate, s.dtype_bytes);
        let norm = self.alloc(t * h * e);
        let qkv = self.alloc(t * (h + 2 * kv) * e);
        self.free(norm);
        let attn = self.alloc(t * h * e);
        self.free(qkv);
        let res = self.alloc(t * h * e);
        self.free(attn);
        self.free(input);
        let gate_up = self.alloc(t * 2 * i * e);
        let act = self.alloc(t * i * e);
        self.free(gate_up);
        let out = self.alloc(t * h * e);
        self.free(act);
        self.free(res);
        out
    }

    /// Sizes of the tensors one decoder layer saves for backward over `t` tokens.
    fn layer_saved_sizes(&self, t: u64) -> Vec<u64> {
        let s = self.s;
        let (h, kv, i, e) = (s.hidden, self.kv_width(), s.intermediate, s.dtype_bytes);
        let mut v = vec![
            t * 4,           // rms statistics (fp32)
            t * h * e,       // normed input
            t * h * e,       // q
            t * kv * e,      // k
            t * kv * e,      // v
            t * h * e,       // attention output
            t * s.heads * 4, // softmax log-sum-exp (fp32)
            t * h * e,       // residual
            t * 4,
            t * h * e, // normed
            t * i * e, // gate
            t * i * e, // up
            t * i * e, // silu(gate)
            t * i * e, // product
        ];
        if s.optimizer == Optimizer::Lora {
            // x @ A for every adapted projection.
            v.extend(std::iter::repeat_n(t * s.lora_rank * e, 7));
        }
        v
    }

    /// Forward of one trained layer. Without checkpointing its activations are appended to
    /// `saved`; with checkpointing they are freed and only the input stays (in `saved`).
    fn layer_forward_train(&mut self, t: u64, input: u32, saved: &mut Vec<u32>) -> u32 {
        let e = self.s.dtype_bytes;
        let sizes = self.layer_saved_sizes(t);
        let ids: Vec<u32> = sizes.iter().map(|&b| self.alloc(b)).collect();
        let out = self.alloc(t * self.s.hidden * e);
        if self.s.grad_checkpointing {
            for id in ids {
                self.free(id);
            }
        } else {
            saved.extend(ids);
        }
        saved.push(input);
        out
    }

    /// Backward of one trained layer: recompute (checkpointing), gradients per saved tensor
    /// freed as it is consumed, weight gradients on the first micro-batch.
    fn layer_backward(&mut self, t: u64, saved: &mut Vec<u32>, grad_out: u32, grads: &mut Vec<u32>, layer: u64) -> u32 {
        let s = self.s;
        let e = s.dtype_bytes;
        let input = saved.pop();
        let sizes = self.layer_saved_sizes(t);
        let acts: Vec<u32> = if s.grad_checkpointing {
            sizes.iter().map(|&b| self.alloc(b)).collect()
        } else {
            let n = sizes.len();
            saved.split_off(saved.len() - n)
        };
        let mut grad = grad_out;
        for (&act, &bytes) in acts.iter().zip(&sizes).rev() {
            if bytes > t * 8 {
                let g = self.alloc(bytes);
                self.free(grad);
                grad = g;
            }
            self.free(act);
        }
        if grads.len() < self.trainables_of_layer_end(layer) {
            self.layer_weight_grads(layer, grads);
        }
        let grad_in = self.alloc(t * s.hidden * e);
        self.free(grad);
        if let Some(input) = input {
            self.free(input);
        }
        grad_in
    }

    /// Trainables are pushed layer by layer for the decoder: index range of `layer`'s.
    fn trainables_per_layer(&self) -> usize {
        match self.s.optimizer {
            Optimizer::Lora => 14,
            Optimizer::Partial | Optimizer::Full => 7,
        }
    }

    fn trainables_of_layer_end(&self, layer: u64) -> usize {
        let first = self.first_trainable_layer();
        if layer < first {
            return 0;
        }
        // Gradients are created from the last layer down, so layer L's are complete once
        // (layers - L) layers' worth exist.
        ((self.s.layers - layer) as usize) * self.trainables_per_layer()
    }

    fn layer_weight_grads(&mut self, layer: u64, grads: &mut Vec<u32>) {
        let per = self.trainables_per_layer();
        let base = (layer - self.first_trainable_layer()) as usize * per;
        for k in 0..per {
            let (n, gb) = match self.trainables.get(base + k) {
                Some(tr) => (tr.elements, tr.grad_bytes),
                None => continue,
            };
            grads.push(self.alloc(n * gb));
        }
    }

    /// Logits (bf16 and their fp32 copy) and the loss over `t` tokens; returns what backward
    /// needs (the fp32 logits) after freeing the rest.
    fn logits_and_loss(&mut self, t: u64, hidden: u32) -> (u32, u32) {
        let s = self.s;
        let norm = self.alloc(t * s.hidden * s.dtype_bytes);
        self.free(hidden);
        let logits = self.alloc(t * s.vocab * s.dtype_bytes);
        let logits32 = self.alloc(t * s.vocab * 4);
        self.free(logits);
        let loss = self.alloc(t * 4);
        self.free(loss);
        (norm, logits32)
    }

    /// Forward without grad over sequences of the lengths `seqs` (`t` tokens in all) with the
    /// output logits freed at once (log-probs, evaluation).
    fn forward_nograd(&mut self, seqs: &[u64]) {
        let s = self.s;
        let t = seqs.iter().sum();
        self.charge_decoder(seqs.iter().copied(), 0.0);
        let mut x = self.alloc(t * s.hidden * s.dtype_bytes);
        for _ in 0..s.layers {
            x = self.layer_nograd(t, x);
        }
        let (norm, logits32) = self.logits_and_loss(t, x);
        let logp = self.alloc(t * 4);
        self.free(logits32);
        self.free(norm);
        self.free(logp);
    }

    /// One micro-batch of sequences of the lengths `seqs` (`t` tokens in all; with `images`
    /// image token counts) forward and backward.
    fn micro_batch(&mut self, seqs: &[u64], images: &[u64], grads: &mut Vec<u32>) {
        let s = self.s;
        let e = s.dtype_bytes;
        let t = seqs.iter().sum();
        let backward = time::backward_factor(s.optimizer, s.grad_checkpointing);
        self.charge_decoder(seqs.iter().copied(), backward);
        // Vision: frozen encoders run without grad; trained ones keep activations.
        let mut vision_saved = Vec::new();
        let mut image_embeds = Vec::new();
        for &n in images {
            let out = if s.train_vision {
                self.vision_forward_train(n, &mut vision_saved)
            } else {
                self.vision_forward_nograd(n)
            };
            image_embeds.push(out);
        }
        let mut x = self.alloc(t * s.hidden * e); // input embeddings (text + image tokens)
        for id in image_embeds {
            self.free(id);
        }
        let first = self.first_trainable_layer();
        let mut saved = Vec::new();
        for layer in 0..s.layers {
            x = if layer < first { self.layer_nograd(t, x) } else { self.layer_forward_train(t, x, &mut saved) };
        }
        let (norm, logits32) = self.logits_and_loss(t, x);
        // Backward.
        let dlogits = self.alloc(t * s.vocab * 4);
        self.free(logits32);
        let mut grad = self.alloc(t * s.hidden * e);
        self.free(dlogits);
        self.free(norm);
        for layer in (first..s.layers).rev() {
            grad = self.layer_backward(t, &mut saved, grad, grads, layer);
        }
        self.free(grad);
        // The vision encoder's backward (when trained) frees its activations in reverse.
        // Gradients of the same size as each saved activation, freed as they are consumed.
        let mut grad = None;
        while let Some((id, bytes)) = vision_saved.pop() {
            let g = self.alloc(bytes);
            if let Some(previous) = grad.replace(g) {
                self.free(previous);
            }
            self.free(id);
        }
        if let Some(g) = grad {
            self.free(g);
        }
        if s.train_vision && grads.len() < self.trainables.len() {
            let start = grads.len();
            for k in start..self.trainables.len() {
                let bytes = self.trainables[k].elements * self.trainables[k].grad_bytes;
                grads.push(self.alloc(bytes));
            }
        }
    }

    /// Adam: moments created at the first step and kept; a temporary per tensor; then the
    /// gradients are dropped (`zero_grad(set_to_none=True)`).
    fn optimizer_step(&mut self, grads: Vec<u32>) {
        let bytes: f64 =
            self.trainables.iter().map(|t| t.elements as f64 * time::adam_bytes_per_element(t.grad_bytes)).sum();
        self.clock.pass(0.0, bytes);
        if self.optimizer_state.is_empty() {
            for k in 0..self.trainables.len() {
                let n = self.trainables[k].elements;
                let m = self.alloc(n * 4);
                let v = self.alloc(n * 4);
                self.optimizer_state.extend([m, v]);
            }
        }
        for k in 0..self.trainables.len() {
            let tmp = self.alloc(self.trainables[k].elements * 4);
            self.free(tmp);
        }
        for g in grads {
            self.free(g);
        }
    }

    // ----- steps ---------------------------------------------------------------------------

    fn ensure_kv(&mut self, kv: &mut Vec<u32>, cap: &mut u64, need: u64) {
        if need <= *cap {
            return;
        }
        let s = self.s;
        let new_cap = need.div_ceil(s.kv_chunk) * s.kv_chunk;
        let bytes = s.rollout_batch * new_cap * self.kv_width() * s.dtype_bytes;
        if kv.is_empty() {
            for _ in 0..2 * s.layers {
                kv.push(self.alloc(bytes));
            }
        } else {
            // torch.cat into a larger tensor, then the old one is dropped; layer by layer.
            for slot in kv.iter_mut() {
                let new = self.b.alloc(bytes, COMPUTE, self.device);
                self.b.free(*slot);
                *slot = new;
            }
        }
        *cap = new_cap;
    }

    /// One rollout step: a batch of episodes generated in lockstep. Returns the sequences.
    fn rollout_step(&mut self) -> Vec<Sequence> {
        let s = self.s;
        let e = s.dtype_bytes;
        let b = s.rollout_batch;
        self.b.step_begin("rollout");
        let mut seqs: Vec<Sequence> = (0..b).map(|_| Sequence { tokens: 0, images: Vec::new() }).collect();
        let turns = self.rng.random_range(s.turns_min..=s.turns_max);
        let (mut kv, mut cap, mut len) = (Vec::new(), 0u64, 0u64);
        for turn in 0..turns {
            // New input of every episode: prompt or tool observation, plus images.
            let mut padded = 0;
            let mut embeds = Vec::new();
            for seq in seqs.iter_mut() {
                let text = if turn == 0 {
                    lognormal(&mut self.rng, s.prompt_median as f64, 0.9, 16, s.prompt_max)
                } else {
                    lognormal(&mut self.rng, s.observation_median as f64, 1.0, 8, s.prompt_max)
                };
                let images = self.images(turn == 0);
                for &n in &images {
                    embeds.push(self.vision_forward_nograd(n));
                }
                let new = text + images.iter().sum::<u64>();
                seq.tokens += new;
                seq.images.extend(images);
                padded = padded.max(new);
            }
            // Prefill.
            let t = b * padded;
            let mut x = self.alloc(t * s.hidden * e);
            for id in embeds {
                self.free(id);
            }
            self.ensure_kv(&mut kv, &mut cap, len + padded);
            // Prefill: every layer over the new tokens after the cached ones; logits of the
            // last token only.
            let sh = &self.shapes;
            let flops =
                sh.decoder_forward(b as f64, padded as f64, len as f64, s.layers as f64) + sh.head_forward(b as f64);
            let bytes = sh.decode_bytes(b as f64, (len + padded) as f64);
            self.clock.pass(flops, bytes);
            for _ in 0..s.layers {
                x = self.layer_nograd(t, x);
            }
            let logits = self.alloc(b * s.vocab * 4);
            self.free(logits);
            self.free(x);
            len += padded;
            // Decode token by token until the longest response of the batch ends.
            let responses: Vec<u64> = (0..b).map(|_| self.response_len()).collect();
            let steps = responses.iter().copied().max().unwrap_or(0);
            for (j, r) in responses.iter().enumerate() {
                seqs[j].tokens += r;
            }
            let mut x = self.alloc(b * s.hidden * e);
            for _ in 0..steps {
                if self.b.limit_error().is_some() {
                    break; // the program is over its bounds: generate reports it
                }
                self.ensure_kv(&mut kv, &mut cap, len + 1);
                let context = (len + 1) as f64;
                let (flops, bytes) =
                    (self.shapes.decode_flops(b as f64, context), self.shapes.decode_bytes(b as f64, context));
                self.clock.pass(flops, bytes);
                for _ in 0..s.layers {
                    x = self.layer_nograd(b, x);
                }
                let logits = self.alloc(b * s.vocab * 4);
                let probs = self.alloc(b * s.vocab * 4);
                self.free(logits);
                let token = self.alloc(b * 8);
                self.free(probs);
                self.free(token);
                len += 1;
            }
            self.free(x);
        }
        for id in kv {
            self.free(id);
        }
        self.end_step();
        seqs
    }

    /// One RL training step over the rollout's sequences.
    fn train_step_rl(&mut self, seqs: &[Sequence]) {
        let s = self.s;
        self.b.step_begin("train");
        let groups = split(seqs, s.micro_batches as usize);
        // Log-probs of the behaviour policy: no grad.
        for g in &groups {
            let lens: Vec<u64> = g.iter().map(|q| q.tokens).collect();
            for &n in g.iter().flat_map(|q| q.images.iter()) {
                let id = self.vision_forward_nograd(n);
                self.free(id);
            }
            self.forward_nograd(&lens);
        }
        let mut grads = Vec::new();
        for g in &groups {
            let lens: Vec<u64> = g.iter().map(|q| q.tokens).collect();
            let images: Vec<u64> = g.iter().flat_map(|q| q.images.iter().copied()).collect();
            self.micro_batch(&lens, &images, &mut grads);
        }
        self.optimizer_step(grads);
        self.end_step();
    }

    /// A padded SFT batch: `sft_batch` sequences of the longest drawn length each.
    fn sft_batch_lens(&mut self) -> Vec<u64> {
        let s = self.s;
        let longest = (0..s.sft_batch)
            .map(|_| lognormal(&mut self.rng, s.prompt_median as f64, 0.9, 16, s.prompt_max))
            .max()
            .unwrap_or(1);
        vec![longest; s.sft_batch as usize]
    }

    fn train_step_sft(&mut self) {
        self.b.step_begin("train");
        let mut grads = Vec::new();
        for _ in 0..self.s.micro_batches {
            let lens = self.sft_batch_lens();
            self.micro_batch(&lens, &[], &mut grads);
        }
        self.optimizer_step(grads);
        self.end_step();
    }

    fn eval_step(&mut self) {
        self.b.step_begin("eval");
        for _ in 0..2 * self.s.micro_batches {
            // Twice the training batch: twice as many sequences.
            let mut lens = self.sft_batch_lens();
            lens.extend_from_slice(&lens.clone());
            self.forward_nograd(&lens);
        }
        self.end_step();
    }
}

/// Splits `seqs` into `n` consecutive groups (the last ones may be empty when n > len).
fn split(seqs: &[Sequence], n: usize) -> Vec<Vec<Sequence>> {
    let per = seqs.len().div_ceil(n.max(1)).max(1);
    seqs.chunks(per).map(|c| c.to_vec()).collect()
}
