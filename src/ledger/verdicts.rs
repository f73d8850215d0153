//! A person's manual fixes, as edges of the state machine (never table
//! edits): a verdict on a job nothing else will finish, and a correction
//! appended beside an earlier event.

use serde_json::Value;
use uuid::Uuid;

use super::engine::WriteResult;
use super::error::{LedgerError, LedgerResult};
use super::Ledger;
use crate::domain::{Command, JobState};
use crate::store::events;

impl Ledger {
    /// Records an operator's verdict (`succeeded` or `cancelled`) on a job
    /// that is `dead` or `awaiting_receipt`, with the reason and the evidence
    /// they checked by hand. `expected_version` is the version they looked
    /// at: if the job moved since (another operator resolved it first, a
    /// receipt arrived), the write is refused as stale and recorded.
    pub async fn resolve(
        &self,
        job_id: Uuid,
        operator: &str,
        verdict: JobState,
        note: &str,
        evidence: Value,
        expected_version: i64,
    ) -> LedgerResult<WriteResult> {
        self.limits.name("operator", operator)?;
        self.limits.name("reason", note)?;
        super::validate::typed("operator", operator)?;
        super::validate::typed("reason", note)?;
        self.limits.json("evidence", &evidence)?;
        if evidence.as_object().is_none_or(|o| o.is_empty()) {
            return Err(LedgerError::BadInput(
                "evidence is a JSON object saying what was checked (not empty)".into(),
            ));
        }
        if expected_version < 1 {
            return Err(LedgerError::BadInput(format!(
                "version {expected_version}: a job's versions start at 1"
            )));
        }
        if !matches!(verdict, JobState::Succeeded | JobState::Cancelled) {
            return Err(LedgerError::BadInput(format!(
                "a verdict is succeeded or cancelled, not {verdict}"
            )));
        }
        let cmd = Command::ResolveByOperator {
            operator: operator.into(),
            verdict,
            note: note.into(),
            evidence,
            expected_version,
        };
        self.transition(job_id, &format!("operator:{operator}"), cmd)
            .await
    }

    /// Appends a correction of the event at log position `corrects`, which
    /// must be one of this job's: it changes no state, and the timeline
    /// shows it beside the event it corrects.
    pub async fn annotate(
        &self,
        job_id: Uuid,
        operator: &str,
        corrects: i64,
        note: &str,
    ) -> LedgerResult<WriteResult> {
        self.limits.name("operator", operator)?;
        self.limits.name("reason", note)?;
        super::validate::typed("operator", operator)?;
        super::validate::typed("reason", note)?;
        let version = match events::event_at(self.pool(), corrects).await? {
            Some((owner, version)) if owner == job_id => version,
            Some((owner, _)) => {
                return Err(LedgerError::BadInput(format!(
                    "position {corrects} is an event of job {owner}, not of {job_id}"
                )))
            }
            None => return Err(LedgerError::BadInput(format!("no event at position {corrects}"))),
        };
        let cmd = Command::Annotate {
            operator: operator.into(),
            corrects_position: corrects,
            corrects_version: version,
            note: note.into(),
        };
        self.transition(job_id, &format!("operator:{operator}"), cmd)
            .await
    }
}
