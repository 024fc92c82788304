//! What a generation asks of the sampler: the reference `generate`'s parameters, which
//! predictions a step keeps and how many positions it unmasks, checked against a prompt.

use super::LogitBias;
use crate::error::SamplerError;

/// Which predictions a step keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Remasking {
    /// Keep the most probable predictions (Dream's `maskgit_plus`).
    #[default]
    LowConfidence,
    /// Keep predictions at random positions: a uniform subset of the step's quota under
    /// LLaDA's schedule; each position with probability 1 - s/t under Dream's (`origin`).
    Random,
    /// Keep the predictions whose top-1 probability most exceeds their top-2 (Dream's
    /// `topk_margin`).
    Margin,
    /// Keep the predictions of lowest entropy (Dream's `entropy`: Σ p log p, highest first).
    Entropy,
}

impl Remasking {
    /// Every accepted spelling: LLaDA's names and Dream's `alg` names.
    pub const NAMES: [&str; 7] = [
        "low_confidence",
        "random",
        "maskgit_plus",
        "origin",
        "topk_margin",
        "margin",
        "entropy",
    ];

    /// LLaDA's `remasking` names and Dream's `alg` names.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "low_confidence" | "maskgit_plus" => Some(Self::LowConfidence),
            "random" | "origin" => Some(Self::Random),
            "topk_margin" | "margin" => Some(Self::Margin),
            "entropy" => Some(Self::Entropy),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::LowConfidence => "low_confidence",
            Self::Random => "random",
            Self::Margin => "topk_margin",
            Self::Entropy => "entropy",
        }
    }
}

/// How many positions each step unmasks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Schedule {
    /// The model family's own: the engine picks `Dream` for Dream-family models and
    /// `Llada` otherwise; a sampler made without a model runs `Llada`.
    #[default]
    Auto,
    /// LLaDA's `generate`: each block's masks split evenly over its steps, the first
    /// `n % steps` steps taking one more.
    Llada,
    /// Dream's timestep schedule `linspace(1, eps, steps + 1)`: step i unmasks
    /// `int(#masked · (1 - t[i+1]/t[i]))` positions, all that remain at the last step.
    /// With one block and no threshold this is Dream's `diffusion_generate` (every masked
    /// position competes); with several blocks, or a threshold, it is Fast-dLLM's Dream
    /// port: a block's first step commits its first position from that step's prediction,
    /// the rest of the block follows the schedule (restarted per block) or the threshold.
    Dream { eps: f64 },
}

impl Schedule {
    /// Dream's default: `eps = 1e-3`.
    pub const DREAM: Schedule = Schedule::Dream { eps: 1e-3 };
}

/// The parameters of the reference `generate`, plus Fast-dLLM's threshold decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationParams {
    /// Tokens to generate after the prompt.
    pub gen_length: usize,
    /// Denoising steps over all blocks; each block gets `steps / num_blocks`.
    pub steps: usize,
    /// Blocks are filled left to right; `block_length == gen_length` is pure diffusion.
    pub block_length: usize,
    /// 0 is greedy; above 0 the GPU samples with Gumbel noise.
    pub temperature: f32,
    pub remasking: Remasking,
    /// Classifier-free guidance weight; 0 turns it off.
    pub cfg_scale: f32,
    /// Fast-dLLM: commit every prediction at least this confident (and at least one) per
    /// step instead of a fixed quota; `steps` is then unused.
    pub threshold: Option<f32>,
    /// The EOS logit is set to -inf before the argmax (applied by the GPU).
    pub logits_eos_inf: bool,
    /// EOS and EoT are removed from the confidence softmax (applied by the GPU).
    pub confidence_eos_eot_inf: bool,
    pub seed: u64,
    /// Round confidences to bf16 before ranking, as the reference's bf16 softmax does; the
    /// ties this creates go to the lowest position.
    pub round_confidence_bf16: bool,
    pub schedule: Schedule,
    /// Dream's `alg_temp`: above 0, a step's positions are drawn without replacement with
    /// weights `softmax(confidence / alg_temp)` instead of taken highest first.
    pub alg_temp: f32,
    /// Nucleus cut: each row keeps its most probable ids up to this much probability
    /// (`SelectParams::top_p`); `None` keeps all.
    pub top_p: Option<f32>,
    /// Each row keeps its `k` largest logits, ties included (`SelectParams::top_k`).
    pub top_k: Option<u32>,
    /// Each row keeps the ids at least `min_p` times as probable as its most probable one
    /// (`SelectParams::min_p`); `None` or 0 keeps all.
    pub min_p: Option<f32>,
    /// Applied to the logits before the token choice: fixed per id, the presence and
    /// frequency penalties of the tokens committed so far and the repetition penalty of
    /// the tokens seen (`LogitBias`).
    pub bias: LogitBias,
}

