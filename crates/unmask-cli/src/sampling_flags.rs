//! The sampler's flags shared by the generating commands: the denoising schedule, the
//! token choice (temperature, cuts, guidance, logit biases and penalties) and `--raw`, and
//! the generation parameters they give.

use clap::{Args, ValueEnum};
use unmask::{GenerationParams, LogitBias, Remasking, Schedule};
use unmask_core::error::SamplerError;
use unmask_core::tokenizer::DecodeMode;

use crate::error::CliError;
use crate::options::{DEFAULT_BLOCK_LENGTH, DEFAULT_GEN_LENGTH};
use crate::values;

/// `--confidence-precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ConfidencePrecision {
    F32,
    Bf16,
}

/// The denoising schedule and the sampler's settings.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// tokens to generate (default 64)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    pub gen_length: Option<usize>,
    /// denoising steps over all blocks (default: gen-length)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    pub steps: Option<usize>,
    /// semi-autoregressive block size (default 32, or gen-length when 32 does not divide it)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    pub block_length: Option<usize>,
    /// 0 is greedy (default 0)
    #[arg(long, value_name = "T", value_parser = values::non_negative, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// which predictions a step keeps: low_confidence (default), random, topk_margin or
    /// entropy; Dream's alg names maskgit_plus (= low_confidence) and origin (= random) too
    #[arg(long, alias = "alg", value_name = "R", value_parser = values::choice(Remasking::NAMES, Remasking::parse))]
    pub remasking: Option<Remasking>,
    /// how many positions a step unmasks: llada (blocks split evenly over their steps) or
    /// dream (the timestep schedule; Fast-dLLM's block port with several blocks). Default:
    /// the model family's
    #[arg(long, value_name = "S", value_parser = values::choice(["llada", "dream"], |s: &str| Some(s.to_string())))]
    pub schedule: Option<String>,
    /// the last timestep of Dream's schedule, in (0, 1) (default 1e-3; implies --schedule dream)
    #[arg(long, value_name = "E", value_parser = values::fraction::<f64>, allow_negative_numbers = true)]
    pub eps: Option<f64>,
    /// draw a step's positions by softmax(confidence / T) instead of highest first
    /// (Dream's alg_temp; default 0: off)
    #[arg(long, value_name = "T", value_parser = values::non_negative, allow_negative_numbers = true)]
    pub alg_temp: Option<f32>,
    /// nucleus cut, in (0, 1]: each position samples (and ranks) among its most probable
    /// tokens up to this probability (Dream's top_p; default: off)
    #[arg(long, value_name = "P", value_parser = values::fraction::<f32>, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// each position samples (and ranks) among its K most likely tokens (Dream's top_k).
    /// Default: the model folder's, as Dream's diffusion_generate applies it (Dream:
    /// generation_config.json's top_k, else config.json's, else 50; LLaDA: none); 0: no cut
    #[arg(long, value_name = "K", value_parser = values::whole, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// min-p cut, from 0 to 1: each position samples (and ranks) among the tokens at least
    /// P times as probable as its most probable one (vLLM's min_p; default 0: off)
    #[arg(long, value_name = "P", value_parser = values::share, allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// classifier-free guidance weight (default 0: off)
    #[arg(long, value_name = "W", value_parser = values::non_negative, allow_negative_numbers = true)]
    pub cfg_scale: Option<f32>,
    /// commit every prediction at least this confident, in (0, 1] (Fast-dLLM)
    #[arg(long, value_name = "T", value_parser = values::fraction::<f32>, allow_negative_numbers = true)]
    pub threshold: Option<f32>,
    /// random seed for temperature > 0 and random remasking (default 0)
    #[arg(long, value_name = "S", value_parser = values::seed, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// never predict the end-of-text token
    #[arg(long)]
    pub logits_eos_inf: bool,
    /// commit end-of-text / end-of-turn predictions last
    #[arg(long)]
    pub confidence_eos_eot_inf: bool,
    /// precision of the confidences that rank positions: bf16 (default) rounds them as the
    /// reference run in bfloat16 does (its softmax returns bf16); f32 keeps them, as a float32
    /// reference does (tools/llada_ref.py, tools/llada_torch.py --dtype f32). Near-ties can
    /// commit different positions under the two
    #[arg(long, value_name = "P")]
    pub confidence_precision: Option<ConfidencePrecision>,
    /// add BIAS (-100 to 100) to token ID's logit before the token choice, e.g. 42=-100
    /// (bans 42); repeat for several ids (OpenAI's logit_bias)
    #[arg(long, value_name = "ID=BIAS", value_parser = values::token_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// subtract P (-2 to 2) from the logit of every token already in the canvas (end tokens
    /// aside), at every step (OpenAI's presence_penalty; default 0)
    #[arg(long, value_name = "P", value_parser = values::penalty, allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    /// subtract P (-2 to 2) per occurrence in the canvas (OpenAI's frequency_penalty;
    /// default 0)
    #[arg(long, value_name = "P", value_parser = values::penalty, allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    /// divide the positive logits and multiply the negative ones of the tokens in the
    /// prompt or already in the canvas (end tokens aside) by R, above 0 (vLLM's and
    /// transformers' repetition_penalty; default 1: off; 1.1 to 1.3 are usual)
    #[arg(long, value_name = "R", value_parser = values::repetition_penalty, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f32>,
}

