//! A small command-line parser: each command declares its flags, the parser accepts
//! `--flag value`, `--flag=value` and boolean switches, and every error names the flag and
//! what it expects.

use std::collections::HashMap;
use std::str::FromStr;

use crate::error::CliError;

/// Whether a flag takes a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A boolean: present or absent (`--flag=true|false` also accepted).
    Switch,
    /// Takes one value, shown in the help as this placeholder.
    Value(&'static str),
    /// Not a `--flag`: the command's words that are not flags (such as input files), shown
    /// in the help as this placeholder. A command without one takes only flags.
    Words(&'static str),
}

#[derive(Clone, Copy, Debug)]
pub struct Flag {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
}

impl Flag {
    pub const fn value(name: &'static str, placeholder: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind: Kind::Value(placeholder),
            help,
        }
    }

    pub const fn switch(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind: Kind::Switch,
            help,
        }
    }

    /// The words of the command line that are not flags; read them with `Matches::words`.
    pub const fn words(name: &'static str, placeholder: &'static str, help: &'static str) -> Self {
        Self {
            name,
            kind: Kind::Words(placeholder),
            help,
        }
    }
}

/// A subcommand: its name, one-line summary, usage line and flags.
#[derive(Clone, Debug)]
pub struct CommandSpec {
    pub name: &'static str,
    pub summary: &'static str,
    pub usage: &'static str,
    pub flags: Vec<Flag>,
    /// Extra paragraphs shown after the flags.
    pub notes: &'static str,
}

impl CommandSpec {
    /// The `--name` flag (never the words, which have no `--` spelling).
    fn find(&self, name: &str) -> Option<&Flag> {
        self.flags
            .iter()
            .find(|f| f.name == name && !matches!(f.kind, Kind::Words(_)))
    }

    fn takes_words(&self) -> bool {
        self.flags.iter().any(|f| matches!(f.kind, Kind::Words(_)))
    }

    /// The text of `unmask <command> --help`.
    pub fn help(&self) -> String {
        let mut out = format!("{}\n\nUsage: {}\n\nFlags:\n", self.summary, self.usage);
        let labels: Vec<String> = self
            .flags
            .iter()
            .map(|f| match f.kind {
                Kind::Switch => format!("--{}", f.name),
                Kind::Value(p) => format!("--{} {p}", f.name),
                Kind::Words(p) => p.to_string(),
            })
            .collect();
        let width = labels.iter().map(|l| l.len()).max().unwrap_or(0).max(10);
        for (flag, label) in self.flags.iter().zip(&labels) {
            out.push_str(&format!("  {label:<width$}  {}\n", flag.help));
        }
        out.push_str(&format!("  {:<width$}  show this help\n", "--help"));
        if !self.notes.is_empty() {
            out.push('\n');
            out.push_str(self.notes.trim_end());
            out.push('\n');
        }
        out
    }
}

/// What a command line asked for.
#[derive(Debug)]
pub enum Parsed {
    Help,
    Run(Matches),
}

/// The flags given to one command, checked against its spec.
#[derive(Debug)]
pub struct Matches {
    command: &'static str,
    values: HashMap<&'static str, String>,
    switches: HashMap<&'static str, bool>,
    words: Vec<String>,
}

