//! The domain: ids, states, events, reason codes and the pure transition
//! functions. No I/O here; everything else calls into it, and `verify` replays
//! the log through it.

pub mod admission;
pub mod apply;
pub mod checkpoint;
pub mod command;
pub mod decide;
pub mod digest;
pub mod event;
pub mod fence;
pub mod merkle;
pub mod model;
mod operator;
pub mod queue;
pub mod reason;
pub mod schedule;
pub mod schema;
mod steps;
pub mod workflow;

pub use apply::{apply, edge_allowed, ApplyError};
pub use command::{Command, Ctx, Fence, NewJob, Outcome, Rejection};
pub use decide::{decide, decide_enqueue, decide_enqueue_tied};
pub use digest::{canonical_json, digest, event_hash};
pub use event::{Event, EventBody};
pub use model::{
    ErrorClass, ExpiryPolicy, Job, JobState, LastError, NextAction, Policy, ReceiptPolicy, ReceiptStatus,
    Release, ReleaseOp,
};
pub use reason::Reason;
