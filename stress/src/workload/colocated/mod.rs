//! The `colocated` workload: an agent loop in which a rollout engine and a trainer take turns on
//! one device, run under four ways of sharing it (`run.rs`), with a modelled switch time
//! (`cost.rs`).
//!
//! Shape (one seeded generator, so the same spec and seed give the same events):
//! - the engine's weights (one bf16 copy of the decoder: embedding, per layer two norms and the
//!   seven projections of `agent/model.rs`'s decoder layer, final norm, LM head), allocated once
//!   in the engine's `engine_weights` region;
//! - the engine's KV cache, in the `kv_cache` region: per layer one K and one V block of
//!   `kv_block` tokens for the whole batch, kept across rollouts and grown when a rollout needs
//!   more tokens than any before (as vLLM's and SGLang's caches are: allocated, then reused);
//! - a rollout: prefill of the batch's prompts (a transient per layer) and decoding in chunks of
//!   `kv_block` tokens (a logits buffer per chunk), growing the cache as the sequences grow;
//! - the trainer (outside any region, tag "default"): its own bf16 parameters (same shapes),
//!   allocated once; per training step `micro_batches` packed micro-batches of varying tokens,
//!   forward saving the decoder layer's activations (`agent/model.rs`'s list, without LoRA),
//!   fp32 logits, backward from the last layer freeing them and creating bf16 gradients at the
//!   first micro-batch; the optimizer step creates Adam's two fp32 moments once and frees the
//!   gradients.
//!
//! A phase's own peak: the most bytes live at once during it of what that phase needs on the
//! device (rollout: the engine's weights and cache, its transients and the trainer's kept
//! parameters and moments; training: the trainer's tensors alone). The larger of the two is
//! the least any way of sharing the device can reach.

mod cost;
mod run;

pub use cost::{CostModel, PCIE4_X16_GBPS, PCIE5_X16_GBPS};
pub use run::{run, table, ColocatedReport, Column, DEFAULT_CAPACITY_GB, MAX_CAPACITY_GB};

use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use serde::Serialize;

/// Who owns an allocation: what each way of sharing the device does with it between phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Owner {
    /// Backed up while the engine sleeps.
    EngineWeights,
    /// The engine's KV cache and its transients (prefill, logits): discarded while it sleeps.
    KvCache,
    Trainer,
}

/// One event of the loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ev {
    Alloc {
        id: u32,
        bytes: u64,
        owner: Owner,
    },
    Free {
        id: u32,
    },
    /// The engine's phase begins (the engine must be awake).
    Rollout,
    /// The trainer's phase begins (the engine may sleep).
    Train,
}

/// Every dimension of the loop.
#[derive(Clone, Debug, PartialEq, Serialize, clap::Args)]
pub struct ColocatedSpec {
    /// Iterations of the loop (rollout then training step).
    #[arg(long, default_value_t = 4)]
    pub iterations: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Decoder width (default: a 1.5B-parameter decoder with grouped-query attention).
    #[arg(long, default_value_t = 1536)]
    pub hidden: u64,
    #[arg(long, default_value_t = 28)]
    pub layers: u64,
    #[arg(long, default_value_t = 12)]
    pub heads: u64,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: u64,
    #[arg(long, default_value_t = 8960)]
    pub intermediate: u64,
    #[arg(long, default_value_t = 151_936)]
    pub vocab: u64,
    /// Sequences generated in lockstep per rollout.
    #[arg(long, default_value_t = 64)]
    pub rollout_batch: u64,
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: u64,
    /// Response tokens of a rollout: drawn uniformly in [min, max].
    #[arg(long, default_value_t = 1024)]
    pub response_min: u64,
    #[arg(long, default_value_t = 4096)]
    pub response_max: u64,
    /// Tokens per KV-cache block (and per decoding chunk).
    #[arg(long, default_value_t = 256)]
    pub kv_block: u64,
    #[arg(long, default_value_t = 4)]
    pub micro_batches: u64,
    /// Tokens of a packed micro-batch: drawn uniformly in [min, max].
    #[arg(long, default_value_t = 3072)]
    pub micro_tokens_min: u64,
    #[arg(long, default_value_t = 6144)]
    pub micro_tokens_max: u64,
}

impl Default for ColocatedSpec {
    fn default() -> ColocatedSpec {
        ColocatedSpec {
            iterations: 4,
            seed: 1,
            hidden: 1536,
            layers: 28,
            heads: 12,
            kv_heads: 2,
            intermediate: 8960,
            vocab: 151_936,
            rollout_batch: 64,
            prompt_tokens: 512,
            response_min: 1024,
            response_max: 4096,
            kv_block: 256,
            micro_batches: 4,
            micro_tokens_min: 3072,
            micro_tokens_max: 6144,
        }
    }
}

