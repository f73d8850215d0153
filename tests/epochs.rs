//! Lifecycle epochs of a reused key (issue 9 item 7): a key whose previous
//! lifecycle was purged while an enqueue of it was in flight never gets a
//! lower epoch than the purged one, whatever the isolation level.

mod common;

use common::{fresh, new_job, within};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Issue 9 item 7: an enqueue draws its epoch before the inserting statement
/// (the epoch is hashed into the `enqueued` event). When a lifecycle of the
/// same key is enqueued, finished and purged between one enqueue's draw and
/// its insert, the reused key must still get a higher epoch than the purged
/// lifecycle: the database refuses the lower one and the enqueue draws
/// again. Both orders: the purge committed before the insert, and the purge
/// in flight while the insert waits on the key's unique index.
#[tokio::test]
async fn a_reused_key_never_gets_a_lower_epoch() {
    use jobledger::ledger::LedgerHooks;
    use tokio::sync::{mpsc, Mutex};
    for in_flight in [false, true] {
        let db = fresh().await;
        let (reached, mut at_gate) = mpsc::channel::<()>(1);
        let (open, gate) = mpsc::channel::<()>(1);
        let gate = Arc::new(Mutex::new(gate));
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (c, g) = (calls.clone(), gate.clone());
        let hooked = db.ledger.clone().with_hooks(LedgerHooks {
            after_epochs: Some(Arc::new(move || {
                let (reached, g) = (reached.clone(), g.clone());
                let first = c.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
                Box::pin(async move {
                    if first {
                        reached.send(()).await.unwrap();
                        g.lock().await.recv().await;
                    }
                })
            })),
            before_wake: None,
        });
        let t1 = tokio::spawn(async move { hooked.enqueue(new_job("q", Some("K"), json!({"n": 2}))).await });
        within("the gate", at_gate.recv()).await.unwrap(); // T1 holds its epoch, not yet inserted
        let l2 = db.enqueue(Some("K"), json!({"n": 1})).await;
        db.ledger.cancel(l2.job_id, None).await.unwrap();
        let mut purge = None;
        if in_flight {
            // A real purge, paused after its delete of the key's row: another
            // transaction holds the key's floor row, which the purge's
            // tombstone raises. T1's insert then waits on the key's unique
            // index for the purge, and must see its tombstone.
            let pool = db.ledger.pool();
            sqlx::query("INSERT INTO jobledger.key_floors VALUES ('q', 'K', 0)")
                .execute(pool)
                .await
                .unwrap();
            let mut floor = pool.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM jobledger.key_floors WHERE queue = 'q' AND job_key = 'K' FOR UPDATE")
                .execute(&mut *floor)
                .await
                .unwrap();
            let ledger = db.ledger.clone();
            let purging = tokio::spawn(async move { ledger.purge(Duration::ZERO, 10).await });
            waiting_on_a_lock(&db, "INSERT INTO jobledger.tombstones").await;
            purge = Some((floor, purging));
        } else {
            assert_eq!(db.ledger.purge(Duration::ZERO, 10).await.unwrap(), 1);
        }
        open.send(()).await.unwrap();
        if let Some((floor, purging)) = purge {
            waiting_on_a_lock(&db, "INSERT INTO jobledger.jobs").await; // T1, behind the purge
            floor.commit().await.unwrap();
            assert_eq!(within("the purge", purging).await.unwrap().unwrap(), 1);
        }
        let e = within("the enqueue", t1)
            .await
            .unwrap()
            .expect("the enqueue draws again and succeeds");
        assert!(e.created);
        assert!(
            e.job.epoch > l2.epoch,
            "in flight {in_flight}: the reused key's epoch {} is above the purged lifecycle's {}",
            e.job.epoch,
            l2.epoch
        );
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "one refused insert, one retry"
        );
        db.assert_verified().await;
    }
}

