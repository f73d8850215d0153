//! What the review of the API's second part and the console found: each of
//! these was a write that should not have happened, a wrong answer, or a
//! 5xx for the client's own input.

mod common;

use common::serve::{call, csrf_in, post, Server};
use common::workflows::seed;
use common::{fresh, new_job};
use jobledger::domain::workflow::DependencyPolicy;
use jobledger::domain::{ErrorClass, JobState};
use jobledger::ledger::search::Search;
use jobledger::ledger::tokens::Role;
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn a_refused_workflow_cancel_writes_nothing() {
    let db = fresh().await;
    let olga = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let s = Server::start(&db.url);
    let c = db
        .ledger
        .workflow(&seed("w", DependencyPolicy::Cancel))
        .await
        .unwrap();
    let id = c.parent.job.job_id;
    let forged = "x\n2026-12-02T05:00:00Z  completed by operator:alice";
    let (st, v) = post(
        &s,
        &format!("/v1/workflows/{id}/cancel"),
        &olga,
        json!({ "reason": forged }),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(
        db.job(id).await.version,
        1,
        "the parent recorded no cancel request"
    );
}

#[tokio::test]
async fn no_name_can_forge_a_line_of_history() {
    let db = fresh().await;
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let s = Server::start(&db.url);
    let fake = "p\n2026-12-02T04:59:59Z  cancelled by operator:alice → cancelled";
    let (st, _) = post(&s, "/v1/queues/q/claim", &wes, json!({ "worker": fake })).await;
    assert_eq!(st, 400, "a worker id with a newline");
    let (st, _) = post(&s, "/v1/jobs", &wes, json!({ "queue": "q", "kind": fake })).await;
    assert_eq!(st, 400, "a kind with a newline");
    // Free text (a failure's message) may hold newlines; every timeline
    // shows it on one line.
    let id = db.enqueue(Some("a"), json!({})).await.job_id;
    let l = db
        .ledger
        .claim_job(id, "w", Duration::from_secs(30))
        .await
        .unwrap()
        .1
        .unwrap();
    l.fail(
        ErrorClass::Permanent,
        "declined",
        Some("x)\nresolved by alice → succeeded\n("),
    )
    .await
    .unwrap();
    let story = jobledger::ledger::timeline::story(&db.ledger, id).await.unwrap();
    assert!(story.iter().all(|l| !l.words.contains('\n')), "{story:?}");
    assert!(
        story[2].words.contains("x)\\nresolved by alice"),
        "{}",
        story[2].words
    );
    let lines = jobledger::ledger::timeline::lines(&db.ledger, id).await.unwrap();
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| !l.contains('\n')));
    // Token names cannot pass for another's actor either.
    for name in ["operator:alice", "wes/p"] {
        assert!(
            db.ledger.create_token(name, Role::Worker).await.is_err(),
            "{name}"
        );
    }
}

#[tokio::test]
async fn a_batch_names_each_job_once_and_leases_have_bounds() {
    let db = fresh().await;
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let rita = db.ledger.create_token("rita", Role::Reader).await.unwrap();
    let s = Server::start(&db.url);
    let id = db.enqueue(Some("a"), json!({})).await.job_id;
    let (_, v) = post(&s, "/v1/queues/q/claim", &wes, json!({ "worker": "p" })).await;
    let l = &v["leases"][0];
    let item = json!({ "job_id": id, "epoch": l["epoch"], "token": l["token"] });
    let (st, v) = post(
        &s,
        "/v1/leases/complete",
        &wes,
        json!({ "worker": "p", "items": [item, item] }),
    )
    .await;
    assert_eq!(st, 400, "the same job twice: {v}");
    assert_eq!(db.job(id).await.state, JobState::Leased, "nothing was written");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.rejections").await,
        0,
        "and no false refusal"
    );
    let fence = json!({ "worker": "p", "epoch": l["epoch"], "token": l["token"] });
    for (write, extra) in [
        ("heartbeat", json!({ "lease_ms": 0 })),
        ("heartbeat", json!({ "lease_ms": 9_000_000_000_000_u64 })),
        ("snooze", json!({ "delay_ms": 9_000_000_000_000_000_u64 })),
    ] {
        let mut body = fence.clone();
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, v) = post(&s, &format!("/v1/jobs/{id}/{write}"), &wes, body).await;
        assert_eq!(st, 400, "{write}: {v}");
    }
    let (st, _) = post(
        &s,
        "/v1/queues/q/claim",
        &wes,
        json!({ "worker": "p", "lease_ms": 0 }),
    )
    .await;
    assert_eq!(st, 400);
    // The role is checked before the body is read.
    let (st, _) = call(
        "POST",
        &format!("{}/v1/queues/q/claim", s.base),
        Some(&rita),
        Some("{".into()),
    )
    .await;
    assert_eq!(st, 403);
}