/// Defaults of the generation flags that differ between commands.
#[derive(Clone, Copy, Debug)]
pub struct GenerationDefaults {
    pub gen_length: usize,
    /// True: one block over the whole canvas. False: `DEFAULT_BLOCK_LENGTH` when it divides
    /// the generation length, else the generation length.
    pub single_block: bool,
}

impl GenerationDefaults {
    /// `generate`, `chat` and `trace`: 64 tokens in blocks of 32.
    pub const STANDARD: Self = Self {
        gen_length: DEFAULT_GEN_LENGTH,
        single_block: false,
    };
}

impl SamplingArgs {
    /// The flags given that only the masked-diffusion sampler (LLaDA, Dream) reads:
    /// DiffusionGemma's sampler takes its schedule and bound from its model folder (and
    /// `--logit-bias` alone of the biases), so these are refused by name on it rather than
    /// ignored.
    pub fn masked_only_given(&self) -> Vec<&'static str> {
        [
            ("--block-length", self.block_length.is_some()),
            ("--temperature", self.temperature.is_some()),
            ("--remasking", self.remasking.is_some()),
            ("--schedule", self.schedule.is_some()),
            ("--eps", self.eps.is_some()),
            ("--alg-temp", self.alg_temp.is_some()),
            ("--top-p", self.top_p.is_some()),
            ("--top-k", self.top_k.is_some()),
            ("--min-p", self.min_p.is_some()),
            ("--cfg-scale", self.cfg_scale.is_some()),
            ("--threshold", self.threshold.is_some()),
            ("--logits-eos-inf", self.logits_eos_inf),
            ("--confidence-eos-eot-inf", self.confidence_eos_eot_inf),
            (
                "--confidence-precision",
                self.confidence_precision.is_some(),
            ),
            ("--presence-penalty", self.presence_penalty.is_some()),
            ("--frequency-penalty", self.frequency_penalty.is_some()),
            ("--repetition-penalty", self.repetition_penalty.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// The generation parameters, with `defaults` for the flags that are not given, checked
    /// as the sampler will check them, so a bad combination is reported before the model
    /// loads.
    pub fn params(&self, defaults: GenerationDefaults) -> Result<GenerationParams, CliError> {
        let gen_length = self.gen_length.unwrap_or(defaults.gen_length);
        let block_length = match self.block_length {
            Some(b) => b,
            None if !defaults.single_block && gen_length.is_multiple_of(DEFAULT_BLOCK_LENGTH) => {
                DEFAULT_BLOCK_LENGTH
            }
            None => gen_length,
        };
        let params = GenerationParams {
            gen_length,
            steps: self.steps.unwrap_or(gen_length),
            block_length,
            temperature: self.temperature.unwrap_or(0.0),
            remasking: self.remasking.unwrap_or(Remasking::LowConfidence),
            cfg_scale: self.cfg_scale.unwrap_or(0.0),
            threshold: self.threshold,
            logits_eos_inf: self.logits_eos_inf,
            confidence_eos_eot_inf: self.confidence_eos_eot_inf,
            seed: self.seed.unwrap_or(0),
            round_confidence_bf16: match self.confidence_precision {
                Some(p) => p == ConfidencePrecision::Bf16,
                None => GenerationParams::default().round_confidence_bf16,
            },
            schedule: match (self.schedule.as_deref(), self.eps) {
                (Some("llada"), Some(_)) => {
                    return Err(CliError::usage(
                        "--eps belongs to --schedule dream, not --schedule llada",
                    ));
                }
                (Some("llada"), None) => Schedule::Llada,
                (Some(_), eps) | (None, eps @ Some(_)) => Schedule::Dream {
                    eps: eps.unwrap_or(1e-3),
                },
                (None, None) => Schedule::Auto,
            },
            alg_temp: self.alg_temp.unwrap_or(0.0),
            top_p: self.top_p,
            // None takes the model's default (`ModelConfig::default_top_k`); a k past the
            // vocabulary keeps every id, so 0 ("no cut") is u32::MAX.
            top_k: self.top_k.map(|k| match k {
                0 => u32::MAX,
                k => u32::try_from(k).unwrap_or(u32::MAX),
            }),
            min_p: self.min_p,
            bias: LogitBias {
                presence_penalty: self.presence_penalty.unwrap_or(0.0),
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
                repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
                ..LogitBias::with_ids(self.logit_bias.clone()).map_err(bias_error)?
            },
        };
        params.bias.check(None).map_err(bias_error)?;
        params
            .validate(1, 0, usize::MAX)
            .map_err(|e| schedule_error(&params, e))?;
        Ok(params)
    }
}

/// The sampling flags and `--raw`.
#[derive(Args, Clone, Debug)]
pub struct GenerationArgs {
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// decode every generated token (default: stop at end of turn)
    #[arg(long)]
    pub raw: bool,
}

impl GenerationArgs {
    /// The generation parameters (with the standard defaults) and the decode mode.
    pub fn params(&self) -> Result<(GenerationParams, DecodeMode), CliError> {
        let params = self.sampling.params(GenerationDefaults::STANDARD)?;
        let decode = if self.raw {
            DecodeMode::Raw
        } else {
            DecodeMode::Clean
        };
        Ok((params, decode))
    }
}

/// A `LogitBias` objection, in terms of `--logit-bias`.
fn bias_error(e: SamplerError) -> CliError {
    match e {
        SamplerError::BadLogitBias { expected, found } => {
            CliError::usage(format!("--logit-bias: expected {expected}, found {found}"))
        }
        other => CliError::usage(other.to_string()),
    }
}

/// The sampler's objection, in terms of the flags.
fn schedule_error(p: &GenerationParams, e: SamplerError) -> CliError {
    let blocks = p.gen_length / p.block_length.max(1);
    CliError::usage(match e {
        SamplerError::GenNotMultipleOfBlock { .. } => format!(
            "--gen-length {} is not a multiple of --block-length {}",
            p.gen_length, p.block_length
        ),
        SamplerError::TooFewSteps { .. } => format!(
            "--steps {} is fewer than the {blocks} blocks (--gen-length {} / --block-length {}); \
             every block needs at least one step",
            p.steps, p.gen_length, p.block_length
        ),
        SamplerError::StepsNotMultipleOfBlocks { .. } => format!(
            "--steps {} is not a multiple of the {blocks} blocks (--gen-length {} / --block-length {})",
            p.steps, p.gen_length, p.block_length
        ),
        other => format!("invalid generation flags: {other}"),
    })
}
