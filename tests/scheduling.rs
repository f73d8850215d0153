//! Issue 10 item 4, through the binary: `--delay`, `--run-at` and priority
//! decide what a claim hands out and in which order; names over 256 bytes
//! are refused and 256 are not; a key reused with another kind is refused
//! and writes nothing; the lag figures count what a reader has not applied.

mod common;

use common::cli::jl;
use common::fresh;
use serde_json::Value;

fn enqueue(url: &str, extra: &[&str]) -> String {
    let mut args = vec!["enqueue", "--queue", "s", "--kind", "k"];
    args.extend_from_slice(extra);
    let r = jl(url, &args);
    assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
    r.json()["job_id"].as_str().unwrap().to_string()
}

fn claim(url: &str, limit: &str) -> Vec<String> {
    let r = jl(url, &["claim", "--queue", "s", "--worker", "w", "--limit", limit]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.lines()
        .iter()
        .map(|l| l["job_id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn delay_run_at_and_priority_decide_the_claims() {
    let db = fresh().await;
    let url = &db.url;
    let later = enqueue(url, &["--delay", "1h"]);
    let future = enqueue(url, &["--run-at", "2999-01-01T00:00:00Z"]);
    let low = enqueue(url, &["--priority", "5"]);
    let past = enqueue(url, &["--run-at", "2020-01-01T00:00:00Z", "--priority", "5"]);
    let high = enqueue(url, &["--priority", "1"]);
    let mid = enqueue(url, &["--priority", "3"]);
    // One at a time: lowest priority number first, then the earliest run_at.
    let order: Vec<String> = (0..4).flat_map(|_| claim(url, "1")).collect();
    assert_eq!(order, vec![high, mid, past, low], "priority, then run_at");
    assert!(
        claim(url, "10").is_empty(),
        "the delayed and future jobs are not due"
    );
    let shown = jl(url, &["show", &later]).json();
    assert_eq!(shown["state"], "queued");
    let due_in = chrono::DateTime::parse_from_rfc3339(shown["run_at"].as_str().unwrap())
        .unwrap()
        .with_timezone(&chrono::Utc)
        - chrono::Utc::now();
    assert!(
        (3500..=3600).contains(&due_in.num_seconds()),
        "--delay 1h: {due_in}"
    );
    assert_eq!(
        jl(url, &["show", &future]).json()["run_at"].as_str().unwrap()[..10],
        *"2999-01-01"
    );
}

#[tokio::test]
async fn names_are_limited_to_256_bytes() {
    let db = fresh().await;
    let url = &db.url;
    let at_limit = "é".repeat(128); // 256 bytes, 128 characters
    let over = format!("{at_limit}x");
    for flag in ["--queue", "--kind", "--key"] {
        let args = |name: &str| {
            let mut a = vec!["enqueue".to_string()];
            for (f, default) in [("--queue", "s"), ("--kind", "k"), ("--key", "key")] {
                a.push(f.into());
                a.push(if f == flag {
                    name.to_string()
                } else {
                    format!("{default}{flag}")
                });
            }
            a
        };
        let ok = args(&at_limit);
        let r = jl(url, &ok.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(r.code, 0, "{flag} of 256 bytes: {}", r.stderr);
        let bad = args(&over);
        let r = jl(url, &bad.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(r.code, 2, "{flag} of 257 bytes");
        assert!(
            r.stderr.contains("257 bytes, over the limit of 256"),
            "{}",
            r.stderr
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        3,
        "only the ones at the limit"
    );
}

#[tokio::test]
async fn a_key_reused_with_another_kind_is_refused_and_writes_nothing() {
    let db = fresh().await;
    let url = &db.url;
    let first = enqueue(url, &["--key", "order-1", "--payload", "{\"n\": 1}"]);
    let again = jl(
        url,
        &[
            "enqueue",
            "--queue",
            "s",
            "--kind",
            "k",
            "--key",
            "order-1",
            "--payload",
            "{\"n\": 1}",
        ],
    );
    assert_eq!(
        (again.code, again.json()["job_id"].as_str()),
        (0, Some(first.as_str())),
        "same job"
    );
    let other_kind = jl(
        url,
        &[
            "enqueue",
            "--queue",
            "s",
            "--kind",
            "other",
            "--key",
            "order-1",
            "--payload",
            "{\"n\": 1}",
        ],
    );
    assert_eq!(other_kind.code, 4, "{}", other_kind.stderr);
    assert!(
        other_kind.stderr.contains(&first),
        "names the existing job: {}",
        other_kind.stderr
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        1,
        "nothing written"
    );
}

#[tokio::test]
async fn lag_counts_what_a_projection_has_not_applied() {
    let db = fresh().await;
    let url = &db.url;
    enqueue(url, &[]);
    assert_eq!(jl(url, &["projections", "run"]).code, 0);
    for _ in 0..3 {
        enqueue(url, &[]);
    }
    let status = jl(url, &["projections", "status"]);
    assert_eq!(status.code, 0, "{}", status.stderr);
    let lines = status.lines();
    let mut names: Vec<&str> = lines.iter().map(|l| l["projection"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(
        names,
        ["job_timeline", "jobs_rebuilt", "queue_stats", "workflows"],
        "every shipped projection, one line each"
    );
    for l in &lines {
        assert_eq!(l["lag_events"], 3, "{l}");
        let s = l["lag_seconds"].as_f64().unwrap();
        assert!((0.0..60.0).contains(&s), "{l}");
    }
    let stats = jl(url, &["stats"]).lines();
    assert!(
        stats.iter().all(|l| l.get("reader").is_none()),
        "no reader checkpoint that nothing moves (the runner keeps its own): {stats:?}"
    );
    assert_eq!(jl(url, &["projections", "run"]).code, 0);
    let caught_up: Vec<Value> = jl(url, &["projections", "status"]).lines();
    assert!(caught_up.iter().all(|l| l["lag_events"] == 0), "{caught_up:?}");
}
