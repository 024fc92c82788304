//! `unmask serve`: an OpenAI-compatible HTTP server over one model: a LLaDA or Dream
//! `Engine`, or a `DgemmaEngine`.
//!
//! The HTTP side runs on tokio (axum); the engine runs on its own thread. For LLaDA and
//! Dream (`scheduler::run`) it steps every running request in a fair round and batches
//! BiCache requests that share a system prompt; for DiffusionGemma
//! (`scheduler::run_gemma`) it denoises up to `max_solo` requests' canvases in one decoder
//! pass per step, each system turn through the prefix store. Handlers and the engine thread
//! talk through channels: a handler sends a `Job` and reads its events (accepted, final text
//! as it appears, the canvas, the result).

mod access;
mod answer;
pub mod api;
pub mod error;
mod fields;
pub mod kv_events;
pub mod logprobs;
pub mod metrics;
pub mod net;
mod routes;
pub mod scheduler;
mod scoring;
pub mod text;
mod tokenize;
pub mod vllm_metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use unmask::{DgemmaEngine, Engine};

pub use access::Access;
pub use api::{Family, Limits};
pub use kv_events::KvEventsConfig;
pub use net::NetConfig;
pub use scheduler::SchedulerConfig;

/// How the server listens and what it accepts.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    /// Clients must send `Authorization: Bearer KEY` (all routes but /health).
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// Requests accepted and not yet running, beyond which a request gets 429.
    pub max_queue: usize,
    /// The model's id in /v1/models and the `model` field requests may give.
    pub model_name: String,
    pub limits: Limits,
    pub scheduler: SchedulerConfig,
    /// Connection cap, timeouts and the shutdown's grace period.
    pub net: NetConfig,
    /// `--allow-host`: more names the `Host` header may give.
    pub allow_hosts: Vec<String>,
    /// `--allow-origin`: web origins that may call the server.
    pub allow_origins: Vec<String>,
    /// Publish the prefix store's changes as vLLM's KV-cache events.
    pub kv_events: Option<KvEventsConfig>,
}

/// What went wrong starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot load the model: {0}")]
    Load(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the server stopped: {0}")]
    Io(#[from] std::io::Error),
    #[error("the engine thread panicked")]
    EnginePanicked,
    #[error("{0}")]
    KvEvents(String),
}

/// The model a server runs.
// One value per server, moved once to the engine thread: its size costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum ServedModel {
    /// LLaDA or Dream.
    Masked(Engine),
    DiffusionGemma(DgemmaEngine),
}

impl ServedModel {
    pub fn family(&self) -> Family {
        match self {
            Self::Masked(_) => Family::MaskedDiffusion,
            Self::DiffusionGemma(_) => Family::DiffusionGemma,
        }
    }
}

/// What the engine thread reports once the model is loaded.
pub struct Loaded {
    /// Positions the model takes (prompt and answer together).
    pub max_sequence_length: usize,
    pub family: Family,
    /// The engine's tokenizer and chat format, for the handlers to tokenize requests
    /// before they queue them (`scheduler::encode_input`).
    encoder: Option<Arc<tokenize::PromptEncoder>>,
}

