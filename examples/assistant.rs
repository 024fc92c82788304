//! A desktop assistant: one long system prompt, many questions. Every question is answered
//! twice — without a cache and with BiCache, which keeps the system prompt's K/V in a store
//! shared by all requests — to show what reusing the shared prefix saves. Then all the
//! questions are answered at once, as a server would: one batch whose requests share the
//! entry and run in the same forward passes.
//!
//!     cargo run --release --example assistant -- [MODEL_DIR] [SYSTEM_FILE] [QUESTIONS_FILE] [--depth B]
//!
//! MODEL_DIR defaults to `models/tiny`, else the test fixture `tests/fixtures/tiny`.
//! SYSTEM_FILE holds the system prompt (default: the bundled demo prompt, a table of members,
//! data/tasks/demo-system.txt); QUESTIONS_FILE one question per line (default: five questions
//! about that table, which the bundled model answers). The BiCache depth is `--depth B`, else `UNMASK_DEPTH`,
//! else the model's `bicache_depth.json`, else half the layers.

use std::path::Path;

use unmask::{CacheMode, Engine, EngineOptions, Generation, GenerationParams, Request};

/// The bundled demo system prompt (a table of members), which models/tiny was trained to read.
const SYSTEM: &str = include_str!("../data/tasks/demo-system.txt");

const QUESTIONS: [&str; 5] = [
    "What is the city of Bella?",
    "What is the pet of Martin?",
    "Give the record of Peter.",
    "What is the sport of Bella and of Martin?",
    "What is the colour of Peter?",
];

struct Args {
    model: String,
    system: String,
    questions: Vec<String>,
    depth: Option<usize>,
}

fn parse_args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut positional = Vec::new();
    let mut depth = std::env::var("UNMASK_DEPTH")
        .ok()
        .map(|d| d.trim().parse::<usize>())
        .transpose()
        .map_err(|e| format!("UNMASK_DEPTH: {e}"))?;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if let Some(v) = a.strip_prefix("--depth=") {
            depth = Some(v.parse().map_err(|e| format!("--depth {v}: {e}"))?);
        } else if a == "--depth" {
            let v = args.next().ok_or("--depth needs a number")?;
            depth = Some(v.parse().map_err(|e| format!("--depth {v}: {e}"))?);
        } else {
            positional.push(a);
        }
    }
    let mut positional = positional.into_iter();
    let model = positional.next().unwrap_or_else(|| {
        let bundled = "models/tiny";
        if Path::new(bundled).is_dir() {
            bundled.into()
        } else {
            "tests/fixtures/tiny".into()
        }
    });
    let system = match positional.next() {
        Some(path) => std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?,
        None => SYSTEM.to_string(),
    };
    let questions = match positional.next() {
        Some(path) => std::fs::read_to_string(&path)
            .map_err(|e| format!("{path}: {e}"))?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect(),
        None => QUESTIONS.iter().map(|q| q.to_string()).collect(),
    };
    Ok(Args {
        model,
        system: system.trim().to_string(),
        questions,
        depth,
    })
}

/// The system prompt cut to whole sentences so that it, the longest question and the answer
/// fit the model (the bundled tiny models have few positions).
fn fit_system(
    engine: &Engine,
    system: &str,
    questions: &[String],
    params: &GenerationParams,
) -> Result<String, unmask::EngineError> {
    let max = engine.config().max_sequence_length;
    let sentences: Vec<&str> = system.split_inclusive(". ").collect();
    for keep in (1..=sentences.len()).rev() {
        let text = sentences[..keep].concat();
        let mut fits = true;
        for q in questions {
            let len = engine
                .encode_prompt(&Request::chat(Some(&text), q).prompt)?
                .len();
            if len + params.gen_length > max {
                fits = false;
                break;
            }
        }
        if fits {
            if keep < sentences.len() {
                eprintln!(
                    "note: the system prompt was cut to its first {keep} of {} sentences to fit \
                     the model's {max} positions",
                    sentences.len()
                );
            }
            return Ok(text);
        }
    }
    Err(unmask::EngineError::Invalid {
        field: "system",
        expected: format!(
            "a system prompt that fits the model's {max} positions with these questions"
        ),
        found: "none of its sentences fits".into(),
    })
}

fn question(
    system: &str,
    question: &str,
    params: &GenerationParams,
    cache: CacheMode,
    depth: Option<usize>,
) -> Request {
    let mut request = Request::chat(Some(system), question)
        .with_params(params.clone())
        .with_cache(cache);
    // The default split makes everything before the question (the system turn) the prefix.
    request.depth = depth;
    request
}

