//! Job search, from the library and over HTTP: every filter, newest first,
//! a cursor that pages through everything once, clear refusals, and plans
//! that use the search indexes (no sequential scan) on a table of 30,000.

mod common;

use common::serve::{call, Server};
use common::{fresh, new_job, TestDb};
use jobledger::domain::{ErrorClass, JobState};
use jobledger::ledger::search::Search;
use jobledger::ledger::tokens::Role;
use jobledger::ledger::LedgerError;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

/// 12 jobs: queues a/b, kinds x/y, three of them dead (declined), two
/// cancelled. Returns the ids in enqueue order.
async fn some_jobs(db: &TestDb) -> Vec<Uuid> {
    let mut ids = vec![];
    for i in 0..12 {
        let mut j = new_job(
            if i % 2 == 0 { "a" } else { "b" },
            Some(&format!("k{i}")),
            json!({ "i": i }),
        );
        j.kind = if i % 3 == 0 { "x" } else { "y" }.into();
        ids.push(db.ledger.enqueue(j).await.unwrap().job.job_id);
    }
    for &i in &[0, 2, 4] {
        let l = db
            .ledger
            .claim_job(ids[i], "w", Duration::from_secs(30))
            .await
            .unwrap()
            .1
            .unwrap();
        l.fail(ErrorClass::Permanent, "declined", None).await.unwrap();
    }
    for &i in &[1, 6] {
        db.ledger.cancel(ids[i], Some("dup")).await.unwrap();
    }
    ids
}

/// A search of `states`, with what `f` sets besides.
fn in_states(states: &[&str], f: fn(&mut Search)) -> Search {
    let mut s = Search {
        states: states.iter().map(|s| s.to_string()).collect(),
        ..Search::default()
    };
    f(&mut s);
    s
}

fn ids(page: &jobledger::ledger::search::Page) -> Vec<Uuid> {
    page.jobs.iter().map(|j| j.job_id).collect()
}

