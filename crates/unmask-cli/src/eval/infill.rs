//! `--infill`: each item becomes an infilling task. The answer `#### <name> <field> :
//! <value> <more facts>` is written out except the value of its first fact: the prompt ends
//! with `#### <name> <field> :`, the canvas is as long as the value's tokens, and the suffix
//! is the rest of the answer and the end of the turn. The value must come back exactly.

use unmask::{Engine, Prompt, Request};

use super::items::Item;
use crate::error::CliError;

/// One item's infilling task, as token ids.
#[derive(Clone, Debug, PartialEq)]
pub struct Infill {
    /// The chat prompt, then the answer up to the hidden value.
    pub prompt: Vec<u32>,
    /// The system turn's share of `prompt` (the shared prefix).
    pub prefix_len: usize,
    /// The rest of the answer after the value, then the end-of-turn token.
    pub suffix: Vec<u32>,
    /// Tokens of the hidden value: the canvas length.
    pub canvas: usize,
}

/// The answer split around the value of its first fact: (head, value, tail), where
/// head + value + tail is `#### ` + the answer.
fn split_answer(answer: &str) -> Option<(String, String, String)> {
    let answer = answer.trim();
    let colon = answer.find(" : ")?;
    let value_start = colon + " :".len();
    let rest = &answer[value_start + 1..];
    let word_len = rest.find(char::is_whitespace).unwrap_or(rest.len());
    if word_len == 0 {
        return None;
    }
    let value_end = value_start + 1 + word_len;
    Some((
        format!("#### {}", &answer[..value_start]),
        answer[value_start..value_end].to_string(),
        answer[value_end..].to_string(),
    ))
}

/// `item` as an infilling task: its answer becomes the hidden value.
pub fn prepare(engine: &Engine, item: &Item) -> Result<Item, CliError> {
    let at = |why: String| {
        CliError::usage(format!(
            "--infill: item {:?} (line {}): {why}",
            item.id, item.line
        ))
    };
    let (head, value, tail) = split_answer(&item.answer).ok_or_else(|| {
        at(format!(
            "expected an answer of facts \"<name> <field> : <value>\", found {:?}",
            item.answer
        ))
    })?;
    let chat = Request::chat(item.system.as_deref(), &item.user);
    let (mut prompt, prefix_len) = engine.encode_with_prefix(&chat)?;
    let head_ids = engine.encode_text(&head)?;
    let value_ids = engine.encode_text(&value)?;
    let mut suffix = engine.encode_text(&tail)?;
    // The pieces must be the tokens of the whole answer, or the task would ask for a
    // tokenization the model never saw.
    let whole = engine.encode_text(&format!("{head}{value}{tail}"))?;
    let joined: Vec<u32> = [&head_ids[..], &value_ids, &suffix].concat();
    if whole != joined {
        return Err(at(format!(
            "the answer does not tokenize at the value's edges ({head:?} | {value:?} | {tail:?})"
        )));
    }
    let eot = engine.special().eot.ok_or_else(|| {
        at("the model has no end-of-turn token to close the suffix with".to_string())
    })?;
    suffix.push(eot);
    prompt.extend_from_slice(&head_ids);
    Ok(Item {
        answer: value.trim().to_string(),
        infill: Some(Infill {
            prompt,
            prefix_len,
            suffix,
            canvas: value_ids.len(),
        }),
        ..item.clone()
    })
}

impl Infill {
    /// The request of the task: one block as long as the value, one token per step.
    pub fn request(&self, base: Request) -> Request {
        let mut params = base.params.clone();
        params.gen_length = self.canvas;
        params.block_length = self.canvas;
        params.steps = self.canvas;
        Request {
            prompt: Prompt::Ids(self.prompt.clone()),
            prefix_len: Some(self.prefix_len),
            suffix: self.suffix.clone(),
            params,
            ..base
        }
    }

    /// Positions of the whole sequence.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.canvas + self.suffix.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_facts_value_is_hidden() {
        let s = |a: &str| split_answer(a);
        assert_eq!(
            s("Tara sport : fencing Victor sport : rowing"),
            Some((
                "#### Tara sport :".into(),
                " fencing".into(),
                " Victor sport : rowing".into()
            ))
        );
        assert_eq!(
            s(" Nina city : Paris\n"),
            Some(("#### Nina city :".into(), " Paris".into(), String::new()))
        );
        assert_eq!(s("Oslo"), None);
        assert_eq!(s("Nina city :  Paris"), None);
    }
}
