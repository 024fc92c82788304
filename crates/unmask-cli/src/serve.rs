//! `unmask serve`: the OpenAI-compatible HTTP server (crates/unmask-server).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Args;
use unmask::CacheMode;
use unmask_server::{Limits, NetConfig, SchedulerConfig, ServeConfig, ServedModel};

use crate::error::CliError;
use crate::options::{ModelArgs, RunArgs, load_engine};
use crate::values;

#[derive(Args, Debug)]
#[command(
    about = "Serve the model over HTTP with OpenAI's API (chat and text completions, streaming).",
    override_usage = "unmask serve [--model DIR] [--host 127.0.0.1] [--port 8080] [--api-key KEY] [flags]",
    after_help = "Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, \
                  GET /health, GET /metrics (Prometheus). BiCache requests that share a system \
                  prompt run in one batch; the others run side by side. Requests may add the \
                  diffusion settings steps, block_length, threshold, cache and remasking. \
                  A DiffusionGemma folder denoises up to --max-solo requests together (steps, \
                  seed and max_tokens are its settings; a shared system prompt is encoded \
                  once). \
                  Prints `listening on http://ADDR` on stdout once it accepts requests; \
                  ctrl-c or SIGTERM finishes the accepted requests within --shutdown-grace \
                  and stops (a second one stops at once). Requests must name this server in \
                  Host, come from no web page or an --allow-origin one, and POST \
                  application/json."
)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// address to listen on (127.0.0.1: this machine only; 0.0.0.0 for every interface, best
    /// with --api-key)
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// port to listen on (0: any free port, printed at start)
    #[arg(long, value_name = "PORT", default_value_t = 8080)]
    pub port: u16,
    /// clients must send `Authorization: Bearer KEY` (every route but /health)
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// the model's id in /v1/models (default: the model folder's name)
    #[arg(long, value_name = "NAME")]
    pub model_name: Option<String>,
    /// cache mode of requests that name none (bicache-dual falls back to fast-dllm-dual for
    /// requests that cannot share a prefix) [default: bicache-dual; LLaDA and Dream only]
    #[arg(long = "cache", value_name = "MODE", value_parser = values::cache_mode())]
    pub cache: Option<CacheMode>,
    /// largest max_tokens a request may ask for (default: the model's positions minus one)
    #[arg(long, value_name = "N", value_parser = values::positive)]
    pub max_tokens: Option<usize>,
    /// max_tokens of a request that gives none (DiffusionGemma: generation_config.json's
    /// max_new_tokens instead)
    #[arg(long, value_name = "N", value_parser = values::positive, default_value_t = 64)]
    pub default_max_tokens: usize,
    /// requests accepted and not yet running; past it a request gets 429
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_queue: usize,
    /// largest request body, e.g. 1M
    #[arg(long, value_name = "BYTES", value_parser = values::byte_size, default_value = "1M")]
    pub max_body: u64,
    /// requests without a shared prefix that run at once (DiffusionGemma: requests whose
    /// canvases are denoised together, one decoder pass per step)
    #[arg(long, value_name = "N", value_parser = values::positive, default_value_t = 4)]
    pub max_solo: usize,
    /// positions (prompts and answers) of the requests one shared-prefix batch holds (capped
    /// by the device's largest binding)
    #[arg(long, value_name = "N", value_parser = values::positive, default_value_t = 4096)]
    pub batch_rows: usize,
    /// open connections at most; past it the oldest connection with no request running
    /// (an idle or slow client) is closed for the new one
    #[arg(long, value_name = "N", value_parser = values::positive, default_value_t = 256)]
    pub max_connections: usize,
    /// seconds a connection has to send a request's headers, counted from when it starts
    /// waiting for them (an idle keep-alive connection closes after it too)
    #[arg(long, value_name = "S", value_parser = values::seconds, default_value = "10")]
    pub header_timeout: Duration,
    /// seconds a request has to send its whole body (408 after it)
    #[arg(long, value_name = "S", value_parser = values::seconds, default_value = "30")]
    pub body_timeout: Duration,
    /// seconds the open connections have to finish after ctrl-c or SIGTERM; then they are
    /// closed and the server exits
    #[arg(long, value_name = "S", value_parser = values::seconds, default_value = "10")]
    pub shutdown_grace: Duration,
    /// a host name the Host header may give besides this server's address and loopback
    /// names (e.g. the name of a reverse proxy; NAME or NAME:PORT; `*` for any); repeatable
    #[arg(long, value_name = "NAME")]
    pub allow_host: Vec<String>,
    /// a web origin whose pages may call this server (e.g. http://localhost:3000; `*` for
    /// any); repeatable. Without it, requests carrying an Origin header are refused
    #[arg(long, value_name = "ORIGIN")]
    pub allow_origin: Vec<String>,
    /// publish the prefix store's entries as vLLM's KV-cache events on a ZMQ PUB socket
    /// bound here, e.g. tcp://127.0.0.1:5557 (off by default)
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events: Option<String>,
    /// the topic frame of every KV-event message (default: empty)
    #[arg(long, value_name = "TOPIC", default_value = "")]
    pub kv_events_topic: String,
    /// tokens per hashed block in KV events
    #[arg(long, value_name = "N", value_parser = values::positive, default_value_t = 16)]
    pub kv_block_size: usize,
    #[command(flatten)]
    pub run: RunArgs,
}

