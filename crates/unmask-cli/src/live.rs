//! Terminal feedback: a loading progress bar on stderr (indicatif) and a live view of the
//! canvas on stdout, redrawn in place with ANSI escapes while the model denoises it.
//!
//! The canvas view stays hand-written: it redraws a multi-line block of styled, wrapped
//! token text, which no progress-bar crate lays out.

use std::io::{self, Write};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use unmask::StepEvent;
use unmask_core::tokenizer::{DecodeMode, Tokenizer};
use unmask_gpu::model::LoadProgress;

const DIM: &str = "\x1b[2m";
const FRESH: &str = "\x1b[1;32m";
const RESET: &str = "\x1b[0m";
const MASK_CELL: &str = "░";
/// End-of-text and end-of-turn tokens decode to nothing; a dot keeps their place visible.
const END_CELL: &str = "·";
const REDRAW_EVERY: Duration = Duration::from_millis(40);

/// Terminal width from `COLUMNS`, else 80. One column is left free so a full line never
/// leaves the cursor in the terminal's pending-wrap state.
fn term_width() -> usize {
    env_usize("COLUMNS").unwrap_or(80).max(20) - 1
}

fn term_height() -> usize {
    env_usize("LINES").unwrap_or(24).max(6)
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

const LOAD_TEMPLATE: &str =
    "loading [{bar:24}] {percent:>3}%  {binary_bytes} / {binary_total_bytes}  {wide_msg}";

/// A progress bar of `total` bytes on stderr, drawn in `template` with `#` and `.` cells.
/// indicatif hides it (draws nothing, `is_hidden()`) when stderr is not a terminal or
/// TERM is dumb.
pub fn stderr_bar(total: u64, template: &str) -> ProgressBar {
    let style = ProgressStyle::with_template(template)
        .expect("a valid template")
        .progress_chars("#.");
    ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()).with_style(style)
}

/// `loading [#####.....]  45%  12.30 MiB / 27.00 MiB  tensor` on stderr, redrawn at most 20
/// times a second; nothing when stderr is not a terminal.
pub struct LoadBar {
    bar: Option<ProgressBar>,
}

impl LoadBar {
    pub fn new() -> Self {
        Self { bar: None }
    }

    pub fn update(&mut self, p: &LoadProgress<'_>) {
        let bar = self
            .bar
            .get_or_insert_with(|| stderr_bar(p.total_bytes, LOAD_TEMPLATE));
        bar.set_length(p.total_bytes);
        bar.set_position(p.done_bytes);
        bar.set_message(p.tensor.to_string());
    }

    /// Erases the bar.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Style {
    Plain,
    Dim,
    Fresh,
    /// An end-of-text / end-of-turn token.
    End,
}

impl Style {
    fn code(self) -> &'static str {
        match self {
            Style::Plain => RESET,
            Style::Dim | Style::End => DIM,
            Style::Fresh => FRESH,
        }
    }
}

/// The generated part of the canvas, redrawn in place on stdout after every step: masks
/// are dim cells, the tokens committed by the latest step are highlighted.
pub struct CanvasView<'a> {
    tokenizer: Option<&'a Tokenizer>,
    end_ids: Vec<u32>,
    total_steps: Option<usize>,
    steps_seen: usize,
    drawn_lines: usize,
    last: Option<Instant>,
}

impl<'a> CanvasView<'a> {
    /// `tokenizer` turns ids into text (ids are shown without one); with a tokenizer,
    /// `end_ids` are shown as dots; `total_steps` is shown in the header when the schedule
    /// is fixed.
    pub fn new(
        tokenizer: Option<&'a Tokenizer>,
        end_ids: Vec<u32>,
        total_steps: Option<usize>,
    ) -> Self {
        Self {
            tokenizer,
            end_ids,
            total_steps,
            steps_seen: 0,
            drawn_lines: 0,
            last: None,
        }
    }