/// The same race inside a caller's REPEATABLE READ transaction, whose
/// snapshot predates the purge: the reused key's lower epoch is refused as a
/// serialization failure (retryable, nothing written), and the caller's
/// retry gets a higher epoch.
#[tokio::test]
async fn a_reused_key_never_gets_a_lower_epoch_under_repeatable_read() {
    use jobledger::ledger::LedgerHooks;
    use tokio::sync::{mpsc, Mutex};
    let db = fresh().await;
    let (reached, mut at_gate) = mpsc::channel::<()>(1);
    let (open, gate) = mpsc::channel::<()>(1);
    let gate = Arc::new(Mutex::new(gate));
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (a, g) = (armed.clone(), gate.clone());
    let hooked = db.ledger.clone().with_hooks(LedgerHooks {
        after_epochs: Some(Arc::new(move || {
            let (reached, g) = (reached.clone(), g.clone());
            let first = a.swap(false, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async move {
                if first {
                    reached.send(()).await.unwrap();
                    g.lock().await.recv().await;
                }
            })
        })),
        before_wake: None,
    });
    let h = hooked.clone();
    let t1 = tokio::spawn(async move {
        let mut tx = h.pool().begin().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .unwrap();
        let r = h
            .enqueue_in(&mut tx, new_job("q", Some("K"), json!({"n": 2})))
            .await;
        if r.is_ok() {
            tx.commit().await.unwrap();
        }
        r
    });
    within("the gate", at_gate.recv()).await.unwrap();
    let l2 = db.enqueue(Some("K"), json!({"n": 1})).await;
    db.ledger.cancel(l2.job_id, None).await.unwrap();
    assert_eq!(db.ledger.purge(Duration::ZERO, 10).await.unwrap(), 1);
    open.send(()).await.unwrap();
    let err = within("the enqueue", t1)
        .await
        .unwrap()
        .expect_err("the lower epoch is refused");
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("serialize"), "{err}");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        0,
        "nothing written"
    );
    // The caller retries its transaction: a new draw, above the purged one.
    let mut tx = hooked.pool().begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    let e = hooked
        .enqueue_in(&mut tx, new_job("q", Some("K"), json!({"n": 2})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(e.job.epoch > l2.epoch);
    db.assert_verified().await;
}

/// Waits until a statement starting with `sql` waits on a lock in this
/// test's database.
async fn waiting_on_a_lock(db: &common::TestDb, sql: &str) {
    common::eventually(&format!("{sql} waits on a lock"), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND position($1 in query) > 0",
        )
        .bind(sql)
        .fetch_one(db.ledger.pool())
        .await
        .unwrap()
            > 0
    })
    .await;
}

/// Issue 15: an epoch's uniqueness sits on the log's first events, not on
/// every row version of `jobs`. A job copied under a new id with a taken
/// epoch is refused; so is a first event alone that reuses one (which the
/// old `jobs` index let through: an epoch stays taken after a purge). The
/// same copy with a fresh epoch goes in, so the epoch is what is refused.
#[tokio::test]
async fn an_epoch_is_never_taken_twice() {
    use jobledger::store::rows::{EVENT_COLUMNS, JOB_COLUMNS};
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    // The columns of a copy: a new job id ($2) and the epoch $3.
    let copy = |cols: &str| {
        cols.split(", ")
            .map(|c| match c.trim() {
                "job_id" => "$2".to_string(),
                "epoch" => "$3".to_string(),
                c => c.to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let first_event = format!(
        "INSERT INTO jobledger.events ({EVENT_COLUMNS}) SELECT {} FROM jobledger.events \
         WHERE job_id = $1 AND version = 1",
        copy(EVENT_COLUMNS)
    );
    let with_row = format!(
        "WITH e AS ({first_event} RETURNING 1) \
         INSERT INTO jobledger.jobs ({JOB_COLUMNS}) SELECT {} FROM jobledger.jobs WHERE job_id = $1",
        copy(JOB_COLUMNS)
    );
    let run = |sql: String, epoch: i64| {
        let pool = db.ledger.pool().clone();
        async move {
            sqlx::query(&sql)
                .bind(job.job_id)
                .bind(uuid::Uuid::now_v7())
                .bind(epoch)
                .execute(&pool)
                .await
        }
    };
    for sql in [with_row.clone(), first_event.clone()] {
        let err = run(sql.clone(), job.epoch).await.unwrap_err();
        let code = common::sqlstate(&err);
        assert_eq!(code.as_deref(), Some("23505"), "{sql}: {err}");
        assert!(err.to_string().contains("events_first_epoch"), "{err}");
    }
    let fresh_epoch: i64 = sqlx::query_scalar("SELECT nextval('jobledger.epoch_seq')")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
    run(with_row, fresh_epoch)
        .await
        .expect("the same copy with a fresh epoch");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 2);
}
