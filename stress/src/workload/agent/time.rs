//! The agent workload's step-time model: the GPU compute time of each step, modelled from the
//! workload's own shapes, so that the driver time an allocator spends can be set against the
//! time of the steps it serves ("driver % of step" in the report).
//!
//! Each pass (a forward over some tokens, a backward, one decoded token, an optimizer step)
//! takes the roofline time `max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)`: prefill
//! and training are compute bound, decoding one token is bound by reading the weights and the
//! KV cache. Counted FLOPs are the matrix multiplications (2 per multiply-add) and attention
//! (`QK^T` and `AV`: 4 x queries x keys x width per layer, causal where the tokens are new);
//! norms, activations, softmax, LoRA adapters and the optimizer's arithmetic are left out, so
//! the modelled steps are, if anything, shorter than real ones and the driver's share larger.
//!
//! Constants (published figures, NVIDIA H100 / H200 datasheets):
//! - bf16 dense tensor-core peak: 989 TFLOP/s on H100 SXM and on H200 (the same GH100 compute),
//!   of which training and prefill reach `MFU` = 45% (the 40–50% reported for large dense
//!   transformer training at this scale);
//! - HBM3 bandwidth 3.35 TB/s (H100 SXM 80 GB), HBM3e 4.8 TB/s (H200 141 GB), of which a
//!   memory-bound kernel reaches `HBM_EFFICIENCY` = 75% (70–80% measured with STREAM-like
//!   kernels and decode kernels).

use super::{AgentSpec, Optimizer};
use serde::Serialize;

/// bf16 dense peak of H100 SXM and H200, FLOP/s.
pub const BF16_DENSE_PEAK: f64 = 989e12;
/// Share of the peak that training and prefill reach (model FLOPs utilisation).
pub const MFU: f64 = 0.45;
/// HBM bandwidth, bytes/s.
pub const H100_HBM: f64 = 3.35e12;
pub const H200_HBM: f64 = 4.8e12;
/// Share of the bandwidth a memory-bound pass reaches.
pub const HBM_EFFICIENCY: f64 = 0.75;

/// The GPU whose throughput the step-time model uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Gpu {
    /// H100 SXM 80 GB (the simulated device's default capacity).
    #[default]
    H100,
    /// H200 141 GB (`--h200`).
    H200,
}

impl Gpu {
    /// Achieved FLOP/s and bytes/s.
    pub fn achieved(self) -> (f64, f64) {
        let hbm = match self {
            Gpu::H100 => H100_HBM,
            Gpu::H200 => H200_HBM,
        };
        (BF16_DENSE_PEAK * MFU, hbm * HBM_EFFICIENCY)
    }
}

/// Modelled time of the steps generated so far, one entry per step in order.
#[derive(Clone, Debug, Default)]
pub struct StepClock {
    flops_per_s: f64,
    bytes_per_s: f64,
    current: f64,
    pub steps: Vec<f64>,
}

impl StepClock {
    pub fn new(gpu: Gpu) -> StepClock {
        let (flops_per_s, bytes_per_s) = gpu.achieved();
        StepClock { flops_per_s, bytes_per_s, ..Default::default() }
    }

    /// One pass of `flops` operations reading or writing `bytes`.
    pub fn pass(&mut self, flops: f64, bytes: f64) {
        self.current += (flops / self.flops_per_s).max(bytes / self.bytes_per_s);
    }

    /// Closes the current step.
    pub fn end_step(&mut self) {
        self.steps.push(std::mem::take(&mut self.current));
    }
}

/// FLOPs and weight bytes of the workload's passes, from the spec's dimensions (all in f64:
/// the products of the largest accepted dimensions stay finite).
pub struct Shapes {
    /// Multiply-adds per token of the decoder's projections, all layers.
    decoder_params: f64,
    /// Multiply-adds per token of the LM head.
    head_params: f64,
    layers: f64,
    hidden: f64,
    /// Width of K (and of V) per layer.
    kv_width: f64,
    dtype: f64,
    vision_layer_params: f64,
    vision_layers: f64,
    vision_hidden: f64,
    projector_params: f64,
}

