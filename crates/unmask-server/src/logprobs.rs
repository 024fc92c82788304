//! OpenAI's `logprobs` of an answer: each token of its text with the log-probability the
//! model gave it at the denoising step that committed it (a diffusion model commits tokens
//! in any order, each once). Tokens are reported as their text becomes final, so a stream
//! sends each with the text that contains it.

use serde_json::{Value, json};
use unmask::Logprob;
use unmask_core::tokenizer::Tokenizer;

/// One answer token as reported.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The bytes it adds to the text (a piece of a character when a merge splits one).
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// Characters of the answer's text before it (the legacy completions' `text_offset`).
    pub text_offset: usize,
    /// The most likely tokens at its step (its bytes, its log-probability), most likely
    /// first, when asked for.
    pub top: Vec<(Vec<u8>, f32)>,
}

impl TokenLogprob {
    fn token(&self) -> String {
        lossy(&self.bytes)
    }
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The value a token gets when it has none (non-finite logits): OpenAI's floor.
const FLOOR: f32 = -9999.0;

/// An f32 as the shortest decimal that reads back as it (-0.004, not -0.004000000189989805),
/// as a JSON number; not a finite number: `FLOOR`, as JSON has no -inf.
fn number(x: f32) -> Value {
    let x = if x.is_finite() { x } else { FLOOR };
    json!(x.to_string().parse().unwrap_or(x as f64))
}

/// The bytes an alternative stands for: its text, or a special token's name (an end of turn
/// is a likely alternative and has no text).
fn alternative_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    tokenizer
        .token_bytes(id)
        .or_else(|| tokenizer.id_to_token(id).map(String::into_bytes))
        .unwrap_or_default()
}

/// How far an answer's tokens were reported: tokens and bytes of text behind.
#[derive(Debug, Default)]
pub struct LogprobStream {
    tokens: usize,
    /// Bytes of text the reported tokens spell.
    bytes: usize,
    /// Whole characters in them, and the bytes after those that do not end a character yet.
    chars: usize,
    partial: Vec<u8>,
}

impl LogprobStream {
    /// Adds a token's bytes to the characters counted: a character whose bytes are all in
    /// counts once, bytes that can never start one count one each (as a lossy decode shows
    /// them).
    fn count(&mut self, bytes: &[u8]) {
        self.bytes += bytes.len();
        self.partial.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.partial) {
                Ok(s) => {
                    self.chars += s.chars().count();
                    self.partial.clear();
                    return;
                }
                Err(e) => {
                    let (valid, rest) = self.partial.split_at(e.valid_up_to());
                    self.chars += std::str::from_utf8(valid).map_or(0, |s| s.chars().count());
                    let Some(bad) = e.error_len() else {
                        // An incomplete character: it waits for its next bytes.
                        self.partial = rest.to_vec();
                        return;
                    };
                    self.chars += 1;
                    self.partial = rest[bad..].to_vec();
                }
            }
        }
    }
}

impl LogprobStream {
    /// The answer's next tokens whose bytes lie within its first `text_len` bytes of text
    /// (what was sent of it). `answer`: its final tokens, up to its end token; `logprobs`:
    /// theirs, by position. `complete`: the text is whole, so a token that starts inside it
    /// counts even when a stop string cut the text within the token.
    pub fn advance(
        &mut self,
        tokenizer: &Tokenizer,
        answer: &[u32],
        logprobs: &[Option<Logprob>],
        text_len: usize,
        complete: bool,
    ) -> Vec<TokenLogprob> {
        let mut out = Vec::new();
        while let Some(&id) = answer.get(self.tokens) {
            // Special tokens add no text and are not reported.
            let bytes = tokenizer.token_bytes(id).unwrap_or_default();
            let start = self.bytes;
            let fits = start + bytes.len() <= text_len || (complete && start < text_len);
            if !bytes.is_empty() && !fits {
                break;
            }
            self.tokens += 1;
            if bytes.is_empty() {
                continue;
            }
            // A token that starts inside a character is at that character's offset.
            let text_offset = self.chars;
            self.count(&bytes);
            // Every token of the text is listed, so the list spells it; one whose value is
            // missing (non-finite logits) gets the floor.
            let (logprob, top) = match logprobs.get(self.tokens - 1) {
                Some(Some(lp)) => {
                    let top = lp
                        .top
                        .iter()
                        .map(|&(id, l)| (alternative_bytes(tokenizer, id), l))
                        .collect();
                    (lp.logprob, top)
                }
                _ => (FLOOR, Vec::new()),
            };
            out.push(TokenLogprob {
                bytes,
                logprob,
                text_offset,
                top,
            });
        }
        out
    }
}

