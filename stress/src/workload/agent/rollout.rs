//! The rollout step: a batch of episodes generated in lockstep, turn by turn (prompt or tool
//! observation with its images, prefill, token-by-token decoding), the KV cache grown in chunks
//! and freed when the episodes end, and the draws of images and response lengths.

use super::{Gen, COMPUTE};
use crate::workload::lognormal;
use rand::RngExt;

/// A sequence of a finished episode, as training sees it.
#[derive(Clone, Debug)]
pub(super) struct Sequence {
    pub(super) tokens: u64,
    /// Image token counts (one per image).
    pub(super) images: Vec<u64>,
}

impl Gen<'_> {
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
    pub(super) fn rollout_step(&mut self) -> Vec<Sequence> {
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
}
