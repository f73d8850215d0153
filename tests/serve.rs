//! `jobledger serve`, the binary itself on a loopback port: every route of
//! this first part of the API, every role, every write outcome's status,
//! bad and oversized input (nothing written), and a clean stop on SIGTERM.

mod common;

use common::fresh;
use common::serve::{call, one_line, Server};
use jobledger::domain::{ErrorClass, JobState};
use jobledger::ledger::tokens::Role;
use serde_json::json;

#[tokio::test]
async fn tokens_and_roles_guard_every_route() {
    let db = fresh().await;
    let reader = db.ledger.create_token("rita", Role::Reader).await.unwrap();
    let worker = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let gone = db.ledger.create_token("old", Role::Admin).await.unwrap();
    db.ledger.revoke_token("old").await.unwrap();
    let s = Server::start(&db.url);
    let jobs = format!("{}/v1/jobs", s.base);
    let body = || Some(json!({ "queue": "q", "kind": "k", "key": "k1", "payload": { "a": 1 } }).to_string());

    let (st, v) = call("POST", &jobs, None, body()).await;
    assert_eq!(st, 401, "{v}");
    one_line(&v);
    let (st, _) = call("POST", &jobs, Some("jl_not_a_token"), body()).await;
    assert_eq!(st, 401);
    let (st, _) = call("POST", &jobs, Some(&gone), body()).await;
    assert_eq!(st, 401, "a revoked token is refused");
    let (st, v) = call("POST", &jobs, Some(&reader), body()).await;
    assert_eq!(st, 403, "a reader does not enqueue: {v}");
    assert!(one_line(&v).contains("reader"));

    let (st, created) = call("POST", &jobs, Some(&worker), body()).await;
    assert_eq!((st, created["created"].as_bool()), (201, Some(true)), "{created}");
    let (st, again) = call("POST", &jobs, Some(&worker), body()).await;
    assert_eq!(
        (st, again["job_id"].clone()),
        (200, created["job_id"].clone()),
        "idempotent by key"
    );
    let id = created["job_id"].as_str().unwrap().to_string();
    let first = db.ledger.history(id.parse().unwrap()).await.unwrap().remove(0);
    assert_eq!(first.event.actor, "token:wes", "the enqueue names its token");

    let (st, v) = call("GET", &format!("{jobs}/{id}"), Some(&reader), None).await;
    assert_eq!((st, v["state"].as_str()), (200, Some("queued")), "{v}");
    let (st, v) = call("GET", &format!("{jobs}/{id}/history"), Some(&reader), None).await;
    assert_eq!((st, v["entries"].as_array().map(Vec::len)), (200, Some(1)), "{v}");
    let (st, v) = call("POST", &format!("{jobs}/{id}/cancel"), Some(&worker), None).await;
    assert_eq!(st, 403, "a worker does not cancel: {v}");
    assert_eq!(
        db.job(id.parse().unwrap()).await.version,
        1,
        "nothing was written"
    );
    assert_eq!(s.stop(), 0, "SIGTERM stops the server cleanly");
}

#[tokio::test]
async fn bad_and_oversized_input_is_a_4xx_and_writes_nothing() {
    let db = fresh().await;
    let op = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let s = Server::start(&db.url);
    let jobs = format!("{}/v1/jobs", s.base);
    let cases = [
        ("{\"queue\": \"q\"".to_string(), 400),
        (json!({ "queue": "q" }).to_string(), 400),
        (
            json!({ "queue": "q", "kind": "k", "colour": "red" }).to_string(),
            400,
        ),
        (json!({ "queue": "", "kind": "k" }).to_string(), 400),
        (
            json!({ "queue": "q", "kind": "k", "delay_ms": 5, "run_at": "2026-12-02T00:00:00Z" }).to_string(),
            400,
        ),
        (
            json!({ "queue": "q", "kind": "k", "payload": "x".repeat(1_100_000) }).to_string(),
            413,
        ),
        (
            json!({ "queue": "q", "kind": "k", "payload": "x".repeat(3_000_000) }).to_string(),
            413,
        ),
    ];
    for (body, want) in cases {
        let (st, v) = call("POST", &jobs, Some(&op), Some(body.clone())).await;
        assert_eq!(st, want, "{} -> {v}", &body[..body.len().min(80)]);
        one_line(&v);
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        0,
        "nothing was written"
    );
    let (st, v) = call("GET", &format!("{jobs}/not-a-uuid"), Some(&op), None).await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = call(
        "GET",
        &format!("{jobs}/{}", uuid::Uuid::now_v7()),
        Some(&op),
        None,
    )
    .await;
    assert_eq!(st, 404, "{v}");
    let (st, v) = call("GET", &format!("{}/v1/nothing", s.base), Some(&op), None).await;
    assert_eq!(st, 404, "{v}");
}