    pub fn step(&mut self, event: &StepEvent<'_>) {
        self.steps_seen += 1;
        let masks_left = event
            .generated()
            .iter()
            .filter(|&&t| t == event.mask_id)
            .count();
        // The last frame is always drawn so the finished canvas stays visible if the
        // caller does not clear it.
        if masks_left > 0 && self.last.is_some_and(|t| t.elapsed() < REDRAW_EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        let header = match self.total_steps {
            Some(n) => format!(
                "step {}/{n} · block {} · {masks_left} masked · {:.1} s",
                self.steps_seen,
                event.record.block + 1,
                event.elapsed_s
            ),
            None => format!(
                "step {} · block {} · {masks_left} masked · {:.1} s",
                self.steps_seen,
                event.record.block + 1,
                event.elapsed_s
            ),
        };
        let mut pieces = vec![(Style::Dim, header), (Style::Plain, "\n".to_string())];
        pieces.extend(self.canvas_pieces(event));
        let lines = layout(&pieces, term_width(), term_height() - 2);
        self.redraw(&lines);
    }

    /// Runs of committed tokens are decoded together (a token may be part of a multi-byte
    /// character); masks become one dim cell each.
    fn canvas_pieces(&self, event: &StepEvent<'_>) -> Vec<(Style, String)> {
        let fresh: Vec<u32> = event.record.committed.iter().map(|&(p, _)| p).collect();
        let generated = event.generated();
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < generated.len() {
            let style_of = |j: usize| {
                if generated[j] == event.mask_id {
                    Style::Dim
                } else if self.tokenizer.is_some() && self.end_ids.contains(&generated[j]) {
                    Style::End
                } else if fresh.contains(&((event.prompt_len + j) as u32)) {
                    Style::Fresh
                } else {
                    Style::Plain
                }
            };
            let style = style_of(i);
            let mut end = i + 1;
            while end < generated.len() && style_of(end) == style {
                end += 1;
            }
            let run = &generated[i..end];
            let text = match style {
                Style::Dim => MASK_CELL.repeat(run.len()),
                Style::End => END_CELL.repeat(run.len()),
                _ => self.render_tokens(run),
            };
            pieces.push((style, text));
            i = end;
        }
        pieces
    }

    fn render_tokens(&self, ids: &[u32]) -> String {
        match self.tokenizer {
            Some(t) => t
                .decode(ids, DecodeMode::Raw)
                .unwrap_or_else(|_| "\u{fffd}".into()),
            None => ids.iter().map(|id| format!("{id} ")).collect(),
        }
    }

    fn redraw(&mut self, lines: &[String]) {
        let mut frame = self.erase_sequence();
        frame.push_str(&lines.join("\n"));
        let mut out = io::stdout().lock();
        let _ = out.write_all(frame.as_bytes());
        let _ = out.flush();
        self.drawn_lines = lines.len();
    }

    /// Moves the cursor to the start of the view and clears everything below it.
    fn erase_sequence(&self) -> String {
        match self.drawn_lines {
            0 => String::new(),
            1 => "\r\x1b[J".to_string(),
            n => format!("\r\x1b[{}A\x1b[J", n - 1),
        }
    }

    /// Removes the view from the terminal, leaving the cursor where it started.
    pub fn clear(&mut self) {
        if self.drawn_lines > 0 {
            let mut out = io::stdout().lock();
            let _ = out.write_all(self.erase_sequence().as_bytes());
            let _ = out.flush();
            self.drawn_lines = 0;
        }
        self.steps_seen = 0;
        self.last = None;
    }
}

/// Lays styled text out in lines of at most `width` characters (wrapping by hand, so the
/// number of terminal lines is known), each line ending with a style reset. When there are
/// more than `max_lines`, the first line (the header) and the last lines are kept.
fn layout(pieces: &[(Style, String)], width: usize, max_lines: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    let mut col = 0;
    for (style, text) in pieces {
        line.push_str(style.code());
        for c in text.chars() {
            if c == '\n' || col == width {
                line.push_str(RESET);
                lines.push(std::mem::take(&mut line));
                line.push_str(style.code());
                col = 0;
                if c == '\n' {
                    continue;
                }
            }
            line.push(if c.is_control() { ' ' } else { c });
            col += 1;
        }
    }
    line.push_str(RESET);
    lines.push(line);
    if lines.len() > max_lines {
        let keep = max_lines.saturating_sub(2).max(1);
        let tail = lines.split_off(lines.len() - keep);
        lines.truncate(1);
        lines.push(format!("{DIM}…{RESET}"));
        lines.extend(tail);
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(line: &str) -> String {
        let mut out = String::new();
        let mut in_escape = false;
        for c in line.chars() {
            match (in_escape, c) {
                (false, '\x1b') => in_escape = true,
                (true, 'm') => in_escape = false,
                (true, _) => {}
                (false, c) => out.push(c),
            }
        }
        out
    }

    #[test]
    fn progress_templates_parse() {
        for template in [LOAD_TEMPLATE, crate::synth::WRITE_TEMPLATE] {
            ProgressStyle::with_template(template).unwrap();
        }
    }

    #[test]
    fn wraps_and_breaks_lines() {
        let pieces = vec![
            (Style::Plain, "abcdefg\nhi".to_string()),
            (Style::Dim, "░░░".to_string()),
        ];
        let lines: Vec<String> = layout(&pieces, 4, 100).iter().map(|l| visible(l)).collect();
        assert_eq!(lines, ["abcd", "efg", "hi░░", "░"]);
    }

    #[test]
    fn keeps_header_and_tail_when_too_tall() {
        let pieces = vec![(Style::Plain, "h\n1\n2\n3\n4\n5".to_string())];
        let lines: Vec<String> = layout(&pieces, 10, 4).iter().map(|l| visible(l)).collect();
        assert_eq!(lines, ["h", "…", "4", "5"]);
    }
}
