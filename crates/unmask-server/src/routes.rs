//! The HTTP side: routes, authentication, the body limit and the answers' shapes
//! (OpenAI's `chat.completion`, `text_completion` and their stream chunks).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tokio_stream::{StreamExt, StreamMap};

use crate::answer::{Shape, extension, usage};
use crate::api::{ChatRequest, CompletionRequest, JobSpec, Limits};
use crate::error::ApiError;
use crate::scheduler::{Finished, Job, JobEvent, Shared};

/// What every handler shares.
pub struct App {
    pub jobs: mpsc::UnboundedSender<Job>,
    pub shared: Arc<Shared>,
    pub limits: Limits,
    pub model: String,
    /// Positions the model takes, prompt and answer together (`/tokenize`'s `max_model_len`).
    pub max_model_len: usize,
    pub api_key: Option<String>,
    pub max_queue: usize,
    pub max_body_bytes: usize,
    /// Time a request has to send its whole body.
    pub body_timeout: std::time::Duration,
    /// The tokenizer and chat layout (`None` without tokenizer.json).
    pub encoder: Option<Arc<crate::tokenize::PromptEncoder>>,
    /// Which hosts and origins may call (`access`).
    pub access: crate::access::Access,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    pub next_id: AtomicU64,
}

/// The two generating endpoints, which differ only in their shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

pub fn router(app: Arc<App>) -> Router {
    let limit = app.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/loglikelihood", post(crate::scoring::loglikelihood))
        .route("/v1/models", get(models))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&app), authorize))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost: a refused Host, Origin or Content-Type is answered before anything
        // else reads the request.
        .layer(middleware::from_fn_with_state(
            Arc::clone(&app),
            crate::access::guard,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

/// With `--api-key`, every route but `/health` needs `Authorization: Bearer KEY`.
async fn authorize(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        if given != Some(key.as_str()) {
            app.shared.metrics.count("rejected");
            let why = if given.is_none() {
                "no API key given: send the header Authorization: Bearer KEY"
            } else {
                "the API key given is not the server's"
            };
            return ApiError::status(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "invalid_api_key",
                why,
            )
            .into_response();
        }
    }
    next.run(request).await
}

/// The token of `Authorization: Bearer TOKEN`; the scheme's name is case-insensitive
/// (RFC 9110, 11.1), so `bearer` is the same scheme.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
}

async fn not_found(request: Request) -> Response {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown_url",
        format!(
            "no route {} {}: this server answers POST /v1/chat/completions, POST \
             /v1/completions, POST /v1/loglikelihood, POST /tokenize, POST /detokenize, GET \
             /v1/models, GET /health and GET /metrics",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}

async fn method_not_allowed(request: Request) -> Response {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
    .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({ "status": "ok", "model": app.model })).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.shared.metrics.encode(),
    )
        .into_response()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": app.model,
            "object": "model",
            "created": app.created,
            "owned_by": "unmask",
        }],
    }))
    .into_response()
}

/// The body, or the error that names why it could not be read: too large, or not sent
/// whole within `--body-timeout` (a client that stops halfway must not hold its connection
/// and a handler forever).
pub(crate) async fn read_body(app: &App, request: Request) -> Result<Bytes, ApiError> {
    let read = tokio::time::timeout(app.body_timeout, Bytes::from_request(request, &()));
    match read.await {
        Err(_) => Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!(
                "the body did not arrive whole within {:.1} s (--body-timeout)",
                app.body_timeout.as_secs_f64()
            ),
        )),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!(
                "the body is larger than the server's limit of {} bytes",
                app.max_body_bytes
            ),
        )),
        Ok(Err(e)) => Err(ApiError::unnamed(format!(
            "the body could not be read: {e}"
        ))),
    }
}

async fn chat_completions(State(app): State<Arc<App>>, request: Request) -> Response {
    let body = read_body(&app, request).await;
    let spec = body.and_then(|b| ChatRequest::parse(&b)?.check(&app.limits, &app.model));
    generate(app, spec, Endpoint::Chat).await
}