#[tokio::test]
async fn write_outcomes_have_their_statuses_and_the_token_is_the_actor() {
    let db = fresh().await;
    let op = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let s = Server::start(&db.url);
    let jobs = format!("{}/v1/jobs", s.base);
    // A dead job, and a queued one.
    let dead = db.enqueue(Some("d"), json!({})).await.job_id;
    let lease = db.claim_one("w").await;
    assert!(lease
        .fail(ErrorClass::Permanent, "declined", None)
        .await
        .unwrap()
        .committed());
    let queued = db.enqueue(Some("q"), json!({})).await.job_id;
    let version = db.job(dead).await.version;

    let replay_queued = call(
        "POST",
        &format!("{jobs}/{queued}/replay"),
        Some(&op),
        Some(json!({ "reason": "r" }).to_string()),
    )
    .await;
    assert_eq!(replay_queued.0, 422, "invalid_transition: {}", replay_queued.1);
    assert_eq!(replay_queued.1["outcome"], "invalid_transition");
    let stale = json!({ "verdict": "succeeded", "reason": "seen", "evidence": { "seen": true }, "version": version - 1 }).to_string();
    let (st, v) = call("POST", &format!("{jobs}/{dead}/resolve"), Some(&op), Some(stale)).await;
    assert_eq!((st, v["outcome"].as_str()), (409, Some("stale")), "{v}");
    let bad =
        json!({ "verdict": "queued", "reason": "seen", "evidence": { "seen": true }, "version": version })
            .to_string();
    let (st, _) = call("POST", &format!("{jobs}/{dead}/resolve"), Some(&op), Some(bad)).await;
    assert_eq!(st, 400);
    let ok = json!({ "verdict": "succeeded", "reason": "seen in the dashboard", "evidence": { "re": 1 }, "version": version });
    let (st, v) = call(
        "POST",
        &format!("{jobs}/{dead}/resolve"),
        Some(&op),
        Some(ok.to_string()),
    )
    .await;
    assert_eq!((st, v["outcome"].as_str()), (200, Some("committed")), "{v}");
    assert_eq!(db.job(dead).await.state, JobState::Succeeded);

    let (st, v) = call(
        "POST",
        &format!("{jobs}/{queued}/cancel"),
        Some(&op),
        Some(json!({ "reason": "dup" }).to_string()),
    )
    .await;
    assert_eq!((st, v["outcome"].as_str()), (200, Some("committed")), "{v}");
    let (st, v) = call("POST", &format!("{jobs}/{queued}/cancel"), Some(&op), None).await;
    assert_eq!(
        (st, v["outcome"].as_str()),
        (200, Some("already_committed")),
        "{v}"
    );
    let first = db.ledger.history(dead).await.unwrap()[0].position;
    let note = json!({ "corrects": first, "reason": "key mistyped" }).to_string();
    let (st, v) = call("POST", &format!("{jobs}/{dead}/annotate"), Some(&op), Some(note)).await;
    assert_eq!(st, 200, "{v}");

    for id in [dead, queued] {
        let last = db.ledger.history(id).await.unwrap().pop().unwrap();
        assert_eq!(last.event.actor, "operator:olga", "the token's name is the actor");
    }
    db.assert_verified().await;
}

/// What the first review of the server found: each of these used to be a
/// dropped connection, a plain-text answer or a wrong status.
#[tokio::test]
async fn odd_requests_get_a_json_4xx() {
    let db = fresh().await;
    let op = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let long = "é".repeat(124);
    assert!(
        db.ledger.create_token(&long, Role::Operator).await.is_err(),
        "a name that would make the actor too long is refused at creation"
    );
    let s = Server::start(&db.url);
    let jobs = format!("{}/v1/jobs", s.base);
    // A delay near i64::MAX used to panic the handler (no answer at all).
    let huge = json!({ "queue": "q", "kind": "k", "delay_ms": i64::MAX }).to_string();
    let (st, v) = call("POST", &jobs, Some(&op), Some(huge)).await;
    assert_eq!(st, 400, "{v}");
    // The scheme is case-insensitive; two Authorization headers are refused.
    let lower = reqwest::Client::new()
        .get(format!("{jobs}/{}", uuid::Uuid::now_v7()))
        .header("authorization", format!("bearer {op}"))
        .send()
        .await
        .unwrap();
    assert_eq!(lower.status().as_u16(), 404, "authenticated, then no such job");
    let two = reqwest::Client::new()
        .get(format!("{jobs}/{}", uuid::Uuid::now_v7()))
        .header("authorization", format!("Bearer {op}"))
        .header("authorization", "Bearer jl_other")
        .send()
        .await
        .unwrap();
    assert_eq!(two.status().as_u16(), 401);
    let (st, v) = call("PUT", &jobs, Some(&op), None).await;
    assert_eq!(st, 405, "{v}");
    one_line(&v);
    let (st, v) = call("GET", &format!("{jobs}/%FF"), Some(&op), None).await;
    assert_eq!(st, 400, "{v}");
    let dead = db.enqueue(Some("d"), json!({})).await.job_id;
    let (st, v) = call(
        "POST",
        &format!("{jobs}/{dead}/replay"),
        Some(&op),
        Some(json!({ "reason": "  " }).to_string()),
    )
    .await;
    assert_eq!(st, 400, "a blank reason is bad input: {v}");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.rejections").await,
        0,
        "and no refused write"
    );
}
