//! The auditor's kit in tests: a ledger with a signed head over 100 jobs,
//! and what an attacker with the superuser's rights does to it.

use super::{eventually, fresh, new_job, TestDb};
use ed25519_dalek::{SigningKey, VerifyingKey};
use jobledger::audit::checkpointer::{CheckpointConfig, Checkpointer};
use jobledger::audit::offline::{Auditor, Finding};
use jobledger::domain::ErrorClass;
use jobledger::store::EventRow;
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use uuid::Uuid;

pub struct Kit {
    pub db: TestDb,
    pub key: SigningKey,
    pub public: VerifyingKey,
    pub dir: PathBuf,
}

impl Kit {
    pub fn checkpointer(&self) -> Checkpointer {
        Checkpointer::new(
            self.db.ledger.clone(),
            self.key.clone(),
            CheckpointConfig::default(),
        )
    }

    pub async fn checkpoint(&self) -> u64 {
        let step = self.checkpointer().checkpoint_now().await.unwrap();
        step.signed.expect("a head was signed").head.tree_size
    }

    /// `n` more jobs in `queue` (events past the kit's signed head).
    pub async fn enqueue_more(&self, queue: &str, n: usize) {
        let jobs = (0..n).map(|i| new_job(queue, None, json!({ "i": i }))).collect();
        self.db.ledger.enqueue_many_as(jobs, "test").await.unwrap();
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Exports the whole log and audits it offline: the findings.
    pub async fn export_and_audit(&self, name: &str) -> Vec<Finding> {
        let out = self.path(name);
        self.db.ledger.export(0, None, &out).await.unwrap();
        audit(&[out], Some(self.public))
    }

    pub async fn problems(&self) -> Vec<jobledger::ledger::Problem> {
        self.db
            .ledger
            .verify_with(None, Some(&self.public), &[])
            .await
            .unwrap()
            .problems
    }

    /// Runs `sql` as the superuser with every trigger off.
    pub async fn around(&self, sql: &str) {
        let mut tx = self.db.ledger.pool().begin().await.unwrap();
        sqlx::query("SET LOCAL session_replication_role = replica")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
    }

    pub async fn events_of(&self, job: Uuid) -> Vec<EventRow> {
        jobledger::store::events::job_events(self.db.ledger.pool(), job)
            .await
            .unwrap()
    }

    /// What an attacker who knows the hashing does after changing a job's
    /// events: every hash and link recomputed, the projection's last hash too.
    pub async fn recompute_chain(&self, job: Uuid) {
        let mut prev: Option<String> = None;
        let mut sql = String::new();
        for mut e in self.events_of(job).await {
            e.prev_hash = prev.clone();
            let h = e.stored_hash();
            sql.push_str(&format!(
                "UPDATE jobledger.events SET prev_hash = {}, hash = '{h}' WHERE position = {};",
                prev.as_ref().map_or("NULL".into(), |p| format!("'{p}'")),
                e.position
            ));
            prev = Some(h);
        }
        sql.push_str(&format!(
            "UPDATE jobledger.jobs SET last_hash = '{}' WHERE job_id = '{job}';",
            prev.unwrap()
        ));
        self.around(&sql).await;
    }
}

pub fn audit(files: &[PathBuf], key: Option<VerifyingKey>) -> Vec<Finding> {
    let mut found = vec![];
    let mut a = Auditor::new(key, |f| found.push(f.clone()));
    for f in files {
        a.segment(f).unwrap();
    }
    a.finish();
    found
}

/// 100 jobs (over 256 events: a stored block) through claims, results, failures and observations, then a
/// signed head over all of it.
pub async fn new_kit() -> Kit {
    kit_with(fresh().await, || {}).await
}

/// The kit on `db`; `waiting` is called each time the signing waits for
/// the log horizon.
pub async fn kit_with(db: TestDb, waiting: impl FnMut()) -> Kit {
    let dir = std::env::temp_dir().join(format!("jl-audit-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let (_, public) = jobledger::audit::keys::keygen(&dir.join("key")).unwrap();
    let key = jobledger::audit::keys::signing_key(&dir.join("key")).unwrap();
    let public = jobledger::audit::keys::public_key(&public).unwrap();
    populate(&db).await;
    // The tree reads only below the log horizon, which any transaction of
    // the cluster that cannot yet be told apart from ours holds back (CI saw
    // it: a first head over part of the kit, a second over the rest). The
    // tests name checkpoint versions, so the kit signs one head, over all
    // of it, once the horizon is past its last event.
    let behind = "SELECT count(*) FROM jobledger.events WHERE txid >= jobledger.log_horizon()";
    let (db_ref, waiting) = (&db, std::sync::Mutex::new(waiting));
    let waiting = &waiting;
    eventually("the log horizon past the kit's events", move || async move {
        let past = db_ref.count(behind).await == 0;
        if !past {
            (waiting.lock().unwrap())();
        }
        past
    })
    .await;
    let kit = Kit { db, key, public, dir };
    kit.checkpoint().await;
    kit
}

async fn populate(db: &TestDb) {
    for i in 0..100 {
        db.ledger
            .enqueue(new_job("q", Some(&format!("k{i}")), json!({ "i": i })))
            .await
            .unwrap();
    }
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 100)
        .await
        .unwrap();
    for (i, l) in leases.into_iter().enumerate() {
        let r = match i % 4 {
            0 => l.fail(ErrorClass::Permanent, "declined", None).await,
            1 => {
                l.observe("ack", json!({ "i": i })).await.unwrap();
                l.complete(Some(json!({ "refund": i }))).await
            }
            _ => l.complete(Some(json!({ "refund": i }))).await,
        };
        assert!(r.unwrap().committed());
    }
}

pub async fn job_with(kit: &Kit, kind: &str) -> (Uuid, EventRow) {
    let row: (Uuid,) = sqlx::query_as(&format!(
        "SELECT job_id FROM jobledger.events WHERE type = '{kind}' ORDER BY position LIMIT 1"
    ))
    .fetch_one(kit.db.ledger.pool())
    .await
    .unwrap();
    let ev = kit
        .events_of(row.0)
        .await
        .into_iter()
        .find(|e| e.kind == kind)
        .unwrap();
    (row.0, ev)
}