impl Default for GenerationParams {
    fn default() -> Self {
        Self {
            gen_length: 128,
            steps: 128,
            block_length: 32,
            temperature: 0.0,
            remasking: Remasking::LowConfidence,
            cfg_scale: 0.0,
            threshold: None,
            logits_eos_inf: false,
            confidence_eos_eot_inf: false,
            seed: 0,
            round_confidence_bf16: true,
            schedule: Schedule::Auto,
            alg_temp: 0.0,
            top_p: None,
            top_k: None,
            min_p: None,
            bias: LogitBias::default(),
        }
    }
}

impl GenerationParams {
    /// Checks the parameters against a prompt length, a suffix length (infilling; 0
    /// without) and the model's maximum sequence length; returns the number of blocks.
    pub fn validate(
        &self,
        prompt_len: usize,
        suffix_len: usize,
        max_len: usize,
    ) -> Result<usize, SamplerError> {
        if prompt_len == 0 {
            return Err(SamplerError::EmptyPrompt);
        }
        if self.gen_length == 0 {
            return Err(SamplerError::ZeroGenLength);
        }
        if self.block_length == 0 {
            return Err(SamplerError::ZeroBlockLength);
        }
        if !self.gen_length.is_multiple_of(self.block_length) {
            return Err(SamplerError::GenNotMultipleOfBlock {
                gen_length: self.gen_length,
                block_length: self.block_length,
            });
        }
        let num_blocks = self.gen_length / self.block_length;
        if let Schedule::Dream { eps } = self.schedule {
            if !(eps > 0.0 && eps < 1.0) {
                return Err(SamplerError::BadEps { eps });
            }
            if self.threshold.is_some() && self.remasking != Remasking::LowConfidence {
                return Err(SamplerError::ThresholdNeedsProbability {
                    remasking: self.remasking.name(),
                });
            }
            let blockwise = num_blocks > 1;
            if self.threshold.is_none()
                && blockwise
                && self.steps.is_multiple_of(num_blocks)
                && self.steps / num_blocks < 2
            {
                return Err(SamplerError::TooFewDreamSteps {
                    steps: self.steps,
                    num_blocks,
                });
            }
        }
        match self.threshold {
            Some(threshold) => {
                if !(threshold > 0.0 && threshold <= 1.0) {
                    return Err(SamplerError::ThresholdOutOfRange { threshold });
                }
            }
            None => {
                if self.steps < num_blocks {
                    return Err(SamplerError::TooFewSteps {
                        steps: self.steps,
                        num_blocks,
                    });
                }
                if !self.steps.is_multiple_of(num_blocks) {
                    return Err(SamplerError::StepsNotMultipleOfBlocks {
                        steps: self.steps,
                        num_blocks,
                    });
                }
            }
        }
        // Weights of noise and guidance: finite and never negative.
        let non_negative = |v: f32| v.is_finite() && v >= 0.0;
        for (ok, error) in [
            (
                non_negative(self.alg_temp),
                SamplerError::BadAlgTemp {
                    alg_temp: self.alg_temp,
                },
            ),
            (
                non_negative(self.temperature),
                SamplerError::BadTemperature {
                    temperature: self.temperature,
                },
            ),
            (
                non_negative(self.cfg_scale),
                SamplerError::BadCfgScale {
                    cfg_scale: self.cfg_scale,
                },
            ),
        ] {
            if !ok {
                return Err(error);
            }
        }
        if let Some(top_p) = self.top_p
            && !(top_p > 0.0 && top_p <= 1.0)
        {
            return Err(SamplerError::BadTopP { top_p });
        }
        if self.top_k == Some(0) {
            return Err(SamplerError::ZeroTopK);
        }
        if let Some(min_p) = self.min_p
            && !(0.0..=1.0).contains(&min_p)
        {
            return Err(SamplerError::BadMinP { min_p });
        }
        self.bias.check(None)?;
        if self.cfg_scale > 0.0 && self.cuts() {
            return Err(SamplerError::CutWithCfg);
        }
        // Guidance runs the biases on both passes, where an additive bias comes out as it
        // is but a sign-dependent scale does not.
        if self.cfg_scale > 0.0 && self.bias.repetition_penalty != 1.0 {
            return Err(SamplerError::RepetitionWithCfg);
        }
        let total = prompt_len
            .saturating_add(self.gen_length)
            .saturating_add(suffix_len);
        if total > max_len {
            return Err(SamplerError::TooLong {
                prompt_len,
                gen_length: self.gen_length,
                suffix_len,
                total,
                max_len,
            });
        }
        Ok(num_blocks)
    }

    /// Whether a top-p, top-k or min-p cut leaves ids out of some row (top-p 1 and min-p
    /// 0 keep all).
    pub fn cuts(&self) -> bool {
        self.top_p.is_some_and(|p| p < 1.0)
            || self.top_k.is_some()
            || self.min_p.is_some_and(|p| p > 0.0)
    }
}
