//! Training: one micro-batch forward and backward (saved activations, or layer inputs only
//! under gradient checkpointing with recomputation in backward; a trained vision encoder), the
//! weight gradients, and the optimizer step (Adam moments created at the first step and kept).

use super::{time, Gen, COMPUTE, COPY};

impl Gen<'_> {
    /// Trained vision encoder: saves every layer's activations for backward.
    pub(super) fn vision_forward_train(&mut self, n: u64, saved: &mut Vec<(u32, u64)>) -> u32 {
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

    /// Forward of one trained layer. Without checkpointing its activations are appended to
    /// `saved`; with checkpointing they are freed and only the input stays (in `saved`).
    pub(super) fn layer_forward_train(&mut self, t: u64, input: u32, saved: &mut Vec<u32>) -> u32 {
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
    pub(super) fn layer_backward(
        &mut self,
        t: u64,
        saved: &mut Vec<u32>,
        grad_out: u32,
        grads: &mut Vec<u32>,
        layer: u64,
    ) -> u32 {
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

    pub(super) fn layer_weight_grads(&mut self, layer: u64, grads: &mut Vec<u32>) {
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

    /// One micro-batch of sequences of the lengths `seqs` (`t` tokens in all; with `images`
    /// image token counts) forward and backward.
    pub(super) fn micro_batch(&mut self, seqs: &[u64], images: &[u64], grads: &mut Vec<u32>) {
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
    pub(super) fn optimizer_step(&mut self, grads: Vec<u32>) {
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
}
