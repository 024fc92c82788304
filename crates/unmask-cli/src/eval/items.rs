//! The task set: one JSON object per line, read into `Item`s (errors name the file, the line
//! and what is wrong), and the answer in a model's output.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use unmask::{CacheMode, DecodeMode, GenerationParams, Request};
use unmask_core::config::json_kind;

use crate::error::CliError;
use crate::options::CacheSettings;

/// The task types of the set format, in the order of the report's columns. Other task names
/// are accepted and get columns after these.
pub const TASKS: [&str; 3] = ["lookup", "pair", "record"];
/// Where the answer starts in a model's output: the text after the last marker.
pub const ANSWER_MARKER: &str = "####";
/// One line of a task set.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// Line number in the set file, counting from 1.
    pub line: usize,
    pub id: String,
    pub task: String,
    pub system: Option<String>,
    pub user: String,
    pub answer: String,
    pub prompt_group: Option<String>,
    /// ACache: the system prompt's shared span (text inside `system`).
    pub affix: Option<String>,
    /// `--infill`: the item as an infilling task (its `answer` is then the hidden value).
    pub infill: Option<super::infill::Infill>,
    /// Multiple choice (`unmask score --set`): the candidate answers, the right one among
    /// them.
    pub choices: Option<Vec<String>>,
}

impl Item {
    /// The item's chat request; the default split makes the system turn the shared prefix.
    pub(super) fn request(
        &self,
        params: &GenerationParams,
        cache: CacheMode,
        bicache: CacheSettings,
    ) -> Request {
        let mut request = Request::chat(self.system.as_deref(), &self.user)
            .with_params(params.clone())
            .with_cache(cache);
        request.decode = DecodeMode::Clean;
        request.prefix_len = None;
        bicache.apply(&mut request);
        request.span = self.affix.clone().map(unmask::Span::Text);
        match &self.infill {
            Some(infill) => infill.request(request),
            None => request,
        }
    }
}

impl Item {
    /// A model's output against the expected answer: the extracted answer, whether it is
    /// right, and the progress line's verdict.
    pub(super) fn score(&self, text: &str) -> (String, bool, String) {
        let output = extract_answer(text).to_string();
        let want = self.answer.trim();
        let correct = output == want;
        let verdict = if correct {
            "correct".to_string()
        } else {
            format!(
                "wrong (expected {want:?}, got {:?})",
                super::shorten(&output, 40)
            )
        };
        (output, correct, verdict)
    }
}

/// The answer in a model's output: the text after the last `####`, else the whole output,
/// trimmed.
pub fn extract_answer(text: &str) -> &str {
    match text.rfind(ANSWER_MARKER) {
        Some(at) => text[at + ANSWER_MARKER.len()..].trim(),
        None => text.trim(),
    }
}

/// Reads a task set; errors name the file and the line.
pub fn load_set(path: &Path) -> Result<Vec<Item>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        CliError::context(format!("cannot read the set {}: {e}", path.display()), e)
    })?;
    let mut items = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let at = |why: String| CliError::runtime(format!("{}:{number}: {why}", path.display()));
        let item = parse_item(line, number).map_err(at)?;
        if let Some(first) = first_line.insert(item.id.clone(), number) {
            return Err(at(format!(
                "id {:?} is already used on line {first}",
                item.id
            )));
        }
        items.push(item);
    }
    if items.is_empty() {
        return Err(CliError::runtime(format!(
            "the set {} holds no items (expected one JSON object per line)",
            path.display()
        )));
    }
    Ok(items)
}

