//! The `jobledger` binary's contract: JSON lines on stdout, one-line errors
//! on stderr, documented exit codes, and bad input that changes nothing.

mod common;

use common::cli::{jl, jl_stdin};

fn fence_args<'a>(job: &'a str, epoch: &'a str, token: &'a str) -> Vec<&'a str> {
    vec![job, "--epoch", epoch, "--token", token]
}

#[tokio::test]
async fn migrate_creates_the_database_once() {
    let url = format!("{}/jlt_{}", common::server_url(), uuid::Uuid::new_v4().simple());
    let first = jl(&url, &["migrate"]);
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert_eq!(first.json()["database_created"], true);
    let second = jl(&url, &["migrate"]);
    assert_eq!(second.json()["database_created"], false);
}

#[tokio::test]
async fn a_job_through_the_cli_with_every_exit_code() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    let e = jl(
        url,
        &[
            "enqueue",
            "--queue",
            "refunds",
            "--kind",
            "refund",
            "--key",
            "r-1",
            "--payload",
            r#"{"amount": 10}"#,
        ],
    );
    assert_eq!(e.code, 0, "{}", e.stderr);
    let e = e.json();
    assert_eq!(
        (e["state"].as_str(), e["created"].as_bool(), e["token"].as_i64()),
        (Some("queued"), Some(true), Some(0))
    );
    let job = e["job_id"].as_str().unwrap().to_string();
    let epoch = e["epoch"].to_string();

    // Same key again: the same job; another payload: a conflict (exit 4).
    let again = jl(
        url,
        &[
            "enqueue",
            "--queue",
            "refunds",
            "--kind",
            "refund",
            "--key",
            "r-1",
            "--payload",
            r#"{ "amount" : 10 }"#,
        ],
    );
    assert_eq!(
        (again.json()["job_id"].as_str(), again.json()["created"].as_bool()),
        (Some(job.as_str()), Some(false))
    );
    let clash = jl(
        url,
        &[
            "enqueue",
            "--queue",
            "refunds",
            "--kind",
            "refund",
            "--key",
            "r-1",
            "--payload",
            r#"{"amount": 11}"#,
        ],
    );
    assert_eq!(clash.code, 4, "{}", clash.stderr);

    let c = jl(
        url,
        &["claim", "--queue", "refunds", "--worker", "w-a", "--lease", "30s"],
    );
    let c = c.json();
    assert_eq!(
        (
            c["token"].as_i64(),
            c["attempt"].as_i64(),
            c["next_action"].as_str()
        ),
        (Some(1), Some(1), Some("execute"))
    );
    assert_eq!(c["payload"]["amount"], 10);
    let nothing = jl(url, &["claim", "--queue", "refunds", "--worker", "w-b"]);
    assert_eq!(
        (nothing.code, nothing.stdout.as_str()),
        (0, ""),
        "nothing due prints nothing"
    );

    let mut hb = vec!["heartbeat"];
    hb.extend(fence_args(&job, &epoch, "1"));
    assert_eq!(jl(url, &hb).json()["outcome"], "committed");
    let mut pr = vec!["progress", "--step", "called-provider"];
    pr.extend(fence_args(&job, &epoch, "1"));
    assert_eq!(jl(url, &pr).json()["outcome"], "committed");

    // Invalid transition (exit 5): no cancel was requested.
    let mut cc = vec!["confirm-cancel"];
    cc.extend(fence_args(&job, &epoch, "1"));
    assert_eq!(jl(url, &cc).code, 5);

    // Complete with a result from a file; a lost response retried: 0; a
    // different result from the same token: conflict (4).
    let dir = std::env::temp_dir().join(format!("jl-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("result.json");
    std::fs::write(&file, r#"{"refund_id": "re_1"}"#).unwrap();
    let at_file = format!("@{}", file.display());
    let mut done = vec!["complete", "--result", at_file.as_str()];
    done.extend(fence_args(&job, &epoch, "1"));
    let r = jl(url, &done);
    assert_eq!(
        (r.code, r.json()["outcome"].as_str(), r.json()["state"].as_str()),
        (0, Some("committed"), Some("succeeded"))
    );
    let r = jl(url, &done);
    assert_eq!(
        (r.code, r.json()["outcome"].as_str()),
        (0, Some("already_committed"))
    );
    let mut other = vec!["complete", "--result", "@-"];
    other.extend(fence_args(&job, &epoch, "1"));
    let r = jl_stdin(url, &other, Some(r#"{"refund_id": "re_2"}"#));
    assert_eq!((r.code, r.json()["outcome"].as_str()), (4, Some("conflict")));

    // Stale (exit 3): an older token.
    let mut old = vec!["fail", "--class", "transient", "--code", "timeout"];
    old.extend(fence_args(&job, &epoch, "0"));
    let r = jl(url, &old);
    assert_eq!((r.code, r.json()["outcome"].as_str()), (3, Some("stale")));

    let show = jl(url, &["show", &job]).json();
    assert_eq!(
        (show["state"].as_str(), show["result"]["refund_id"].as_str()),
        (Some("succeeded"), Some("re_1"))
    );
    let history = jl(url, &["history", &job, "--text"]);
    assert_eq!(history.code, 0);
    assert!(
        history.stdout.contains("claimed") && history.stdout.contains("REFUSED fail stale"),
        "{}",
        history.stdout
    );
    let events = jl(url, &["history", &job, "--json"]).lines();
    assert_eq!(events.iter().filter(|e| e.get("hash").is_some()).count(), 5);
    let v = jl(url, &["verify"]);
    assert_eq!(
        (v.code, v.lines().last().unwrap()["ok"].as_bool()),
        (0, Some(true))
    );

    // Not found (exit 6).
    let missing = uuid::Uuid::now_v7().to_string();
    assert_eq!(jl(url, &["show", &missing]).code, 6);
    let mut m = vec!["complete"];
    m.extend(fence_args(&missing, "1", "1"));
    assert_eq!(jl(url, &m).code, 6);
}

#[tokio::test]
async fn fail_prints_the_retry_time_and_cancel_prints_the_state() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    let e = jl(
        url,
        &["enqueue", "--queue", "q", "--kind", "k", "--backoff-base", "10s"],
    )
    .json();
    let (job, epoch) = (e["job_id"].as_str().unwrap().to_string(), e["epoch"].to_string());
    jl(url, &["claim", "--queue", "q", "--worker", "w"]);
    let mut f = vec![
        "fail",
        "--class",
        "transient",
        "--code",
        "busy",
        "--message",
        "503 from provider",
    ];
    f.extend(fence_args(&job, &epoch, "1"));
    let r = jl(url, &f).json();
    assert_eq!(r["state"], "queued");
    assert!(r["run_at"].is_string());
    let r = jl(url, &["cancel", &job, "--reason", "customer asked"]).json();
    assert_eq!(
        (r["outcome"].as_str(), r["state"].as_str()),
        (Some("committed"), Some("cancelled"))
    );
    assert_eq!(jl(url, &["cancel", &job]).json()["outcome"], "already_committed");
}

#[tokio::test]
async fn bad_input_is_refused_clearly_and_changes_nothing() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["enqueue", "--queue", "q", "--kind", "k", "--payload", "{not json"],
            "malformed JSON",
        ),
        (
            vec![
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--payload",
                "@/no/such/file",
            ],
            "cannot read",
        ),
        (
            vec![
                "--max-payload-bytes",
                "64",
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--payload",
                &LONG,
            ],
            "over the limit",
        ),
        (
            vec![
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--payload",
                r#"{"a": "\u0000"}"#,
            ],
            "U+0000",
        ),
        (vec!["enqueue", "--queue", "", "--kind", "k"], "must not be empty"),
        (
            vec!["enqueue", "--queue", "q", "--kind", "k", "--delay", "-5s"],
            "negative",
        ),
        (
            vec![
                "enqueue",
                "--queue",
                "q",
                "--kind",
                "k",
                "--delay",
                "5 fortnights",
            ],
            "not a duration",
        ),
        (
            vec!["enqueue", "--queue", "q", "--kind", "k", "--delay", "400days"],
            "longer than a year",
        ),
        (
            vec!["enqueue", "--queue", "q", "--kind", "k", "--max-attempts", "0"],
            "max attempts",
        ),
        (
            vec!["enqueue", "--queue", "q", "--kind", "k", "--run-at", "tomorrow"],
            "RFC 3339",
        ),
        (
            vec!["claim", "--queue", "q", "--worker", "w", "--lease", "0s"],
            "shorter than 1ms",
        ),
        (
            vec![
                "fail",
                "00000000-0000-0000-0000-000000000000",
                "--epoch",
                "1",
                "--token",
                "1",
                "--class",
                "fatal",
                "--code",
                "x",
            ],
            "not one of",
        ),
        (vec!["show", "not-a-uuid"], "invalid"),
        (vec!["replay", "--operator", "o", "--reason", "r"], "required"),
    ];
    for (args, needle) in cases {
        let r = jl(url, &args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(
            r.stderr.contains(needle),
            "{args:?}: stderr {:?} lacks {needle:?}",
            r.stderr
        );
        assert!(r.stdout.is_empty(), "{args:?} printed {:?}", r.stdout);
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        0,
        "nothing was written"
    );
}

/// Keys, kinds and payloads that look like SQL, or are deeply nested, are
/// data: stored and shown exactly, or refused as bad input; never executed.
#[tokio::test]
async fn sql_looking_and_deeply_nested_input_is_just_data() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    let key = "k'); DROP TABLE jobledger.events; --";
    let kind = "refund\" OR 1=1 --";
    let payload = r#"{"note": "'; DELETE FROM jobledger.jobs; --", "q": "$1"}"#;
    let e = jl(
        url,
        &[
            "enqueue",
            "--queue",
            "q",
            "--kind",
            kind,
            "--key",
            key,
            "--payload",
            payload,
        ],
    );
    assert_eq!(e.code, 0, "{}", e.stderr);
    let job = e.json()["job_id"].as_str().unwrap().to_string();
    let shown = jl(url, &["show", &job]).json();
    assert_eq!(shown["key"], key);
    assert_eq!(shown["kind"], kind);
    assert_eq!(shown["payload"]["note"], "'; DELETE FROM jobledger.jobs; --");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 1);

    let deep = format!("{}1{}", "[".repeat(500), "]".repeat(500));
    let r = jl(
        url,
        &["enqueue", "--queue", "q", "--kind", "k", "--payload", &deep],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("malformed JSON"), "{}", r.stderr);
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        1,
        "nothing else was written"
    );
}

