//! Workflows, as pure rules: a parent job whose named steps are real jobs.
//! The spec and its checks, how a step and its parent are tied together in
//! their `enqueued` events, the parent's tally and the one rule table that
//! turns it into the parent's state, and when a waiting step may go.
//! No I/O; the ledger (`ledger::workflow`) calls these under the locks.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{HashMap, HashSet, VecDeque};
use thiserror::Error;
use uuid::Uuid;

use super::model::{wire_enum, JobState, Policy};

/// More steps than this is refused: the parent's creation is one
/// transaction and its first event lists every step.
pub const MAX_STEPS: usize = 10_000;

wire_enum!(
    /// What a waiting step does when a prerequisite ends `dead` or
    /// `cancelled`.
    DependencyPolicy {
        Cancel => "cancel",
        Run => "run",
        Hold => "hold",
    }
);

// `wire_enum!` cannot put `#[default]` on a variant.
#[allow(clippy::derivable_impls)]
impl Default for DependencyPolicy {
    fn default() -> Self {
        DependencyPolicy::Cancel
    }
}

wire_enum!(
    /// A step as its parent counts it: still open, or how it ended.
    StepStatus {
        Open => "open",
        Succeeded => "succeeded",
        Cancelled => "cancelled",
        Dead => "dead",
    }
);

impl StepStatus {
    pub fn of(state: JobState) -> StepStatus {
        match state {
            JobState::Succeeded => StepStatus::Succeeded,
            JobState::Cancelled => StepStatus::Cancelled,
            JobState::Dead => StepStatus::Dead,
            _ => StepStatus::Open,
        }
    }
}

/// A workflow as the caller describes it (`jobledger workflow create
/// @spec.json` reads exactly this).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowSpec {
    /// The parent's queue, and the queue of every step that names none.
    pub queue: String,
    /// The parent's kind, e.g. `publish_note`.
    pub name: String,
    /// Idempotency key of the parent: the same spec under the same key
    /// returns the existing workflow; a different one is refused.
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub payload: Value,
    pub steps: Vec<StepSpec>,
    /// The fan-in: one more step that runs exactly once, when every other
    /// step has ended (however), with their summary as its payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finally: Option<FinallySpec>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinallySpec {
    pub name: String,
    #[serde(default)]
    pub queue: Option<String>,
    pub kind: String,
    #[serde(default)]
    pub priority: i16,
    #[serde(default)]
    pub policy: Option<Policy>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    pub name: String,
    #[serde(default)]
    pub queue: Option<String>,
    pub kind: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub payload: Value,
    #[serde(default)]
    pub after: Vec<String>,
    #[serde(default)]
    pub on_dependency_failure: DependencyPolicy,
    #[serde(default)]
    pub priority: i16,
    #[serde(default)]
    pub policy: Option<Policy>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WorkflowError {
    #[error("a workflow needs at least one step")]
    Empty,
    #[error("a workflow has at most {max} steps, this one has {got}")]
    TooLarge { max: usize, got: usize },
    #[error("step name {0:?} is used twice")]
    Duplicate(String),
    #[error("step {step:?} waits for {missing:?}, which is not a step of this workflow")]
    Unknown { step: String, missing: String },
    #[error("step {0:?} waits for itself")]
    SelfDependency(String),
    #[error("step {step:?} lists {twice:?} twice in `after`")]
    RepeatedPrerequisite { step: String, twice: String },
    #[error("steps {0} form a cycle")]
    Cycle(String),
    #[error("step name must not be empty")]
    EmptyName,
}