/// Parses `args` (the words after the command name) against `spec`.
pub fn parse(spec: &CommandSpec, args: &[String]) -> Result<Parsed, CliError> {
    let mut matches = Matches {
        command: spec.name,
        values: HashMap::new(),
        switches: HashMap::new(),
        words: Vec::new(),
    };
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "--help" || arg == "-h" {
            return Ok(Parsed::Help);
        }
        let Some(body) = arg.strip_prefix("--").filter(|b| !b.is_empty()) else {
            if spec.takes_words() && !(arg.starts_with('-') && arg.len() > 1) {
                matches.words.push(arg.clone());
                continue;
            }
            let what = if arg.starts_with('-') && arg.len() > 1 {
                format!("unknown flag `{arg}` (flags are spelled --name)")
            } else {
                format!(
                    "unexpected argument `{arg}`: `unmask {}` takes only flags",
                    spec.name
                )
            };
            return Err(CliError::usage(format!(
                "{what}; see `unmask {} --help`",
                spec.name
            )));
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let Some(flag) = spec.find(name) else {
            return Err(unknown_flag(spec, name));
        };
        if matches.values.contains_key(flag.name) || matches.switches.contains_key(flag.name) {
            return Err(CliError::usage(format!(
                "flag --{} was given more than once",
                flag.name
            )));
        }
        match flag.kind {
            Kind::Switch => {
                let on = match inline.as_deref() {
                    None | Some("true") => true,
                    Some("false") => false,
                    Some(other) => {
                        return Err(CliError::usage(format!(
                            "flag --{} is a switch: expected no value (or =true / =false), found `{other}`",
                            flag.name
                        )));
                    }
                };
                matches.switches.insert(flag.name, on);
            }
            Kind::Value(placeholder) => {
                let value = match inline {
                    Some(v) => v,
                    // A following `--word` is another flag, not this one's value; such a
                    // value can still be given as `--flag=--word`.
                    None => match args.get(i) {
                        Some(next) if !(next.starts_with("--") && next.len() > 2) => {
                            i += 1;
                            next.clone()
                        }
                        _ => {
                            return Err(CliError::usage(format!(
                                "flag --{} expects a value {placeholder}",
                                flag.name
                            )));
                        }
                    },
                };
                matches.values.insert(flag.name, value);
            }
            // `find` never returns the words.
            Kind::Words(_) => unreachable!("words have no --flag spelling"),
        }
    }
    Ok(Parsed::Run(matches))
}

fn unknown_flag(spec: &CommandSpec, name: &str) -> CliError {
    let closest = spec
        .flags
        .iter()
        .filter(|f| !matches!(f.kind, Kind::Words(_)))
        .map(|f| (edit_distance(name, f.name), f.name))
        .filter(|(d, _)| *d <= 2)
        .min();
    let hint = match closest {
        Some((_, known)) => format!(" (did you mean --{known}?)"),
        None => String::new(),
    };
    CliError::usage(format!(
        "unknown flag --{name} for `unmask {}`{hint}; see `unmask {} --help`",
        spec.name, spec.name
    ))
}

/// Levenshtein distance, for "did you mean" hints.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(diag + usize::from(ca != *cb));
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

impl Matches {
    pub fn value(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    pub fn switch(&self, name: &str) -> bool {
        self.switches.get(name).copied().unwrap_or(false)
    }

    /// The words that were not flags, in order (empty unless the spec has `Flag::words`).
    pub fn words(&self) -> &[String] {
        &self.words
    }

    /// The value of a required flag.
    pub fn required(&self, name: &str, placeholder: &str) -> Result<&str, CliError> {
        self.value(name).ok_or_else(|| {
            CliError::usage(format!(
                "`unmask {}` needs --{name} {placeholder}; see `unmask {} --help`",
                self.command, self.command
            ))
        })
    }

    /// Parses a flag's value; `expected` describes a valid value for the error message.
    pub fn parsed<T: FromStr>(&self, name: &str, expected: &str) -> Result<Option<T>, CliError> {
        match self.value(name) {
            None => Ok(None),
            Some(text) => text
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| invalid(name, expected, text)),
        }
    }

    /// Checks a parsed value with `ok`; `expected` describes a valid value.
    pub fn checked<T: FromStr + Copy>(
        &self,
        name: &str,
        expected: &str,
        ok: impl Fn(T) -> bool,
    ) -> Result<Option<T>, CliError> {
        match self.parsed::<T>(name, expected)? {
            Some(v) if !ok(v) => Err(invalid(name, expected, self.value(name).unwrap_or(""))),
            other => Ok(other),
        }
    }

    /// A value that must be one of `choices`.
    pub fn choice(
        &self,
        name: &str,
        choices: &[&'static str],
    ) -> Result<Option<&'static str>, CliError> {
        match self.value(name) {
            None => Ok(None),
            Some(text) => choices
                .iter()
                .find(|c| **c == text)
                .copied()
                .map(Some)
                .ok_or_else(|| invalid(name, &format!("one of {}", choices.join(", ")), text)),
        }
    }

