//! Where ACache's anchors fall: the share on the span's lines the question asks about (a
//! table line `- NAME ...` whose NAME is a word of the question), the rows whose K/V the
//! request changes.

use unmask::{DecodeMode, Engine, Generation};

/// Where one request's anchors fall.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnchorSpread {
    /// Anchors on the lines the question asks about.
    pub on_asked: usize,
    pub anchors: usize,
    /// Span tokens on those lines.
    pub asked_tokens: usize,
}

/// Where an ACache generation's anchors fall, when it ran with a span.
pub fn on_asked_lines(engine: &Engine, g: &Generation, question: &str) -> Option<AnchorSpread> {
    let report = g.acache.as_ref().filter(|r| r.fallback.is_none())?;
    let tokenizer = engine.tokenizer()?;
    let span = g
        .prompt_ids
        .get(report.span_start..report.span_start + report.span_tokens)?;
    let pieces: Vec<String> = span
        .iter()
        .map(|&id| tokenizer.decode(&[id], DecodeMode::Raw).unwrap_or_default())
        .collect();
    let line_of = token_lines(&pieces);
    let lines: Vec<String> = {
        let text: String = pieces.concat();
        text.split('\n').map(str::to_string).collect()
    };
    let words: Vec<&str> = question
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let asked = |line: usize| {
        lines.get(line).is_some_and(|l| {
            l.strip_prefix("- ")
                .and_then(|rest| rest.split_whitespace().next())
                .is_some_and(|name| words.contains(&name))
        })
    };
    let on_asked = report
        .anchors
        .iter()
        .filter(|&&a| line_of.get(a as usize).is_some_and(|&l| asked(l)))
        .count();
    Some(AnchorSpread {
        on_asked,
        anchors: report.anchors.len(),
        asked_tokens: line_of.iter().filter(|&&l| asked(l)).count(),
    })
}

/// The line of each token: the line of its first character that is not a line break (a
/// token of line breaks alone belongs to the line it ends).
fn token_lines(pieces: &[String]) -> Vec<usize> {
    let mut line = 0;
    pieces
        .iter()
        .map(|p| {
            let lead = p.chars().take_while(|&c| c == '\n').count();
            let own = if lead == p.chars().count() {
                line
            } else {
                line + lead
            };
            line += p.matches('\n').count();
            own
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_belong_to_the_line_of_their_text() {
        let pieces = ["Rules", ":", "\n", "- Nina", " pet", "\n-", " Tom", "\n"].map(String::from);
        assert_eq!(token_lines(&pieces), vec![0, 0, 0, 1, 1, 2, 2, 2]);
    }
}