/// A chat choice's (or chunk's) `logprobs`: `{"content": [...], "refusal": null}`.
pub fn chat_json(tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|(bytes, l)| json!({ "token": lossy(bytes), "logprob": number(*l), "bytes": bytes }))
                .collect();
            json!({
                "token": t.token(),
                "logprob": number(t.logprob),
                "bytes": t.bytes,
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// A text completion's `logprobs`: the legacy parallel lists, `top_logprobs` a map per token
/// when alternatives were asked for (`top`: how many).
pub fn completion_json(tokens: &[TokenLogprob], top: usize) -> Value {
    let alternatives = (top > 0).then(|| {
        tokens
            .iter()
            .map(|t| {
                let map: serde_json::Map<String, Value> =
                    t.top.iter().map(|(b, l)| (lossy(b), number(*l))).collect();
                Value::Object(map)
            })
            .collect::<Vec<_>>()
    });
    json!({
        "tokens": tokens.iter().map(TokenLogprob::token).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| number(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": alternatives,
        "text_offset": tokens.iter().map(|t| t.text_offset).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny");
        Tokenizer::from_file(format!("{dir}/tokenizer.json")).unwrap()
    }

    #[test]
    fn tokens_are_reported_once_their_text_was_sent() {
        let t = tokenizer();
        let text = "caf\u{e9} ok";
        let ids = t.encode(text).unwrap();
        let lps: Vec<Option<Logprob>> = (0..ids.len())
            .map(|i| {
                Some(Logprob {
                    logprob: -(i as f32),
                    top: vec![(ids[i], -(i as f32))],
                })
            })
            .collect();
        let mut s = LogprobStream::default();
        // Nothing sent yet: no token.
        assert!(s.advance(&t, &ids, &lps, 0, false).is_empty());
        // "caf" sent: the tokens inside it, none that reach into "é".
        let first = s.advance(&t, &ids, &lps, 3, false);
        let first_bytes: Vec<u8> = first.iter().flat_map(|x| x.bytes.clone()).collect();
        assert!(text.as_bytes().starts_with(&first_bytes) && first_bytes.len() <= 3);
        let rest = s.advance(&t, &ids, &lps, text.len(), true);
        let all: Vec<TokenLogprob> = first.into_iter().chain(rest).collect();
        let bytes: Vec<u8> = all.iter().flat_map(|x| x.bytes.clone()).collect();
        assert_eq!(bytes, text.as_bytes(), "every byte once, in order");
        assert_eq!(all.len(), ids.len());
        for (i, x) in all.iter().enumerate() {
            assert_eq!(x.logprob, -(i as f32), "token {i} keeps its own value");
            assert_eq!(
                x.top,
                vec![(x.bytes.clone(), -(i as f32))],
                "and its alternatives"
            );
        }
        // Offsets count characters; a token starting inside "é" is at the "é".
        let mut at = 0;
        for x in &all {
            let chars = text
                .char_indices()
                .take_while(|(i, c)| i + c.len_utf8() <= at)
                .count();
            assert_eq!(x.text_offset, chars, "token at byte {at}");
            at += x.bytes.len();
        }
        assert!(s.advance(&t, &ids, &lps, text.len(), true).is_empty());
    }

    #[test]
    fn a_stop_string_inside_a_token_keeps_the_token() {
        let t = tokenizer();
        let ids = t.encode("Hello world").unwrap();
        let lp = Logprob {
            logprob: -0.5,
            top: Vec::new(),
        };
        let lps = vec![Some(lp); ids.len()];
        // The text was cut after "Hello w": the token holding "w" starts inside it.
        let mut s = LogprobStream::default();
        let got = s.advance(&t, &ids, &lps, "Hello w".len(), true);
        let bytes: Vec<u8> = got.iter().flat_map(|x| x.bytes.clone()).collect();
        assert!(
            bytes.starts_with(b"Hello w"),
            "{:?}",
            String::from_utf8_lossy(&bytes)
        );
        assert!(got.len() < ids.len() || bytes == b"Hello world");
        let json = chat_json(&got);
        assert_eq!(json["content"].as_array().unwrap().len(), got.len());
        let legacy = completion_json(&got, 0);
        assert_eq!(legacy["tokens"].as_array().unwrap().len(), got.len());
    }
}
