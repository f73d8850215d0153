//! The log reader's contract, with both traps of docs/log-reader.md forced by gates:
//! writers committing out of position order, and a transaction that took its
//! xid early appending version n+1 with a smaller txid than version n's.

mod common;

use common::reading::{drain, drain_data_of, drain_raw, drain_wanted, early_xid_trap};
use common::{fresh, new_job, TestDb};
use jobledger::reader::{Checkpoint, LogEvent, LogReader};
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

/// Drops duplicates the way a consumer does (by version) and checks that
/// what is left is each job's full, gapless version sequence in order.
fn assert_per_job_order(events: &[LogEvent]) -> HashMap<Uuid, i64> {
    let mut seen: HashMap<Uuid, i64> = HashMap::new();
    for e in events {
        let last = seen.entry(e.job_id()).or_insert(0);
        if e.version() <= *last {
            continue; // duplicate
        }
        assert_eq!(
            e.version(),
            *last + 1,
            "job {} jumped from v{} to v{}",
            e.job_id(),
            last,
            e.version()
        );
        *last = e.version();
    }
    seen
}

/// Trap 1: the slower transaction took the smaller position but commits
/// last. The reader holds the faster one back instead of skipping the slower.
#[tokio::test]
async fn out_of_order_commits_are_never_skipped() {
    let db = fresh().await;
    let reader = LogReader::open(db.ledger.pool().clone(), "test").await.unwrap();

    let mut slow = db.ledger.pool().begin().await.unwrap();
    let s = db
        .ledger
        .enqueue_in(&mut slow, new_job("q", Some("slow"), json!({})))
        .await
        .unwrap();
    let f = db
        .ledger
        .enqueue(new_job("q", Some("fast"), json!({})))
        .await
        .unwrap();
    assert!(
        s.position.unwrap() < f.position.unwrap(),
        "the slow writer holds the smaller position"
    );

    // A naive "position > checkpoint" reader would hand out `fast` now and
    // move past `slow` forever. Ours waits below the snapshot horizon.
    let b = reader.read(Checkpoint::default(), 100).await.unwrap();
    assert!(
        b.events.is_empty(),
        "nothing is handed out past an open transaction: {:?}",
        b.events.len()
    );
    let lag = reader.lag(b.next).await.unwrap();
    let holder = lag.horizon_holder.expect("the open transaction is named");
    assert!(holder.pid.is_some_and(|p| p > 0));

    slow.commit().await.unwrap();
    let (events, _) = drain(&reader, b.next, 100).await;
    let jobs: Vec<Uuid> = events.iter().map(|e| e.job_id()).collect();
    assert!(
        jobs.contains(&s.job.job_id) && jobs.contains(&f.job.job_id),
        "both delivered"
    );
}

