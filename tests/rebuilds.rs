//! Issue 10 item 4: a rebuild whose process died resumes from its own
//! checkpoint (it neither starts over nor skips), with a projection that
//! counts every application, so a double apply cannot hide.

mod common;

use common::counting::Counting;
use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::runner::Runner;
use serde_json::json;

fn counts(version: i32) -> Counting {
    Counting::new("counts", version, false)
}

#[tokio::test]
async fn a_crashed_rebuild_resumes_from_its_own_checkpoint() {
    let db = fresh().await;
    for i in 0..10 {
        db.enqueue(Some(&format!("r{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    {
        let first = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
        within("a catch-up", first.catch_up(&[&counts(1)])).await.unwrap();
        let s = first.step(&[&counts(1), &counts(2)]).await.unwrap();
        assert!(s.rebuilt >= 1 && s.switched_to.is_none(), "{s:?}");
        // The process dies here: nothing but the database remembers.
    }
    let building: i64 = db.count("SELECT count(*) FROM jobledger_proj.counts_v2").await;
    assert!(
        (1..10).contains(&building),
        "part of the rebuild is done: {building}"
    );
    let second = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
    let done = within("the resumed rebuild", second.catch_up(&[&counts(1), &counts(2)]))
        .await
        .unwrap();
    assert_eq!(done.switched_to, Some(2));
    let rows: Vec<(i64, i32)> = sqlx::query_as("SELECT version, applied FROM jobledger_proj.counts")
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(rows.len(), 10, "nothing skipped");
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "nothing applied twice: {rows:?}"
    );
}
