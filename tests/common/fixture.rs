//! The version-1 fixture log (tests/fixtures/log-v1, made by
//! tests/fixture_log.rs) loaded into a test database.

use super::TestDb;
use serde_json::Value;

pub const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/log-v1");

fn read(name: &str) -> Value {
    let text = std::fs::read_to_string(format!("{DIR}/{name}")).unwrap();
    Value::Array(text.lines().map(|l| serde_json::from_str(l).unwrap()).collect())
}

/// Loads the fixture's rows as they were stored (positions included: an
/// annotation names the position it corrects), around the triggers: the
/// projection rows are the old code's, not written by today's write path.
pub async fn load(db: &TestDb) {
    let mut tx = db.ledger.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    // The columns the old rows have: a column added since (the schema
    // version) takes its default, as it did for the rows of a real upgrade.
    let events = read("events.ndjson");
    let cols: Vec<String> = events[0].as_object().unwrap().keys().cloned().collect();
    let cols = cols.join(", ");
    sqlx::query(&format!(
        "INSERT INTO jobledger.events ({cols}) OVERRIDING SYSTEM VALUE \
         SELECT {cols} FROM jsonb_populate_recordset(NULL::jobledger.events, $1)"
    ))
    .bind(events)
    .execute(&mut *tx)
    .await
    .unwrap();
    let cols = jobledger::store::rows::JOB_COLUMNS;
    sqlx::query(&format!(
        "INSERT INTO jobledger.jobs ({cols}) SELECT {cols} FROM jsonb_populate_recordset(NULL::jobledger.jobs, $1)"
    ))
    .bind(read("jobs.ndjson"))
    .execute(&mut *tx)
    .await
    .unwrap();
    // Positions and epochs go on after the old ones, as in the old database.
    sqlx::query(
        "SELECT setval(pg_get_serial_sequence('jobledger.events', 'position'), (SELECT max(position) FROM jobledger.events)), \
                setval('jobledger.epoch_seq', (SELECT max(epoch) FROM jobledger.events))",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query("INSERT INTO jobledger.tombstones SELECT * FROM jsonb_populate_recordset(NULL::jobledger.tombstones, $1)")
        .bind(read("tombstones.ndjson"))
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}
