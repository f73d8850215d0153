//! Traces of single writes and what the database keeps (issue 16): an
//! unusable endpoint, a CLI lease write continuing `TRACEPARENT`, a
//! workflow's fan-in joining its trace, and the W3C checks on the stored
//! contexts. The end-to-end shape is in tests/traces.rs.

mod common;

use common::otlp::*;
use common::{eventually, fresh};
use std::process::{Command, Stdio};

/// A tracing setting never stops the work: an endpoint this build cannot
/// export to (HTTPS: no TLS here) is a warning, and the command runs.
#[tokio::test]
async fn an_unusable_endpoint_is_a_warning_not_a_failure() {
    let db = fresh().await;
    let out = Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args(["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"])
        .env("DATABASE_URL", &db.url)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector.invalid:4317")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("traces are off"), "{stderr}");
    assert_eq!(db.open_jobs().await, 1);
}

/// A script driving a lease through the CLI keeps the job's trace: the
/// grant `claim` prints names its claim span, and a write run with it as
/// TRACEPARENT continues it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_lease_write_continues_its_traceparent() {
    let db = fresh().await;
    let (endpoint, got) = receiver().await;
    let run = |args: &[&str], tp: Option<&str>| {
        let mut c = jobledger(&db.url, &endpoint, args);
        if let Some(tp) = tp {
            c.env("TRACEPARENT", tp);
        }
        // The log's level must not change the trace's shape (debug spans
        // are enabled for the log only).
        c.env("RUST_LOG", "debug");
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    run(
        &["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"],
        Some(&caller),
    );
    let grant = run(
        &["claim", "--queue", "q", "--worker", "sh", "--lease", "60s"],
        Some(&caller),
    );
    let handed = grant["traceparent"]
        .as_str()
        .expect("the grant names its claim span")
        .to_string();
    let (job, epoch, token) = (
        grant["job_id"].as_str().unwrap().to_string(),
        grant["epoch"].to_string(),
        grant["token"].to_string(),
    );
    // A write from a script in no trace at all still lands in the job's.
    run(
        &[
            "heartbeat",
            &job,
            "--epoch",
            &epoch,
            "--token",
            &token,
            "--worker",
            "sh",
        ],
        None,
    );
    let out = run(
        &[
            "complete", &job, "--epoch", &epoch, "--token", &token, "--worker", "sh",
        ],
        Some(&handed),
    );
    assert_eq!(out["outcome"], "committed", "{out}");
    let claim_cmd = got.named("jobledger claim").pop().expect("the command is a span");
    let claim = got.named("jobledger.claim").pop().expect("the claim span");
    assert_eq!(
        claim.parent_span_id, claim_cmd.span_id,
        "the claim is its command's child, whatever RUST_LOG says"
    );
    // Its span is the command's (a trace of the script's own); its event
    // is stamped in the job's trace.
    let (beat,): (Option<String>,) = sqlx::query_as(
        "SELECT trace FROM jobledger.events WHERE job_id = $1::uuid AND type = 'lease_extended'",
    )
    .bind(&job)
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    assert!(
        beat.expect("traced").contains(CALLER_TRACE),
        "a write outside any trace is stamped in its job's"
    );
    let complete = got
        .named("jobledger complete")
        .pop()
        .expect("the command is a span");
    assert_eq!(traceparent_parent(&complete), handed, "it continues TRACEPARENT");
    let (written,): (Option<String>,) =
        sqlx::query_as("SELECT trace FROM jobledger.events WHERE job_id = $1::uuid AND type = 'succeeded'")
            .bind(&job)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let written = written.expect("traced");
    let spans = got.spans();
    let mut up = spans
        .iter()
        .find(|s| traceparent(s) == written)
        .expect("a span the receiver got")
        .clone();
    while up.span_id != complete.span_id {
        up = spans
            .iter()
            .find(|s| s.span_id == up.parent_span_id)
            .cloned()
            .expect("the writer leads up to the command");
    }
}

