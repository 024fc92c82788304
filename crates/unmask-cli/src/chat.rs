//! `unmask chat`: a multi-turn conversation read line by line from stdin.

use std::io::{BufRead, IsTerminal};

use clap::Args;
use serde_json::json;
use unmask::{Prompt, Request};
use unmask_core::chat::Message;

use crate::error::CliError;
use crate::generate::{self, bicache_json, summary, timings_json};
use crate::options::{self, CacheArgs, GenerationArgs, ModelArgs, RunArgs};
use crate::output;

#[derive(Args, Debug)]
#[command(
    about = "Chat with the model: each line read from stdin is a user turn.",
    override_usage = "unmask chat [--model <DIR>] [--system <TEXT>] [--cache <MODE>] [--depth <B>] [OPTIONS]",
    after_help = "Commands: /reset clears the conversation (the system message stays), /quit or\n\
                  end of input ends it. Every answer becomes an assistant turn of the history.\n\
                  Piped input works: `printf 'Hi\\nWhy?\\n' | unmask chat` prints two answers.\n\
                  With --cache bicache the shared prefix is everything before the last user turn\n\
                  (the system message and the earlier turns)."
)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// a system message at the start of the conversation
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    #[command(flatten)]
    generation: GenerationArgs,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    run: RunArgs,
    /// print one JSON object per answer (one per line) instead of the text
    #[arg(long)]
    json: bool,
}

pub fn run(args: &ChatArgs) -> Result<(), CliError> {
    let (params, decode) = args.generation.params()?;
    let cache = args.cache.mode;
    let bicache = args.run.bicache.settings(&[cache]);
    let engine_options = args.run.engine_options()?;
    let json = args.json;
    let system = args.system.as_deref().map(Message::system);
    let dir = args.model.dir()?;
    let engine = options::load_engine(&dir, &engine_options)?;
    if engine.tokenizer().is_none() {
        return Err(CliError::runtime(format!(
            "{} has no tokenizer.json: chat needs one (use `unmask generate --prompt-ids` with token ids)",
            dir.display()
        )));
    }
    let interactive = std::io::stdin().is_terminal();
    let live = !json && std::io::stdout().is_terminal();
    if interactive {
        eprintln!("type a message; /reset clears the conversation, /quit or Ctrl-D ends it");
    }

    let mut history: Vec<Message> = system.iter().cloned().collect();
    let mut turn = 0;
    let mut failed = 0;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            output::partial("> ")?;
        }
        let Some(line) = lines.next() else {
            break;
        };
        let line = line.map_err(|e| CliError::context("cannot read stdin", e))?;
        let text = line.trim();
        match text {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                history = system.iter().cloned().collect();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ if text.starts_with('/') && !text.contains(' ') => {
                eprintln!("unknown command {text}: /reset clears the conversation, /quit ends it");
                continue;
            }
            _ => {}
        }
        history.push(Message::user(text));
        let request = Request {
            prompt: Prompt::Chat(history.clone()),
            params: params.clone(),
            decode,
            cache,
            prefix_len: None,
            recompute_all: false,
            depth: bicache.depth,
            refresh_every: bicache.refresh_every,
            span: None,
            anchor_ratio: bicache.anchor_ratio,
            adaptive: bicache.adaptive,
            record_picks: false,
            suffix: Vec::new(),
            full_canvas: bicache.full_canvas,
            logprobs: false,
            top_logprobs: 0,
        };
        turn += 1;
        match generate::generate(&engine, &request, live) {
            Ok(g) => {
                let answer = g.text.clone().unwrap_or_default();
                if json {
                    let obj = json!({
                        "turn": turn,
                        "user": text,
                        "prompt_tokens": g.prompt_ids.len(),
                        "cache": g.cache.name(),
                        "prefix_len": g.prefix_len,
                        "bicache": bicache_json(&g),
                        "acache": g.acache,
                        "ids": g.ids,
                        "text": answer,
                        "timings": timings_json(&g),
                    });
                    output::line(&obj.to_string())?;
                } else {
                    output::line(&answer)?;
                }
                if interactive {
                    eprintln!("{}", summary(&g));
                }
                history.push(Message::assistant(answer));
            }
            Err(e) => {
                // The turn is dropped so the conversation can go on (or be /reset).
                history.pop();
                failed += 1;
                eprintln!("{}", e.report());
                if interactive {
                    eprintln!("(the turn was dropped; /reset clears the conversation)");
                }
                if json {
                    output::line(
                        &json!({ "turn": turn, "user": text, "error": e.message }).to_string(),
                    )?;
                }
            }
        }
    }
    if failed > 0 {
        return Err(CliError::runtime(format!(
            "{failed} of {turn} turns failed (see the errors above)"
        )));
    }
    Ok(())
}