    /// A comma-separated list of token ids (`1,2,3`; spaces allowed).
    pub fn ids(&self, name: &str) -> Result<Option<Vec<u32>>, CliError> {
        let Some(text) = self.value(name) else {
            return Ok(None);
        };
        let expected = "comma-separated token ids such as 1,2,3";
        let ids = text
            .split(',')
            .map(|part| part.trim().parse::<u32>())
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| invalid(name, expected, text))?;
        Ok(Some(ids))
    }
}

pub fn invalid(name: &str, expected: &str, found: &str) -> CliError {
    CliError::usage(format!(
        "invalid value for --{name}: expected {expected}, found `{found}`"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> CommandSpec {
        CommandSpec {
            name: "demo",
            summary: "demo",
            usage: "unmask demo",
            flags: vec![
                Flag::value("steps", "N", "steps"),
                Flag::value("prompt", "TEXT", "prompt"),
                Flag::switch("json", "json"),
            ],
            notes: "",
        }
    }

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|s| s.to_string()).collect()
    }

    fn run(words: &[&str]) -> Result<Matches, CliError> {
        match parse(&spec(), &args(words))? {
            Parsed::Run(m) => Ok(m),
            Parsed::Help => panic!("unexpected help"),
        }
    }

    #[test]
    fn both_value_spellings_and_switches() {
        let m = run(&["--steps", "8", "--prompt=a=b", "--json"]).unwrap();
        assert_eq!(m.parsed::<usize>("steps", "N").unwrap(), Some(8));
        assert_eq!(m.value("prompt"), Some("a=b"));
        assert!(m.switch("json"));
        let m = run(&["--json=false", "--steps=-1"]).unwrap();
        assert!(!m.switch("json"));
        assert_eq!(m.value("steps"), Some("-1"));
    }

    #[test]
    fn errors_name_the_flag() {
        let msg = |w: &[&str]| run(w).unwrap_err().to_string();
        assert!(msg(&["--step", "3"]).contains("did you mean --steps"));
        assert!(msg(&["--steps"]).contains("--steps expects a value N"));
        assert!(msg(&["--prompt", "--json"]).contains("--prompt expects a value TEXT"));
        assert!(msg(&["--json=yes"]).contains("--json"));
        assert!(msg(&["--steps", "1", "--steps", "2"]).contains("more than once"));
        assert!(msg(&["extra"]).contains("unexpected argument `extra`"));
        let m = run(&["--steps", "x"]).unwrap();
        let e = m.parsed::<usize>("steps", "a whole number").unwrap_err();
        assert!(e.to_string().contains("invalid value for --steps"));
    }

    #[test]
    fn help_anywhere() {
        assert!(matches!(
            parse(&spec(), &args(&["--steps", "1", "--help"])).unwrap(),
            Parsed::Help
        ));
        assert!(spec().help().contains("--steps N"));
    }

    #[test]
    fn ids_list() {
        let m = run(&["--prompt", "1, 2,3"]).unwrap();
        assert_eq!(m.ids("prompt").unwrap(), Some(vec![1, 2, 3]));
        let m = run(&["--prompt", "1,,3"]).unwrap();
        assert!(m.ids("prompt").is_err());
    }

    #[test]
    fn words_only_where_the_spec_takes_them() {
        let mut with_words = spec();
        with_words
            .flags
            .push(Flag::words("files", "FILE...", "input files"));
        let parsed = parse(
            &with_words,
            &args(&["a.jsonl", "--steps", "2", "b.jsonl", "-"]),
        )
        .unwrap();
        let Parsed::Run(m) = parsed else {
            panic!("unexpected help")
        };
        assert_eq!(m.words(), ["a.jsonl", "b.jsonl", "-"]);
        assert_eq!(m.value("steps"), Some("2"));
        assert!(with_words.help().contains("FILE...  "));
        // The words have no `--files` spelling, and single-dash words are still flags.
        let err = |w: &[&str]| parse(&with_words, &args(w)).unwrap_err().to_string();
        assert!(err(&["--files", "x"]).contains("unknown flag --files"));
        assert!(err(&["-x"]).contains("unknown flag `-x`"));
        assert!(run(&["--json"]).unwrap().words().is_empty());
    }

    #[test]
    fn distance() {
        assert_eq!(edit_distance("steps", "step"), 1);
        assert_eq!(edit_distance("seed", "steps"), 3);
    }
}
