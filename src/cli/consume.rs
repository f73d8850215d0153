//! `jobledger consume status-mirror|audit-log` and `verify --audit-log`.

use anyhow::{Context, Result};
use serde_json::json;
use std::collections::HashMap;

use super::output::{self, line};
use jobledger::ledger::Ledger;
use jobledger_consumers::shipped::{AuditLog, StatusMirror};
use jobledger_consumers::{ConsumerConfig, FencedConsumer};

async fn consumer_pool(url: &str) -> Result<sqlx::PgPool> {
    // The consumer's database is its own; create it like `migrate` does.
    jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(url)?).await?;
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .context("consumer database")
}

pub async fn run(which: &str, brokers: &str, topic: &str, group: Option<&str>, db: &str) -> Result<i32> {
    let pool = consumer_pool(db).await?;
    let group = group.map_or_else(|| format!("jobledger-{which}"), str::to_string);
    let cfg = ConsumerConfig {
        brokers: brokers.into(),
        group: group.clone(),
        topic: topic.into(),
    };
    let consumer = FencedConsumer::new(cfg, pool)
        .await
        .map_err(|e| anyhow::anyhow!("consumer: {e}"))?;
    let stop = tokio_util::sync::CancellationToken::new();
    jobledger::worker::cancel_on_signals(stop.clone());
    eprintln!("consume {which}: group {group} on {brokers} topic {topic}");
    match which {
        "status-mirror" => consumer.run(&StatusMirror, stop).await?,
        _ => consumer.run(&AuditLog, stop).await?,
    }
    line(&consumer.counters().snapshot());
    Ok(output::OK)
}

/// Checks an audit-log consumer's copy: every event's hash recomputes, each
/// links to its predecessor, and each equals the ledger's event of the same
/// (job, version). A ledger event missing from the copy while a later
/// version of its job is there is a gap (a problem, one line each); missing
/// events past the copy's last version of a job are counted as not yet
/// delivered.
pub async fn verify_audit_log(ledger: &Ledger, url: &str) -> Result<i32> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .context("audit database")?;
    let rows = jobledger_consumers::shipped::audit_rows(&pool).await?;
    let mut problems = 0u64;
    let mut copied: HashMap<(uuid::Uuid, i64), String> = HashMap::new();
    let mut prev: Option<(uuid::Uuid, i64, String)> = None;
    for body in &rows {
        let Some(ev) = jobledger::relay::message::row_of(body) else {
            problems += 1;
            line(&json!({ "problem": { "detail": "unreadable audit row", "body": body } }));
            continue;
        };
        let recomputed = ev.stored_hash();
        let linked = match &prev {
            Some((job, v, h)) if *job == ev.job_id && *v + 1 == ev.version => {
                ev.prev_hash.as_deref() == Some(h.as_str())
            }
            // A first event, or a predecessor missing from the copy (counted below).
            _ => true,
        };
        if recomputed != ev.hash || !linked {
            problems += 1;
            line(&json!({ "problem": { "job_id": ev.job_id, "version": ev.version,
                                       "detail": if recomputed != ev.hash { "hash mismatch" } else { "chain link broken" } } }));
        }
        prev = Some((ev.job_id, ev.version, ev.hash.clone()));
        copied.insert((ev.job_id, ev.version), ev.hash);
    }
    let mut highest: HashMap<uuid::Uuid, i64> = HashMap::new();
    for (job, version) in copied.keys() {
        let h = highest.entry(*job).or_insert(0);
        *h = (*h).max(*version);
    }
    let (mut missing, mut gaps) = (0u64, 0u64);
    for (job, version, hash) in ledger.all_event_hashes().await? {
        match copied.get(&(job, version)) {
            Some(h) if *h == hash => {}
            Some(_) => {
                problems += 1;
                line(
                    &json!({ "problem": { "job_id": job, "version": version, "detail": "differs from the ledger" } }),
                );
            }
            None if highest.get(&job).is_some_and(|h| *h > version) => {
                problems += 1;
                gaps += 1;
                line(&json!({ "problem": { "job_id": job, "version": version,
                                           "detail": "gap: missing from the audit copy, which holds later versions" } }));
            }
            None => missing += 1,
        }
    }
    let ok = problems == 0 && missing == 0;
    line(
        &json!({ "ok": ok, "audit_events": rows.len(), "problems": problems, "gaps": gaps, "missing": missing }),
    );
    Ok(if ok { output::OK } else { output::FAILURE })
}