/// Checks a spec: names unique and non-empty, every `after` a known other
/// step listed once, no cycle, size within [`MAX_STEPS`]. Returns the steps
/// in an order where every step follows its prerequisites.
pub fn check(spec: &WorkflowSpec) -> Result<Vec<usize>, WorkflowError> {
    let n = spec.steps.len();
    if n == 0 {
        return Err(WorkflowError::Empty);
    }
    let total = n + usize::from(spec.finally.is_some());
    if total > MAX_STEPS {
        return Err(WorkflowError::TooLarge {
            max: MAX_STEPS,
            got: total,
        });
    }
    let mut index = HashMap::with_capacity(n);
    if let Some(f) = &spec.finally {
        if f.name.is_empty() {
            return Err(WorkflowError::EmptyName);
        }
        index.insert(f.name.as_str(), usize::MAX);
    }
    for (i, s) in spec.steps.iter().enumerate() {
        if s.name.is_empty() {
            return Err(WorkflowError::EmptyName);
        }
        if index.insert(s.name.as_str(), i).is_some() {
            return Err(WorkflowError::Duplicate(s.name.clone()));
        }
    }
    let mut waits = vec![0usize; n];
    let mut then: Vec<Vec<usize>> = vec![vec![]; n];
    for (i, s) in spec.steps.iter().enumerate() {
        let mut seen = HashSet::new();
        for a in &s.after {
            let Some(&j) = index.get(a.as_str()).filter(|&&j| j != usize::MAX) else {
                return Err(WorkflowError::Unknown {
                    step: s.name.clone(),
                    missing: a.clone(),
                });
            };
            if j == i {
                return Err(WorkflowError::SelfDependency(s.name.clone()));
            }
            if !seen.insert(j) {
                return Err(WorkflowError::RepeatedPrerequisite {
                    step: s.name.clone(),
                    twice: a.clone(),
                });
            }
            waits[i] += 1;
            then[j].push(i);
        }
    }
    // Kahn: whatever never reaches zero waits lies on (or behind) a cycle.
    let mut ready: VecDeque<usize> = (0..n).filter(|&i| waits[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop_front() {
        order.push(i);
        for &d in &then[i] {
            waits[d] -= 1;
            if waits[d] == 0 {
                ready.push_back(d);
            }
        }
    }
    if order.len() < n {
        return Err(WorkflowError::Cycle(cycle_names(spec, &waits)));
    }
    Ok(order)
}

/// Names of the steps on one cycle: walk back along unfinished
/// prerequisites until a step repeats.
fn cycle_names(spec: &WorkflowSpec, waits: &[usize]) -> String {
    let index: HashMap<&str, usize> = spec
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let start = waits
        .iter()
        .position(|&w| w > 0)
        .expect("a cycle has a waiting step");
    let mut path = vec![start];
    let mut at = start;
    loop {
        let next = spec.steps[at]
            .after
            .iter()
            .map(|a| index[a.as_str()])
            .find(|&j| waits[j] > 0)
            .expect("a step on a cycle waits for another");
        if let Some(p) = path.iter().position(|&x| x == next) {
            let mut names: Vec<&str> = path[p..].iter().map(|&i| spec.steps[i].name.as_str()).collect();
            names.reverse();
            return names.join(" → ");
        }
        path.push(next);
        at = next;
    }
}

/// A step's place in the parent, as its first event records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRef {
    pub step: String,
    pub job_id: Uuid,
}

/// How a step is tied to its workflow (in its `enqueued` event and on its
/// row). `after` are the prerequisites; `then` the steps that wait for
/// this one, so finishing it finds them without reading the whole tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepLink {
    pub parent: Uuid,
    pub step: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<StepRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub then: Vec<Uuid>,
    pub on_dependency_failure: DependencyPolicy,
}

/// The workflow field of an `enqueued` event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum WorkflowTie {
    /// The parent lists every step once, so its own stream tells the story
    /// (the fan-in among them: it is counted from the start, and its job is
    /// created under this id when every other step has ended).
    Parent {
        steps: Vec<StepRef>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fan_in: Option<FanIn>,
    },
    Step(StepLink),
}

