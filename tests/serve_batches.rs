//! The API's many-at-once routes and status reads: a batch of jobs (all or
//! none), a workflow from its spec, the batch replay of dead jobs, queues,
//! readers and projections (with a rebuild started over HTTP).

mod common;

use common::serve::{call, one_line, post, Server};
use common::workflows::{seed, spec, step};
use common::{fresh, new_job};
use jobledger::domain::workflow::DependencyPolicy;
use jobledger::domain::ErrorClass;
use jobledger::ledger::tokens::Role;
use serde_json::{json, Value};
use std::time::Duration;

#[tokio::test]
async fn a_batch_of_jobs_is_written_whole_or_not_at_all() {
    let db = fresh().await;
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let s = Server::start(&db.url);
    let jobs: Vec<Value> = (0..300)
        .map(|i| json!({ "queue": "q", "kind": "k", "key": format!("k{i}"), "payload": { "i": i } }))
        .collect();
    let (st, v) = post(&s, "/v1/jobs/batch", &wes, json!({ "jobs": jobs })).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["jobs"].as_array().unwrap().len(), 300);
    assert!(v["jobs"].as_array().unwrap().iter().all(|j| j["created"] == true));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events WHERE actor = 'token:wes'")
            .await,
        300
    );
    // The same batch again: every answer names the existing job.
    let (st, v) = post(&s, "/v1/jobs/batch", &wes, json!({ "jobs": jobs })).await;
    assert_eq!(st, 200);
    assert!(v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|j| j["created"] == false));
    // One bad job in a batch: nothing of it is written.
    let before = db.count("SELECT count(*) FROM jobledger.events").await;
    for (bad, want) in [
        (
            json!({ "jobs": [{ "queue": "q", "kind": "k", "key": "new1" }, { "queue": "", "kind": "k" }] }),
            400,
        ),
        (
            json!({ "jobs": [{ "queue": "q", "kind": "k", "key": "new2" }, { "queue": "q", "kind": "k", "key": "k1", "payload": { "other": 1 } }] }),
            409,
        ),
        (json!({ "jobs": [] }), 400),
        (
            json!({ "jobs": (0..1001).map(|i| json!({ "queue": "q", "kind": "k", "key": format!("n{i}") })).collect::<Vec<_>>() }),
            400,
        ),
    ] {
        let (st, v) = post(&s, "/v1/jobs/batch", &wes, bad).await;
        assert_eq!(st, want, "{v}");
        one_line(&v);
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        before,
        "nothing written"
    );
}

#[tokio::test]
async fn workflows_over_http() {
    let db = fresh().await;
    let wes = db.ledger.create_token("wes", Role::Worker).await.unwrap();
    let olga = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let s = Server::start(&db.url);
    let spec_json = serde_json::to_value(seed("note-7", DependencyPolicy::Cancel)).unwrap();
    let (st, v) = post(&s, "/v1/workflows", &wes, spec_json.clone()).await;
    assert_eq!((st, v["created"].as_bool()), (201, Some(true)), "{v}");
    let id = v["workflow_id"].as_str().unwrap().to_string();
    assert_eq!(v["steps"].as_array().unwrap().len(), 3);
    let (st, again) = post(&s, "/v1/workflows", &wes, spec_json).await;
    assert_eq!((st, again["workflow_id"].as_str()), (200, Some(&*id)));
    let (st, shown) = call("GET", &format!("{}/v1/workflows/{id}", s.base), Some(&wes), None).await;
    assert_eq!(st, 200, "{shown}");
    let review = shown["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["step"] == "review")
        .unwrap();
    assert_eq!(review["state"], "waiting");
    assert_eq!(review["waiting_for"], json!(["render"]));
    // A cycle is refused and nothing is written.
    let before = db.count("SELECT count(*) FROM jobledger.events").await;
    let cycle = serde_json::to_value(spec("c", vec![step("a", &["b"]), step("b", &["a"])])).unwrap();
    let (st, v) = post(&s, "/v1/workflows", &wes, cycle).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, before);
    // A worker may not cancel it; an operator may, and is the actor.
    let (st, _) = post(&s, &format!("/v1/workflows/{id}/cancel"), &wes, json!({})).await;
    assert_eq!(st, 403);
    let (st, v) = post(
        &s,
        &format!("/v1/workflows/{id}/cancel"),
        &olga,
        json!({ "reason": "withdrawn" }),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["answers"].as_array().unwrap().len(),
        4,
        "the parent and three steps: {v}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events WHERE actor = 'operator:olga'")
            .await,
        4
    );
    db.assert_verified().await;
}

