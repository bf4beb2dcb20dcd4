//! Which steps an iteration runs: a rollout then an RL training step, or an SFT training step
//! and every `eval_every` steps a no-grad evaluation; the steps' markers, and the batches each
//! training or evaluation step draws.

use super::rollout::Sequence;
use super::Gen;
use crate::workload::lognormal;

impl Gen<'_> {
    /// Iteration `i` (0-based): a rollout and a training step, or an SFT step and maybe an
    /// evaluation.
    pub(super) fn iteration(&mut self, i: u64) {
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
