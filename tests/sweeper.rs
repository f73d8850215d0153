//! Issue 10 item 4: one active sweeper at a time, also when the leader's
//! session dies under it (a database restart or a terminated backend ends
//! the session and its advisory lock, while the worker still believes it
//! leads): the old leader's next sweep fails instead of sweeping beside the
//! new one.

mod common;

use common::workers::{base, start, stop};
use common::{eventually, fresh};
use jobledger::worker::{HandlerOutcome, JobContext, Worker};
use serde_json::json;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn sweeper(db: &common::TestDb, name: &str, every: Duration) -> Worker {
    base(db, name)
        .sweeper(Some(every))
        .handler("refund", |_ctx: JobContext| async {
            HandlerOutcome::success(json!({}))
        })
        .build()
        .unwrap()
}

fn sweeps(w: &Worker) -> u64 {
    w.counters().sweeps.load(Ordering::Relaxed)
}

/// Sweeper A (every `a_every`) leads and has swept; sweeper B (every 20 ms)
/// is started behind it. Returns both running, with a handle on each one's
/// counters.
async fn a_leads_then_b_waits(
    db: &common::TestDb,
    a_every: Duration,
) -> (common::workers::Running, Worker, common::workers::Running, Worker) {
    let a = sweeper(db, "a", a_every);
    let b = sweeper(db, "b", Duration::from_millis(20));
    let (a_count, b_count) = (a.clone(), b.clone());
    let a = start(a);
    eventually("A leads and sweeps", || async { sweeps(&a_count) >= 1 }).await;
    (a, a_count, start(b), b_count)
}

/// The tests here run one at a time: the restart drops every connection of
/// the server (cargo runs test binaries one after another, so only this
/// binary's tests could be hit).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn a_sweeper_whose_session_died_stops_sweeping() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = fresh().await;
    // A sweeps rarely, B often: once A's session is gone, B takes the lock
    // long before A's next tick.
    let (a, a_count, b, b_count) = a_leads_then_b_waits(&db, Duration::from_secs(2)).await;
    let leader_pid = || async {
        db.count(
            "SELECT coalesce(max(pid), 0)::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .await
    };
    let a_pid = leader_pid().await;
    assert!(a_pid > 0, "A's session holds the sweeper lock");
    // (No check that B has not swept yet: right after its start it may not
    // have tried at all. That B cannot lead beside a live A is what the
    // restart test below proves: after it, only one of them sweeps.)

    sqlx::query("SELECT pg_terminate_backend($1::int)")
        .bind(a_pid as i32)
        .execute(db.ledger.pool())
        .await
        .unwrap();
    eventually("B leads", || async { sweeps(&b_count) >= 1 }).await;
    assert_ne!(leader_pid().await, a_pid);
    let a_then = sweeps(&a_count);
    let b_then = sweeps(&b_count);
    // 150 of B's ticks span at least one of A's (every 2 s).
    eventually("B keeps sweeping", || async { sweeps(&b_count) >= b_then + 150 }).await;
    assert_eq!(
        sweeps(&a_count),
        a_then,
        "A, whose lock died with its session, swept no more"
    );
    let (ra, rb) = (stop(a).await, stop(b).await);
    assert_eq!(ra.sweeps, a_then);
    assert!(rb.sweeps > b_then);
}

/// The same across a real PostgreSQL restart (`pg_ctlcluster … restart`):
/// the restart ends A's session and lock; B takes the lock once the server
/// is back, and A, which still holds its dead session, never sweeps again.
#[tokio::test]
async fn after_a_database_restart_only_the_new_leader_sweeps() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = fresh().await;
    let (a, a_count, b, b_count) = a_leads_then_b_waits(&db, Duration::from_secs(5)).await;
    let port = url::Url::parse(&common::server_url())
        .unwrap()
        .port()
        .unwrap_or(5432);
    let restarted = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "c=$(pg_lsclusters --no-header | awk '$3 == {port} {{print $1\" \"$2}}'); \
             [ -n \"$c\" ] && pg_ctlcluster --skip-systemctl-redirect $c restart"
        ))
        .status()
        .unwrap();
    assert!(
        restarted.success(),
        "pg_ctlcluster restart of the test server on port {port}"
    );
    let a_then = sweeps(&a_count);
    eventually("B leads after the restart", || async { sweeps(&b_count) >= 1 }).await;
    let b_then = sweeps(&b_count);
    // 300 of B's ticks (6 s) span at least one of A's (every 5 s).
    eventually("B keeps sweeping", || async { sweeps(&b_count) >= b_then + 300 }).await;
    assert_eq!(
        sweeps(&a_count),
        a_then,
        "A's lock died with its session: it swept no more"
    );
    let (ra, rb) = (stop(a).await, stop(b).await);
    assert_eq!(ra.sweeps, a_then);
    assert!(rb.sweeps > b_then);
}
