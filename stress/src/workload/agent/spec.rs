//! The agent workload's dimensions: `AgentSpec` (every dimension, as plain data), its presets
//! and `AgentArgs`, the command-line flags that override a preset one dimension at a time.
//! `AgentArgs::spec` validates the result, so the generator may assume a consistent spec.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Optimizer {
    /// LoRA adapters on every projection (fp32 adapters, grads and Adam moments).
    Lora,
    /// The last `trainable_layers` decoder layers trained in full (bf16 grads, fp32 Adam moments).
    Partial,
    /// Every decoder weight trained (does not fit 80 GB for a 7B model with Adam).
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum Preset {
    /// 7B decoder + ViT-L vision encoder, rollouts alternating with LoRA training.
    #[value(name = "vlm-7b")]
    Vlm7b,
    /// 7B decoder, text-only supervised fine-tuning of the last layers, periodic evaluation.
    #[value(name = "llm-7b-sft")]
    Llm7bSft,
}

/// Every dimension of the workload.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgentSpec {
    pub preset: String,
    pub seed: u64,
    pub iterations: u64,
    /// Ranks, one per simulated device: rank `r` runs the same workload with seed `seed + r`
    /// on device `r`, in lockstep with the others (see `AgentStream`).
    pub devices: u64,
    // decoder
    pub hidden: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub dtype_bytes: u64,
    // vision encoder
    pub vision: bool,
    pub vision_hidden: u64,
    pub vision_layers: u64,
    pub vision_intermediate: u64,
    pub patch: u64,
    pub images_min: u64,
    pub images_max: u64,
    pub resolutions: Vec<u64>,
    pub train_vision: bool,
    // text
    pub prompt_median: u64,
    pub prompt_max: u64,
    pub observation_median: u64,
    pub response_min: u64,
    pub response_max: u64,
    // rollout
    pub rollout: bool,
    pub rollout_batch: u64,
    pub turns_min: u64,
    pub turns_max: u64,
    pub kv_chunk: u64,
    // training
    pub micro_batches: u64,
    pub sft_batch: u64,
    pub eval_every: u64,
    pub grad_checkpointing: bool,
    pub optimizer: Optimizer,
    pub lora_rank: u64,
    pub trainable_layers: u64,
    /// The GPU of the step-time model (`time`); it changes no event.
    pub gpu: super::Gpu,
}

impl AgentSpec {
    pub fn preset(p: Preset) -> AgentSpec {
        let vlm = AgentSpec {
            preset: "vlm-7b".into(),
            seed: 1,
            iterations: 6,
            devices: 1,
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 32,
            intermediate: 11008,
            vocab: 32000,
            dtype_bytes: 2,
            vision: true,
            vision_hidden: 1024,
            vision_layers: 24,
            vision_intermediate: 4096,
            patch: 14,
            images_min: 1,
            images_max: 3,
            resolutions: vec![224, 336, 448, 672],
            train_vision: false,
            prompt_median: 400,
            prompt_max: 4096,
            observation_median: 200,
            response_min: 32,
            response_max: 384,
            rollout: true,
            rollout_batch: 8,
            turns_min: 1,
            turns_max: 3,
            kv_chunk: 256,
            micro_batches: 4,
            sft_batch: 8,
            eval_every: 0,
            grad_checkpointing: true,
            optimizer: Optimizer::Lora,
            lora_rank: 64,
            trainable_layers: 8,
            gpu: super::Gpu::H100,
        };
        match p {
            Preset::Vlm7b => vlm,
            Preset::Llm7bSft => AgentSpec {
                preset: "llm-7b-sft".into(),
                iterations: 24,
                vision: false,
                rollout: false,
                prompt_median: 384,
                prompt_max: 2048,
                micro_batches: 2,
                sft_batch: 4,
                eval_every: 6,
                grad_checkpointing: false,
                optimizer: Optimizer::Partial,
                ..vlm
            },
        }
    }
}

