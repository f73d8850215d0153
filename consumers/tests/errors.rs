//! Which handler errors retry and which dead-letter, classified from real
//! PostgreSQL errors (not hand-made SQLSTATEs).

use jobledger_consumers::consumer::{transient_db, HandlerError};
use sqlx::Connection;

async fn error_of(sql: &str) -> sqlx::Error {
    let url = std::env::var("JOBLEDGER_TEST_SERVER")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let mut c = sqlx::PgConnection::connect(&format!("{url}/postgres"))
        .await
        .expect("connect");
    sqlx::raw_sql(sql).execute(&mut c).await.expect_err(sql)
}

/// A revoked grant or a missing table is the same for every message: the
/// consumer must wait for it to be fixed, not dead-letter the whole stream
/// (issue 9 review).
#[tokio::test]
async fn a_schema_or_permission_error_retries() {
    let missing = error_of("SELECT * FROM jobledger_consumer_no_such_table").await;
    assert!(transient_db(&missing), "42P01 retries: {missing}");
    let denied = error_of(
        // PostgreSQL 15 grants nobody CREATE on `public`.
        "BEGIN; SET LOCAL ROLE pg_read_all_stats; CREATE TABLE public.jobledger_denied (x int)",
    )
    .await;
    assert!(transient_db(&denied), "42501 retries: {denied}");
    assert!(HandlerError::Db(denied).is_transient());
}

/// A value this message carries that the handler's table refuses fails the
/// same way every time: dead-lettered, the consumer goes on.
#[tokio::test]
async fn a_data_error_is_dead_lettered() {
    let bad_value = error_of("SELECT 'not a uuid'::uuid").await;
    assert!(!transient_db(&bad_value), "22P02 is the message's: {bad_value}");
    let null = error_of("BEGIN; CREATE TEMP TABLE t (x int NOT NULL); INSERT INTO t VALUES (NULL)").await;
    assert!(!transient_db(&null), "23502 is the message's: {null}");
    assert!(!HandlerError::Poison("no".into()).is_transient());
}
