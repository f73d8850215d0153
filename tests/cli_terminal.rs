//! The reads a person runs (`show`, `history`, `stats`): aligned, coloured
//! text on a terminal, JSON lines into a pipe, `--json`/`--text` to choose,
//! no colour with `NO_COLOR`. The terminal is a real pseudo-terminal
//! (util-linux `script`), not a flag pretending to be one.

mod common;

use common::{cli::jl, fresh, new_job};
use serde_json::json;
use std::process::Command;
use std::time::Duration;

/// Runs the binary on a pseudo-terminal; what it printed there.
fn on_terminal(url: &str, args: &[&str], no_color: bool) -> String {
    let quoted: Vec<String> = std::iter::once(env!("CARGO_BIN_EXE_jobledger"))
        .chain(args.iter().copied())
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect();
    let mut c = Command::new("script");
    c.args(["-qec", &quoted.join(" "), "/dev/null"])
        .env("DATABASE_URL", url)
        .env_remove("RUST_LOG")
        .env("TERM", "xterm");
    if no_color {
        c.env("NO_COLOR", "1");
    } else {
        c.env_remove("NO_COLOR");
    }
    let out = c.output().expect("script(1) from util-linux");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().replace("\r\n", "\n")
}

#[tokio::test]
async fn reads_render_for_people_on_a_terminal_and_json_into_a_pipe() {
    let db = fresh().await;
    let l = &db.ledger;
    let job = l
        .enqueue(new_job("q", Some("k"), json!({"n": 1})))
        .await
        .unwrap()
        .job
        .job_id;
    let lease = l
        .claim("q", "w", Duration::from_secs(30), 1)
        .await
        .unwrap()
        .remove(0);
    lease.complete(Some(json!({"ok": true}))).await.unwrap();
    let id = job.to_string();

    // history: coloured text on a terminal, the target state painted.
    let h = on_terminal(&db.url, &["history", &id], false);
    assert!(h.contains("enqueued") && h.contains("succeeded"), "{h}");
    assert!(
        h.contains("\u{1b}[1m\u{1b}[32msucceeded"),
        "the state is green and bold: {h:?}"
    );
    assert!(!h.trim_start().starts_with('{'), "{h}");
    // NO_COLOR: the same text, no escapes.
    let plain = on_terminal(&db.url, &["history", &id], true);
    assert!(!plain.contains('\u{1b}'), "{plain:?}");
    assert_eq!(plain.lines().count(), 3, "{plain}");
    // --json on a terminal: JSON lines.
    let j = on_terminal(&db.url, &["history", &id, "--json"], false);
    assert!(
        j.lines()
            .all(|x| serde_json::from_str::<serde_json::Value>(x).is_ok()),
        "{j}"
    );
    // Into a pipe: JSON lines; --text: the terminal's text, uncoloured.
    assert_eq!(jl(&db.url, &["history", &id]).lines().len(), 3);
    assert_eq!(jl(&db.url, &["history", &id, "--text"]).stdout, plain);

    // show: aligned fields, nulls left out; JSON into a pipe.
    let s = on_terminal(&db.url, &["show", &id], true);
    let state = s.lines().find(|x| x.starts_with("state ")).unwrap_or_default();
    assert!(state.trim_end().ends_with(" succeeded"), "{s}");
    assert!(!s.contains("null"), "{s}");
    // Where each value starts: after the key and its padding.
    let col = |x: &str| x.find("  ").map(|i| i + x[i..].len() - x[i..].trim_start().len());
    let starts: std::collections::HashSet<_> = s
        .lines()
        .filter(|x| !x.starts_with(' '))
        .filter_map(col)
        .collect();
    assert_eq!(starts.len(), 1, "values start in one column: {s}");
    assert_eq!(jl(&db.url, &["show", &id]).json()["state"], "succeeded");

    // stats: a table of states and one of readers.
    let t = on_terminal(&db.url, &["stats"], true);
    let mut rows = t.lines();
    assert_eq!(rows.next().map(str::trim_end), Some("state      jobs"), "{t}");
    assert_eq!(rows.next().map(str::trim_end), Some("succeeded     1"), "{t}");
    assert!(t.contains("reader"), "{t}");
    assert!(jl(&db.url, &["stats"])
        .lines()
        .iter()
        .any(|v| v["state"] == "succeeded"));
}

/// Long operations show a bar with an ETA on a terminal and say nothing on
/// a piped stderr. 20,000 events keep the export and the audit busy for
/// many of the bar's 100 ms ticks even in a debug build.
#[tokio::test]
async fn export_and_audit_show_progress_on_a_terminal_only() {
    let db = fresh().await;
    for chunk in 0..20 {
        let jobs: Vec<_> = (0..1000)
            .map(|i| new_job("q", Some(&format!("k{chunk}-{i}")), json!({ "i": i })))
            .collect();
        db.ledger.enqueue_many_as(jobs, "test").await.unwrap();
    }
    let dir = std::env::temp_dir().join(format!("jl-progress-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let (tty_file, pipe_file) = (dir.join("tty.zst"), dir.join("pipe.zst"));

    let shown = on_terminal(&db.url, &["export", "--out", tty_file.to_str().unwrap()], true);
    assert!(shown.contains("/20,000 events, ETA "), "{shown:?}");
    let shown = on_terminal(&db.url, &["audit", tty_file.to_str().unwrap()], true);
    assert!(
        shown.contains(" read, ETA ") || shown.contains("read, "),
        "{shown:?}"
    );
    assert!(shown.contains("\"ok\":true"), "{shown:?}");

    let piped = jl(&db.url, &["export", "--out", pipe_file.to_str().unwrap()]);
    assert_eq!(piped.code, 0, "{}", piped.stderr);
    assert_eq!(piped.stderr, "", "nothing but the result when piped");
    let piped = jl(&db.url, &["audit", pipe_file.to_str().unwrap()]);
    assert_eq!(piped.code, 0, "{}", piped.stderr);
    assert_eq!(piped.stderr, "");
    assert_eq!(piped.json()["ok"], true);
    let _ = std::fs::remove_dir_all(&dir);
}