/// Every numeric dimension's accepted range, as (flag, value, least, most). The bounds keep
/// every tensor size the generator computes within u64 (the largest product, logits of a
/// training micro-batch, stays below 2^63) while covering today's models many times over.
fn ranges(s: &AgentSpec) -> [(&'static str, u64, u64, u64); 31] {
    const K: u64 = 1024;
    [
        ("iterations", s.iterations, 0, 1_000_000),
        ("devices", s.devices, 1, crate::ops::MAX_DEVICES as u64),
        ("hidden", s.hidden, 1, 64 * K),
        ("layers", s.layers, 1, K),
        ("heads", s.heads, 1, K),
        ("kv-heads", s.kv_heads, 1, K),
        ("intermediate", s.intermediate, 1, 256 * K),
        ("vocab", s.vocab, 1, K * K),
        ("dtype-bytes", s.dtype_bytes, 1, 8),
        ("vision-hidden", s.vision_hidden, 0, 64 * K),
        ("vision-layers", s.vision_layers, 0, K),
        ("vision-intermediate", s.vision_intermediate, 0, 256 * K),
        ("patch", s.patch, 1, K),
        ("images-min", s.images_min, 0, 16),
        ("images-max", s.images_max, 0, 16),
        ("prompt-median", s.prompt_median, 1, K * K),
        ("prompt-max", s.prompt_max, 1, K * K),
        ("observation-median", s.observation_median, 0, K * K),
        ("response-min", s.response_min, 0, K * K),
        ("response-max", s.response_max, 0, K * K),
        ("rollout-batch", s.rollout_batch, 1, K),
        ("turns-min", s.turns_min, 0, 64),
        ("turns-max", s.turns_max, 1, 64),
        ("kv-chunk", s.kv_chunk, 1, K * K),
        ("micro-batches", s.micro_batches, 1, K),
        ("sft-batch", s.sft_batch, 1, K),
        ("eval-every", s.eval_every, 0, 1_000_000),
        ("lora-rank", s.lora_rank, 1, 4 * K),
        ("trainable-layers", s.trainable_layers, 0, K),
        ("resolutions (count)", s.resolutions.len() as u64, 0, 64),
        ("resolutions", s.resolutions.iter().copied().max().unwrap_or(0), 0, 16 * K),
    ]
}

impl AgentSpec {
    /// Checks every dimension against its range (`ranges`) and the dimensions against each
    /// other; the error names the flag, the value and what is accepted.
    pub fn validate(&self) -> Result<(), String> {
        let s = self;
        for (name, value, lo, hi) in ranges(s) {
            if !(lo..=hi).contains(&value) {
                return Err(format!("--{name} {value} is out of range: accepted {lo}..={hi}"));
            }
        }
        if s.heads % s.kv_heads != 0 || s.hidden % s.heads != 0 {
            return Err(format!(
                "--hidden ({}) must be a multiple of --heads ({}), and --heads of --kv-heads ({})",
                s.hidden, s.heads, s.kv_heads
            ));
        }
        if s.images_min > s.images_max || s.turns_min > s.turns_max || s.response_min > s.response_max {
            return Err("each --*-min must not exceed its --*-max".into());
        }
        if s.vision {
            if s.resolutions.is_empty() || s.resolutions.iter().any(|&r| r < s.patch) {
                return Err("--resolutions needs at least one side length of at least --patch pixels".into());
            }
            // An image is (side / patch)^2 tokens: at most 1024^2.
            if let Some(&r) = s.resolutions.iter().find(|&&r| r / s.patch > 1024) {
                return Err(format!(
                    "--resolutions {r} with --patch {}: {} patches per side, at most 1024 accepted",
                    s.patch,
                    r / s.patch
                ));
            }
        }
        Ok(())
    }
}

/// Command-line overrides of a preset (each flag replaces one dimension).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct AgentArgs {
    /// Workload preset.
    #[arg(long, value_enum, default_value = "vlm-7b")]
    pub preset: Option<Preset>,
    /// Seed of the generator (same seed, same events).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Rollout + training iterations (SFT: training steps).
    #[arg(long)]
    pub iterations: Option<u64>,
    /// Ranks, one per simulated device, in lockstep (rank r: seed + r on device r); each
    /// device is reported on its own.
    #[arg(long)]
    pub devices: Option<u64>,
    #[arg(long)]
    pub hidden: Option<u64>,
    #[arg(long)]
    pub layers: Option<u64>,
    #[arg(long)]
    pub heads: Option<u64>,
    /// Key/value heads (grouped-query attention when below `heads`).
    #[arg(long)]
    pub kv_heads: Option<u64>,
    #[arg(long)]
    pub intermediate: Option<u64>,
    #[arg(long)]
    pub vocab: Option<u64>,
    /// Bytes per element of weights and activations (2 = bf16).
    #[arg(long)]
    pub dtype_bytes: Option<u64>,
    /// Include the vision encoder.
    #[arg(long)]
    pub vision: Option<bool>,
    #[arg(long)]
    pub vision_hidden: Option<u64>,
    #[arg(long)]
    pub vision_layers: Option<u64>,
    #[arg(long)]
    pub vision_intermediate: Option<u64>,
    #[arg(long)]
    pub patch: Option<u64>,
    #[arg(long)]
    pub images_min: Option<u64>,
    #[arg(long)]
    pub images_max: Option<u64>,
    /// Image side lengths in pixels to draw from (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub resolutions: Option<Vec<u64>>,
    /// Train the vision encoder too (else it is frozen).
    #[arg(long)]
    pub train_vision: Option<bool>,
    /// Median prompt length in tokens (log-normal).
    #[arg(long)]
    pub prompt_median: Option<u64>,
    #[arg(long)]
    pub prompt_max: Option<u64>,
    /// Median tool-observation length in tokens for turns after the first.
    #[arg(long)]
    pub observation_median: Option<u64>,
    #[arg(long)]
    pub response_min: Option<u64>,
    #[arg(long)]
    pub response_max: Option<u64>,
    /// Generate rollouts (agent RL); false: supervised fine-tuning only.
    #[arg(long)]
    pub rollout: Option<bool>,
    /// Episodes generated together in a rollout step.
    #[arg(long)]
    pub rollout_batch: Option<u64>,
    #[arg(long)]
    pub turns_min: Option<u64>,
    #[arg(long)]
    pub turns_max: Option<u64>,
    /// KV cache growth chunk in tokens (1 = reallocated every token).
    #[arg(long)]
    pub kv_chunk: Option<u64>,
    /// Micro-batches per training step (gradient accumulation).
    #[arg(long)]
    pub micro_batches: Option<u64>,
    /// SFT: sequences per micro-batch (padded to the longest).
    #[arg(long)]
    pub sft_batch: Option<u64>,
    /// SFT: a no-grad evaluation step every N training steps (0: never).
    #[arg(long)]
    pub eval_every: Option<u64>,
    #[arg(long)]
    pub grad_checkpointing: Option<bool>,
    #[arg(long, value_enum)]
    pub optimizer: Option<Optimizer>,
    #[arg(long)]
    pub lora_rank: Option<u64>,
    /// `partial` optimizer: how many of the last decoder layers are trained.
    #[arg(long)]
    pub trainable_layers: Option<u64>,
    /// GPU whose published throughput models the step time (default: h100, h200 with --h200).
    #[arg(long, value_enum)]
    pub gpu: Option<super::Gpu>,
}