/// A workflow's fan-in continues the workflow's trace, whoever ends the
/// last step (here a worker, in no span of the workflow's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflows_fan_in_joins_its_trace() {
    let db = fresh().await;
    let (endpoint, _got) = receiver().await;
    let spec = serde_json::json!({
        "queue": "q", "name": "wf",
        "steps": [{ "name": "a", "kind": "k" }, { "name": "b", "kind": "k", "after": ["a"] }],
        "finally": { "name": "fin", "kind": "k" }
    });
    let out = jobledger(&db.url, &endpoint, &["workflow", "create", &spec.to_string()])
        .env("TRACEPARENT", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let worker = jobledger(&db.url, &endpoint, &worker_args("echo '{}'"))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    eventually("the workflow ends", || async { db.open_jobs().await == 0 }).await;
    stop(worker);
    let outside = db
        .count(&format!(
            "SELECT count(*) FROM jobledger.events e JOIN jobledger.jobs j USING (job_id) \
             WHERE e.trace IS NULL OR NOT e.trace LIKE '00-{CALLER_TRACE}-%' \
                OR NOT j.traceparent LIKE '00-{CALLER_TRACE}-%'"
        ))
        .await;
    assert_eq!(
        outside, 0,
        "every job and event of the workflow, the fan-in's too, is in its trace"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        4,
        "parent, two steps, fan-in"
    );
}

/// Only a W3C trace context can be stored as one: the relay sends
/// `events.trace` on as a header (the check holds even with the log's
/// triggers off).
#[tokio::test]
async fn only_a_trace_context_is_stored_as_one() {
    let db = fresh().await;
    let job = db.enqueue(None, serde_json::json!({})).await;
    let mut conn = db.conn().await;
    let err = sqlx::raw_sql(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, actor, epoch, token, \
           attempt, run, data, recorded_at, prev_hash, hash, trace) \
         SELECT job_id, 2, type, from_state, to_state, reason, actor, epoch, token, attempt, run, data, \
           recorded_at, hash, 'h', 'evil\r\nheader' FROM jobledger.events WHERE job_id = '{}'; COMMIT;",
        job.job_id
    ))
    .execute(&mut conn)
    .await
    .expect_err("refused");
    let code = common::sqlstate(&err);
    assert_eq!(code.as_deref(), Some("23514"), "{err}");
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
    // Near misses of the shape: short ids, a dash moved, upper case, a
    // fourth group, another version, an extra character.
    for bad in [
        "00-1-1-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-701",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
        "00-4bf92f3577b34da6-3ce929d0e0e4736-00f067aa0ba902b7-01",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
    ] {
        let err = sqlx::raw_sql(&format!(
            "BEGIN; SET LOCAL session_replication_role = replica; \
             UPDATE jobledger.jobs SET traceparent = '{bad}'; COMMIT;"
        ))
        .execute(&mut conn)
        .await
        .expect_err(bad);
        assert!(err.to_string().contains("jobs_traceparent_w3c"), "{bad}: {err}");
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
    }
    sqlx::raw_sql(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         UPDATE jobledger.jobs SET traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'; COMMIT;",
    )
    .execute(&mut conn)
    .await
    .expect("a W3C trace context is stored");
}

/// A handler's other outcomes are its children too: a permanent failure
/// (exit 3) is written by a `jobledger.fail` span under the handler's span
/// of the same attempt, like a completion.
#[tokio::test]
async fn a_handlers_failure_is_written_under_its_handler() {
    let db = fresh().await;
    let (endpoint, got) = receiver().await;
    let job_id = enqueue_in_callers_trace(&db.url, &endpoint);
    let worker = jobledger(&db.url, &endpoint, &worker_args("exit 3"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    eventually("the job is dead", || async {
        db.state_of(job_id).await == jobledger::domain::JobState::Dead
    })
    .await;
    // Exported within the batch processor's second; `stop` blocks this
    // test's thread, which also serves the receiver.
    eventually("the failure's span arrives", || async {
        !got.named("jobledger.fail").is_empty()
    })
    .await;
    stop(worker);
    let handle = got.named("jobledger.handle");
    let fail = got.named("jobledger.fail");
    assert_eq!((handle.len(), fail.len()), (1, 1), "one attempt, one failure");
    assert_eq!(hex(&fail[0].trace_id), CALLER_TRACE);
    assert_eq!(
        fail[0].parent_span_id, handle[0].span_id,
        "the failure is its handler's child"
    );
    assert_eq!(attr(&fail[0], "token").as_deref(), Some("1"));
}