#[tokio::test]
async fn text_postgres_cannot_store_is_a_400() {
    let db = fresh().await;
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let s = Server::start(&db.url);
    for q in ["queue=%00", "kind=%00", "queue=a&key=%00"] {
        let (st, v) = call("GET", &format!("{}/v1/jobs?{q}", s.base), Some(&wes), None).await;
        assert_eq!(st, 400, "{q}: {v}");
    }
    let (st, v) = post(&s, "/v1/queues/%00/claim", &wes, json!({ "worker": "p" })).await;
    assert_eq!(st, 400, "{v}");
    let mut spec = serde_json::to_value(seed("w", DependencyPolicy::Cancel)).unwrap();
    spec["key"] = json!("a\u{0}b");
    let (st, v) = post(&s, "/v1/workflows", &wes, spec).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 0);
}

#[tokio::test]
async fn receipts_name_their_token_and_batch_replays_check_their_reason() {
    let db = fresh().await;
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let olga = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let s = Server::start(&db.url);
    let id = db.enqueue(Some("a"), json!({})).await.job_id;
    let l = db
        .ledger
        .claim_job(id, "w", Duration::from_secs(30))
        .await
        .unwrap()
        .1
        .unwrap();
    l.submit("r-1").await.unwrap();
    let (st, _) = post(
        &s,
        &format!("/v1/jobs/{id}/receipt"),
        &wes,
        json!({ "receipt_id": "r-1", "status": "succeeded" }),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(
        db.ledger.history(id).await.unwrap().pop().unwrap().event.actor,
        "token:wes"
    );
    let (st, v) = post(
        &s,
        "/v1/replays",
        &olga,
        json!({ "reason_code": "permanent_error",
        "since": "2000-01-01T00:00:00Z", "until": "2001-01-01T00:00:00Z", "reason": "  " }),
    )
    .await;
    assert_eq!(st, 400, "a blank reason, even with no job in the range: {v}");
}

#[tokio::test]
async fn searches_by_kind_or_reason_alone_use_their_own_index() {
    let db = fresh().await;
    let mut conn = db.conn().await;
    let mut first = vec![];
    for chunk in 0..20 {
        let jobs = (0..1000)
            .map(|i| {
                let mut j = new_job(&format!("q{}", i % 4), Some(&format!("k{chunk}-{i}")), json!({}));
                j.kind = format!("kind{}", i % 5);
                j
            })
            .collect();
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        let done = db.ledger.enqueue_many_in(&mut tx, jobs).await.unwrap();
        tx.commit().await.unwrap();
        if chunk == 0 {
            first = done.into_iter().map(|e| e.job.job_id).collect();
        }
    }
    // Queued jobs are only in jobs_search_queued (issue 15), so the indexes
    // named here hold the jobs that ended: a thousand cancelled ones. A
    // search by kind alone walks the queued jobs too (its cost is in
    // docs/benchmarks.md).
    for id in first {
        db.ledger.cancel(id, None).await.unwrap();
    }
    sqlx::query("ANALYZE jobledger.jobs")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let kind = Search {
        kind: Some("nope".into()),
        ..Search::default()
    };
    let plan = db.ledger.explain_search(&kind).await.unwrap();
    assert!(plan.contains("jobs_search_kind"), "{plan}");
    let reason = Search {
        reason: Some("attempts_exhausted".into()),
        ..Search::default()
    };
    let plan = db.ledger.explain_search(&reason).await.unwrap();
    assert!(plan.contains("jobs_search_reason"), "{plan}");
    // No queued job can carry that reason: the search does not read the
    // 19,000 queued ones (they are only in jobs_search_queued, no reason).
    assert!(!plan.contains("'queued'"), "{plan}");
    assert!(db.ledger.search(&kind).await.unwrap().jobs.is_empty());
    let both = Search {
        kind: Some("kind2".into()),
        queue: Some("q2".into()),
        limit: Some(500),
        ..Search::default()
    };
    let page = db.ledger.search(&both).await.unwrap();
    assert_eq!(page.jobs.len(), 500);
    assert!(page.jobs.iter().all(|j| j.kind == "kind2" && j.queue == "q2"));
}

#[tokio::test]
async fn the_console_reports_each_job_of_a_bulk_replay_and_its_notices_are_its_own() {
    let db = fresh().await;
    let token = db.ledger.create_token("alice", Role::Operator).await.unwrap();
    let mut dead = vec![];
    for k in ["a", "b"] {
        let id = db.enqueue(Some(k), json!({})).await.job_id;
        let l = db
            .ledger
            .claim_job(id, "w", Duration::from_secs(30))
            .await
            .unwrap()
            .1
            .unwrap();
        l.fail(ErrorClass::Permanent, "declined", None).await.unwrap();
        dead.push(id);
    }
    let s = Server::start(&db.url);
    let http = reqwest::Client::new();
    let cookie = format!("jl_session={token}");
    let page = http
        .get(format!(
            "{}/console/jobs/{}?done=anything%20I%20like",
            s.base, dead[0]
        ))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !page.contains("anything I like"),
        "a link cannot make the page speak"
    );
    let csrf = csrf_in(&page);
    let gone = uuid::Uuid::now_v7();
    let body = format!(
        "csrf={csrf}&reason=bulk&job={}&job={gone}&job={}",
        dead[0], dead[1]
    );
    let r = http
        .post(format!("{}/console/dead/replay", s.base))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("not found"), "{text}");
    for id in &dead {
        assert_eq!(
            db.job(*id).await.state,
            JobState::Queued,
            "both real jobs replayed"
        );
    }
}

