//! `unmask bench --only scoring`: one likelihood estimate (an answer of `--answer-tokens`
//! after a prompt of `--prefix-tokens` + `--user-tokens`, ordinary token ids from
//! `--seed`) timed at every pass size of `--pass-samples`.

use serde_json::Value;
use unmask::Engine;
use unmask_bench::{self as bench, ScoringBenchOptions, Workload};

use super::{BenchArgs, ordinary_ids};
use crate::error::CliError;
use crate::values;

/// `--pass-samples`: positive counts or `auto`.
pub fn pass_sizes(text: &str) -> Result<Vec<Option<usize>>, String> {
    values::list(
        text,
        "a list of positive counts or auto, e.g. 1,4,auto",
        |s| match s {
            "auto" => Some(None),
            n => n.parse::<usize>().ok().filter(|&n| n > 0).map(Some),
        },
    )
}

pub fn run(
    args: &BenchArgs,
    engine: &Engine,
    envelope: &Value,
    on_record: &mut dyn FnMut(&Value),
) -> Result<(), CliError> {
    let prompt_tokens = args.prefix_tokens + args.user_tokens;
    let max = engine.config().max_sequence_length;
    if prompt_tokens + args.answer_tokens > max {
        return Err(CliError::usage(format!(
            "--prefix-tokens {} + --user-tokens {} + --answer-tokens {} = {} exceed the \
             model's maximum sequence length {max}",
            args.prefix_tokens,
            args.user_tokens,
            args.answer_tokens,
            prompt_tokens + args.answer_tokens
        )));
    }
    let (ordinary, avoid) = ordinary_ids(engine);
    let mut ids = Workload {
        groups: 1,
        per_group: 1,
        prefix_tokens: prompt_tokens,
        user_tokens: args.answer_tokens,
        seed: args.seed,
    }
    .requests(ordinary, &avoid)
    .remove(0)
    .ids;
    let answer = ids.split_off(prompt_tokens);
    let options = ScoringBenchOptions {
        mc_num: args.mc_num,
        pass_samples: args.pass_samples.clone().unwrap_or(vec![Some(1), None]),
        runs: 3,
    };
    eprintln!(
        "scoring: {prompt_tokens} + {} tokens, {} samples, pass sizes {:?}",
        args.answer_tokens, options.mc_num, options.pass_samples
    );
    bench::run_scoring_bench(engine, envelope, &ids, &answer, &options, on_record)?;
    Ok(())
}
