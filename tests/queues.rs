//! Queue pause and resume: recorded operator actions in a hash-chained
//! stream per queue; a paused queue is not claimed (nor taken over), running
//! jobs go on and complete; `show` says why a due job has not started;
//! `verify` replays the controls and catches an edited one.

mod common;

use common::serve::{call, csrf_in, Server};
use common::{fresh, new_job};
use jobledger::domain::JobState;
use jobledger::ledger::tokens::Role;
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn a_paused_queue_is_not_claimed_and_running_jobs_go_on() {
    let db = fresh().await;
    let running = db.enqueue(Some("a"), json!({})).await.job_id;
    let lease = db.claim_one("w1").await;
    let waiting = db.enqueue(Some("b"), json!({})).await.job_id;
    let other = db
        .ledger
        .enqueue(new_job("elsewhere", Some("c"), json!({})))
        .await
        .unwrap()
        .job
        .job_id;

    let p = db
        .ledger
        .pause_queue("q", "alice", "the provider is down")
        .await
        .unwrap();
    assert!(p.changed && p.status.paused);
    let again = db.ledger.pause_queue("q", "bob", "me too").await.unwrap();
    assert!(!again.changed, "pausing a paused queue records nothing");
    db.claim_none("w2").await;
    // An expired lease of a paused queue is not taken over either.
    db.expire_lease(running).await;
    db.claim_none("w2").await;
    assert!(
        lease.complete(None).await.unwrap().committed(),
        "the running job completes"
    );
    // Other queues are not affected.
    let l = db
        .ledger
        .claim("elsewhere", "w3", Duration::from_secs(30), 10)
        .await
        .unwrap();
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].job_id(), other);

    let shown = common::cli::jl(&db.url, &["show", &waiting.to_string()]).json();
    let why = shown["waiting_because"]
        .as_str()
        .unwrap_or_else(|| panic!("{shown}"));
    assert!(
        why.starts_with("queue paused since ") && why.ends_with(" by alice: the provider is down"),
        "{why}"
    );

    let r = db.ledger.resume_queue("q", "bob", "provider back").await.unwrap();
    assert!(r.changed && !r.status.paused);
    let claimed = db.claim_one("w2").await;
    assert_eq!(claimed.job_id(), waiting);
    assert_eq!(db.job(waiting).await.state, JobState::Leased);

    let h = db.ledger.queue_history("q").await.unwrap();
    let who: Vec<(&str, &str)> = h.iter().map(|e| (e.action.as_str(), e.actor.as_str())).collect();
    assert_eq!(who, vec![("paused", "alice"), ("resumed", "bob")]);
    db.assert_verified().await;

    // An edit around the triggers is found by verify.
    let mut conn = db.conn().await;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("UPDATE jobledger.queue_events SET reason = 'routine' WHERE version = 1")
        .execute(&mut conn)
        .await
        .unwrap();
    let report = db.ledger.verify(None).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.detail.contains("queue \"q\" v1")),
        "{:?}",
        report.problems
    );
}

#[tokio::test]
async fn two_pauses_at_once_record_one() {
    let db = fresh().await;
    let (a, b) = tokio::join!(
        db.ledger.pause_queue("q", "alice", "one"),
        db.ledger.pause_queue("q", "bob", "two")
    );
    let changed = [a.unwrap().changed, b.unwrap().changed];
    assert_eq!(changed.iter().filter(|c| **c).count(), 1, "{changed:?}");
    assert_eq!(db.ledger.queue_history("q").await.unwrap().len(), 1);
    db.assert_verified().await;
}