#[tokio::test]
async fn batch_replay_and_the_status_reads() {
    let db = fresh().await;
    let olga = db.ledger.create_token("olga", Role::Operator).await.unwrap();
    let root = db.ledger.create_token("root", Role::Admin).await.unwrap();
    let s = Server::start(&db.url);
    let mut dead = vec![];
    for i in 0..3 {
        let id = db
            .ledger
            .enqueue(new_job("q", Some(&format!("d{i}")), json!({})))
            .await
            .unwrap()
            .job
            .job_id;
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
    let (st, v) = call("GET", &format!("{}/v1/queues", s.base), Some(&olga), None).await;
    assert_eq!(
        (st, v["queues"].as_array().map(Vec::len)),
        (200, Some(0)),
        "no projection yet: {v}"
    );

    let window = json!({ "reason_code": "permanent_error", "since": "2000-01-01T00:00:00Z",
                         "until": "2100-01-01T00:00:00Z", "reason": "provider fixed" });
    let (st, v) = post(&s, "/v1/replays", &olga, window.clone()).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["answers"].as_array().unwrap().len(), 3);
    assert!(
        v["answers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a["state"] == "queued"),
        "{v}"
    );
    let (st, v) = post(
        &s,
        "/v1/replays",
        &olga,
        json!({ "reason_code": "because", "since": "2000-01-01T00:00:00Z",
        "until": "2100-01-01T00:00:00Z", "reason": "r" }),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let (st, _) = post(
        &s,
        "/v1/replays",
        &olga,
        json!({ "reason_code": "permanent_error", "since": "2100-01-01T00:00:00Z",
        "until": "2000-01-01T00:00:00Z", "reason": "r" }),
    )
    .await;
    assert_eq!(st, 400);

    // The projections, once their service ran; then a rebuild over HTTP.
    let run = common::cli::jl(&db.url, &["projections", "run"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let (st, v) = call("GET", &format!("{}/v1/queues", s.base), Some(&olga), None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["queues"][0]["queue"], "q", "{v}");
    assert_eq!(v["queues"][0]["queued"], 3, "{v}");
    assert_eq!(v["projection"]["lag_events"], 0, "{v}");
    let (st, v) = call("GET", &format!("{}/v1/projections", s.base), Some(&olga), None).await;
    assert_eq!(
        (st, v["projections"].as_array().map(Vec::len)),
        (200, Some(4)),
        "{v}"
    );
    let (st, _) = post(&s, "/v1/projections/queue_stats/rebuild", &olga, json!({})).await;
    assert_eq!(st, 403, "an operator does not rebuild");
    let (st, v) = post(&s, "/v1/projections/nope/rebuild", &root, json!({})).await;
    assert_eq!(st, 400, "{v}");
    let (st, v) = post(&s, "/v1/projections/queue_stats/rebuild", &root, json!({})).await;
    assert_eq!(st, 202, "{v}");
    let (_, v) = call("GET", &format!("{}/v1/projections", s.base), Some(&olga), None).await;
    let qs = v["projections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["projection"] == "queue_stats")
        .unwrap()
        .clone();
    assert!(qs["rebuild_table"].is_string(), "the rebuild shows: {qs}");
    let run = common::cli::jl(&db.url, &["projections", "run"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let (_, v) = call("GET", &format!("{}/v1/projections", s.base), Some(&olga), None).await;
    let qs = v["projections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["projection"] == "queue_stats")
        .unwrap()
        .clone();
    assert!(
        qs["rebuild_table"].is_null(),
        "the service finished and switched: {qs}"
    );
    // A newer version serves (a rolling upgrade, this server not yet
    // replaced): a conflict with a reason, not a server error.
    sqlx::query("UPDATE jobledger_proj.registry SET version = 99 WHERE name = 'queue_stats'")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let (st, v) = post(&s, "/v1/projections/queue_stats/rebuild", &root, json!({})).await;
    assert_eq!(st, 409, "{v}");
    assert!(v.to_string().contains("version 99 serves"), "{v}");
    let (st, v) = call("GET", &format!("{}/v1/readers", s.base), Some(&olga), None).await;
    assert_eq!(st, 200, "{v}");
    assert!(v["readers"].is_array());
}