impl Shapes {
    pub fn of(s: &AgentSpec) -> Shapes {
        let f = |x: u64| x as f64;
        let (h, kv, i) = (f(s.hidden), f(s.hidden / s.heads * s.kv_heads), f(s.intermediate));
        // q, k, v, o, gate, up, down: the projections of `Gen::decoder_mats`.
        let per_layer = h * h + 2.0 * h * kv + h * h + 3.0 * h * i;
        let (vh, vi) = (f(s.vision_hidden), f(s.vision_intermediate));
        Shapes {
            decoder_params: f(s.layers) * per_layer,
            head_params: f(s.vocab) * h,
            layers: f(s.layers),
            hidden: h,
            kv_width: kv,
            dtype: f(s.dtype_bytes),
            vision_layer_params: 3.0 * vh * vh + vh * vh + 2.0 * vh * vi,
            vision_layers: f(s.vision_layers),
            vision_hidden: vh,
            projector_params: vh * h + h * h,
        }
    }

    /// Bytes of the decoder's and the LM head's weights.
    pub fn weight_bytes(&self) -> f64 {
        (self.decoder_params + self.head_params) * self.dtype
    }

    /// Attention FLOPs of `queries` new tokens of one sequence after `cached` earlier ones,
    /// over `layers` layers (causal: new token k sees the cached ones and k + 1 new ones).
    fn attention(&self, queries: f64, cached: f64, layers: f64) -> f64 {
        4.0 * queries * (cached + (queries + 1.0) / 2.0) * self.hidden * layers
    }

    /// Forward FLOPs of the decoder over `sequences` sequences of `tokens` new tokens each
    /// after `cached` cached ones, through `layers` of its layers (the LM head excluded).
    pub fn decoder_forward(&self, sequences: f64, tokens: f64, cached: f64, layers: f64) -> f64 {
        let share = layers / self.layers.max(1.0);
        sequences * (2.0 * tokens * self.decoder_params * share + self.attention(tokens, cached, layers))
    }

    /// Forward FLOPs of the LM head over `tokens` tokens.
    pub fn head_forward(&self, tokens: f64) -> f64 {
        2.0 * tokens * self.head_params
    }

    /// Forward FLOPs and weight bytes of the vision encoder and projector over one image of
    /// `patches` patches (plus the class token).
    pub fn vision_forward(&self, patches: f64) -> (f64, f64) {
        let n = patches + 1.0;
        let flops = 2.0 * n * self.vision_layer_params * self.vision_layers
            + 4.0 * n * n * self.vision_hidden * self.vision_layers
            + 2.0 * patches * self.projector_params;
        (flops, (self.vision_layer_params * self.vision_layers + self.projector_params) * self.dtype)
    }

    /// Bytes one decoded token reads: every weight, and the K and V of `context` tokens of
    /// each of `sequences` sequences in every layer.
    pub fn decode_bytes(&self, sequences: f64, context: f64) -> f64 {
        self.weight_bytes() + 2.0 * self.layers * sequences * context * self.kv_width * self.dtype
    }

    /// FLOPs of one decoded token for each of `sequences` sequences with `context` tokens
    /// cached (the new token included).
    pub fn decode_flops(&self, sequences: f64, context: f64) -> f64 {
        sequences * (2.0 * self.decoder_params + 4.0 * context * self.hidden * self.layers + 2.0 * self.head_params)
    }
}

/// Bytes an Adam step moves per trainable element: the parameter read and written, its
/// gradient read, both fp32 moments read and written.
pub fn adam_bytes_per_element(grad_bytes: u64) -> f64 {
    3.0 * grad_bytes as f64 + 16.0
}

