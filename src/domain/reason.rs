//! Stable reason codes. Sent to the log and to Kafka; a code once published
//! keeps its meaning forever. New situations get new codes.

use super::model::wire_enum;

wire_enum!(
    /// Why a transition happened. Matched on in code, never on text.
    Reason {
        New => "new",
        Claimed => "claimed",
        LeaseExpiredTakeover => "lease_expired_takeover",
        LeaseExtended => "lease_extended",
        StepProgress => "step_progress",
        Completed => "completed",
        CancelAfterSubmit => "cancel_after_submit",
        Submitted => "submitted",
        ReceiptSucceeded => "receipt_succeeded",
        ReceiptFailed => "receipt_failed",
        ReceiptPending => "receipt_pending",
        ReceiptTimeout => "receipt_timeout",
        ReceiptTimeoutReconcile => "receipt_timeout_reconcile",
        RetryScheduled => "retry_scheduled",
        PermanentError => "permanent_error",
        AttemptsExhausted => "attempts_exhausted",
        CancelledBeforeStart => "cancelled_before_start",
        CancelRequested => "cancel_requested",
        CancelConfirmed => "cancel_confirmed",
        CancelledAfterFailure => "cancelled_after_failure",
        CancelledLeaseExpired => "cancelled_lease_expired",
        ReplayedByOperator => "replayed_by_operator",
        Observation => "observation",
        LeaseExpiredRequeued => "lease_expired_requeued",
        LeaseExpiredUncertain => "lease_expired_uncertain",
        ReleasedUnstarted => "released_unstarted",
        Snoozed => "snoozed",
        Purged => "purged",
        WorkflowStarted => "workflow_started",
        WaitingForDependencies => "waiting_for_dependencies",
        DependenciesMet => "dependencies_met",
        DependencyFailed => "dependency_failed",
        DependencyFailedRun => "dependency_failed_run",
        DependencyHeld => "dependency_held",
        HoldReleased => "hold_released",
        StepFinished => "step_finished",
        StepReopened => "step_reopened",
        ResolvedByOperator => "resolved_by_operator",
    }
);

impl Reason {
    /// Whether a queued job can carry this reason (the reason of its last
    /// event): every transition into `queued`, and the events that keep a
    /// job's state and may befall a queued job (a purge only befalls ended
    /// jobs and deletes the row; an operator's verdict is succeeded or
    /// cancelled). Job search leaves the queued jobs out of a search by any
    /// other reason without reading them (a queued job is found only by
    /// walking the queued jobs; issue 15). The property tests check after
    /// every event they apply that no queued job carries a reason outside
    /// it; an entry too many would only cost such a search its speed.
    pub fn may_be_queued(self) -> bool {
        matches!(
            self,
            Reason::New
                | Reason::RetryScheduled
                | Reason::ReceiptFailed
                | Reason::ReceiptTimeoutReconcile
                | Reason::LeaseExpiredRequeued
                | Reason::ReleasedUnstarted
                | Reason::Snoozed
                | Reason::ReplayedByOperator
                | Reason::DependenciesMet
                | Reason::DependencyFailedRun
                | Reason::HoldReleased
                | Reason::Observation
        )
    }
}