#[tokio::test]
async fn pause_and_resume_over_http() {
    let db = fresh().await;
    let olga = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    db.enqueue(Some("a"), json!({})).await;
    let s = Server::start(&db.url);
    let url = |a: &str| format!("{}/v1/queues/q/{a}", s.base);
    let body = |r: &str| Some(json!({ "reason": r }).to_string());
    let (st, _) = call("POST", &url("pause"), Some(&wes), body("x")).await;
    assert_eq!(st, 403, "a worker does not pause");
    let (st, v) = call("POST", &url("pause"), Some(&olga), body("  ")).await;
    assert_eq!(st, 400, "a blank reason: {v}");
    let (st, v) = call("POST", &url("pause"), Some(&olga), body("maintenance")).await;
    assert_eq!((st, v["changed"].as_bool()), (200, Some(true)), "{v}");
    let (st, v) = call(
        "POST",
        &url("claim"),
        Some(&wes),
        Some(json!({ "worker": "p" }).to_string()),
    )
    .await;
    assert_eq!((st, v["leases"].as_array().map(Vec::len)), (200, Some(0)), "{v}");
    let (st, v) = call("GET", &format!("{}/v1/queues", s.base), Some(&wes), None).await;
    assert_eq!(st, 200);
    assert_eq!(v["controls"][0]["paused_by"], "operator:olga", "{v}");
    let (st, v) = call("POST", &url("resume"), Some(&olga), body("done")).await;
    assert_eq!((st, v["status"]["paused"].as_bool()), (200, Some(false)), "{v}");
    let (_, v) = call(
        "POST",
        &url("claim"),
        Some(&wes),
        Some(json!({ "worker": "p" }).to_string()),
    )
    .await;
    assert_eq!(v["leases"].as_array().map(Vec::len), Some(1), "{v}");
}

/// What the second review found: a console form that paused another queue
/// (a space encoded as `+`), bursts of pauses that starved the server's
/// pool, and edits of the state row that verify did not see.
#[tokio::test]
async fn second_review_of_queue_controls() {
    let db = fresh().await;
    let olga = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    for q in ["a b", "a+b"] {
        db.ledger.enqueue(new_job(q, Some("k"), json!({}))).await.unwrap();
    }
    db.ledger.pause_queue("a b", "alice", "incident").await.unwrap();
    let s = Server::start(&db.url);

    // The console's resume form of "a b" resumes "a b".
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let cookie = format!("jl_session={olga}");
    let page = http
        .get(format!("{}/console", s.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let action = page
        .split("action=\"")
        .filter_map(|p| p.split('"').next())
        .find(|a| a.ends_with("/resume"))
        .unwrap_or_else(|| panic!("a resume form: {page}"))
        .to_string();
    assert_eq!(action, "/console/queues/a%20b/resume");
    let csrf = csrf_in(&page);
    let r = http
        .post(format!("{}{action}", s.base))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("csrf={csrf}&reason=over"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 303);
    assert!(
        !db.ledger.queue_status("a b").await.unwrap().paused,
        "the queue named resumed"
    );
    assert_eq!(
        db.ledger.queue_status("a+b").await.unwrap().version,
        0,
        "the other untouched"
    );

    // Sixteen pauses at once: every one answered, one recorded.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (url, t) = (format!("{}/v1/queues/burst/pause", s.base), olga.clone());
        tasks.spawn(
            async move { call("POST", &url, Some(&t), Some(json!({ "reason": "r" }).to_string())).await },
        );
    }
    let mut changed = 0;
    while let Some(r) = tasks.join_next().await {
        let (st, v) = r.unwrap();
        assert_eq!(st, 200, "{v}");
        changed += usize::from(v["changed"] == true);
    }
    assert_eq!(changed, 1);
    db.assert_verified().await;

    // An edit of the state row (who paused, why) is found.
    let mut conn = db.conn().await;
    sqlx::query("UPDATE jobledger.queues SET paused_by = 'mallory' WHERE queue = 'burst'")
        .execute(&mut conn)
        .await
        .unwrap();
    let report = db.ledger.verify(None).await.unwrap();
    assert!(
        report.problems.iter().any(|p| p.detail.contains("\"burst\"")),
        "{:?}",
        report.problems
    );
}

#[tokio::test]
async fn a_resumed_lease_checks_the_name_it_records() {
    let db = fresh().await;
    db.enqueue(Some("a"), json!({})).await;
    let l = db.claim_one("w").await;
    let forged = jobledger::ledger::Lease::resume(
        db.ledger.clone(),
        l.job_id(),
        l.fence().epoch,
        l.fence().token,
        "x\n 99 v9 forged",
    );
    assert!(matches!(
        forged.complete(None).await,
        Err(jobledger::ledger::LedgerError::BadInput(_))
    ));
    assert_eq!(
        db.job(l.job_id()).await.state,
        JobState::Leased,
        "nothing written"
    );
}
