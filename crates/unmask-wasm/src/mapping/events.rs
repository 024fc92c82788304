//! The page's event per denoising step of a masked-diffusion generation.

use serde_json::{Value, json};
use unmask::{DecodeMode, StepEvent};
use unmask_core::tokenizer::Tokenizer;

/// Per-position state of the canvas shown while a request denoises.
pub struct CanvasTracker {
    /// Confidence of each generated position: of its commit once committed, else of the
    /// latest prediction (None before the first).
    confidence: Vec<Option<f32>>,
    /// Token last predicted at each still-masked position.
    predicted: Vec<Option<u32>>,
}

impl CanvasTracker {
    pub fn new(gen_length: usize) -> Self {
        Self {
            confidence: vec![None; gen_length],
            predicted: vec![None; gen_length],
        }
    }

    /// The event as JSON: `step`, `block`, `stepInBlock`, `elapsed`, `promptLength`,
    /// `canvas` (generated ids, masks included), `masked` (generated positions still
    /// masked), `committed` ([position in the canvas, token] committed now), `infilled`
    /// ([position in the prompt, token] committed now where a prompt held a mask),
    /// `confidence`, `predicted` (the guess at each masked position), `pieces` (each
    /// committed token's text, null for masks) and `text` (the answer so far).
    pub fn event(&mut self, e: &StepEvent<'_>, tokenizer: Option<&Tokenizer>) -> Value {
        let start = e.prompt_len;
        let canvas = e.generated();
        for (&pos, &(token, conf)) in e.rows.iter().zip(e.predictions) {
            // Rows before `start` are masks inside the prompt (infilling): not the canvas.
            let Some(i) = (pos as usize).checked_sub(start) else {
                continue;
            };
            if let (Some(c), Some(p)) = (self.confidence.get_mut(i), self.predicted.get_mut(i)) {
                *c = Some(conf);
                *p = Some(token);
            }
        }
        let masked: Vec<usize> = canvas
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == e.mask_id)
            .map(|(i, _)| i)
            .collect();
        let pieces: Vec<Value> = canvas
            .iter()
            .map(|&t| {
                if t == e.mask_id {
                    Value::Null
                } else {
                    Value::String(piece(tokenizer, t))
                }
            })
            .collect();
        let predicted: Vec<Value> = canvas
            .iter()
            .zip(&self.predicted)
            .map(|(&t, p)| match p {
                Some(p) if t == e.mask_id => Value::String(piece(tokenizer, *p)),
                _ => Value::Null,
            })
            .collect();
        // A commit before `start` fills a mask of the prompt (infilling): subtracting
        // `start` from it would wrap (or panic in a debug build), so it is reported apart.
        let (mut committed, mut infilled) = (Vec::new(), Vec::new());
        for &(p, t) in &e.record.committed {
            match (p as usize).checked_sub(start) {
                Some(i) => committed.push([i as u32, t]),
                None => infilled.push([p, t]),
            }
        }
        let known: Vec<u32> = canvas.iter().copied().filter(|&t| t != e.mask_id).collect();
        let text = tokenizer
            .and_then(|t| t.decode(&known, DecodeMode::Clean).ok())
            .unwrap_or_default();
        json!({
            "step": e.global_step,
            "block": e.record.block,
            "stepInBlock": e.record.step,
            "elapsed": e.elapsed_s,
            "promptLength": e.prompt_len,
            "canvas": canvas,
            "masked": masked,
            "committed": committed,
            "infilled": infilled,
            "confidence": self.confidence,
            "predicted": predicted,
            "pieces": pieces,
            "text": text,
        })
    }
}

/// The text of one token; special tokens (which decode to nothing) by their name.
pub fn piece(tokenizer: Option<&Tokenizer>, id: u32) -> String {
    let Some(t) = tokenizer else {
        return id.to_string();
    };
    match t.decode(&[id], DecodeMode::Raw) {
        Ok(s) if !s.is_empty() => s,
        _ => t.id_to_token(id).unwrap_or_else(|| id.to_string()),
    }
}