static LONG: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{{\"blob\": \"{}\"}}", "x".repeat(200)));

#[test]
fn an_unreachable_database_is_reported_in_one_line() {
    let r = jl(
        "postgres://postgres@127.0.0.1:1/nothing",
        &["show", "00000000-0000-0000-0000-000000000000"],
    );
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.starts_with("error: cannot reach the database"),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.trim_end().lines().count(), 1, "{}", r.stderr);
}

#[tokio::test]
async fn verify_exits_non_zero_on_tampering() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    jl(url, &["enqueue", "--queue", "q", "--kind", "k"]);
    let mut conn = db.conn().await;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("UPDATE jobledger.events SET actor = 'mallory'")
        .execute(&mut conn)
        .await
        .unwrap();
    let v = jl(url, &["verify"]);
    assert_eq!(v.code, 1);
    assert_eq!(v.lines().last().unwrap()["ok"], false);
    assert!(v.lines()[0]["problem"]["detail"]
        .as_str()
        .unwrap()
        .contains("hash mismatch"));
}

/// `replay-log`: the log between two positions, in order, for one job or all,
/// including purged jobs' events.
#[tokio::test]
async fn replay_log_streams_events_in_position_order() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    let a = jl(url, &["enqueue", "--queue", "q", "--kind", "k", "--key", "a"]).json();
    jl(url, &["enqueue", "--queue", "q", "--kind", "k", "--key", "b"]);
    let c = jl(url, &["claim", "--queue", "q", "--worker", "w", "--limit", "2"]).lines();
    for l in &c {
        let mut args = vec!["complete"];
        let (job, epoch, token) = (
            l["job_id"].as_str().unwrap().to_string(),
            l["epoch"].to_string(),
            l["token"].to_string(),
        );
        args.extend([job.as_str(), "--epoch", epoch.as_str(), "--token", token.as_str()]);
        assert_eq!(jl(url, &args).code, 0);
    }
    assert_eq!(jl(url, &["purge", "--older-than", "0s"]).json()["purged"], 2);
    let all = jl(url, &["replay-log", "--json"]).lines();
    assert_eq!(all.len(), 8, "2 × (enqueued, claimed, succeeded, purged)");
    let positions: Vec<i64> = all.iter().map(|e| e["position"].as_i64().unwrap()).collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "in position order: {positions:?}"
    );
    let job = a["job_id"].as_str().unwrap();
    let one = jl(url, &["replay-log", "--json", "--job", job]).lines();
    assert_eq!(
        one.iter()
            .map(|e| e["type"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["enqueued", "claimed", "succeeded", "purged"]
    );
    let window = jl(
        url,
        &[
            "replay-log",
            "--from",
            &positions[2].to_string(),
            "--to",
            &positions[4].to_string(),
        ],
    );
    assert_eq!(window.stdout.lines().count(), 3);
}

/// `projections query --min-position`: pending while the projection is
/// behind, the rows once it has caught up.
#[tokio::test]
async fn projection_queries_wait_for_a_minimum_position_or_say_pending() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    assert_eq!(jl(url, &["projections", "run"]).code, 0);
    let e = jl(url, &["enqueue", "--queue", "q", "--kind", "k", "--key", "p"]).json();
    let (job, pos) = (
        e["job_id"].as_str().unwrap().to_string(),
        e["position"].to_string(),
    );
    let q = [
        "projections",
        "query",
        "job_timeline",
        "--job",
        &job,
        "--min-position",
        &pos,
        "--timeout",
        "100ms",
    ];
    let pending = jl(url, &q).json();
    assert_eq!(
        pending["pending"], true,
        "the runner is held back: pending, not an older answer"
    );
    assert_eq!(jl(url, &["projections", "run"]).code, 0);
    let rows = jl(url, &q).lines();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["type"], "enqueued");
    let status = jl(url, &["projections", "status"]).lines();
    assert!(status.iter().all(|s| s["lag_events"] == 0), "{status:?}");
}