async fn completions(State(app): State<Arc<App>>, request: Request) -> Response {
    let body = read_body(&app, request).await;
    let spec = body.and_then(|b| CompletionRequest::parse(&b)?.check(&app.limits, &app.model));
    generate(app, spec, Endpoint::Completion).await
}

async fn generate(app: Arc<App>, spec: Result<JobSpec, ApiError>, endpoint: Endpoint) -> Response {
    let spec = match spec {
        Ok(s) => s,
        Err(e) => {
            app.shared.metrics.count("rejected");
            return e.into_response();
        }
    };
    let spec = match encoded(&app, spec).await {
        Ok(spec) => spec,
        Err(e) => return e,
    };
    let stream = spec.stream;
    let usage = spec.include_usage;
    // (One choice past the bound is the queue's 429, as before.)
    if spec.choices > 1 && spec.choices > app.max_queue {
        app.shared.metrics.count("rejected");
        return ApiError::invalid(
            "n",
            format!(
                "n: expected at most {} choices (the server's --max-queue), found {}",
                app.max_queue, spec.choices
            ),
        )
        .into_response();
    }
    let logprobs = spec.logprobs;
    let events = match submit(&app, spec).await {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    let id = format!(
        "{}-{}",
        match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let shape = Shape {
        endpoint,
        id,
        created: unix_now(),
        model: app.model.clone(),
        logprobs,
    };
    if stream {
        stream_response(shape, events, usage)
    } else {
        whole_response(shape, events).await
    }
}

/// The spec with its prompt tokenized here, on a blocking thread (a large prompt tokenized
/// on the engine thread would stall every running request meanwhile); as it is without a
/// tokenizer. Err: the answer to send.
pub(crate) async fn encoded(app: &App, spec: JobSpec) -> Result<JobSpec, Response> {
    let Some(encoder) = app.encoder.as_ref().filter(|e| e.masked_format().is_some()) else {
        return Ok(spec);
    };
    let encoder = Arc::clone(encoder);
    let encoded = tokio::task::spawn_blocking(move || {
        let completion = spec.is_completion();
        let mut spec = spec;
        let input = std::mem::replace(&mut spec.input, crate::api::Input::Ids(Vec::new()));
        let format = encoder.masked_format().expect("filtered above");
        match crate::scheduler::encode_input(&encoder.tokenizer, format, input) {
            Ok(input) => Ok(JobSpec { input, ..spec }),
            Err(e) => {
                let error = ApiError::from_engine(&e);
                Err(if completion {
                    error.for_completion()
                } else {
                    error
                })
            }
        }
    })
    .await;
    match encoded {
        Ok(Ok(spec)) => Ok(spec),
        Ok(Err(e)) => {
            app.shared.metrics.count("rejected");
            Err(e.into_response())
        }
        Err(e) => {
            Err(ApiError::server(format!("tokenizing the request failed: {e}")).into_response())
        }
    }
}

/// Queues a job per choice (429 when the queue has no room for all of them) and waits until
/// the engine accepts the first: a request it refuses (a prompt past the context) is refused
/// for every choice alike. A later choice's events start with its own `Started`.
pub(crate) async fn submit(
    app: &App,
    spec: JobSpec,
) -> Result<Vec<mpsc::UnboundedReceiver<JobEvent>>, ApiError> {
    let shared = &app.shared;
    let n = spec.choices.max(1);
    // Counted only when there is room: the count never passes the bound, even for a moment.
    let max = app.max_queue;
    let counted = shared
        .queued
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
            (q + n <= max).then_some(q + n)
        });
    if counted.is_err() {
        shared.metrics.count("rejected");
        return Err(ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            if n == 1 {
                format!(
                    "the server's queue is full ({} requests waiting): retry later",
                    app.max_queue
                )
            } else {
                format!(
                    "the server's queue has no room for {n} choices (at most {} requests \
                     wait): retry later",
                    app.max_queue
                )
            },
        ));
    }
    let specs = if n == 1 {
        vec![spec]
    } else {
        (0..n).map(|index| spec.choice(index)).collect()
    };
    let mut receivers = Vec::with_capacity(n);
    for (index, spec) in specs.into_iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        if app.jobs.send(Job { spec, events: tx }).is_err() {
            // This job and the ones not sent were counted and will never run.
            shared.queued.fetch_sub(n - index, Ordering::Relaxed);
            return Err(engine_gone());
        }
        receivers.push(rx);
    }
    match receivers[0].recv().await {
        Some(JobEvent::Started) => Ok(receivers),
        Some(JobEvent::Done(Err(e))) => Err(e),
        Some(other) => Err(ApiError::server(format!(
            "the engine answered {other:?} before accepting the request"
        ))),
        None => Err(engine_gone()),
    }
}

