//! Workflows on the one write path: creation in the caller's transaction,
//! and what follows a step's edge in the same transaction (the parent's
//! event, the release or cancel of the steps waiting for it).
//!
//! Lock order (no deadlock between two steps of one parent finishing at
//! once, or a step finishing while another is cancelled): a transaction
//! locks the step(s) it writes, then their parents in id order, then the
//! waiting dependents in id order. A waiting step's row is only ever locked
//! by a transaction that holds its parent's row: `cancel` and
//! `release_hold` of a waiting step lock the parent first.

use serde::Serialize;
use sqlx::PgConnection;
use std::collections::HashMap;
use uuid::Uuid;

use super::engine::{self, WriteResult};
use super::enqueue::Enqueued;
use super::error::{LedgerError, LedgerResult};
use super::Ledger;
use crate::domain::workflow::{self, FanIn, Membership, StepLink, StepRef, WorkflowSpec, WorkflowTie};
use crate::domain::{digest, Command, Job, JobState, NewJob, Outcome, Policy};
use crate::store::rejections::RejectionRow;
use crate::store::{jobs, workflows};

/// A created (or, for the same spec under the same key, found) workflow.
#[derive(Debug, Clone, Serialize)]
pub struct Created {
    pub parent: Enqueued,
    pub steps: Vec<(String, Enqueued)>,
}

/// A workflow as a person asks about it: the parent and each step's live
/// state, with what a waiting step waits for.
#[derive(Debug, Clone, Serialize)]
pub struct WorkflowView {
    pub parent: Job,
    pub steps: Vec<StepView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepView {
    pub step: String,
    pub job_id: Uuid,
    pub state: JobState,
    pub reason: crate::domain::Reason,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waiting_for: Vec<String>,
}

impl Ledger {
    /// Creates a workflow in its own transaction (retried when a purge of a
    /// reused key raced the epoch draw, like `enqueue`).
    pub async fn workflow(&self, spec: &WorkflowSpec) -> LedgerResult<Created> {
        self.workflow_as(spec, "api").await
    }