/// bf16 weights and activations.
const DTYPE: u64 = 2;
/// Bounds that keep every product below 2^64 and a run within seconds.
const MAX_DIM: u64 = 1 << 20;
const MAX_ITERATIONS: u64 = 64;
const MAX_LAYERS: u64 = 256;
const MAX_TOKENS: u64 = 1 << 17;
/// Training events at most (each about 16 per layer per micro-batch): the loop is held whole.
const MAX_TRAIN_EVENTS: u64 = 1 << 22;

impl ColocatedSpec {
    /// Checks every dimension against its range; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        let ranged = [
            ("--iterations", self.iterations, 1, MAX_ITERATIONS),
            ("--hidden", self.hidden, 64, MAX_DIM),
            ("--layers", self.layers, 1, MAX_LAYERS),
            ("--heads", self.heads, 1, 1024),
            ("--kv-heads", self.kv_heads, 1, self.heads),
            ("--intermediate", self.intermediate, 64, MAX_DIM),
            ("--vocab", self.vocab, 2, MAX_DIM),
            ("--rollout-batch", self.rollout_batch, 1, 1024),
            ("--prompt-tokens", self.prompt_tokens, 1, MAX_TOKENS),
            ("--response-min", self.response_min, 1, MAX_TOKENS),
            ("--response-max", self.response_max, self.response_min, MAX_TOKENS),
            ("--kv-block", self.kv_block, 1, MAX_TOKENS),
            ("--micro-batches", self.micro_batches, 1, 64),
            ("--micro-tokens-min", self.micro_tokens_min, 1, MAX_TOKENS),
            ("--micro-tokens-max", self.micro_tokens_max, self.micro_tokens_min, MAX_TOKENS),
        ];
        for (flag, v, lo, hi) in ranged {
            if !(lo..=hi).contains(&v) {
                return Err(format!("{flag} {v}: must be in {lo}..={hi}"));
            }
        }
        let train_events = self.iterations * self.micro_batches * self.layers * 16;
        if train_events > MAX_TRAIN_EVENTS {
            return Err(format!(
                "--iterations {} x --micro-batches {} x --layers {}: about {train_events} events, over {MAX_TRAIN_EVENTS}; \
                 lower one of them",
                self.iterations, self.micro_batches, self.layers
            ));
        }
        if self.hidden % self.heads != 0 {
            return Err(format!("--hidden {} is not a multiple of --heads {}", self.hidden, self.heads));
        }
        // Grouped-query attention: each key/value head serves the same number of query heads.
        if self.heads % self.kv_heads != 0 {
            return Err(format!("--heads {} is not a multiple of --kv-heads {}", self.heads, self.kv_heads));
        }
        Ok(())
    }

    fn kv_width(&self) -> u64 {
        self.hidden / self.heads * self.kv_heads
    }

    /// (in, out) of every projection of a decoder layer (as `agent/model.rs`).
    fn decoder_mats(&self) -> [(u64, u64); 7] {
        let (h, kv, i) = (self.hidden, self.kv_width(), self.intermediate);
        [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    }

    /// Every weight tensor of the decoder, in bytes, in allocation order.
    fn weights(&self) -> Vec<u64> {
        let (h, e) = (self.hidden, DTYPE);
        let mut w = vec![self.vocab * h * e];
        for _ in 0..self.layers {
            w.push(h * e);
            w.extend(self.decoder_mats().iter().map(|(a, b)| a * b * e));
            w.push(h * e);
        }
        w.push(h * e);
        w.push(self.vocab * h * e);
        w
    }

    /// What one decoder layer saves for backward over `t` tokens (`agent/model.rs`, no LoRA).
    fn layer_saved(&self, t: u64) -> [u64; 14] {
        let (h, kv, i, e) = (self.hidden, self.kv_width(), self.intermediate, DTYPE);
        [
            t * 4,
            t * h * e,
            t * h * e,
            t * kv * e,
            t * kv * e,
            t * h * e,
            t * self.heads * 4,
            t * h * e,
            t * 4,
            t * h * e,
            t * i * e,
            t * i * e,
            t * i * e,
            t * i * e,
        ]
    }

    /// Bytes of one K (or V) block of one layer.
    fn kv_block_bytes(&self) -> u64 {
        self.rollout_batch * self.kv_block * self.kv_width() * DTYPE
    }
}

/// The loop's events, and each phase's own peak.
#[derive(Clone, Debug, Default)]
pub struct Loop {
    pub events: Vec<Ev>,
    pub rollout_peak: u64,
    pub train_peak: u64,
    /// Engine weight tensors (vLLM backs each up with one copy).
    pub weight_tensors: u64,
    pub weight_bytes: u64,
}

/// Builds the loop's events, counting live bytes per owner for the phases' own peaks.
struct Builder {
    events: Vec<Ev>,
    sizes: Vec<(u64, Owner)>,
    live: [u64; 3],
    in_rollout: bool,
    rollout_peak: u64,
    train_peak: u64,
}