/// `projections run` with one projection that cannot catch up (its table
/// was dropped by hand): the others still catch up, the failing one is
/// named, and the command fails. It stopped at the first before.
#[tokio::test]
async fn projections_run_carries_on_past_a_projection_that_fails() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    assert_eq!(jl(url, &["projections", "run"]).code, 0);
    sqlx::query("DROP TABLE jobledger_proj.job_timeline_v1 CASCADE")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    jl(url, &["enqueue", "--queue", "q", "--kind", "k"]).json();
    let run = jl(url, &["projections", "run"]);
    assert_ne!(run.code, 0, "{}", run.stderr);
    let lines = run.lines();
    let named = |name: &str| lines.iter().find(|l| l["projection"] == name).cloned();
    assert!(
        named("job_timeline").expect("reported")["error"].is_string(),
        "{lines:?}"
    );
    for p in ["queue_stats", "jobs_rebuilt", "workflows"] {
        assert_eq!(named(p).expect("tried")["applied"], 1, "{lines:?}");
    }
}

/// Issue 15 (rolling upgrades): once a newer binary's `jobs_rebuilt`
/// serves, an older binary's `verify --rebuilt` says so instead of
/// comparing against a table of a shape it does not know.
#[tokio::test]
async fn verify_rebuilt_by_older_code_names_the_newer_version() {
    let db = common::fresh().await;
    let url = db.url.as_str();
    jl(url, &["enqueue", "--queue", "q", "--kind", "k"]).json();
    let v = jl(url, &["verify", "--rebuilt"]);
    assert_eq!((v.code, v.json()["ok"].clone()), (0, true.into()), "{}", v.stderr);
    sqlx::query("UPDATE jobledger_proj.registry SET version = 99 WHERE name = 'jobs_rebuilt'")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let v = jl(url, &["verify", "--rebuilt"]);
    assert_ne!(v.code, 0, "{}", v.stdout);
    assert!(v.stderr.contains("version 99 serves"), "{}", v.stderr);
    assert_eq!(v.stderr.trim().lines().count(), 1, "{}", v.stderr);
}