/// Backward FLOPs of a trained decoder layer, as multiples of its forward: the activation
/// gradients (1x), the weight gradients where the base weights train (1x, not under LoRA,
/// whose adapters are left out), the forward recomputed under gradient checkpointing (1x).
pub fn backward_factor(optimizer: Optimizer, grad_checkpointing: bool) -> f64 {
    let weights = if optimizer == Optimizer::Lora { 0.0 } else { 1.0 };
    1.0 + weights + if grad_checkpointing { 1.0 } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::agent::Preset;

    /// The 7B preset is Llama-2-7B: 6.74 B parameters with the embedding; one decoded token
    /// reads its 13.2 GB of bf16 weights, 5.26 ms at 75% of an H100's 3.35 TB/s.
    #[test]
    fn the_7b_presets_shapes_and_a_decoded_token() {
        let spec = AgentSpec::preset(Preset::Vlm7b);
        let sh = Shapes::of(&spec);
        assert_eq!(sh.decoder_params, 6_476_005_376.0);
        assert_eq!(sh.head_params, 131_072_000.0);
        let with_embedding = sh.decoder_params + 2.0 * sh.head_params;
        assert_eq!(with_embedding, 6_738_149_376.0);
        assert_eq!(sh.weight_bytes(), 13_214_154_752.0);
        let mut clock = StepClock::new(Gpu::H100);
        clock.pass(sh.decode_flops(1.0, 1.0), sh.decode_bytes(1.0, 1.0));
        clock.end_step();
        let expected = sh.decode_bytes(1.0, 1.0) / (H100_HBM * HBM_EFFICIENCY);
        assert_eq!(clock.steps, vec![expected]);
        assert!((expected - 5.26e-3).abs() < 0.01e-3, "{expected}");
        // The K and V of 1000 cached tokens of 8 sequences: 2 x 32 layers x 8 x 1000 x 4096 x 2 bytes.
        assert_eq!(sh.decode_bytes(8.0, 1000.0) - sh.weight_bytes(), 4_194_304_000.0);
    }

    /// Prefill is compute bound: 2 FLOPs per weight per token plus causal attention.
    #[test]
    fn prefill_is_compute_bound_and_attention_is_causal() {
        let spec = AgentSpec::preset(Preset::Llm7bSft);
        let sh = Shapes::of(&spec);
        let t = 1000.0;
        let attention = 4.0 * t * (t + 1.0) / 2.0 * 4096.0 * 32.0;
        assert_eq!(sh.decoder_forward(1.0, t, 0.0, 32.0), 2.0 * t * sh.decoder_params + attention);
        // 8 of 32 layers: a quarter of the projections, attention in those layers only.
        assert_eq!(sh.decoder_forward(1.0, t, 0.0, 8.0), 2.0 * t * sh.decoder_params / 4.0 + attention / 4.0);
        // After 500 cached tokens every new one sees 500 more keys.
        let cached = sh.decoder_forward(1.0, t, 500.0, 32.0) - sh.decoder_forward(1.0, t, 0.0, 32.0);
        assert_eq!(cached, 4.0 * t * 500.0 * 4096.0 * 32.0);
        let mut clock = StepClock::new(Gpu::H200);
        let flops = sh.decoder_forward(8.0, t, 0.0, 32.0);
        clock.pass(flops, sh.weight_bytes());
        clock.end_step();
        assert_eq!(clock.steps, vec![flops / (BF16_DENSE_PEAK * MFU)]);
    }

    #[test]
    fn backward_multiples_and_adam_bytes() {
        assert_eq!(backward_factor(Optimizer::Lora, false), 1.0);
        assert_eq!(backward_factor(Optimizer::Lora, true), 2.0);
        assert_eq!(backward_factor(Optimizer::Partial, false), 2.0);
        assert_eq!(backward_factor(Optimizer::Full, true), 3.0);
        // bf16 parameter and gradient, fp32 moments: 2 + 2 read, 2 written, 8 + 8.
        assert_eq!(adam_bytes_per_element(2), 22.0);
    }
}
