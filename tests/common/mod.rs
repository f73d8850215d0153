//! Shared test support: a fresh PostgreSQL database per test, and hooks that
//! move time by rewriting `lease_until` / `run_at` in the database.
#![allow(dead_code)]

pub mod auditkit;
pub mod cli;
pub mod counting;
pub mod fixture;
pub mod gated;
pub mod kafka;
pub mod otlp;
pub mod reading;
pub mod serve;
pub mod tagged;
pub mod workers;
pub mod workflows;

use jobledger::domain::{NewJob, Policy};
use jobledger::ledger::{Lease, Ledger};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};
use std::time::Duration;
use uuid::Uuid;

pub fn server_url() -> String {
    std::env::var("JOBLEDGER_TEST_SERVER").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

pub struct TestDb {
    pub ledger: Ledger,
    pub url: String,
    pub name: String,
}

/// A new, migrated database named `jlt_<uuid>`. `scripts/test` drops old ones.
pub async fn fresh() -> TestDb {
    let name = format!("jlt_{}", Uuid::new_v4().simple());
    let url = format!("{}/{}", server_url(), name);
    let ledger = Ledger::connect_and_migrate(&url, 16)
        .await
        .expect("test database");
    TestDb { ledger, url, name }
}

impl TestDb {
    pub async fn conn(&self) -> PgConnection {
        PgConnection::connect(&self.url).await.expect("connect")
    }

    /// Runs `sql` (with `$1` = `job`) as the superuser with the database's
    /// triggers off: the only way left to change `jobledger.jobs` without an
    /// event (`jobs_need_event_*` refuses it otherwise). Tests use it to move
    /// a job's clock fields into the past and to forge tampering.
    pub async fn around_the_log(&self, sql: &str, job: Uuid) {
        around_the_log(self.ledger.pool(), sql, job).await
    }

    /// Moves a lease into the past: the lease has expired, nobody waited.
    pub async fn expire_lease(&self, job: Uuid) {
        self.around_the_log(
            "UPDATE jobledger.jobs SET lease_until = now() - interval '1 second' WHERE job_id = $1",
            job,
        )
        .await;
    }

    /// Makes a delayed/backed-off job due now.
    pub async fn make_due(&self, job: Uuid) {
        self.around_the_log(
            "UPDATE jobledger.jobs SET run_at = now() - interval '1 millisecond' WHERE job_id = $1",
            job,
        )
        .await;
    }

    pub async fn expire_receipt(&self, job: Uuid) {
        self.around_the_log(
            "UPDATE jobledger.jobs SET receipt_deadline = now() - interval '1 second' WHERE job_id = $1",
            job,
        )
        .await;
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.ledger.pool())
            .await
            .unwrap()
    }

    pub async fn enqueue(&self, key: Option<&str>, payload: Value) -> jobledger::domain::Job {
        self.ledger
            .enqueue(new_job("q", key, payload))
            .await
            .expect("enqueue")
            .job
    }

    pub async fn enqueue_with(&self, policy: Policy) -> jobledger::domain::Job {
        let mut n = new_job("q", None, json!({}));
        n.policy = Some(policy);
        self.ledger.enqueue(n).await.expect("enqueue").job
    }

    pub async fn claim_one(&self, worker: &str) -> Lease {
        let mut leases = self
            .ledger
            .claim("q", worker, Duration::from_secs(30), 1)
            .await
            .expect("claim");
        assert_eq!(leases.len(), 1, "{worker} expected one lease");
        leases.pop().unwrap()
    }

    pub async fn claim_none(&self, worker: &str) {
        let leases = self
            .ledger
            .claim("q", worker, Duration::from_secs(30), 10)
            .await
            .expect("claim");
        assert!(
            leases.is_empty(),
            "{worker} expected nothing, got {} lease(s)",
            leases.len()
        );
    }

    pub async fn job(&self, id: Uuid) -> jobledger::domain::Job {
        match self.ledger.show(id).await.expect("show") {
            jobledger::ledger::Found::Live(j) => *j,
            other => panic!("job {id} is not live: {other:?}"),
        }
    }

    pub async fn assert_verified(&self) {
        let report = self.ledger.verify(None).await.expect("verify");
        assert!(report.ok(), "verify found problems: {:?}", report.problems);
    }
}

/// `TestDb::around_the_log` on a pool (inside handlers).
pub async fn around_the_log(pool: &sqlx::PgPool, sql: &str, job: Uuid) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(sql).bind(job).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
}

/// The SQLSTATE of a database error (None for any other error).
pub fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.to_string())
}

pub fn new_job(queue: &str, key: Option<&str>, payload: Value) -> NewJob {
    NewJob {
        queue: queue.into(),
        kind: "refund".into(),
        job_key: key.map(Into::into),
        payload,
        priority: 0,
        run_at: None,
        delay_ms: None,
        policy: None,
        concurrency_key: None,
        unique_for_ms: None,
    }
}

/// Waits for a condition of the database to hold (polls; the deadline only
/// turns a hang into a failure, it orders nothing).
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !cond().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl TestDb {
    pub async fn state_of(&self, id: Uuid) -> jobledger::domain::JobState {
        self.job(id).await.state
    }

    pub async fn open_jobs(&self) -> i64 {
        self.count(
            "SELECT count(*) FROM jobledger.jobs WHERE state NOT IN ('succeeded', 'cancelled', 'dead')",
        )
        .await
    }
}

/// Fails the test instead of hanging when `what` does not arrive in 30 s
/// (the deadline orders nothing; it turns a hang into a message).
pub async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .unwrap_or_else(|_| panic!("timed out after 30 s waiting for: {what}"))
}

/// `jobs_rebuilt` caught up from the log in batches of `batch`, by the
/// projection runner (under the runner's own reader name).
pub async fn catch_up_jobs_rebuilt(
    db: &TestDb,
    batch: i64,
) -> Result<jobledger_projections::runner::Step, jobledger_projections::ProjectionError> {
    use jobledger_projections::{runner::Runner, Projection};
    let reader = jobledger::reader::LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, batch)
        .await
        .unwrap();
    let rebuilt: &dyn Projection = &jobledger::rebuilt::JobsRebuilt;
    within("a catch-up", runner.catch_up(&[rebuilt])).await
}