/// The fan-in step as the parent's first event fixes it: its id and what
/// its job will be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FanIn {
    pub step: String,
    pub job_id: Uuid,
    pub queue: String,
    pub kind: String,
    pub priority: i16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
}

/// What a job row keeps of its tie: a parent only its size (its first
/// event has the list), a step its whole link.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Membership {
    Parent {
        steps: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fan_in: Option<FanIn>,
    },
    Step(StepLink),
}

impl WorkflowTie {
    pub fn membership(&self) -> Membership {
        match self {
            WorkflowTie::Parent { steps, fan_in } => Membership::Parent {
                steps: (steps.len() + usize::from(fan_in.is_some())) as i64,
                fan_in: fan_in.clone(),
            },
            WorkflowTie::Step(l) => Membership::Step(l.clone()),
        }
    }
}

/// The parent's count of its steps by status: its `result` column.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    pub open: i64,
    pub succeeded: i64,
    pub cancelled: i64,
    pub dead: i64,
    /// `workflow cancel` was asked for (and no step reopened since): a
    /// second request is the same request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cancel_requested: bool,
}

impl Tally {
    pub fn new(steps: i64) -> Tally {
        Tally {
            open: steps,
            ..Tally::default()
        }
    }

    fn slot(&mut self, s: StepStatus) -> &mut i64 {
        match s {
            StepStatus::Open => &mut self.open,
            StepStatus::Succeeded => &mut self.succeeded,
            StepStatus::Cancelled => &mut self.cancelled,
            StepStatus::Dead => &mut self.dead,
        }
    }

    /// One step moves from `from` to `to`; `None` if `from` has no step
    /// left to move (a forged or repeated event).
    pub fn moved(mut self, from: StepStatus, to: StepStatus) -> Option<Tally> {
        let f = self.slot(from);
        if *f <= 0 {
            return None;
        }
        *f -= 1;
        *self.slot(to) += 1;
        Some(self)
    }

    pub fn to_value(self) -> Value {
        serde_json::to_value(self).expect("a tally serialises")
    }

    pub fn from_value(v: Option<&Value>) -> Option<Tally> {
        v.and_then(|v| serde_json::from_value(v.clone()).ok())
    }
}

/// The rule table (docs/state-machine.md, "Workflows"): the parent's state
/// from its tally. Fixed rules that cannot lie: a dead step never leaves the
/// parent `running`; an open step never lets it look finished.
pub fn parent_state(t: Tally) -> JobState {
    match (t.open > 0, t.dead > 0, t.cancelled > 0) {
        (true, false, false) => JobState::Running,
        (true, _, _) => JobState::Failing,
        (false, true, _) => JobState::Dead,
        (false, false, true) => JobState::Cancelled,
        (false, false, false) => JobState::Succeeded,
    }
}

/// What a waiting step does now, given its prerequisites' states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    /// Every prerequisite succeeded (or, under `run`, ended somehow).
    Go { failed: Option<String> },
    /// A prerequisite ended badly and the policy is `cancel`.
    Cancel { failed: String },
    /// A prerequisite ended badly and the policy is `hold`.
    Hold { failed: String },
    /// Not yet: these prerequisites are still open.
    Wait { open: Vec<String> },
}

pub fn release(policy: DependencyPolicy, prerequisites: &[(String, JobState)]) -> Release {
    let failed = prerequisites
        .iter()
        .find(|(_, s)| s.is_terminal() && *s != JobState::Succeeded)
        .map(|(n, _)| n.clone());
    let open: Vec<String> = prerequisites
        .iter()
        .filter(|(_, s)| !s.is_terminal())
        .map(|(n, _)| n.clone())
        .collect();
    match (failed, policy) {
        (Some(f), DependencyPolicy::Cancel) => Release::Cancel { failed: f },
        (Some(f), DependencyPolicy::Hold) => Release::Hold { failed: f },
        (failed, _) if open.is_empty() => Release::Go { failed },
        _ => Release::Wait { open },
    }
}