pub fn run(args: &ServeArgs) -> Result<(), CliError> {
    let dir = args.model.dir()?;
    let options = args.run.engine_options()?;
    let gemma = crate::dgemma::is_diffusion_gemma(&dir);
    if gemma {
        if let Some(mode) = args.cache {
            return Err(CliError::usage(format!(
                "--cache {mode}: DiffusionGemma has no cache modes (its prompt's K/V are exact; \
                 a shared system turn is reused through the prefix store); leave --cache out"
            )));
        }
        if args.kv_events.is_some() {
            return Err(CliError::usage(
                "--kv-events: a DiffusionGemma server does not publish its prefix store's \
                 changes; leave it out",
            ));
        }
    }
    let cache = args.cache.unwrap_or(CacheMode::BicacheDual);
    let bicache = args.run.bicache.settings(&[cache]);
    let model_name = args.model_name.clone().unwrap_or_else(|| {
        let canonical = dir.canonicalize().unwrap_or_else(|_| dir.clone());
        canonical
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    if !args.host.is_loopback() {
        eprintln!(
            "note: listening on {} reaches this server from other machines{}",
            args.host,
            if args.api_key.is_none() {
                "; without --api-key anyone who can reach it can use it"
            } else {
                ""
            }
        );
    }
    let config = ServeConfig {
        addr: SocketAddr::new(args.host, args.port),
        api_key: args.api_key.clone(),
        max_body_bytes: usize::try_from(args.max_body).unwrap_or(usize::MAX),
        max_queue: args.max_queue,
        model_name,
        limits: Limits {
            max_tokens: args.max_tokens.unwrap_or(usize::MAX),
            default_max_tokens: args.default_max_tokens,
            default_cache: cache,
            // Set from the model once it is loaded.
            family: unmask_server::Family::MaskedDiffusion,
        },
        scheduler: SchedulerConfig {
            max_solo: args.max_solo,
            batch_rows: args.batch_rows,
            depth: bicache.depth,
            refresh_every: bicache.refresh_every,
            anchor_ratio: bicache.anchor_ratio,
            adaptive: bicache.adaptive,
            full_canvas: bicache.full_canvas,
            kv_events: None,
        },
        net: NetConfig {
            max_connections: args.max_connections,
            header_timeout: args.header_timeout,
            body_timeout: args.body_timeout,
            shutdown_grace: args.shutdown_grace,
        },
        allow_hosts: args.allow_host.clone(),
        allow_origins: args.allow_origin.clone(),
        kv_events: args
            .kv_events
            .clone()
            .map(|endpoint| unmask_server::KvEventsConfig {
                endpoint,
                topic: args.kv_events_topic.clone(),
                block_size: args.kv_block_size,
            }),
    };
    let load = move || {
        if gemma {
            unmask::DgemmaEngine::load(&dir, &options)
                .map(ServedModel::DiffusionGemma)
                .map_err(|e| CliError::from(e).report())
        } else {
            load_engine(&dir, &options)
                .map(ServedModel::Masked)
                .map_err(|e| e.report())
        }
    };
    unmask_server::serve(config, load, |addr, loaded| {
        eprintln!(
            "serving {} positions per request; ctrl-c to stop",
            loaded.max_sequence_length
        );
        // The first line on stdout, for scripts that start the server on port 0.
        println!("listening on http://{addr}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    })
    .map_err(|e| CliError::runtime(e.to_string()))
}