impl Builder {
    fn alloc(&mut self, bytes: u64, owner: Owner) -> u32 {
        let id = self.sizes.len() as u32;
        self.sizes.push((bytes, owner));
        self.events.push(Ev::Alloc { id, bytes, owner });
        self.live[owner as usize] += bytes;
        self.note();
        id
    }

    fn free(&mut self, id: u32) {
        let (bytes, owner) = self.sizes[id as usize];
        self.live[owner as usize] -= bytes;
        self.events.push(Ev::Free { id });
    }

    fn note(&mut self) {
        let [w, kv, t] = self.live;
        if self.in_rollout {
            self.rollout_peak = self.rollout_peak.max(w + kv + t);
        } else {
            self.train_peak = self.train_peak.max(t);
        }
    }
}

/// Generates the loop of `spec` (validated first).
pub fn generate(spec: &ColocatedSpec) -> Result<Loop, String> {
    spec.validate()?;
    let s = spec;
    let mut rng = XorShiftRng::seed_from_u64(s.seed);
    let mut b = Builder {
        events: Vec::new(),
        sizes: Vec::new(),
        live: [0; 3],
        in_rollout: true,
        rollout_peak: 0,
        train_peak: 0,
    };
    let weights = s.weights();
    // The trainer's parameters first (it loads the model), then the engine's copy.
    let params: Vec<u64> = s.decoder_mats().iter().map(|(a, c)| a * c).collect();
    for &w in &weights {
        b.alloc(w, Owner::Trainer);
    }
    b.events.push(Ev::Rollout);
    for &w in &weights {
        b.alloc(w, Owner::EngineWeights);
    }
    let (h, e) = (s.hidden, DTYPE);
    let mut kv: Vec<u32> = Vec::new();
    let mut moments: Vec<u32> = Vec::new();
    for i in 0..s.iterations {
        if i > 0 {
            b.events.push(Ev::Rollout);
            b.in_rollout = true;
        }
        // Prefill: one transient of the MLP's width per layer, freed as the next one comes.
        let prompt = s.rollout_batch * s.prompt_tokens;
        for _ in 0..s.layers {
            let t = b.alloc(prompt * s.intermediate * e, Owner::KvCache);
            b.free(t);
        }
        let response = rng.random_range(s.response_min..=s.response_max);
        let tokens = s.prompt_tokens + response;
        let mut covered = (kv.len() as u64 / (2 * s.layers)) * s.kv_block;
        let mut done = 0;
        while done < tokens {
            done = (done + s.kv_block).min(tokens);
            while covered < done {
                for _ in 0..2 * s.layers {
                    kv.push(b.alloc(s.kv_block_bytes(), Owner::KvCache));
                }
                covered += s.kv_block;
            }
            let logits = b.alloc(s.rollout_batch * s.vocab * 4, Owner::KvCache);
            let hidden = b.alloc(s.rollout_batch * h * e, Owner::KvCache);
            b.free(hidden);
            b.free(logits);
        }
        b.events.push(Ev::Train);
        b.in_rollout = false;
        b.note();
        let mut grads: Vec<u32> = Vec::new();
        for m in 0..s.micro_batches {
            let t = rng.random_range(s.micro_tokens_min..=s.micro_tokens_max);
            let mut saved: Vec<Vec<u32>> = Vec::new();
            for _ in 0..s.layers {
                saved.push(s.layer_saved(t).iter().map(|&n| b.alloc(n, Owner::Trainer)).collect());
            }
            let logits = b.alloc(t * s.vocab * 4, Owner::Trainer);
            let dlogits = b.alloc(t * s.vocab * 4, Owner::Trainer);
            b.free(logits);
            for layer in saved.into_iter().rev() {
                if m == 0 {
                    for &p in &params {
                        grads.push(b.alloc(p * e, Owner::Trainer));
                    }
                }
                let dx = b.alloc(t * h * e, Owner::Trainer);
                let dmlp = b.alloc(t * s.intermediate * e, Owner::Trainer);
                b.free(dmlp);
                for id in layer {
                    b.free(id);
                }
                b.free(dx);
            }
            b.free(dlogits);
        }
        if moments.is_empty() {
            for _ in 0..s.layers {
                for &p in &params {
                    moments.push(b.alloc(p * 4, Owner::Trainer));
                    moments.push(b.alloc(p * 4, Owner::Trainer));
                }
            }
        }
        for g in grads {
            b.free(g);
        }
    }
    // The loop goes on: the last iteration's switch back, so every iteration is a full cycle.
    b.events.push(Ev::Rollout);
    let weight_bytes = weights.iter().sum();
    Ok(Loop {
        events: b.events,
        rollout_peak: b.rollout_peak,
        train_peak: b.train_peak,
        weight_tensors: weights.len() as u64,
        weight_bytes,
    })
}