/// The third review: rebuilds started at once raced on a new projection's
/// table (500s), a time before 4713 BC was a 500, and a reader saw the
/// dead-jobs form.
#[tokio::test]
async fn third_review_rebuild_race_old_times_and_readers() {
    let db = fresh().await;
    let root = db.ledger.create_token("root", Role::Admin).await.unwrap();
    let rita = db.ledger.create_token("rita", Role::Reader).await.unwrap();
    let s = Server::start(&db.url);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (url, t) = (
            format!("{}/v1/projections/queue_stats/rebuild", s.base),
            root.clone(),
        );
        tasks.spawn(async move { call("POST", &url, Some(&t), None).await });
    }
    let mut tables = std::collections::HashSet::new();
    while let Some(r) = tasks.join_next().await {
        let (st, v) = r.unwrap();
        assert_eq!(st, 202, "{v}");
        tables.insert(v["rebuild_table"].as_str().unwrap().to_string());
    }
    assert_eq!(tables.len(), 1, "one rebuild: {tables:?}");
    let (st, v) = call(
        "GET",
        &format!("{}/v1/jobs?since=-4713-01-01T00:00:00Z", s.base),
        Some(&rita),
        None,
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = post(
        &s,
        "/v1/jobs",
        &root,
        json!({ "queue": "q", "kind": "k", "run_at": "-4713-01-01T00:00:00Z" }),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let page = reqwest::Client::new()
        .get(format!("{}/console/dead", s.base))
        .header("cookie", format!("jl_session={rita}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("Dead jobs") && !page.contains("/console/dead/replay"),
        "{page}"
    );
}