pub(crate) fn engine_gone() -> ApiError {
    ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "engine_stopped",
        "the engine has stopped; the server is shutting down",
    )
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn whole_response(shape: Shape, events: Vec<mpsc::UnboundedReceiver<JobEvent>>) -> Response {
    let mut finished = Vec::with_capacity(events.len());
    for mut rx in events {
        let result = loop {
            match rx.recv().await {
                Some(JobEvent::Done(result)) => break result,
                Some(_) => continue,
                None => return engine_gone().into_response(),
            }
        };
        match result {
            Ok(f) => finished.push(f),
            // The other choices' receivers are dropped with `events`: they stop.
            Err(e) => return e.into_response(),
        }
    }
    axum::Json(shape.whole(&finished)).into_response()
}

/// The SSE answer: each choice's chunks as its events arrive (several choices interleave,
/// each chunk naming its `index`), then the usage chunk when asked for and `[DONE]`. A
/// choice that fails ends the stream with its error, and the others stop.
fn stream_response(
    shape: Shape,
    events: Vec<mpsc::UnboundedReceiver<JobEvent>>,
    include_usage: bool,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let n = events.len();
    let mut merged = StreamMap::new();
    for (index, events) in events.into_iter().enumerate() {
        merged.insert(index, UnboundedReceiverStream::new(events));
    }
    tokio::spawn(async move {
        let data = |v: Value| Ok(Event::default().data(v.to_string()));
        // OpenAI's first chat chunk of each choice carries the role.
        for index in 0..n {
            let role = (shape.endpoint == Endpoint::Chat).then_some("");
            if tx
                .send(data(shape.chunk(index, role, &[], true, None)))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut finished: Vec<Finished> = Vec::with_capacity(n);
        while finished.len() < n {
            let next = tokio::select! {
                e = merged.next() => e,
                // The client went away: dropping the receivers tells the engine.
                _ = tx.closed() => return,
            };
            let Some((index, event)) = next else {
                let _ = tx.send(data(engine_gone().body())).await;
                break;
            };
            let out: Vec<Value> = match event {
                // (A scoring job's answer never comes on a stream.)
                JobEvent::Started | JobEvent::Scored(_) => Vec::new(),
                JobEvent::Text(t, tokens) => {
                    vec![shape.chunk(index, Some(&t), &tokens, false, None)]
                }
                JobEvent::Canvas(c) => {
                    let mut v = shape.envelope(true, json!([]));
                    v["canvas"] = json!(c);
                    if n > 1 {
                        v["index"] = json!(index);
                    }
                    vec![v]
                }
                JobEvent::Done(Ok(f)) => {
                    let finish = Some(f.finish_reason.as_str());
                    let mut last = shape.chunk(index, None, &[], false, finish);
                    last["unmask"] = extension(&f);
                    finished.push(f);
                    vec![last]
                }
                JobEvent::Done(Err(e)) => {
                    // The other choices stop now, not once a slow client took the error.
                    merged.clear();
                    let _ = tx.send(data(e.body())).await;
                    break;
                }
            };
            for v in out {
                if tx.send(data(v)).await.is_err() {
                    return;
                }
            }
        }
        if finished.len() == n && include_usage {
            let mut u = shape.envelope(true, json!([]));
            u["usage"] = usage(&finished);
            if tx.send(data(u)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::bearer_token;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for header in ["Bearer k1", "bearer k1", "BEARER  k1", " Bearer k1"] {
            assert_eq!(bearer_token(header), Some("k1"), "{header:?}");
        }
        for header in ["Basic k1", "Bearerk1", "k1", "Bearer"] {
            assert_eq!(bearer_token(header), None, "{header:?}");
        }
    }
}
