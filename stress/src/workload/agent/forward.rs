//! Passes without grad, shared by rollouts and training: the vision encoder over one image,
//! a decoder layer, the logits and loss, a whole no-grad forward (log-probs, evaluation), and
//! the modelled compute time of a decoder pass.

use super::{Gen, COMPUTE, COPY};

impl Gen<'_> {
    /// Charges a training or no-grad pass of the decoder over `seqs` (sequence lengths): the
    /// layers below the first trained one forward only, the trained ones forward and
    /// `backward` (a multiple of their forward, 0 without grad), the LM head over every token
    /// forward and, with a backward, its input gradient.
    pub(super) fn charge_decoder(&mut self, seqs: impl Iterator<Item = u64> + Clone, backward: f64) {
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

    /// Encodes one image of `n` patches without grad; returns the projected embeddings.
    pub(super) fn vision_forward_nograd(&mut self, n: u64) -> u32 {
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

    pub(super) fn vision_layer_nograd(&mut self, n: u64, input: u32) -> u32 {
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

    /// One decoder layer over `t` tokens without grad (prefill, log-probs, eval, frozen layers).
    pub(super) fn layer_nograd(&mut self, t: u64, input: u32) -> u32 {
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

    /// Logits (bf16 and their fp32 copy) and the loss over `t` tokens; returns what backward
    /// needs (the fp32 logits) after freeing the rest.
    pub(super) fn logits_and_loss(&mut self, t: u64, hidden: u32) -> (u32, u32) {
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
    pub(super) fn forward_nograd(&mut self, seqs: &[u64]) {
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
}
