//! The model's shapes: the width of the key/value projections, the projections of a decoder
//! layer, which layers and tensors are trained (with LoRA, partial or full fine-tuning), what
//! a decoder layer saves for backward, and the weights allocated once at the start.

use super::{Gen, Optimizer};

/// A trainable tensor: its parameter elements (grads and optimizer state follow from it).
pub(super) struct Trainable {
    pub(super) elements: u64,
    /// Bytes per element of the parameter and its gradient.
    pub(super) grad_bytes: u64,
}

impl Gen<'_> {
    pub(super) fn kv_width(&self) -> u64 {
        self.s.hidden / self.s.heads * self.s.kv_heads
    }

    /// (in, out) of every projection of a decoder layer.
    pub(super) fn decoder_mats(&self) -> [(u64, u64); 7] {
        let (h, kv, i) = (self.s.hidden, self.kv_width(), self.s.intermediate);
        [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    }

    pub(super) fn first_trainable_layer(&self) -> u64 {
        match self.s.optimizer {
            Optimizer::Partial => self.s.layers.saturating_sub(self.s.trainable_layers),
            _ => 0,
        }
    }

    /// Trainables are pushed layer by layer for the decoder: index range of `layer`'s.
    pub(super) fn trainables_per_layer(&self) -> usize {
        match self.s.optimizer {
            Optimizer::Lora => 14,
            Optimizer::Partial | Optimizer::Full => 7,
        }
    }

    pub(super) fn trainables_of_layer_end(&self, layer: u64) -> usize {
        let first = self.first_trainable_layer();
        if layer < first {
            return 0;
        }
        // Gradients are created from the last layer down, so layer L's are complete once
        // (layers - L) layers' worth exist.
        ((self.s.layers - layer) as usize) * self.trainables_per_layer()
    }

    /// Sizes of the tensors one decoder layer saves for backward over `t` tokens.
    pub(super) fn layer_saved_sizes(&self, t: u64) -> Vec<u64> {
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

    pub(super) fn weights(&mut self) {
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
}