/// Trap 2: T1 takes its xid early (another job's enqueue), then waits for
/// job J's lock held by T2 (which appends version 3). T2 commits; T1 appends
/// version 4 with a smaller txid. The reader never hands out v4 before v3.
#[tokio::test]
async fn an_early_xid_never_puts_a_version_before_its_predecessor() {
    let db = fresh().await;
    let reader = LogReader::open(db.ledger.pool().clone(), "test").await.unwrap();
    let (j, before, cp) = early_xid_trap(&db, &reader).await;

    // Small batches, so v4 arrives in a batch without v3.
    let (after, _) = drain(&reader, cp, 2).await;
    let first_v3 = after
        .iter()
        .position(|e| e.job_id() == j.job_id && e.version() == 3)
        .unwrap();
    let first_v4 = after
        .iter()
        .position(|e| e.job_id() == j.job_id && e.version() == 4)
        .unwrap();
    assert!(first_v3 < first_v4, "v3 is handed out before v4");
    let mut all = before;
    all.extend(after);
    let last = assert_per_job_order(&all);
    assert_eq!(last[&j.job_id], 4);

    // Read again naming no kind's data: v3 still comes early, and without
    // its data (its lookup reads all data), as every other event does.
    let (again, _) = drain_data_of(&reader, cp, 2, Some(&[]), None).await;
    let v3 = again
        .iter()
        .filter(|e| e.job_id() == j.job_id && e.version() == 3)
        .collect::<Vec<_>>();
    assert!(v3.len() >= 2, "v3 came early, then again in its place");
    assert!(
        again.iter().all(|e| e.row.data.is_null()),
        "no event carries data: {:?}",
        again
            .iter()
            .map(|e| (e.version(), &e.row.data))
            .collect::<Vec<_>>()
    );

    // Without the hashes: v3 comes early and again in its place, both times
    // without them, as every event does; with them, each as stored.
    let chain: HashMap<(Uuid, i64), (Option<String>, String)> =
        sqlx::query_as::<_, (Uuid, i64, Option<String>, String)>(
            "SELECT job_id, version, prev_hash, hash FROM jobledger.events",
        )
        .fetch_all(db.ledger.pool())
        .await
        .unwrap()
        .into_iter()
        .map(|(j, v, p, h)| ((j, v), (p, h)))
        .collect();
    for hashes in [false, true] {
        let (read, _) = drain_wanted(&reader, cp, 2, Some(&[]), None, hashes).await;
        let v3 = read.iter().filter(|e| e.job_id() == j.job_id && e.version() == 3);
        assert!(v3.count() >= 2, "v3 came early, then again in its place");
        for e in &read {
            let (prev, hash) = &chain[&(e.job_id(), e.version())];
            let want = if hashes {
                (prev.clone(), hash.clone())
            } else {
                (None, String::new())
            };
            assert_eq!(
                (e.row.prev_hash.clone(), e.row.hash.clone()),
                want,
                "v{}",
                e.version()
            );
        }
    }

    // Naming keys: v3 comes early (its lookup reads all its data) and again
    // in its place, both times with only those keys, as every event does.
    let stored: HashMap<(Uuid, i64), serde_json::Value> =
        sqlx::query_as::<_, (Uuid, i64, serde_json::Value)>(
            "SELECT job_id, version, data FROM jobledger.events",
        )
        .fetch_all(db.ledger.pool())
        .await
        .unwrap()
        .into_iter()
        .map(|(j, v, d)| ((j, v), d))
        .collect();
    let keys = ["result", "absent", "result"];
    let (again, _) = drain_data_of(&reader, cp, 2, None, Some(&keys)).await;
    assert!(
        again
            .iter()
            .filter(|e| e.job_id() == j.job_id && e.version() == 3)
            .count()
            >= 2,
        "v3 came early, then again in its place"
    );
    for e in &again {
        let data = &stored[&(e.job_id(), e.version())];
        let want = json!({ "result": data.get("result").cloned().unwrap_or_default(), "absent": null });
        assert_eq!(e.row.data, want, "v{} of {}", e.version(), e.job_id());
    }
    assert!(
        again.iter().any(|e| !e.row.data["result"].is_null()),
        "some event has a result: {again:?}"
    );

    // Data a read leaves out is never parsed, early or in its place: v3's
    // result edited (around the write path) to a number beyond f64 still
    // lets a read that names other kinds, or only the digest, through.
    let mut conn = db.ledger.pool().acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("UPDATE jobledger.events SET data = jsonb_set(data, '{result}', '1e400') WHERE job_id = $1 AND version = 3")
        .bind(j.job_id)
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    let (none, _) = drain_data_of(&reader, cp, 2, Some(&[]), None).await;
    assert!(none.iter().all(|e| e.row.data.is_null()));
    let (digests, _) = drain_data_of(&reader, cp, 2, None, Some(&["digest"])).await;
    let v3: Vec<_> = digests
        .iter()
        .filter(|e| e.job_id() == j.job_id && e.version() == 3)
        .map(|e| e.row.data.clone())
        .collect();
    assert!(v3.len() >= 2, "v3 came early, then again in its place");
    assert!(
        v3.iter().all(|d| d == &v3[0] && d["digest"].is_string()),
        "{v3:?}"
    );
    // Read raw (the relay), v3 comes unparsed both times, as stored.
    let stored: String =
        sqlx::query_scalar("SELECT data::text FROM jobledger.events WHERE job_id = $1 AND version = 3")
            .bind(j.job_id)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let (raw, _) = drain_raw(&reader, cp, 2).await;
    let v3: Vec<_> = raw
        .iter()
        .filter(|e| e.job_id() == j.job_id && e.version() == 3)
        .map(|e| {
            (
                e.row.data.clone(),
                e.raw_data.as_ref().map(|r| r.get().to_string()),
            )
        })
        .collect();
    assert!(v3.len() >= 2, "v3 came early, then again in its place");
    for (data, raw) in &v3 {
        assert!(data.is_null());
        assert_eq!(raw.as_deref(), Some(stored.as_str()));
    }
}