impl AgentArgs {
    pub fn spec(&self) -> Result<AgentSpec, String> {
        let mut s = AgentSpec::preset(self.preset.unwrap_or(Preset::Vlm7b));
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f.clone() { s.$f = v; } )* };
        }
        set!(
            seed,
            iterations,
            devices,
            hidden,
            layers,
            heads,
            kv_heads,
            intermediate,
            vocab,
            dtype_bytes,
            vision,
            vision_hidden,
            vision_layers,
            vision_intermediate,
            patch,
            images_min,
            images_max,
            resolutions,
            train_vision,
            prompt_median,
            prompt_max,
            observation_median,
            response_min,
            response_max,
            rollout,
            rollout_batch,
            turns_min,
            turns_max,
            kv_chunk,
            micro_batches,
            sft_batch,
            eval_every,
            grad_checkpointing,
            optimizer,
            lora_rank,
            trainable_layers,
            gpu
        );
        s.validate()?;
        self.refuse_inapplicable(&s)?;
        Ok(s)
    }

    /// A flag given for a part of the workload this spec does not run (an SFT batch size on a
    /// workload with rollouts, a LoRA rank with another optimizer...) is refused, naming it and
    /// what it needs: it would change nothing, and a user would believe it had.
    fn refuse_inapplicable(&self, s: &AgentSpec) -> Result<(), String> {
        const ROLLOUTS: &str = "it shapes rollouts, and this workload has none (--rollout false, as llm-7b-sft); \
                                set --rollout true";
        const SFT: &str = "it shapes supervised fine-tuning, and this workload has rollouts (as vlm-7b); set \
                           --rollout false or --preset llm-7b-sft";
        const VISION: &str = "it shapes the vision encoder, and this workload has none (--vision false, as \
                              llm-7b-sft); set --vision true";
        const IMAGES: &str = "images come with rollouts of a workload with a vision encoder; set --rollout true \
                              and --vision true";
        let rules: &[(bool, &str, bool, &str)] = &[
            (self.rollout_batch.is_some(), "--rollout-batch", s.rollout, ROLLOUTS),
            (self.turns_min.is_some(), "--turns-min", s.rollout, ROLLOUTS),
            (self.turns_max.is_some(), "--turns-max", s.rollout, ROLLOUTS),
            (self.kv_chunk.is_some(), "--kv-chunk", s.rollout, ROLLOUTS),
            (self.response_min.is_some(), "--response-min", s.rollout, ROLLOUTS),
            (self.response_max.is_some(), "--response-max", s.rollout, ROLLOUTS),
            (self.observation_median.is_some(), "--observation-median", s.rollout, ROLLOUTS),
            (self.images_min.is_some(), "--images-min", s.rollout && s.vision, IMAGES),
            (self.images_max.is_some(), "--images-max", s.rollout && s.vision, IMAGES),
            (self.sft_batch.is_some(), "--sft-batch", !s.rollout, SFT),
            (self.eval_every.is_some(), "--eval-every", !s.rollout, SFT),
            (self.vision_hidden.is_some(), "--vision-hidden", s.vision, VISION),
            (self.vision_layers.is_some(), "--vision-layers", s.vision, VISION),
            (self.vision_intermediate.is_some(), "--vision-intermediate", s.vision, VISION),
            (self.patch.is_some(), "--patch", s.vision, VISION),
            (self.resolutions.is_some(), "--resolutions", s.vision, VISION),
            (self.train_vision.is_some(), "--train-vision", s.vision, VISION),
            (
                self.lora_rank.is_some(),
                "--lora-rank",
                s.optimizer == Optimizer::Lora,
                "it sizes LoRA adapters; set --optimizer lora",
            ),
            (
                self.trainable_layers.is_some(),
                "--trainable-layers",
                s.optimizer == Optimizer::Partial,
                "it counts the layers the partial optimizer trains; set --optimizer partial",
            ),
        ];
        match rules.iter().find(|&&(given, _, applies, _)| given && !applies) {
            Some((_, flag, _, why)) => Err(format!("{flag} does not apply here: {why}")),
            None => Ok(()),
        }
    }
}
