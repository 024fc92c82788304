//! `unmask score`: the log-likelihood of one or more answers after a prompt, by LLaDA's
//! Monte Carlo estimate, ranked (the way multiple-choice evaluations pick an answer).

use clap::{ArgGroup, Args};
use serde_json::json;
use unmask::{Engine, LikelihoodParams, Prompt};
use unmask_core::likelihood::{DEFAULT_MC_BATCH, DEFAULT_MC_NUM};

use crate::error::CliError;

mod choices;
mod texts;
use crate::options::{self, EngineArgs, ModelArgs, PromptArgs};
use crate::{output, values};

#[derive(Args, Debug)]
#[command(
    about = "Score answers by their log-likelihood after a prompt (Monte Carlo estimate).",
    override_usage = "unmask score [--model <DIR>] (--prompt <TEXT> [--system <TEXT>] | --prompt-ids <IDS>) (--answer <TEXT>... | --answer-ids <IDS>...) [OPTIONS]\n       unmask score [--model <DIR>] --set <FILE> [--limit <N>] [OPTIONS]\n       unmask score [--model <DIR>] --text-file <FILE>... [--prompt <TEXT> | --prompt-ids <IDS>] [OPTIONS]",
    after_help = "Each answer's estimate is LLaDA's (get_log_likelihood.py): --mc-num samples, each\n\
                  masking k of the answer's L tokens (k stratified over --mc-batch samples), the\n\
                  masked tokens' cross-entropy over k/L averaged and negated: a lower bound on\n\
                  log p(answer | prompt) in nats. A chat prompt ends with the assistant's header,\n\
                  so an answer is scored as the reply; answer text is tokenized as it is. Answers\n\
                  are printed best first; every answer is scored over the same seed's draws.\n\n\
                  With --set, each item of a task set with \"choices\" (tools/add_choices.py) is a\n\
                  multiple-choice question: every choice is scored as the reply \"#### <choice>\"\n\
                  and the end of the turn, the best is the pick, and the accuracy is printed by\n\
                  task.\n\n\
                  With --text-file, each file's text is scored as it is, after no prompt (the\n\
                  text's own bound) or the one given; a text longer than the model's positions\n\
                  is scored in windows of half of them, each after the tokens before it that\n\
                  fit, and their estimates summed. Printed: nats, windows, and the perplexities\n\
                  the bound gives (per token and per word, and bits per byte).",
    group(ArgGroup::new("input").args(["prompt", "prompt_ids", "set"])),
    group(ArgGroup::new("answers").args(["answer", "answer_ids"]).multiple(true).conflicts_with_all(["set", "text_file"]))
)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: PromptArgs,
    /// an answer to score (repeat for several)
    #[arg(long, value_name = "TEXT")]
    answer: Vec<String>,
    /// an answer's token ids (repeat for several)
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    answer_ids: Vec<::std::vec::Vec<u32>>,
    /// Monte Carlo samples per answer (default 128)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    mc_num: Option<usize>,
    /// samples whose mask counts are stratified together; divides --mc-num (default 16)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    mc_batch: Option<usize>,
    /// classifier-free guidance weight (default 0: none)
    #[arg(long, value_name = "W")]
    cfg_scale: Option<f32>,
    /// seed of the masks' draws (default 0)
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// samples one forward pass carries side by side (default: as many as fit 4096 rows,
    /// one storage binding, 1 GiB of buffers and the memory budget); changes the speed, not
    /// the estimate
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    pass_samples: Option<usize>,
    /// a task set whose items have "choices": score every item's choices and report the
    /// accuracy of the best-scored one
    #[arg(long, value_name = "FILE", conflicts_with_all = ["system", "prompt", "prompt_ids"])]
    set: Option<std::path::PathBuf>,
    /// with --set: only the first N items
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, requires = "set")]
    limit: Option<usize>,
    /// a text file to score whole, in rolling windows when it is long (repeat for several)
    #[arg(long, value_name = "FILE", conflicts_with = "set")]
    text_file: Vec<std::path::PathBuf>,
    /// print one JSON object: every answer's estimate, standard error and sample losses
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(args: &ScoreArgs) -> Result<(), CliError> {
    let dir = args.model.dir()?;
    if crate::dgemma::is_diffusion_gemma(&dir) {
        return Err(CliError::usage(
            "score: DiffusionGemma's decoder denoises whole canvases with self-conditioning; \
             the masked-token estimate is defined for LLaDA and Dream models",
        ));
    }
    let params = LikelihoodParams {
        mc_num: args.mc_num.unwrap_or(DEFAULT_MC_NUM),
        batch: args.mc_batch.unwrap_or(DEFAULT_MC_BATCH),
        cfg_scale: args.cfg_scale.unwrap_or(0.0),
        seed: args.seed.unwrap_or(0),
        pass_samples: args.pass_samples,
    };
    params.check().map_err(|e| {
        let flag = match e.field {
            "mc_batch" => "--mc-batch",
            "mc_num" => "--mc-num",
            "pass_samples" => "--pass-samples",
            _ => "--cfg-scale",
        };
        CliError::usage(format!(
            "{flag}: expected {}, found {}",
            e.expected, e.found
        ))
    })?;
    let engine = options::load_engine(&dir, &args.engine.options()?)?;
    if let Some(set) = &args.set {
        return choices::run(&engine, set, args.limit, &params, args.json);
    }
    if !args.text_file.is_empty() {
        if args.input.system.is_some() && args.input.prompt.is_none() {
            return Err(CliError::usage(
                "--system needs --prompt TEXT (the chat template frames a user turn after it)",
            ));
        }
        let given = args.input.prompt.is_some() || args.input.prompt_ids.is_some();
        let prompt = if given {
            prompt_ids(&engine, args)?
        } else {
            Vec::new()
        };
        return texts::run(&engine, &args.text_file, &prompt, &params, args.json);
    }
    if args.input.prompt.is_none() && args.input.prompt_ids.is_none() {
        return Err(CliError::usage(
            "score: give --prompt TEXT or --prompt-ids IDS with answers, --set FILE, or \
             --text-file FILE",
        ));
    }
    if args.answer.is_empty() && args.answer_ids.is_empty() {
        return Err(CliError::usage(
            "score: give --answer TEXT or --answer-ids IDS (one or more), or --set FILE",
        ));
    }
    let prompt = prompt_ids(&engine, args)?;
    let mut answers: Vec<(String, Vec<u32>)> = Vec::new();
    for text in &args.answer {
        answers.push((text.clone(), engine.encode_text(text)?));
    }
    for ids in &args.answer_ids {
        options::check_ids(&engine, "answer-ids", ids)?;
        let label = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        answers.push((label, ids.clone()));
    }
    let mut scored = Vec::with_capacity(answers.len());
    for (label, ids) in answers {
        let l = engine.log_likelihood(&prompt, &ids, &params)?;
        eprintln!(
            "[score] {label:?}: {:.4} ± {:.4} nats over {} tokens ({} sequences in {} passes, \
             {:.2} s)",
            l.log_likelihood,
            l.standard_error,
            l.answer_tokens,
            l.sequences,
            l.forward_passes,
            l.total_s
        );
        scored.push((label, ids, l));
    }
    // Best first; equal estimates keep the order given.
    let mut order: Vec<usize> = (0..scored.len()).collect();
    order.sort_by(|&a, &b| {
        scored[b]
            .2
            .log_likelihood
            .total_cmp(&scored[a].2.log_likelihood)
    });
    if args.json {
        let answers: Vec<_> = order
            .iter()
            .map(|&i| {
                let (label, ids, l) = &scored[i];
                json!({
                    "answer": label,
                    "ids": ids,
                    "log_likelihood": l.log_likelihood,
                    "standard_error": l.standard_error,
                    "per_token": l.log_likelihood / l.answer_tokens as f64,
                    "answer_tokens": l.answer_tokens,
                    "sample_losses": l.sample_losses,
                    "sequences": l.sequences,
                    "forward_passes": l.forward_passes,
                    "pass_samples": l.pass_samples,
                    "total_s": l.total_s,
                })
            })
            .collect();
        let mut v = json_header(&engine, &prompt, &params);
        v["cfg_scale"] = json!(params.cfg_scale);
        v["answers"] = json!(answers);
        return output::line(&v.to_string());
    }
    for &i in &order {
        let (label, _, l) = &scored[i];
        output::line(&format!(
            "{:>12.4} ± {:.4}  {label}",
            l.log_likelihood, l.standard_error
        ))?;
    }
    Ok(())
}

/// The fields a `--json` answer of scores after a prompt starts with: model, adapter, the
/// prompt's ids and the estimate's settings.
fn json_header(engine: &Engine, prompt: &[u32], params: &LikelihoodParams) -> serde_json::Value {
    json!({
        "model": engine.dir().display().to_string(),
        "adapter": engine.ctx().describe(),
        "prompt_ids": prompt,
        "mc_num": params.mc_num,
        "mc_batch": params.batch,
        "seed": params.seed,
    })
}

/// The prompt's ids: the chat template over `--system` and `--prompt`, or `--prompt-ids`.
fn prompt_ids(engine: &Engine, args: &ScoreArgs) -> Result<Vec<u32>, CliError> {
    let prompt = args.input.prompt(args.input.system.clone())?;
    if let Prompt::Ids(ids) = &prompt {
        options::check_ids(engine, "prompt-ids", ids)?;
    }
    Ok(engine.encode_prompt(&prompt)?)
}
