//! `workflows`: the tree of every workflow, one row per parent and per
//! step, with each one's current state, for UIs and downstream teams. Built
//! from the log alone: a parent's and a step's `enqueued` event say where
//! they belong; every later event moves that row's state. Idempotent per
//! (job, version), so redelivered events change nothing.

use serde_json::Value;
use sqlx::PgConnection;
use std::collections::HashMap;
use uuid::Uuid;

use crate::{BoxFuture, Event, Projection};

pub struct Workflows;

/// `(workflow_id, step)` of a job, from its `enqueued` event: the parent is
/// its own workflow with no step name.
fn tie(e: &Event) -> Option<(Uuid, Option<String>)> {
    let w = e.data.get("workflow")?;
    match w.get("role").and_then(Value::as_str)? {
        "parent" => Some((e.job_id, None)),
        "step" => Some((
            w.get("parent")?.as_str()?.parse().ok()?,
            Some(w.get("step")?.as_str()?.to_string()),
        )),
        _ => None,
    }
}

impl Projection for Workflows {
    fn name(&self) -> &str {
        "workflows"
    }
    fn version(&self) -> i32 {
        1
    }
    /// The workflow tie and kind, from each job's `enqueued` event.
    fn data_of(&self) -> Option<&'static [&'static str]> {
        Some(&["enqueued"])
    }
    fn data_keys(&self) -> Option<&'static [&'static str]> {
        Some(&["workflow", "kind"])
    }
    fn reads_hashes(&self) -> bool {
        false
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (workflow_id uuid NOT NULL, step text, job_id uuid PRIMARY KEY, \
                 kind text NOT NULL, state text NOT NULL, reason text NOT NULL, version bigint NOT NULL, \
                 updated_at timestamptz NOT NULL)"
            ))
            .execute(&mut *tx)
            .await?;
            // The tree of one workflow is one index range.
            sqlx::query(&format!("CREATE INDEX ON {table} (workflow_id)"))
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
            let (mut w, mut s, mut j, mut k) = (vec![], vec![], vec![], vec![]);
            let mut last: HashMap<Uuid, &Event> = HashMap::new();
            for e in events {
                if e.kind == "enqueued" {
                    if let Some((wf, step)) = tie(e) {
                        w.push(wf);
                        s.push(step);
                        j.push(e.job_id);
                        k.push(
                            e.data
                                .get("kind")
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_string(),
                        );
                    }
                }
                let newer = last.get(&e.job_id).is_none_or(|l| l.version < e.version);
                if newer {
                    last.insert(e.job_id, e);
                }
            }
            if !j.is_empty() {
                // A new row starts at version 0, so the update below moves it
                // to its latest event like any other.
                sqlx::query(&format!(
                    "INSERT INTO {table} SELECT u.w, u.s, u.j, u.k, 'queued', 'new', 0, now() \
                     FROM UNNEST($1::uuid[], $2::text[], $3::uuid[], $4::text[]) AS u(w, s, j, k) \
                     ON CONFLICT (job_id) DO NOTHING"
                ))
                .bind(&w)
                .bind(&s)
                .bind(&j)
                .bind(&k)
                .execute(&mut *tx)
                .await?;
            }
            let latest: Vec<&Event> = last.into_values().collect();
            sqlx::query(&format!(
                "UPDATE {table} t SET state = u.state, reason = u.reason, version = u.version, updated_at = u.at \
                 FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::timestamptz[]) \
                   AS u(job_id, state, reason, version, at) \
                 WHERE t.job_id = u.job_id AND t.version < u.version"
            ))
            .bind(latest.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(latest.iter().map(|e| e.to_state.clone()).collect::<Vec<_>>())
            .bind(latest.iter().map(|e| e.reason.clone()).collect::<Vec<_>>())
            .bind(latest.iter().map(|e| e.version).collect::<Vec<_>>())
            .bind(latest.iter().map(|e| e.recorded_at).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}