/// Loads the engine with `load` on its own thread, listens on `config.addr`, calls
/// `on_listening` with the bound address (useful with port 0), and serves until ctrl-c
/// or SIGTERM; then finishes the requests already accepted within the grace period
/// (`NetConfig::shutdown_grace`; a second signal ends it at once) and returns.
pub fn serve<L>(
    config: ServeConfig,
    load: L,
    on_listening: impl FnOnce(SocketAddr, &Loaded),
) -> Result<(), ServeError>
where
    L: FnOnce() -> Result<ServedModel, String> + Send + 'static,
{
    let shared = Arc::new(scheduler::Shared {
        metrics: metrics::Metrics::new(),
        queued: AtomicUsize::new(0),
    });
    let (jobs_tx, jobs_rx) = tokio::sync::mpsc::unbounded_channel();
    // A sender the router does not own: on a forced ending it is never dropped, so an idle
    // engine thread stays asleep instead of waking to destroy the GPU device while the
    // process exits (a driver's exit handlers racing that destruction crash lavapipe).
    let engine_keeper = jobs_tx.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let engine_shared = Arc::clone(&shared);
    let mut scheduler_config = config.scheduler.clone();
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    if config.kv_events.is_some() {
        scheduler_config.kv_events = Some(events_tx);
    }
    let engine_thread = std::thread::Builder::new()
        .name("unmask-engine".into())
        .spawn(move || {
            let model = match load() {
                Ok(m) => m,
                Err(why) => {
                    let _ = ready_tx.send(Err(why));
                    return;
                }
            };
            match model {
                ServedModel::Masked(engine) => {
                    let loaded = Loaded {
                        max_sequence_length: engine.config().max_sequence_length,
                        family: Family::MaskedDiffusion,
                        encoder: engine.tokenizer().map(|t| {
                            Arc::new(tokenize::PromptEncoder {
                                tokenizer: t.clone(),
                                chat: tokenize::ChatLayout::Masked(engine.chat_format().clone()),
                            })
                        }),
                    };
                    let _ = ready_tx.send(Ok(loaded));
                    scheduler::run(&engine, jobs_rx, engine_shared, scheduler_config);
                }
                ServedModel::DiffusionGemma(engine) => {
                    if scheduler_config.kv_events.is_some() {
                        let why = "kv events: a DiffusionGemma server does not publish its \
                                   prefix store's changes; leave --kv-events out";
                        let _ = ready_tx.send(Err(why.to_string()));
                        return;
                    }
                    // Its requests' prompts are encoded on the engine thread as they join
                    // (with their system turn's length); the encoder serves /tokenize.
                    let loaded = Loaded {
                        max_sequence_length: engine.model().max_positions,
                        family: Family::DiffusionGemma,
                        encoder: engine.tokenizer().map(|t| {
                            Arc::new(tokenize::PromptEncoder {
                                tokenizer: t.clone(),
                                chat: tokenize::ChatLayout::Gemma,
                            })
                        }),
                    };
                    let _ = ready_tx.send(Ok(loaded));
                    let max_running = scheduler_config.max_solo;
                    scheduler::run_gemma(&engine, jobs_rx, engine_shared, max_running);
                }
            }
        })?;
    let loaded = match ready_rx.recv() {
        Ok(Ok(l)) => l,
        Ok(Err(why)) => return Err(ServeError::Load(why)),
        Err(_) => return Err(ServeError::EnginePanicked),
    };
    let mut limits = config.limits.clone();
    limits.max_tokens = limits.max_tokens.min(loaded.max_sequence_length - 1);
    limits.default_max_tokens = limits.default_max_tokens.min(limits.max_tokens);
    limits.family = loaded.family;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(config.addr)
            .await
            .map_err(|source| ServeError::Bind {
                addr: config.addr,
                source,
            })?;
        let bound = listener.local_addr()?;
        let app = Arc::new(routes::App {
            jobs: jobs_tx,
            shared,
            limits,
            model: config.model_name.clone(),
            max_model_len: loaded.max_sequence_length,
            api_key: config.api_key.clone(),
            max_queue: config.max_queue,
            max_body_bytes: config.max_body_bytes,
            body_timeout: config.net.body_timeout,
            encoder: loaded.encoder.clone(),
            access: Access::new(bound, &config.allow_hosts, &config.allow_origins),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            next_id: AtomicU64::new(1),
        });
        if let Some(kv) = config.kv_events.clone() {
            let publish = kv_events::publisher(kv, events_rx)
                .await
                .map_err(ServeError::KvEvents)?;
            tokio::spawn(publish);
        }
        // Listening for signals before the address is announced: a client told the address
        // may stop the server at once.
        let signals = net::signals();
        on_listening(bound, &loaded);
        Ok::<_, ServeError>(net::serve(listener, routes::router(app), &config.net, signals).await)
    });
    // The router (and with it the last job sender) is gone once the runtime is: the engine
    // thread drops the requests whose clients went away, finishes the rest and returns.
    // Forced, the runtime does not wait for tasks still running (a connection that never
    // finished its request), and the engine is not waited for.
    match served {
        Ok(net::Ending::Forced) => {
            std::mem::forget(engine_keeper);
            runtime.shutdown_background();
            Ok(())
        }
        Ok(net::Ending::Graceful) => {
            drop(engine_keeper);
            drop(runtime);
            if engine_thread.join().is_err() {
                return Err(ServeError::EnginePanicked);
            }
            Ok(())
        }
        Err(e) => {
            drop(engine_keeper);
            Err(e)
        }
    }
}