/// One line of the set; the error says what is wrong with it.
fn parse_item(line: &str, number: usize) -> Result<Item, String> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| format!("not a valid JSON object ({e})"))?;
    let Value::Object(obj) = value else {
        return Err(format!(
            "expected a JSON object with id, task, system, user, answer; found {}",
            json_kind(&value)
        ));
    };
    let optional = |key: &str| -> Result<Option<String>, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!(
                "field \"{key}\" must be a string, found {}",
                json_kind(other)
            )),
        }
    };
    let required = |key: &str| -> Result<String, String> {
        match optional(key)? {
            Some(s) if !s.trim().is_empty() || key == "answer" => Ok(s),
            Some(_) => Err(format!("field \"{key}\" is empty")),
            None => Err(format!("missing field \"{key}\"")),
        }
    };
    let system = optional("system")?;
    let affix = optional("affix")?;
    if let Some(a) = &affix {
        if !system.as_deref().is_some_and(|s| s.contains(a.as_str())) {
            return Err(
                "field \"affix\" must be text inside the item's \"system\" (its shared span)"
                    .into(),
            );
        }
    }
    let answer = required("answer")?;
    let choices = match obj.get("choices") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            let choices = list
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or("field \"choices\" must be an array of strings")?;
            if !choices.contains(&answer) {
                return Err(format!(
                    "field \"choices\" must hold the answer {answer:?}, found {choices:?}"
                ));
            }
            Some(choices)
        }
        Some(other) => {
            return Err(format!(
                "field \"choices\" must be an array of strings, found {}",
                json_kind(other)
            ));
        }
    };
    Ok(Item {
        line: number,
        id: required("id")?,
        task: required("task")?,
        system,
        user: required("user")?,
        answer,
        prompt_group: optional("prompt_group")?,
        affix,
        infill: None,
        choices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_is_the_text_after_the_last_marker() {
        assert_eq!(extract_answer("The city is Oslo. #### Oslo"), "Oslo");
        assert_eq!(extract_answer("a #### b #### c \n"), "c");
        assert_eq!(extract_answer("####42"), "42");
        assert_eq!(extract_answer("  no marker here \n"), "no marker here");
        assert_eq!(extract_answer("ends with ####"), "");
        assert_eq!(extract_answer("###  7"), "###  7");
        assert_eq!(extract_answer(""), "");
        // The last marker is the one that ends last, as Python's `rsplit("####", 1)`.
        assert_eq!(extract_answer("x #####5"), "5");
    }

    #[test]
    fn items_parse_and_errors_say_why() {
        let line = r#"{"id":"a1","task":"lookup","system":"S","user":"U?","answer":"Oslo","prompt_group":"g1"}"#;
        let item = parse_item(line, 3).unwrap();
        assert_eq!(item.line, 3);
        assert_eq!(item.id, "a1");
        assert_eq!(item.system.as_deref(), Some("S"));
        assert_eq!(item.prompt_group.as_deref(), Some("g1"));
        let minimal = parse_item(r#"{"id":"b","task":"t","user":"u","answer":""}"#, 1).unwrap();
        assert_eq!(minimal.choices, None);
        let mc = r#"{"id":"c","task":"t","user":"u","answer":"x","choices":["y","x"]}"#;
        assert_eq!(
            parse_item(mc, 1).unwrap().choices,
            Some(vec!["y".into(), "x".into()])
        );
        assert_eq!(minimal.system, None);
        assert_eq!(minimal.answer, "");

        let err = |line: &str| parse_item(line, 1).unwrap_err();
        assert!(err("{oops").contains("not a valid JSON"));
        assert!(
            err(r#"{"id":"c","task":"t","user":"u","answer":"x","choices":["y"]}"#)
                .contains("must hold the answer \"x\"")
        );
        assert!(
            err(r#"{"id":"c","task":"t","user":"u","answer":"x","choices":"x"}"#)
                .contains("must be an array of strings, found a string")
        );
        assert!(err("[1]").contains("found an array"));
        assert!(err(r#"{"id":"a","task":"t","answer":"x"}"#).contains("missing field \"user\""));
        assert!(
            err(r#"{"id":1,"task":"t","user":"u","answer":"x"}"#)
                .contains("\"id\" must be a string")
        );
        assert!(
            err(r#"{"id":" ","task":"t","user":"u","answer":"x"}"#).contains("\"id\" is empty")
        );
    }
}