fn ask(
    engine: &Engine,
    system: &str,
    q: &str,
    params: &GenerationParams,
    cache: CacheMode,
    depth: Option<usize>,
) -> Result<Generation, unmask::EngineError> {
    engine.generate(&question(system, q, params, cache, depth))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let engine = Engine::load(&args.model, &EngineOptions::default())?;
    let n_layers = engine.config().n_layers;
    let depth = match (args.depth, engine.depth_table()) {
        (Some(d), _) => Some(d),
        (None, Some(_)) => None,
        (None, None) => Some((n_layers / 2).max(1)),
    };
    eprintln!(
        "{} on {}: {} layers; BiCache depth {}",
        args.model,
        engine.ctx().info.name,
        n_layers,
        match depth {
            Some(d) => d.to_string(),
            None => "from the model's depth table".into(),
        }
    );
    // Two blocks of 32, one token per step, greedy: the same settings for both runs.
    let params = GenerationParams {
        gen_length: 64,
        steps: 64,
        block_length: 32,
        ..GenerationParams::default()
    };
    let system = fit_system(&engine, &args.system, &args.questions, &params)?;

    // Kernels compile on first use; keep that out of the timings.
    let warm = GenerationParams {
        gen_length: 8,
        steps: 8,
        block_length: 8,
        ..GenerationParams::default()
    };
    engine.generate(&Request::chat(None, "Hello").with_params(warm))?;

    let mut speedups = Vec::new();
    let mut one_by_one = Vec::new();
    for (i, question) in args.questions.iter().enumerate() {
        let plain = ask(&engine, &system, question, &params, CacheMode::None, None)?;
        let cached = ask(
            &engine,
            &system,
            question,
            &params,
            CacheMode::Bicache,
            depth,
        )?;
        let answer = cached.text.clone().unwrap_or_default();
        let (t0, t1) = (plain.timings.total_s, cached.timings.total_s);
        let reuse = match &cached.bicache {
            Some(b) => match &b.fallback {
                Some(why) => format!("no reuse ({why})"),
                None => format!(
                    "{} (depth {}, prefix {} tokens = {}% of the request)",
                    if b.hit { "hit" } else { "miss, entry built" },
                    b.depth,
                    b.entry_tokens,
                    b.ratio
                ),
            },
            None => "no report".into(),
        };
        println!("Q{}: {question}", i + 1);
        println!("A: {}", answer.trim());
        if plain.ids != cached.ids {
            println!(
                "   (without a cache: {})",
                plain.text.as_deref().unwrap_or_default().trim()
            );
        }
        println!(
            "   {t0:.3} s without a cache, {t1:.3} s with BiCache ({:.2}x); {reuse}\n",
            t0 / t1.max(1e-9)
        );
        speedups.push(t0 / t1.max(1e-9));
        one_by_one.push(cached);
    }

    // The serving case: every question at once, one forward pass per step for all of them.
    let requests: Vec<Request> = args
        .questions
        .iter()
        .map(|q| question(&system, q, &params, CacheMode::Bicache, depth))
        .collect();
    let began = std::time::Instant::now();
    let batch = engine.generate_batch(&requests);
    let wall = began.elapsed().as_secs_f64();
    let sequential: f64 = one_by_one.iter().map(|g| g.timings.total_s).sum();
    let mut same = 0;
    let mut batch_depth = None;
    for (g, alone) in batch.iter().zip(&one_by_one) {
        let g = g.as_ref().map_err(|e| e.to_string())?;
        same += usize::from(g.ids == alone.ids);
        batch_depth = g.bicache.as_ref().map(|b| (b.depth, b.batch));
    }
    if let Some((b, n)) = batch_depth {
        println!(
            "all {} questions as one batch ({n} per forward, depth {b}): {wall:.3} s, against \
             {sequential:.3} s one after another with BiCache ({:.2}x); {same} answers identical \
             to the ones above (they can differ only where a question's own depth was larger)\n",
            requests.len(),
            sequential / wall.max(1e-9)
        );
    }

    let s = engine.prefix_store_stats();
    println!(
        "store: {} entr{} ({} tokens, {:.1} KiB); {} hits, {} misses, {} inserts, {} evictions, {} refused",
        s.entries,
        if s.entries == 1 { "y" } else { "ies" },
        s.tokens,
        s.bytes as f64 / 1024.0,
        s.hits,
        s.misses,
        s.inserts,
        s.evictions,
        s.rejected
    );
    if !speedups.is_empty() {
        let mean = speedups.iter().sum::<f64>() / speedups.len() as f64;
        println!(
            "mean speed-up with BiCache: {mean:.2}x over {} questions",
            speedups.len()
        );
    }
    Ok(())
}