/// Many concurrent writers: every event arrives, per job in order.
#[tokio::test]
async fn concurrent_writers_everything_arrives_in_per_job_order() {
    let db = fresh().await;
    let reader = LogReader::open(db.ledger.pool().clone(), "test").await.unwrap();
    for i in 0..40 {
        db.enqueue(Some(&format!("k{i}")), json!({"i": i})).await;
    }
    let mut tasks = vec![];
    for w in 0..4 {
        let l = db.ledger.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let leases = l
                    .claim("q", &format!("w{w}"), Duration::from_secs(30), 3)
                    .await
                    .unwrap();
                if leases.is_empty() {
                    return;
                }
                for lease in leases {
                    lease.heartbeat(Duration::from_secs(30)).await.unwrap();
                    lease.complete(None).await.unwrap();
                }
            }
        }));
    }
    // Read while they write, in small batches.
    let mut cp = Checkpoint::default();
    let mut got = vec![];
    loop {
        let b = reader.read(cp, 7).await.unwrap();
        got.extend(b.events);
        cp = b.next;
        if tasks.iter().all(|t| t.is_finished()) {
            let (rest, _) = drain(&reader, cp, 7).await;
            got.extend(rest);
            break;
        }
        tokio::task::yield_now().await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let last = assert_per_job_order(&got);
    assert_eq!(last.len(), 40);
    assert!(
        last.values().all(|v| *v == 4),
        "enqueued, claimed, lease_extended, succeeded for every job"
    );
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 160);
}

/// `skip_to_end`: a reader that only wants what comes next sees exactly that.
#[tokio::test]
async fn skip_to_end_hands_out_only_new_events() {
    let db = fresh().await;
    for i in 0..3 {
        db.enqueue(Some(&format!("old{i}")), json!({})).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "tail").await.unwrap();
    let cp = reader.skip_to_end().await.unwrap();
    assert_eq!(reader.checkpoint().await.unwrap(), cp);
    assert!(reader.read(cp, 10).await.unwrap().events.is_empty());
    let new = db.enqueue(Some("new"), json!({})).await;
    let (events, _) = drain(&reader, cp, 10).await;
    assert_eq!(
        events.iter().map(|e| e.job_id()).collect::<Vec<_>>(),
        vec![new.job_id]
    );
}

/// Sets the trap of issue 9 item 1 for job J: v1 committed, then T_b takes
/// its xid (a business write: another job's enqueue), T_c claims J (v2, a
/// newer xid) and commits, then T_b appends v3 (observation) and commits.
/// In txid order the log reads J v1, other v1, J v3, J v2. With `hold`, a
/// transaction whose xid lies between T_b's and T_c's is left open (the
/// caller ends it): it holds the horizon between the two.
async fn gap_in_the_middle(
    db: &TestDb,
    hold: bool,
) -> (Uuid, Option<sqlx::Transaction<'static, sqlx::Postgres>>) {
    let j = db.enqueue(Some("J"), json!({})).await;
    let mut t_b = db.ledger.pool().begin().await.unwrap();
    db.ledger
        .enqueue_in(&mut t_b, new_job("q", Some("other"), json!({})))
        .await
        .unwrap(); // T_b's xid
    let holder = if hold {
        let mut h = db.ledger.pool().begin().await.unwrap();
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&mut *h)
            .await
            .unwrap();
        Some(h)
    } else {
        None
    };
    let lease = db.claim_one("w").await; // T_c: J v2, committed
    assert_eq!(lease.job_id(), j.job_id);
    let r = db
        .ledger
        .observe_in(&mut t_b, j.job_id, None, "receipt", json!({}), "w")
        .await
        .unwrap();
    assert!(r.committed());
    t_b.commit().await.unwrap();
    let order: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT version, txid::text::bigint FROM jobledger.events WHERE job_id = $1 ORDER BY version",
    )
    .bind(j.job_id)
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    assert!(
        order[2].1 < order[1].1,
        "the trap is set: v3's txid is below v2's: {order:?}"
    );
    (j.job_id, holder)
}

/// Every job's first-seen versions are 1, 2, 3, ... (duplicates allowed).
fn first_seen_in_order(events: &[LogEvent], what: &str) -> HashMap<Uuid, i64> {
    let mut seen: HashMap<Uuid, i64> = HashMap::new();
    for e in events {
        let last = seen.entry(e.job_id()).or_insert(0);
        if e.version() <= *last {
            continue;
        }
        assert_eq!(
            e.version(),
            *last + 1,
            "{what}: job {} saw v{} after v{}",
            e.job_id(),
            e.version(),
            last
        );
        *last = e.version();
    }
    seen
}

