//! A projection that counts how often each (job, version) was applied. The
//! shipped projections are idempotent per version, so a batch applied twice
//! is invisible in them; here it shows as a 2. Optionally it fails its first
//! batch after writing it (a crash mid-batch).

use jobledger_projections::{BoxFuture, Event, Projection};
use sqlx::PgConnection;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct Counting {
    name: &'static str,
    version: i32,
    crash_first: AtomicBool,
}

impl Counting {
    pub fn new(name: &'static str, version: i32, crash_first: bool) -> Self {
        Counting {
            name,
            version,
            crash_first: AtomicBool::new(crash_first),
        }
    }
}

impl Projection for Counting {
    fn name(&self) -> &str {
        self.name
    }
    fn version(&self) -> i32 {
        self.version
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, applied int NOT NULL, PRIMARY KEY (job_id, version))"
            ))
            .execute(&mut *tx)
            .await?;
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
                "INSERT INTO {table} AS t SELECT j, v, 1 FROM UNNEST($1::uuid[], $2::int8[]) AS u(j, v) \
                 ON CONFLICT (job_id, version) DO UPDATE SET applied = t.applied + 1"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            if self.crash_first.swap(false, Ordering::SeqCst) {
                return Err(sqlx::Error::Protocol("crash after writing half a batch".into()));
            }
            Ok(())
        })
    }
}