    /// `workflow`, with `actor` (an API token's name) recorded in every
    /// `enqueued` event it writes.
    pub async fn workflow_as(&self, spec: &WorkflowSpec, actor: &str) -> LedgerResult<Created> {
        self.limits.name("actor", actor)?;
        let mut tries = 0;
        loop {
            let mut tx = self.pool.begin().await?;
            match self.workflow_in_as(&mut tx, spec, actor).await {
                Ok(c) => {
                    tx.commit().await?;
                    return Ok(c);
                }
                Err(e) if e.is_retryable() && tries < 5 => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Creates the parent and every step inside the caller's transaction:
    /// all of it exists exactly when the caller commits. On an error the
    /// caller must roll back (the parent may already be written).
    pub async fn workflow_in(&self, conn: &mut PgConnection, spec: &WorkflowSpec) -> LedgerResult<Created> {
        self.workflow_in_as(conn, spec, "api").await
    }

    async fn workflow_in_as(
        &self,
        conn: &mut PgConnection,
        spec: &WorkflowSpec,
        actor: &str,
    ) -> LedgerResult<Created> {
        let order = workflow::check(spec).map_err(|e| LedgerError::BadInput(e.to_string()))?;
        // The parent like any job (queue, name, key), before any query uses them.
        self.check_new(&parent_job(spec))?;
        for s in &spec.steps {
            self.limits.name("step name", &s.name)?;
        }
        if let Some(f) = &spec.finally {
            self.limits.name("step name", &f.name)?;
            // The fan-in's job is created later, by the ledger: what it will
            // be is checked now, like any job's.
            self.check_new(&NewJob {
                queue: f.queue.clone().unwrap_or_else(|| spec.queue.clone()),
                kind: f.kind.clone(),
                job_key: None,
                payload: serde_json::Value::Null,
                priority: f.priority,
                run_at: None,
                delay_ms: None,
                policy: f.policy.clone(),
                concurrency_key: None,
                unique_for_ms: None,
            })?;
        }
        self.keys_are_free(conn, spec).await?;
        let parent_id = Uuid::now_v7();
        let ids: Vec<Uuid> = spec.steps.iter().map(|_| Uuid::now_v7()).collect();
        let parent_tie = WorkflowTie::Parent {
            steps: spec
                .steps
                .iter()
                .zip(&ids)
                .map(|(s, id)| StepRef {
                    step: s.name.clone(),
                    job_id: *id,
                })
                .collect(),
            fan_in: spec.finally.as_ref().map(|f| FanIn {
                step: f.name.clone(),
                job_id: Uuid::now_v7(),
                queue: f.queue.clone().unwrap_or_else(|| spec.queue.clone()),
                kind: f.kind.clone(),
                priority: f.priority,
                policy: f.policy.clone(),
            }),
        };
        let parent = self
            .enqueue_tied_in(conn, vec![(parent_job(spec), parent_id, parent_tie)], actor)
            .await?
            .pop()
            .expect("one in, one out");
        if !parent.created {
            let steps = self.existing_steps(conn, parent.job.job_id).await?;
            return Ok(Created { parent, steps });
        }
        let ties = step_ties(spec, parent_id, &ids);
        let news: Vec<(NewJob, Uuid, WorkflowTie)> = order
            .iter()
            .map(|&i| (step_job(spec, i), ids[i], ties[i].clone()))
            .collect();
        let created = self.enqueue_tied_in(conn, news, actor).await?;
        let mut steps = Vec::with_capacity(created.len());
        for (&i, e) in order.iter().zip(created) {
            if !e.created {
                return Err(LedgerError::BadInput(format!(
                    "step {:?}: key {:?} already names job {} in queue {:?}",
                    spec.steps[i].name,
                    e.job.job_key.as_deref().unwrap_or(""),
                    e.job.job_id,
                    e.job.queue
                )));
            }
            steps.push((spec.steps[i].name.clone(), e));
        }
        Ok(Created { parent, steps })
    }

    /// Step keys are refused before anything is written: one used twice in
    /// the spec, or already naming a job (a concurrent enqueue of the same
    /// key can still win the race; then the insert refuses it and the
    /// caller must roll back).
    async fn keys_are_free(&self, conn: &mut PgConnection, spec: &WorkflowSpec) -> LedgerResult<()> {
        if let Some(k) = &spec.key {
            if jobs::find_job_by_key(&mut *conn, &spec.queue, k).await?.is_some() {
                return Ok(()); // the same workflow again (its steps hold these keys), or a conflict
            }
        }
        let mut seen = std::collections::HashSet::new();
        let (mut queues, mut keys) = (vec![], vec![]);
        for s in &spec.steps {
            let Some(k) = &s.key else { continue };
            let q = s.queue.clone().unwrap_or_else(|| spec.queue.clone());
            if !seen.insert((q.clone(), k.clone())) {
                return Err(LedgerError::BadInput(format!(
                    "step {:?}: key {k:?} in queue {q:?} is used by another step of this workflow",
                    s.name
                )));
            }
            queues.push(q);
            keys.push(k.clone());
        }
        if let Some((q, k, id)) = workflows::jobs_holding_keys(&mut *conn, &queues, &keys)
            .await?
            .first()
        {
            return Err(LedgerError::BadInput(format!(
                "key {k:?} in queue {q:?} already names job {id}"
            )));
        }
        Ok(())
    }

    async fn existing_steps(
        &self,
        conn: &mut PgConnection,
        parent: Uuid,
    ) -> LedgerResult<Vec<(String, Enqueued)>> {
        let mut out = vec![];
        for row in workflows::steps_of(&mut *conn, parent).await? {
            let job = Job::try_from(row)?;
            let name = match &job.workflow {
                Some(Membership::Step(l)) => l.step.clone(),
                _ => continue,
            };
            out.push((
                name,
                Enqueued {
                    job,
                    created: false,
                    position: None,
                },
            ));
        }
        Ok(out)
    }

    /// The parent and its steps as they are now.
    pub async fn workflow_view(&self, parent: Uuid) -> LedgerResult<WorkflowView> {
        let row = jobs::find_job(&self.pool, parent)
            .await?
            .ok_or(LedgerError::NotFound(parent))?;
        let parent_job = Job::try_from(row)?;
        if !matches!(parent_job.workflow, Some(Membership::Parent { .. })) {
            return Err(LedgerError::BadInput(format!("job {parent} is not a workflow")));
        }
        // Every step the parent lists, also one already purged (its state
        // from the tombstone, its reason from its last event before that).
        let members = workflows::members_of(&self.pool, parent).await?;
        let ids: Vec<Uuid> = members.iter().map(|(id, _)| *id).collect();
        let mut ends: HashMap<Uuid, (JobState, crate::domain::Reason)> = HashMap::new();
        for (id, state, reason) in workflows::ends_of(&self.pool, &ids).await? {
            if let (Some(s), Some(r)) = (JobState::parse(&state), crate::domain::Reason::parse(&reason)) {
                ends.insert(id, (s, r));
            }
        }
        let links: HashMap<Uuid, StepLink> = workflows::steps_of(&self.pool, parent)
            .await?
            .into_iter()
            .filter_map(|row| {
                let job = Job::try_from(row).ok()?;
                match job.workflow {
                    Some(Membership::Step(l)) => Some((job.job_id, l)),
                    _ => None,
                }
            })
            .collect();
        let mut views: Vec<StepView> = members
            .iter()
            .filter_map(|(id, step)| {
                // A fan-in not created yet has no state of its own.
                let (state, reason) = *ends.get(id)?;
                let waiting_for = match (state, links.get(id)) {
                    (JobState::Waiting, Some(l)) => unmet(l, |p| ends.get(&p).map(|(s, _)| *s)),
                    _ => vec![],
                };
                Some(StepView {
                    step: step.clone(),
                    job_id: *id,
                    state,
                    reason,
                    waiting_for,
                })
            })
            .collect();
        views.sort_by(|a, b| a.step.cmp(&b.step));
        Ok(WorkflowView {
            parent: parent_job,
            steps: views,
        })
    }

    /// Cancels every open step of a workflow, each with the usual cancel
    /// semantics (before start: cancelled; running: cancel requested, then
    /// confirmed by its worker; awaiting a receipt: refused, recorded as
    /// `cancel_after_submit`), after recording the request on the parent.
    /// Waiting steps go first, so none is released meanwhile. Each step is
    /// its own transaction; a run cut short is finished by running it again.
    pub async fn cancel_workflow(&self, parent: Uuid, note: Option<&str>) -> LedgerResult<Vec<WriteResult>> {
        self.cancel_workflow_as(parent, "api", note).await
    }

    /// `cancel_workflow`, recording `actor` (an operator's token) on the
    /// parent's request and on every step's cancel.
    pub async fn cancel_workflow_as(
        &self,
        parent: Uuid,
        actor: &str,
        note: Option<&str>,
    ) -> LedgerResult<Vec<WriteResult>> {
        if let Some(n) = note {
            // The steps' cancels check their note with `typed`: check it the
            // same way before the parent's request is written.
            self.limits.text("reason", n)?;
            super::validate::typed("reason", n)?;
        }
        let cmd = Command::CancelWorkflow {
            note: note.map(Into::into),
        };
        let first = engine::run_transition(&self.pool, parent, actor, cmd).await?;
        if !matches!(first.outcome, Outcome::Committed | Outcome::AlreadyCommitted) {
            return Ok(vec![first]);
        }
        let mut open: Vec<Job> = workflows::steps_of(&self.pool, parent)
            .await?
            .into_iter()
            .map(Job::try_from)
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .filter(|j| !j.state.is_terminal())
            .collect();
        open.sort_by_key(|j| j.state != JobState::Waiting);
        let mut out = vec![first];
        for j in open {
            out.push(self.cancel_as(j.job_id, actor, note).await?);
        }
        Ok(out)
    }

    /// For a waiting step: the prerequisites that have not succeeded (what
    /// `show` says it waits for). Empty for anything else.
    pub async fn waiting_for(&self, job: &Job) -> LedgerResult<Vec<String>> {
        let Some(Membership::Step(l)) = &job.workflow else {
            return Ok(vec![]);
        };
        if job.state != JobState::Waiting {
            return Ok(vec![]);
        }
        let ids: Vec<Uuid> = l.after.iter().map(|r| r.job_id).collect();
        let states: HashMap<Uuid, JobState> = workflows::states_of(&self.pool, &ids)
            .await?
            .into_iter()
            .filter_map(|(id, s)| Some((id, JobState::parse(&s)?)))
            .collect();
        Ok(unmet(l, |p| states.get(&p).copied()))
    }

    /// For `history PARENT`: every step named in the parent's first event
    /// (the fan-in too), with the steps' events and refused writes, so the
    /// parent's edges and its steps' read interleaved in time. Empty for a
    /// job that is no workflow.
    pub async fn workflow_members(
        &self,
        first: &crate::domain::Event,
    ) -> LedgerResult<Vec<(StepRef, Vec<super::HistoryEntry>, Vec<RejectionRow>)>> {
        let crate::domain::EventBody::Enqueued {
            workflow: Some(tie), ..
        } = &first.body
        else {
            return Ok(vec![]);
        };
        let WorkflowTie::Parent { steps, fan_in } = tie.as_ref() else {
            return Ok(vec![]);
        };
        let mut members = steps.clone();
        members.extend(fan_in.iter().map(|f| StepRef {
            step: f.step.clone(),
            job_id: f.job_id,
        }));
        let ids: Vec<Uuid> = members.iter().map(|m| m.job_id).collect();
        let mut events: HashMap<Uuid, Vec<super::HistoryEntry>> = HashMap::new();
        for r in crate::store::events::events_of(&self.pool, &ids).await? {
            let entry = super::HistoryEntry {
                position: r.position,
                event: r.to_event()?,
            };
            events.entry(entry.event.job_id).or_default().push(entry);
        }
        let mut refused: HashMap<Uuid, Vec<RejectionRow>> = HashMap::new();
        for r in crate::store::rejections::rejections_of(&self.pool, &ids).await? {
            refused.entry(r.job_id).or_default().push(r);
        }
        Ok(members
            .into_iter()
            .map(|m| {
                let e = events.remove(&m.job_id).unwrap_or_default();
                let r = refused.remove(&m.job_id).unwrap_or_default();
                (m, e, r)
            })
            .collect())
    }

    /// Lets a step held by its `hold` policy run after all.
    pub async fn release_hold(&self, job_id: Uuid, operator: &str, note: &str) -> LedgerResult<WriteResult> {
        self.limits.name("operator", operator)?;
        self.limits.name("reason", note)?;
        // The prerequisites' states are read under the locks (`transition_in`).
        let cmd = Command::ReleaseHold {
            operator: operator.into(),
            note: note.into(),
            prerequisites: vec![],
        };
        engine::run_transition(&self.pool, job_id, &format!("operator:{operator}"), cmd).await
    }
}

/// The prerequisites of a step that have not succeeded (`state` of each,
/// `None` when unknown): what `show` says it waits for.
fn unmet(link: &StepLink, state: impl Fn(Uuid) -> Option<JobState>) -> Vec<String> {
    link.after
        .iter()
        .filter(|r| state(r.job_id) != Some(JobState::Succeeded))
        .map(|r| r.step.clone())
        .collect()
}

fn parent_job(spec: &WorkflowSpec) -> NewJob {
    let spec_json = serde_json::to_value(spec).expect("a spec serialises");
    NewJob {
        queue: spec.queue.clone(),
        kind: spec.name.clone(),
        job_key: spec.key.clone(),
        // The request's digest makes the key idempotent for the same spec
        // and a conflict for another; the input is the caller's payload.
        payload: serde_json::json!({ "input": spec.payload, "spec_digest": digest(&spec_json) }),
        priority: 0,
        run_at: None,
        delay_ms: None,
        // A parent is never claimed; a fixed policy keeps it from picking
        // up a kind policy registered for its name.
        policy: Some(Policy::default()),
        concurrency_key: None,
        unique_for_ms: None,
    }
}

fn step_job(spec: &WorkflowSpec, i: usize) -> NewJob {
    let s = &spec.steps[i];
    NewJob {
        queue: s.queue.clone().unwrap_or_else(|| spec.queue.clone()),
        kind: s.kind.clone(),
        job_key: s.key.clone(),
        payload: s.payload.clone(),
        priority: s.priority,
        run_at: None,
        delay_ms: None,
        policy: s.policy.clone(),
        concurrency_key: None,
        unique_for_ms: None,
    }
}

fn step_ties(spec: &WorkflowSpec, parent: Uuid, ids: &[Uuid]) -> Vec<WorkflowTie> {
    let index: HashMap<&str, usize> = spec
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let mut then: Vec<Vec<Uuid>> = vec![vec![]; spec.steps.len()];
    for (i, s) in spec.steps.iter().enumerate() {
        for a in &s.after {
            then[index[a.as_str()]].push(ids[i]);
        }
    }
    spec.steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            WorkflowTie::Step(StepLink {
                parent,
                step: s.name.clone(),
                after: s
                    .after
                    .iter()
                    .map(|a| StepRef {
                        step: a.clone(),
                        job_id: ids[index[a.as_str()]],
                    })
                    .collect(),
                then: std::mem::take(&mut then[i]),
                on_dependency_failure: s.on_dependency_failure,
            })
        })
        .collect()
}