#[tokio::test]
async fn filters_newest_first_and_a_cursor_that_misses_nothing() {
    let db = fresh().await;
    let all = some_jobs(&db).await;
    let newest_first: Vec<Uuid> = all.iter().rev().copied().collect();
    let s = |f: fn(&mut Search)| {
        let mut s = Search::default();
        f(&mut s);
        s
    };
    let page = db.ledger.search(&Search::default()).await.unwrap();
    assert_eq!(ids(&page), newest_first, "newest first");
    assert!(page.next.is_none(), "one page holds all");

    let dead = db
        .ledger
        .search(&s(|s| s.states = vec!["dead".into()]))
        .await
        .unwrap();
    assert_eq!(ids(&dead), vec![all[4], all[2], all[0]]);
    let dead_a_x = db
        .ledger
        .search(&s(|s| {
            s.queue = Some("a".into());
            s.kind = Some("x".into());
            s.states = vec!["dead".into(), "cancelled".into()];
        }))
        .await
        .unwrap();
    assert_eq!(
        ids(&dead_a_x),
        vec![all[6], all[0]],
        "queue a, kind x, dead or cancelled"
    );
    let by_reason = db
        .ledger
        .search(&s(|s| s.reason = Some("cancelled_before_start".into())))
        .await
        .unwrap();
    assert_eq!(ids(&by_reason), vec![all[6], all[1]]);
    let key = db
        .ledger
        .search(&s(|s| {
            s.queue = Some("b".into());
            s.key = Some("k3".into());
        }))
        .await
        .unwrap();
    assert_eq!(ids(&key), vec![all[3]]);
    let third = db.job(all[3]).await.created_at;
    let since = db
        .ledger
        .search(&Search {
            since: Some(third),
            queue: Some("b".into()),
            ..Search::default()
        })
        .await
        .unwrap();
    assert_eq!(
        ids(&since),
        vec![all[11], all[9], all[7], all[5], all[3]],
        "since is inclusive"
    );

    // Pages of 5: every job once, in order, and the last page says so.
    let mut seen = vec![];
    let mut cursor = None;
    loop {
        let page = db
            .ledger
            .search(&Search {
                limit: Some(5),
                cursor: cursor.clone(),
                ..Search::default()
            })
            .await
            .unwrap();
        seen.extend(ids(&page));
        match page.next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, newest_first);
    // A job changing state between pages neither repeats nor vanishes.
    let first = db
        .ledger
        .search(&Search {
            limit: Some(4),
            ..Search::default()
        })
        .await
        .unwrap();
    db.ledger.cancel(all[5], None).await.unwrap();
    let rest = db
        .ledger
        .search(&Search {
            cursor: first.next.clone(),
            ..Search::default()
        })
        .await
        .unwrap();
    let both: Vec<Uuid> = ids(&first).into_iter().chain(ids(&rest)).collect();
    assert_eq!(both, newest_first);

    for bad in [
        s(|s| s.states = vec!["sleeping".into()]),
        s(|s| s.reason = Some("because".into())),
        s(|s| s.key = Some("k1".into())),
        s(|s| s.limit = Some(0)),
        s(|s| s.limit = Some(501)),
        s(|s| s.cursor = Some("12.nope".into())),
        s(|s| s.cursor = Some("garbage".into())),
    ] {
        match db.ledger.search(&bad).await {
            Err(LedgerError::BadInput(_)) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn search_over_http() {
    let db = fresh().await;
    let all = some_jobs(&db).await;
    let rita = db.ledger.create_token("rita", Role::Reader).await.unwrap();
    let srv = Server::start(&db.url);
    let get = |q: &str| format!("{}/v1/jobs?{q}", srv.base);
    let (st, v) = call(
        "GET",
        &get("state=dead,cancelled&queue=a&limit=2"),
        Some(&rita),
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let got: Vec<&str> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(got, vec![all[6].to_string(), all[4].to_string()]);
    assert_eq!(v["jobs"][0]["state"], "cancelled");
    let next = v["next"].as_str().unwrap().to_string();
    let (st, v) = call(
        "GET",
        &get(&format!("state=dead,cancelled&queue=a&limit=2&cursor={next}")),
        Some(&rita),
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let got: Vec<&str> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(got, vec![all[2].to_string(), all[0].to_string()]);
    for q in [
        "state=nope",
        "limit=abc",
        "colour=red",
        "key=k1",
        "since=yesterday",
    ] {
        let (st, v) = call("GET", &get(q), Some(&rita), None).await;
        assert_eq!(st, 400, "{q}: {v}");
        assert!(!v["error"].as_str().unwrap().contains('\n'));
    }
    let (st, _) = call("GET", &get(""), None, None).await;
    assert_eq!(st, 401);
}

#[tokio::test]
async fn searches_use_the_indexes_not_a_sequential_scan() {
    let db = fresh().await;
    // 30,000 jobs in 3 queues, so the planner has a real choice; then the
    // statistics it plans with.
    let mut conn = db.conn().await;
    for chunk in 0..30 {
        let jobs = (0..1000)
            .map(|i| {
                let n = chunk * 1000 + i;
                let mut j = new_job(&format!("q{}", n % 3), Some(&format!("k{n}")), json!({}));
                j.kind = format!("kind{}", n % 7);
                j
            })
            .collect();
        let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
        db.ledger.enqueue_many_in(&mut tx, jobs).await.unwrap();
        tx.commit().await.unwrap();
    }
    // Some leases: the four search indexes leave them out (issue 15), and
    // `jobs_search_leased` finds them in order.
    let leased: HashSet<Uuid> = db
        .ledger
        .claim("q1", "w", Duration::from_secs(30), 5)
        .await
        .unwrap()
        .iter()
        .map(|l| l.job_id())
        .collect();
    assert_eq!(leased.len(), 5);
    sqlx::query("ANALYZE jobledger.jobs")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let leases = |f: fn(&mut Search)| in_states(&["leased", "cancel_requested"], f);
    for s in [
        leases(|_| {}),
        leases(|s| s.queue = Some("q1".into())),
        leases(|s| s.kind = Some("kind3".into())),
        leases(|s| s.reason = Some("claimed".into())),
    ] {
        let plan = db.ledger.explain_search(&s).await.unwrap();
        assert!(!plan.contains("Seq Scan on jobs"), "{s:?}:\n{plan}");
        // Unfiltered, the leases' own search index in order; filtered, it or
        // the claim's jobs_leases (a queue's leases), never the table.
        let unfiltered = s.queue.is_none() && s.kind.is_none() && s.reason.is_none();
        assert!(
            plan.contains("jobs_search_leased") || (!unfiltered && plan.contains("jobs_leases")),
            "{s:?}:\n{plan}"
        );
        let page = db.ledger.search(&s).await.unwrap();
        assert!(page.jobs.iter().all(|j| j.state == JobState::Leased), "{s:?}");
        assert!(ids(&page).iter().all(|id| leased.contains(id)), "{s:?}");
        let newest_first = page.jobs.windows(2).all(|w| w[0].created_at >= w[1].created_at);
        assert!(newest_first, "{s:?}");
        if s.kind.is_none() {
            assert_eq!(page.jobs.len(), 5, "{s:?}");
        }
    }
    // Queued jobs are only in `jobs_search_queued` (issue 15: an enqueue
    // enters one search index, not four); each filtered search still pages
    // them newest first, exactly as the table holds them.
    // A page is 50 jobs by default, as the truth below takes.
    let queued = |f: fn(&mut Search)| in_states(&["queued"], f);
    for s in [
        queued(|_| {}),
        queued(|s| s.queue = Some("q2".into())),
        queued(|s| s.kind = Some("kind4".into())),
        queued(|s| s.reason = Some("new".into())),
        queued(|s| {
            s.queue = Some("q0".into());
            s.kind = Some("kind6".into())
        }),
    ] {
        let plan = db.ledger.explain_search(&s).await.unwrap();
        assert!(!plan.contains("Seq Scan on jobs"), "{s:?}:\n{plan}");
        let truth: Vec<Uuid> = sqlx::query_scalar(
            "SELECT job_id FROM jobledger.jobs WHERE state = 'queued' AND queue = coalesce($1, queue) \
               AND kind = coalesce($2, kind) AND reason = coalesce($3, reason) \
             ORDER BY created_at DESC, job_id DESC LIMIT 50",
        )
        .bind(&s.queue)
        .bind(&s.kind)
        .bind(&s.reason)
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
        assert_eq!(truth.len(), 50, "{s:?}");
        assert_eq!(ids(&db.ledger.search(&s).await.unwrap()), truth, "{s:?}");
    }
    // A reason no queued job can carry leaves the queued jobs unread.
    let dead_only = Search {
        reason: Some("attempts_exhausted".into()),
        ..Search::default()
    };
    let plan = db.ledger.explain_search(&dead_only).await.unwrap();
    assert!(!plan.contains("'queued'"), "{plan}");
    // Pruned to no state at all: a valid search with an empty answer, by
    // filters and by key.
    let none_left = in_states(&["queued"], |s| s.reason = Some("completed".into()));
    assert!(db
        .ledger
        .explain_search(&none_left)
        .await
        .unwrap()
        .contains("One-Time Filter: false"));
    assert!(db.ledger.search(&none_left).await.unwrap().jobs.is_empty());
    let by_key = in_states(&["queued"], |s| {
        s.reason = Some("completed".into());
        s.queue = Some("q1".into());
        s.key = Some("k1".into())
    });
    assert!(db.ledger.search(&by_key).await.unwrap().jobs.is_empty());
    let cases = [
        Search::default(),
        Search {
            queue: Some("q1".into()),
            ..Search::default()
        },
        Search {
            queue: Some("q1".into()),
            states: vec!["dead".into()],
            kind: Some("kind3".into()),
            ..Search::default()
        },
        Search {
            states: vec!["queued".into()],
            reason: Some("new".into()),
            since: Some(chrono::Utc::now() - chrono::Duration::hours(1)),
            ..Search::default()
        },
    ];
    for s in cases {
        let plan = db.ledger.explain_search(&s).await.unwrap();
        assert!(!plan.contains("Seq Scan on jobs"), "{s:?}:\n{plan}");
        assert!(plan.contains("Index"), "{s:?}:\n{plan}");
        let page = db.ledger.search(&s).await.unwrap();
        let distinct: HashSet<Uuid> = ids(&page).into_iter().collect();
        assert_eq!(distinct.len(), page.jobs.len());
        assert!(page
            .jobs
            .iter()
            .all(|j| j.state == JobState::Queued || j.state == JobState::Dead));
    }
}

/// An enqueue writes its job into three of the table's indexes: the
/// primary key, the claim's `jobs_due` and one search index (issue 15: the
/// four search indexes led by text columns cost more to enter than the
/// rest of the row). Counted from each index's predicate.
#[tokio::test]
async fn an_enqueued_job_enters_three_indexes() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({ "n": 1 })).await;
    let indexes: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT c.relname::text, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i \
         JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'jobledger.jobs'::regclass",
    )
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    let mut entered = vec![];
    for (name, pred) in indexes {
        let sql = format!(
            "SELECT count(*) FROM jobledger.jobs WHERE job_id = $1 AND ({})",
            pred.unwrap_or_else(|| "true".into())
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(job.job_id)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
        if n == 1 {
            entered.push(name);
        }
    }
    entered.sort();
    assert_eq!(entered, ["jobs_due", "jobs_pkey", "jobs_search_queued"]);
}

/// The jobs table's indexes are ascending: keys arrive in ascending order
/// (enqueue time, UUIDv7 ids), and a descending index takes each at the left
/// end of its range, where full pages split in half (the search indexes were
/// 1.8 times their ascending size; migration 20261208000001). Searches walk
/// them backwards for the newest first.
#[tokio::test]
async fn the_jobs_indexes_are_ascending() {
    let db = fresh().await;
    let descending: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE i.indrelid = 'jobledger.jobs'::regclass \
           AND EXISTS (SELECT 1 FROM unnest(i.indoption::int2[]) o WHERE o & 1 = 1) ORDER BY 1",
    )
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    assert!(descending.is_empty(), "descending: {descending:?}");
}
