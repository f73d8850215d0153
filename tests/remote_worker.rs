//! The remote worker protocol over HTTP (the `serve` binary on a loopback
//! port): claim and every fenced write, each outcome's status, the fence
//! holding across a takeover, batches, and the Python example worker
//! (examples/python-worker) draining a queue through the API alone.

mod common;

use common::serve::{one_line, post, Server};
use common::{fresh, TestDb};
use jobledger::domain::JobState;
use jobledger::ledger::tokens::Role;
use serde_json::{json, Value};
use std::process::Command;
use uuid::Uuid;

async fn claim(s: &Server, token: &str, worker: &str, limit: usize) -> Vec<Value> {
    let (st, v) = post(
        s,
        "/v1/queues/q/claim",
        token,
        json!({ "worker": worker, "lease_ms": 60_000, "limit": limit }),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    v["leases"].as_array().unwrap().clone()
}

fn fence(l: &Value, worker: &str) -> Value {
    json!({ "worker": worker, "epoch": l["epoch"], "token": l["token"] })
}

fn with(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

async fn setup() -> (TestDb, Server, String) {
    let db = fresh().await;
    let token = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let s = Server::start(&db.url);
    (db, s, token)
}

#[tokio::test]
async fn a_remote_worker_writes_through_the_fence_like_a_lease() {
    let (db, s, wes) = setup().await;
    let id = db.enqueue(Some("a"), json!({ "n": 1 })).await.job_id;
    let l = claim(&s, &wes, "py-1", 10).await;
    assert_eq!(l.len(), 1);
    assert_eq!(
        (l[0]["job_id"].as_str(), l[0]["payload"]["n"].as_i64()),
        (Some(&*id.to_string()), Some(1))
    );
    assert_eq!(l[0]["next_action"], "execute");
    let path = |w: &str| format!("/v1/jobs/{id}/{w}");

    let (st, v) = post(
        &s,
        &path("heartbeat"),
        &wes,
        with(fence(&l[0], "py-1"), json!({ "lease_ms": 90_000 })),
    )
    .await;
    assert_eq!((st, v["outcome"].as_str()), (200, Some("committed")), "{v}");
    let (st, v) = post(
        &s,
        &path("progress"),
        &wes,
        with(fence(&l[0], "py-1"), json!({ "step": "charged" })),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    // Its lease expires and another worker takes the job over: the first
    // worker's completion is stale and changes nothing.
    db.expire_lease(id).await;
    let l2 = claim(&s, &wes, "py-2", 10).await;
    assert_eq!((l2.len(), l2[0]["next_action"].as_str()), (1, Some("reconcile")));
    assert_eq!(l2[0]["step"], "charged", "the successor sees the step reached");
    let done = json!({ "result": { "ok": 1 } });
    let (st, v) = post(
        &s,
        &path("complete"),
        &wes,
        with(fence(&l[0], "py-1"), done.clone()),
    )
    .await;
    assert_eq!((st, v["outcome"].as_str()), (409, Some("stale")), "{v}");
    assert_eq!(db.job(id).await.state, JobState::Leased);
    let (st, v) = post(
        &s,
        &path("complete"),
        &wes,
        with(fence(&l2[0], "py-2"), done.clone()),
    )
    .await;
    assert_eq!(
        (st, v["outcome"].as_str(), v["state"].as_str()),
        (200, Some("committed"), Some("succeeded"))
    );
    // A retried request is already_committed; the same fence with another
    // result is a conflict.
    let (st, v) = post(&s, &path("complete"), &wes, with(fence(&l2[0], "py-2"), done)).await;
    assert_eq!(
        (st, v["outcome"].as_str()),
        (200, Some("already_committed")),
        "{v}"
    );
    let other = json!({ "result": { "ok": 2 } });
    let (st, v) = post(&s, &path("complete"), &wes, with(fence(&l2[0], "py-2"), other)).await;
    assert_eq!((st, v["outcome"].as_str()), (409, Some("conflict")), "{v}");
    let (st, v) = post(
        &s,
        &path("heartbeat"),
        &wes,
        with(fence(&l2[0], "py-2"), json!({ "lease_ms": 1 })),
    )
    .await;
    assert_eq!(
        (st, v["outcome"].as_str()),
        (422, Some("invalid_transition")),
        "{v}"
    );

    let holders: Vec<String> = db
        .ledger
        .history(id)
        .await
        .unwrap()
        .iter()
        .filter(|e| e.event.body.type_name() != "enqueued")
        .map(|e| e.event.actor.clone())
        .collect();
    assert!(
        holders.iter().all(|a| a == "wes/py-1" || a == "wes/py-2"),
        "{holders:?}"
    );
    assert!(holders.contains(&"wes/py-1".to_string()));
    db.assert_verified().await;
}

#[tokio::test]
async fn fail_submit_cancel_release_and_snooze_over_http() {
    let (db, s, wes) = setup().await;
    let op = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let ids: Vec<Uuid> = futures_ids(&db, 5).await;
    let leases = claim(&s, &wes, "py", 5).await;
    assert_eq!(leases.len(), 5);
    let by = |id: Uuid| {
        leases
            .iter()
            .find(|l| l["job_id"] == id.to_string())
            .unwrap()
            .clone()
    };

    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/fail", ids[0]),
        &wes,
        with(
            fence(&by(ids[0]), "py"),
            json!({ "class": "permanent", "code": "declined", "message": "no" }),
        ),
    )
    .await;
    assert_eq!((st, v["state"].as_str()), (200, Some("dead")), "{v}");
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/submit", ids[1]),
        &wes,
        with(fence(&by(ids[1]), "py"), json!({ "receipt_id": "r-1" })),
    )
    .await;
    assert_eq!((st, v["state"].as_str()), (200, Some("awaiting_receipt")), "{v}");
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/receipt", ids[1]),
        &wes,
        json!({ "receipt_id": "r-1", "status": "succeeded" }),
    )
    .await;
    assert_eq!((st, v["state"].as_str()), (200, Some("succeeded")), "{v}");
    // An operator asks for a cancel; the heartbeat's answer says so, and the
    // worker confirms it.
    let (st, _) = post(
        &s,
        &format!("/v1/jobs/{}/cancel", ids[2]),
        &op,
        json!({ "reason": "dup" }),
    )
    .await;
    assert_eq!(st, 200);
    let (st, v) = post(
        &s,
        "/v1/leases/heartbeat",
        &wes,
        json!({ "worker": "py", "lease_ms": 60_000,
        "items": [{ "job_id": ids[2], "epoch": by(ids[2])["epoch"], "token": by(ids[2])["token"] }] }),
    )
    .await;
    assert_eq!(
        (st, v["answers"][0]["state"].as_str()),
        (200, Some("cancel_requested")),
        "{v}"
    );
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/confirm-cancel", ids[2]),
        &wes,
        fence(&by(ids[2]), "py"),
    )
    .await;
    assert_eq!((st, v["state"].as_str()), (200, Some("cancelled")), "{v}");
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/release", ids[3]),
        &wes,
        fence(&by(ids[3]), "py"),
    )
    .await;
    assert_eq!(
        (st, v["state"].as_str(), v["attempt"].as_i64()),
        (200, Some("queued"), Some(0)),
        "{v}"
    );
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/snooze", ids[4]),
        &wes,
        with(fence(&by(ids[4]), "py"), json!({ "delay_ms": 3_600_000 })),
    )
    .await;
    assert_eq!((st, v["state"].as_str()), (200, Some("queued")), "{v}");
    assert!(v["run_at"].is_string(), "a snoozed job says when it is due: {v}");
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/observe", ids[0]),
        &wes,
        json!({ "worker": "py", "key": "provider", "data": { "declined": true } }),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    db.assert_verified().await;
}

