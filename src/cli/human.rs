//! Text for people: where the CLI's reads print aligned, coloured text on a
//! terminal and JSON lines when piped (or with `--json`; `--text` forces
//! text into a pipe). Colour only on a terminal, and never with `NO_COLOR`
//! set (https://no-color.org). The JSON stays the contract for scripts; this
//! is rendering only, so everything here takes what the JSON would say.

use std::io::IsTerminal;

use anstyle::{AnsiColor, Style};
use jobledger::ledger::timeline::{LineKind, TimelineLine};
use serde_json::Value;
use unicode_width::UnicodeWidthStr;

/// `--json` / `--text` of the reads that render for people.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct Format {
    /// JSON lines even on a terminal.
    #[arg(long)]
    pub json: bool,
    /// Text even into a pipe.
    #[arg(long, conflicts_with = "json")]
    pub text: bool,
}

impl Format {
    pub fn render(self) -> Render {
        Render::choose(self.json, self.text)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Render {
    Json,
    Text { colour: bool },
}

impl Render {
    /// `--json` wins, then `--text`, then whether stdout is a terminal.
    pub fn choose(json: bool, text: bool) -> Render {
        let tty = std::io::stdout().is_terminal();
        if json || !(text || tty) {
            return Render::Json;
        }
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Render::Text {
            colour: tty && !no_color,
        }
    }

    pub fn colour(self) -> bool {
        matches!(self, Render::Text { colour: true })
    }
}

fn paint(on: bool, style: Style, s: &str) -> String {
    if on {
        format!("{style}{s}{style:#}")
    } else {
        s.to_string()
    }
}

/// A state's colour: done green, failed-for-good red, stopped yellow,
/// in flight cyan, waiting plain.
fn state_style(state: &str) -> Style {
    let c = match state {
        "succeeded" => AnsiColor::Green,
        "dead" | "failed" => AnsiColor::Red,
        "cancelled" | "cancel_requested" | "held" => AnsiColor::Yellow,
        "leased" | "running" | "awaiting_receipt" => AnsiColor::Cyan,
        _ => return Style::new(),
    };
    Style::new().fg_color(Some(c.into()))
}

pub fn state(on: bool, s: &str) -> String {
    paint(on, state_style(s).bold(), s)
}

fn dim(on: bool, s: &str) -> String {
    paint(on, Style::new().dimmed(), s)
}

/// Text from the log as a terminal may show it: control characters (an
/// escape sequence in a worker's error message would drive the operator's
/// terminal) and bidirectional overrides (which reorder what is read) are
/// written as escapes instead.
pub fn clean(s: &str) -> std::borrow::Cow<'_, str> {
    let bad = |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !s.chars().any(bad) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if bad(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// One `history` line: the state the event moved the job to coloured,
/// refusals red, corrections dimmed. The label (a step's name, chosen by
/// people) is never read for markup; the line after it has a fixed layout
/// up to the target state (position, version, time, event type, from).
pub fn timeline_line(on: bool, l: &TimelineLine) -> String {
    let (label, text) = (clean(&l.label), clean(&l.text));
    if !on {
        return format!("{label}{text}");
    }
    let red = Style::new().fg_color(Some(AnsiColor::Red.into()));
    let body = match &l.kind {
        LineKind::Refused => paint(true, red, &text),
        LineKind::Correction => dim(true, &text),
        LineKind::Event { to_state } => {
            let arrow = format!(" -> {to_state}");
            match text.find(&arrow) {
                Some(at) => format!(
                    "{} -> {}{}",
                    &text[..at],
                    state(true, to_state),
                    &text[at + arrow.len()..]
                ),
                None => text.into_owned(),
            }
        }
    };
    format!("{label}{body}")
}

/// A JSON object as aligned `key  value` lines: scalars as they read,
/// nested values as compact JSON, nulls left out.
pub fn fields(on: bool, v: &Value) -> Vec<String> {
    let Some(o) = v.as_object() else {
        return vec![v.to_string()];
    };
    let width = o.keys().map(|k| k.width()).max().unwrap_or(0);
    // Who and where first, then what happened, then the rest A to Z.
    const FIRST: [&str; 8] = [
        "job_id",
        "queue",
        "kind",
        "key",
        "state",
        "reason",
        "waiting_because",
        "version",
    ];
    let rank = |k: &str| FIRST.iter().position(|f| *f == k).unwrap_or(FIRST.len());
    let mut entries: Vec<_> = o.iter().collect();
    entries.sort_by_key(|(k, _)| rank(k));
    entries
        .into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| {
            let shown = match v {
                Value::String(s) if k == "state" => state(on, &clean(s)),
                Value::String(s) => clean(s).into_owned(),
                Value::Array(a) if a.iter().all(Value::is_object) && !a.is_empty() => a
                    .iter()
                    .map(|x| clean(&x.to_string()).into_owned())
                    .collect::<Vec<_>>()
                    .join(&format!("\n{:width$}  ", "")),
                other => clean(&other.to_string()).into_owned(),
            };
            format!("{}  {shown}", dim(on, &format!("{k:<width$}")))
        })
        .collect()
}

/// Rows of JSON objects as a table with the given columns (header dimmed).
pub fn table(on: bool, columns: &[&str], rows: &[Value]) -> Vec<String> {
    let cell = |r: &Value, c: &str| match &r[c] {
        Value::Null => "-".to_string(),
        Value::String(s) => clean(s).into_owned(),
        v => clean(&v.to_string()).into_owned(),
    };
    let widths: Vec<usize> = columns
        .iter()
        .map(|c| {
            rows.iter()
                .map(|r| cell(r, c).width())
                .chain([c.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = vec![];
    let header: Vec<String> = columns
        .iter()
        .zip(&widths)
        .map(|(c, w)| format!("{c:<w$}"))
        .collect();
    out.push(dim(on, header.join("  ").trim_end()));
    for r in rows {
        let cells: Vec<String> = columns
            .iter()
            .zip(&widths)
            .map(|(c, w)| {
                let text = cell(r, c);
                let pad = " ".repeat(w.saturating_sub(text.width()));
                // Numbers right-aligned, words left; a state coloured.
                match &r[*c] {
                    Value::Number(_) => format!("{pad}{text}"),
                    Value::String(s) if *c == "state" => format!("{}{pad}", state(on, s)),
                    _ => format!("{text}{pad}"),
                }
            })
            .collect();
        out.push(cells.join("  ").trim_end().to_string());
    }
    if rows.is_empty() {
        out.push(dim(on, "(none)"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_text_has_no_escapes_and_aligns() {
        let rows = [
            json!({"state": "succeeded", "jobs": 12}),
            json!({"state": "dead", "jobs": 3}),
        ];
        let t = table(false, &["state", "jobs"], &rows);
        assert_eq!(t, ["state      jobs", "succeeded    12", "dead          3"]);
        let t = table(
            false,
            &["reader", "lag"],
            &[
                json!({"reader": "投影読者", "lag": 1}),
                json!({"reader": "ab", "lag": 2}),
            ],
        );
        assert_eq!(t, ["reader    lag", "投影読者    1", "ab          2"]);
        assert_eq!(table(false, &["state"], &[]), ["state", "(none)"]);
        let f = fields(false, &json!({"job_id": "x", "state": "dead", "result": null}));
        assert_eq!(f, ["job_id  x", "state   dead"]);
        let f = fields(false, &json!({"attempt": 1, "state": "dead", "job_id": "x"}));
        assert_eq!(f, ["job_id   x", "state    dead", "attempt  1"]);
    }

    fn event(label: &str, text: &str, to: &str) -> TimelineLine {
        TimelineLine {
            label: label.into(),
            kind: LineKind::Event { to_state: to.into() },
            text: text.into(),
        }
    }

    #[test]
    fn colour_marks_the_state_only() {
        let t = "      3 v2   2026-12-02T22:09:56Z  claimed   queued -> leased   claimed";
        let c = timeline_line(true, &event("", t, "leased"));
        assert!(c.contains("\u{1b}[") && c.starts_with("      3 v2"), "{c:?}");
        assert_eq!(timeline_line(false, &event("", t, "leased")), t);
        // A step named like an arrow to a state is not marked up.
        let c = timeline_line(true, &event("[a -> dead x] ", t, "leased"));
        assert!(c.starts_with("[a -> dead x] "), "{c:?}");
        assert!(c.contains("\u{1b}[1m\u{1b}[36mleased"), "{c:?}");
        let r = TimelineLine {
            label: String::new(),
            kind: LineKind::Refused,
            text: "      -   REFUSED heartbeat stale".into(),
        };
        assert!(timeline_line(true, &r).contains("\u{1b}[31m"));
    }

    #[test]
    fn text_from_the_log_cannot_drive_the_terminal() {
        let l = timeline_line(
            false,
            &event("[\u{202e}x] ", "by w \u{1b}]0;owned\u{7} x\u{202e}y", "q"),
        );
        assert!(!l.contains('\u{1b}') && !l.contains('\u{202e}'), "{l:?}");
        assert!(l.contains("\\u{1b}") && l.contains("\\u{202e}"), "{l:?}");
        // Nested values too (serde escapes only U+0000..U+001F).
        let f = fields(
            false,
            &json!({"last_error": {"message": "a\u{9b}2J\u{202e}b\u{7f}"}}),
        );
        assert!(
            !f[0].contains('\u{9b}') && !f[0].contains('\u{202e}') && !f[0].contains('\u{7f}'),
            "{f:?}"
        );
        let f = fields(false, &json!({"last_error": "a\u{1b}[2Jb"}));
        assert_eq!(f, ["last_error  a\\u{1b}[2Jb"]);
    }
}
