//! `tagged`: a test projection whose rows say which version's code wrote
//! them, for the runner's rebuild and version tests.

use jobledger::reader::LogReader;
use jobledger_projections::{BoxFuture, Event, Projection};
use serde_json::json;
use sqlx::PgConnection;
use tokio::sync::{mpsc, Mutex};

/// Version `.0` of a projection named `tagged` whose rows say which
/// version's code wrote them, and the `synchronous_commit` their batch was
/// applied under. When `.1` is armed, its `create` reports
/// (first sender) and waits (second receiver) once, with the table created
/// and its transaction open.
pub type CreateGate = Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>;
pub struct Tagged(pub i32, pub CreateGate);
impl Tagged {
    pub fn new(version: i32) -> Self {
        Tagged(version, Mutex::new(None))
    }
}
impl Projection for Tagged {
    fn name(&self) -> &str {
        "tagged"
    }
    fn version(&self) -> i32 {
        self.0
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, by int, flush text, \
                 PRIMARY KEY (job_id, version))"
            ))
            .execute(&mut *tx)
            .await?;
            let gate = self.1.lock().await.take();
            if let Some((held, mut open)) = gate {
                held.send(()).await.expect("gate");
                open.recv().await.expect("gate");
            }
            Ok(())
        })
    }
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "INSERT INTO {table} SELECT j, v, $3, current_setting('synchronous_commit') \
                 FROM UNNEST($1::uuid[], $2::int8[]) AS u(j, v) ON CONFLICT DO NOTHING"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .bind(self.0)
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

/// (rows, rows written by code of another version than the one serving)
/// of what the view serves, and the serving version.
pub async fn tagged(db: &super::TestDb) -> (i64, i64, i64) {
    let version = db
        .count("SELECT version::int8 FROM jobledger_proj.registry WHERE name = 'tagged'")
        .await;
    let rows = db.count("SELECT count(*) FROM jobledger_proj.tagged").await;
    let foreign = db
        .count(&format!(
            "SELECT count(*) FROM jobledger_proj.tagged WHERE by <> {version}"
        ))
        .await;
    (rows, foreign, version)
}

pub async fn six_jobs(db: &super::TestDb) -> LogReader {
    for i in 0..6 {
        db.enqueue(None, json!({ "i": i })).await;
    }
    LogReader::open(db.ledger.pool().clone(), "tagged").await.unwrap()
}

/// `tagged`'s code under another name.
pub struct Renamed(pub &'static str, pub Tagged);
impl Projection for Renamed {
    fn name(&self) -> &str {
        self.0
    }
    fn version(&self) -> i32 {
        self.1.version()
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        self.1.create(tx, table)
    }
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        self.1.apply(tx, table, events)
    }
}