/// Issue 9 item 1: a version missing from the *middle* of a batch (the batch
/// holds J v1 and v3, v2 comes later in txid order) is handed out before v3,
/// at every batch limit.
#[tokio::test]
async fn a_gap_in_the_middle_of_a_batch_is_filled_at_every_batch_limit() {
    let db = fresh().await;
    let (j, _) = gap_in_the_middle(&db, false).await;
    for limit in [1, 2, 3, 5, 5000] {
        let reader = LogReader::open(db.ledger.pool().clone(), &format!("r{limit}"))
            .await
            .unwrap();
        let (events, _) = drain(&reader, Checkpoint::default(), limit).await;
        let last = first_seen_in_order(&events, &format!("limit {limit}"));
        assert_eq!(last[&j], 3, "limit {limit}: all of J's versions");
        assert_eq!(last.len(), 2, "limit {limit}: J and the other job");
    }
}

/// The same trap with a transaction holding the horizon between the two
/// txids: the reader can see J v1 and v3 below the horizon, and must still
/// hand out v2 (committed, above the horizon) before v3.
#[tokio::test]
async fn a_gap_behind_a_held_horizon_is_filled() {
    let db = fresh().await;
    let (j, holder) = gap_in_the_middle(&db, true).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "held").await.unwrap();
    // Read until the batch reaches J v3: another database's transaction that
    // ends while a read looks at it holds that read's horizon further back
    // (it cannot be told from this database's).
    let b = common::within("a read reaches J v3 below the holder", async {
        loop {
            let b = reader.read(Checkpoint::default(), 5000).await.unwrap();
            if b.events.iter().any(|e| e.job_id() == j && e.version() == 3) {
                return b;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let js: Vec<i64> = b
        .events
        .iter()
        .filter(|e| e.job_id() == j)
        .map(|e| e.version())
        .collect();
    assert_eq!(
        js,
        vec![1, 2, 3],
        "v2 is handed out with v1 and v3, ahead of the horizon"
    );
    assert_eq!(b.early, 1, "one version handed out early");
    holder.unwrap().rollback().await.unwrap();
    let (rest, _) = drain(&reader, b.next, 5000).await;
    let mut all = b.events;
    all.extend(rest);
    assert_eq!(first_seen_in_order(&all, "held")[&j], 3);
}

/// The predecessor trap two deep: T_b takes its xid before J even exists,
/// J is enqueued (v1) and claimed (v2) by newer transactions, then T_b
/// appends J v3. In txid order the log reads J v3, J v1, J v2: a batch
/// holding v3 must also hand out v2 *and* v1, both still ahead of it.
#[tokio::test]
async fn a_job_whose_first_versions_all_lie_ahead_is_handed_out_from_v1() {
    let db = fresh().await;
    let mut t_b = db.ledger.pool().begin().await.unwrap();
    db.ledger
        .enqueue_in(&mut t_b, new_job("q", Some("early"), json!({})))
        .await
        .unwrap(); // T_b's xid, older than all of J's
    let j = db.enqueue(Some("J"), json!({})).await; // v1
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 1)
        .await
        .unwrap();
    assert_eq!(leases[0].job_id(), j.job_id); // v2 (T_b's job is not committed yet)
    let r = db
        .ledger
        .observe_in(&mut t_b, j.job_id, None, "receipt", json!({}), "w")
        .await
        .unwrap();
    assert!(r.committed()); // v3
    t_b.commit().await.unwrap();
    let txid = |v: i64| {
        let pool = db.ledger.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT txid::text::bigint FROM jobledger.events WHERE job_id = $1 AND version = $2",
            )
            .bind(j.job_id)
            .bind(v)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert!(
        txid(3).await < txid(1).await && txid(1).await < txid(2).await,
        "the trap is set"
    );
    for limit in [1, 2, 3, 5, 5000] {
        let reader = LogReader::open(db.ledger.pool().clone(), &format!("deep{limit}"))
            .await
            .unwrap();
        let (events, _) = drain(&reader, Checkpoint::default(), limit).await;
        let last = first_seen_in_order(&events, &format!("limit {limit}"));
        assert_eq!(last[&j.job_id], 3, "limit {limit}: all of J's versions");
    }
}

/// A read may name more keys than one SQL function takes arguments (100:
/// 50 keys): the object is built in parts and comes whole.
#[tokio::test]
async fn a_read_names_more_keys_than_a_function_takes() {
    let db = fresh().await;
    db.enqueue(None, json!({ "n": 1 })).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "keys").await.unwrap();
    let mut keys: Vec<String> = (0..60).map(|i| format!("k{i}")).collect();
    keys[55] = "queue".into();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let (events, _) = drain_data_of(&reader, Checkpoint::default(), 10, None, Some(&keys)).await;
    assert_eq!(events.len(), 1);
    let data = events[0].row.data.as_object().expect("an object");
    assert_eq!(data.len(), 60, "{data:?}");
    assert!(data["queue"].is_string(), "{data:?}");
    assert!(data["k59"].is_null() && data["k0"].is_null());
}
