//! The answer's text as it becomes final. A diffusion model fills its canvas in any order,
//! but a committed token is never changed: the tokens before the first still-masked
//! position are final, and so is their text. Text is sent when it is final, cut at the
//! first stop string, and held back while its end could still be the start of one (or of
//! a character whose bytes are not all there yet).

/// Why an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model ended its turn, or a stop string was met.
    Stop,
    /// The canvas filled up first.
    Length,
}

impl FinishReason {
    /// `Stop` when the answer ended (the model's end of turn, a stop string), else
    /// `Length`.
    pub fn of(ended: bool) -> Self {
        if ended { Self::Stop } else { Self::Length }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// The text already sent of one answer and the stop strings it is cut at.
#[derive(Debug, Default)]
pub struct TextStream {
    stop: Vec<String>,
    sent: String,
    /// A stop string was met: nothing more is sent.
    stopped: bool,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        Self {
            stop,
            ..Self::default()
        }
    }

    /// `text` cut before its first stop string, and whether one was found.
    pub fn cut(&self, text: &str) -> (usize, bool) {
        let first = self.stop.iter().filter_map(|s| text.find(s.as_str())).min();
        match first {
            Some(at) => (at, true),
            None => (text.len(), false),
        }
    }

    /// The new part of the final text `text` (the decoded final tokens) that can be sent
    /// now; `complete` when no more tokens will follow it.
    pub fn advance(&mut self, text: &str, complete: bool) -> Option<String> {
        if self.stopped {
            return None;
        }
        let (mut end, stopped) = self.cut(text);
        if stopped {
            self.stopped = true;
        } else if !complete {
            // A replacement character at the end may be a character cut between tokens.
            let trimmed = text.trim_end_matches('\u{FFFD}');
            end = trimmed.len();
            // Hold back the longest tail that starts a stop string.
            let hold = self
                .stop
                .iter()
                .map(|s| partial_suffix(&text[..end], s))
                .max()
                .unwrap_or(0);
            end -= hold;
        }
        // Text that does not extend what was sent (a tokenizer that rewrites earlier text
        // as more follows) waits for the final answer.
        if end <= self.sent.len() || !text.starts_with(self.sent.as_str()) {
            return None;
        }
        if !text.is_char_boundary(end) {
            return None;
        }
        let delta = text[self.sent.len()..end].to_string();
        self.sent.push_str(&delta);
        Some(delta)
    }

    /// Bytes of text sent so far.
    pub fn sent_len(&self) -> usize {
        self.sent.len()
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }
}

/// Bytes at the end of `text` that are a proper prefix of `stop`, at a char boundary.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| {
            n <= text.len()
                && text.is_char_boundary(text.len() - n)
                && stop.is_char_boundary(n)
                && text.ends_with(&stop[..n])
        })
        .unwrap_or(0)
}

/// The final tokens of a canvas: those before the first masked position.
pub fn final_tokens(generated: &[u32], mask: u32) -> &[u32] {
    let n = generated
        .iter()
        .position(|&t| t == mask)
        .unwrap_or(generated.len());
    &generated[..n]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_each_final_piece_once() {
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.advance("Hel", false).as_deref(), Some("Hel"));
        assert_eq!(s.advance("Hel", false), None);
        assert_eq!(s.advance("Hello", false).as_deref(), Some("lo"));
        assert_eq!(
            s.advance("Hello wor\u{FFFD}", false).as_deref(),
            Some(" wor")
        );
        assert_eq!(s.advance("Hello world!", true).as_deref(), Some("ld!"));
    }

    #[test]
    fn cuts_at_stop_strings_and_holds_their_starts() {
        let mut s = TextStream::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(s.advance("one\n", false).as_deref(), Some("one"));
        assert_eq!(s.advance("one\ntwo E", false).as_deref(), Some("\ntwo "));
        assert_eq!(s.advance("one\ntwo EN", false), None);
        assert_eq!(
            s.advance("one\ntwo ENDthree", false),
            None,
            "nothing left before END"
        );
        assert!(s.stopped());
        assert_eq!(s.advance("one\ntwo ENDthree four", true), None);
        let s = TextStream::new(vec!["b".into(), "a".into()]);
        assert_eq!(s.cut("xxab"), (2, true));
        assert_eq!(s.cut("xx"), (2, false));
    }

    #[test]
    fn final_tokens_end_at_the_first_mask() {
        assert_eq!(final_tokens(&[1, 2, 9, 3], 9), &[1, 2]);
        assert_eq!(final_tokens(&[9, 2], 9), &[] as &[u32]);
        assert_eq!(final_tokens(&[1, 2], 9), &[1, 2]);
    }
}
