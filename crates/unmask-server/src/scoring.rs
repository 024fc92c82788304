//! `POST /v1/loglikelihood`: the handler, which queues a scoring job as the completion
//! endpoints queue theirs (the same queue bound and 429), and the answer's shape:
//!
//! ```json
//! {"id": "ll-3", "object": "loglikelihood", "created": 1700000000, "model": "m",
//!  "data": [{"index": 0, "log_likelihood": -3.2, "standard_error": 0.1, "tokens": 4,
//!            "per_token": -0.8, "windows": 1, "is_greedy": false}],
//!  "best": 0,
//!  "usage": {"prompt_tokens": 40, "continuation_tokens": 4, "total_tokens": 44},
//!  "unmask": {"mc_num": 128, "mc_batch": 16, "cfg_scale": 0.0, "seed": 0,
//!             "forward_passes": 8, "sequences": 128, "total_s": 0.9}}
//! ```

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::Sampling;
use crate::api::score::check_score;
use crate::routes::{App, encoded, engine_gone, read_body, submit, unix_now};
use crate::scheduler::{JobEvent, Scored};

pub async fn loglikelihood(State(app): State<Arc<App>>, request: Request) -> Response {
    let body = read_body(&app, request).await;
    let spec = match body.and_then(|b| check_score(&b, &app.limits, &app.model)) {
        Ok(spec) => spec,
        Err(e) => {
            app.shared.metrics.count("rejected");
            return e.into_response();
        }
    };
    let Sampling::Score(score) = &spec.sampling else {
        return crate::error::ApiError::server("a scoring request became another job")
            .into_response();
    };
    let params = score.params;
    let spec = match encoded(&app, spec).await {
        Ok(spec) => spec,
        Err(answer) => return answer,
    };
    let mut events = match submit(&app, spec).await {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    let Some(mut rx) = events.pop() else {
        return engine_gone().into_response();
    };
    let scored = loop {
        match rx.recv().await {
            Some(JobEvent::Scored(s)) => break s,
            Some(JobEvent::Done(Err(e))) => return e.into_response(),
            Some(_) => continue,
            None => return engine_gone().into_response(),
        }
    };
    let id = format!("ll-{}", app.next_id.fetch_add(1, Ordering::Relaxed));
    axum::Json(answer(&id, &app.model, &scored, &params)).into_response()
}

fn answer(id: &str, model: &str, scored: &Scored, params: &unmask::LikelihoodParams) -> Value {
    let data: Vec<Value> = scored
        .estimates
        .iter()
        .enumerate()
        .map(|(index, l)| {
            let mut d = json!({
                "index": index,
                "log_likelihood": l.log_likelihood,
                "standard_error": l.standard_error,
                "tokens": l.answer_tokens,
                "per_token": l.log_likelihood / l.answer_tokens.max(1) as f64,
                "windows": l.windows,
            });
            if let Some(greedy) = &scored.greedy {
                d["is_greedy"] = json!(greedy.get(index));
            }
            d
        })
        .collect();
    let best = unmask::best_estimate(&scored.estimates);
    let continuation: usize = scored.estimates.iter().map(|l| l.answer_tokens).sum();
    json!({
        "id": id,
        "object": "loglikelihood",
        "created": unix_now(),
        "model": model,
        "data": data,
        "best": best,
        "usage": {
            "prompt_tokens": scored.prompt_tokens,
            "continuation_tokens": continuation,
            "total_tokens": scored.prompt_tokens + continuation,
        },
        "unmask": {
            "mc_num": params.mc_num,
            "mc_batch": params.batch,
            "cfg_scale": params.cfg_scale,
            "seed": params.seed,
            "forward_passes": scored.estimates.iter().map(|l| l.forward_passes).sum::<usize>(),
            "sequences": scored.estimates.iter().map(|l| l.sequences).sum::<usize>(),
            "total_s": scored.estimates.iter().map(|l| l.total_s).sum::<f64>(),
        },
    })
}
