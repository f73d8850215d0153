//! What data a projection is handed: that of the kinds of event it names
//! (`Projection::data_of`), of it only the keys it names
//! (`Projection::data_keys`), and the hashes only if it reads them
//! (`Projection::reads_hashes`), through a runner that reads ahead.

mod common;

use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::runner::Runner;
use jobledger_projections::{BoxFuture, Event, Projection};
use serde_json::json;
use sqlx::PgConnection;

/// Records the `data` and hashes it was handed, per (job, version): (kinds,
/// keys, name, hashes).
type Kinds = Option<&'static [&'static str]>;
struct DataSeen(Kinds, Kinds, &'static str, bool);
impl Projection for DataSeen {
    fn name(&self) -> &str {
        self.2
    }
    fn version(&self) -> i32 {
        1
    }
    fn data_of(&self) -> Option<&'static [&'static str]> {
        self.0
    }
    fn data_keys(&self) -> Option<&'static [&'static str]> {
        self.1
    }
    fn reads_hashes(&self) -> bool {
        self.3
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, type text, data jsonb, prev_hash text, hash text, \
                 PRIMARY KEY (job_id, version))"
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
                "INSERT INTO {table} SELECT * FROM UNNEST($1::uuid[], $2::int8[], $3::text[], $4::jsonb[], \
                 $5::text[], $6::text[]) ON CONFLICT DO NOTHING"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.kind.clone()).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.data.clone()).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.prev_hash.clone()).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.hash.clone()).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

/// A projection gets the data of the event kinds it names and JSON null on
/// the others; one that names none gets every event's data as stored. One
/// that names keys gets an object of exactly those keys (null where the
/// data lacks one). One that reads no hashes gets them empty, whatever data
/// it names; the others get them as stored.
#[tokio::test]
async fn a_projection_reads_only_the_data_it_names() {
    let db = fresh().await;
    db.enqueue(None, json!({ "big": "payload" })).await;
    db.claim_one("w")
        .await
        .complete(Some(json!({ "r": 1 })))
        .await
        .unwrap();
    for i in 0..3 {
        db.enqueue(None, json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "data-of")
        .await
        .unwrap();
    // Batches of one: every batch is full, so each is read ahead while the
    // one before it is applied (the read ahead must name the data too).
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 1).await.unwrap();
    let cases: [(&'static str, Kinds, Kinds, bool); 8] = [
        ("seen_all", None, None, true),
        ("seen_enqueued", Some(&["enqueued"]), None, true),
        ("seen_none", Some(&[]), None, true),
        (
            "seen_queue",
            Some(&["enqueued"]),
            Some(&["queue", "absent"]),
            true,
        ),
        ("seen_results", None, Some(&["result"]), true),
        ("seen_no_key", None, Some(&[]), true),
        ("seen_no_hash", Some(&[]), None, false),
        ("seen_all_no_hash", None, None, false),
    ];
    for (name, data_of, keys, hashes) in cases {
        let p = DataSeen(data_of, keys, name, hashes);
        within("a catch-up", runner.catch_up(&[&p])).await.unwrap();
    }
    type Seen = (String, serde_json::Value, Option<String>, Option<String>);
    let stored: Vec<Seen> =
        sqlx::query_as("SELECT type, data, prev_hash, hash FROM jobledger.events ORDER BY job_id, version")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(stored.len(), 6);
    assert!(
        stored.iter().all(|(_, d, _, h)| !d.is_null() && h.is_some()),
        "every event stored data and a hash: {stored:?}"
    );
    for (name, data_of, keys, hashes) in cases {
        let seen: Vec<Seen> = sqlx::query_as(&format!(
            "SELECT type, data, prev_hash, hash FROM jobledger_proj.{name} ORDER BY job_id, version"
        ))
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
        assert_eq!(seen.len(), 6, "{name}: every event, data or not");
        for ((kind, data, prev, hash), (seen_kind, seen_data, seen_prev, seen_hash)) in
            stored.iter().zip(&seen)
        {
            let want = match hashes {
                true => (prev.clone(), hash.clone()),
                false => (None, Some(String::new())),
            };
            assert_eq!(
                (seen_prev.clone(), seen_hash.clone()),
                want,
                "{name}: the hashes of {kind}"
            );
            assert_eq!(kind, seen_kind);
            let named = data_of.is_none_or(|kinds| kinds.contains(&kind.as_str()));
            let want = match keys {
                _ if !named => serde_json::Value::Null,
                None => data.clone(),
                Some(keys) => keys
                    .iter()
                    .map(|k| (k.to_string(), data.get(k).cloned().unwrap_or_default()))
                    .collect(),
            };
            assert_eq!(seen_data, &want, "{name}: the data of the {kind} event");
        }
    }
}