async fn futures_ids(db: &TestDb, n: usize) -> Vec<Uuid> {
    let mut ids = vec![];
    for i in 0..n {
        ids.push(db.enqueue(Some(&format!("k{i}")), json!({ "i": i })).await.job_id);
    }
    ids
}

#[tokio::test]
async fn bad_protocol_requests_are_4xx_and_write_nothing() {
    let (db, s, wes) = setup().await;
    let reader = db.ledger.create_token("rita", Role::Reader).await.unwrap();
    let op = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let id = db.enqueue(Some("a"), json!({})).await.job_id;
    let (st, v) = post(&s, "/v1/queues/q/claim", &reader, json!({ "worker": "r" })).await;
    assert_eq!(st, 403, "a reader does not claim: {v}");
    let (st, _) = post(&s, "/v1/queues/q/claim", &op, json!({ "worker": "o" })).await;
    assert_eq!(st, 403, "an operator holds no leases");
    for body in [
        json!({}),
        json!({ "worker": "" }),
        json!({ "worker": "w", "limit": 1001 }),
        json!({ "worker": "w", "lease_ms": -5 }),
        json!({ "worker": "w", "colour": "red" }),
    ] {
        let (st, v) = post(&s, "/v1/queues/q/claim", &wes, body.clone()).await;
        assert_eq!(st, 400, "{body} -> {v}");
        one_line(&v);
    }
    let l = claim(&s, &wes, "w", 1).await;
    let versions = db.job(id).await.version;
    let f = fence(&l[0], "w");
    for (write, body) in [
        ("heartbeat", f.clone()),
        ("progress", f.clone()),
        ("fail", with(f.clone(), json!({ "code": "x" }))),
        (
            "fail",
            with(f.clone(), json!({ "class": "sometimes", "code": "x" })),
        ),
        ("submit", f.clone()),
        ("snooze", f.clone()),
        ("complete", json!({ "worker": "w", "epoch": "one", "token": 1 })),
        (
            "complete",
            with(f.clone(), json!({ "result": "x".repeat(1_100_000) })),
        ),
    ] {
        let (st, v) = post(&s, &format!("/v1/jobs/{id}/{write}"), &wes, body).await;
        assert!(st == 400 || st == 413, "{write}: {st} {v}");
        one_line(&v);
    }
    let (st, v) = post(&s, &format!("/v1/jobs/{id}/explode"), &wes, f.clone()).await;
    assert_eq!(st, 404, "{v}");
    let (st, v) = post(
        &s,
        &format!("/v1/jobs/{}/complete", Uuid::now_v7()),
        &wes,
        f.clone(),
    )
    .await;
    assert_eq!(st, 404, "an unknown job: {v}");
    let many: Vec<Value> = (0..1001)
        .map(|_| json!({ "job_id": id, "epoch": 1, "token": 1 }))
        .collect();
    let (st, v) = post(
        &s,
        "/v1/leases/complete",
        &wes,
        json!({ "worker": "w", "items": many }),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = post(
        &s,
        "/v1/leases/heartbeat",
        &wes,
        json!({ "worker": "w", "items": [] }),
    )
    .await;
    assert_eq!(st, 400, "a heartbeat needs lease_ms: {v}");
    assert_eq!(db.job(id).await.version, versions, "nothing was written");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.rejections").await, 0);
}

#[tokio::test]
async fn the_python_example_worker_drains_a_queue_through_the_api() {
    let (db, s, wes) = setup().await;
    let n = 120;
    for i in 0..n {
        let mut j = common::new_job("q", Some(&format!("add-{i}")), json!({ "a": i, "b": 1 }));
        j.kind = "add".into();
        db.ledger.enqueue(j).await.unwrap();
    }
    // One job of a kind the worker has no handler for, and one whose
    // handler refuses the payload: both end dead, permanently.
    let mut odd = common::new_job("q", Some("odd"), json!({}));
    odd.kind = "unknown".into();
    let odd = db.ledger.enqueue(odd).await.unwrap().job.job_id;
    let mut bad = common::new_job("q", Some("bad"), json!({ "text": 5 }));
    bad.kind = "shout".into();
    let bad = db.ledger.enqueue(bad).await.unwrap().job.job_id;
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/python-worker/worker.py"
        ))
        .args([
            "--url",
            &s.base,
            "--queue",
            "q",
            "--worker",
            "py-1",
            "--batch",
            "25",
            "--exit-when-idle",
        ])
        .env("JOBLEDGER_TOKEN", &wes)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "worker failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let counts: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{stdout:?}: {e}"));
    assert_eq!(counts["completed"], n, "{counts}");
    assert_eq!(counts["failed"], 2, "{counts}");
    let succeeded = db
        .count("SELECT count(*) FROM jobledger.jobs WHERE state = 'succeeded' AND (result->>'sum')::int = (payload->>'a')::int + 1")
        .await;
    assert_eq!(succeeded, n as i64, "every job succeeded with its own result");
    for id in [odd, bad] {
        assert_eq!(db.job(id).await.state, JobState::Dead);
    }
    let claimed_by = db
        .count("SELECT count(*) FROM jobledger.events WHERE type = 'claimed' AND actor = 'wes/py-1'")
        .await;
    assert_eq!(claimed_by, n as i64 + 2, "the log names the token and the worker");
    db.assert_verified().await;
}
