//! Property test of the pure workflow rules (issue 11): random DAGs, random
//! policies and random interleavings of step outcomes, driven through the
//! same `decide` and `apply` the ledger uses. After every parent event the
//! parent's state is the rule table over its steps' actual states; no step
//! is released before its prerequisites allow it; replaying the parent's
//! stream alone gives the same parent. Also: every spec `check` accepts is
//! acyclic, and every cycle is refused.

use chrono::{Duration, TimeZone, Utc};
use jobledger::domain::workflow::{
    check, DependencyPolicy, Membership, StepLink, StepRef, StepSpec, StepStatus, WorkflowError,
    WorkflowSpec, WorkflowTie,
};
use jobledger::domain::{
    apply, decide, decide_enqueue_tied, Command, Ctx, ErrorClass, Event, EventBody, Fence, Job, JobState,
    NewJob, Policy, Reason,
};
use proptest::prelude::*;
use serde_json::json;
use uuid::Uuid;

#[derive(Clone, Debug)]
enum Outcome {
    Succeed,
    Die,
    Cancel,
}

/// `after` of step i: a subset of the steps before it, so the DAG is acyclic.
fn dag() -> impl Strategy<Value = Vec<(Vec<usize>, DependencyPolicy)>> {
    (1usize..8).prop_flat_map(|n| {
        let steps: Vec<_> = (0..n)
            .map(|i| {
                (
                    proptest::sample::subsequence((0..i).collect::<Vec<_>>(), 0..=i.min(3)),
                    prop_oneof![
                        Just(DependencyPolicy::Cancel),
                        Just(DependencyPolicy::Run),
                        Just(DependencyPolicy::Hold)
                    ],
                )
            })
            .collect();
        steps
    })
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![3 => Just(Outcome::Succeed), 1 => Just(Outcome::Die), 1 => Just(Outcome::Cancel)]
}

struct World {
    parent: Job,
    parent_events: Vec<Event>,
    steps: Vec<Job>,
    now: chrono::DateTime<Utc>,
}

/// Job search skips queued jobs for any reason `Reason::may_be_queued`
/// leaves out, so no queued job may carry one.
fn queued_reason_is_listed(j: &Job) {
    assert!(
        j.state != JobState::Queued || j.reason.may_be_queued(),
        "a queued job carries {:?}",
        j.reason
    );
}

impl World {
    fn ctx(&mut self) -> Ctx {
        self.now += Duration::milliseconds(1);
        Ctx {
            now: self.now,
            actor: "t".into(),
            jitter: 0.5,
            trace: None,
        }
    }

    fn link(&self, i: usize) -> StepLink {
        match &self.steps[i].workflow {
            Some(Membership::Step(l)) => l.clone(),
            other => panic!("not a step: {other:?}"),
        }
    }

    fn prerequisites(&self, i: usize) -> Vec<(String, JobState)> {
        self.link(i)
            .after
            .iter()
            .map(|r| (r.step.clone(), self.steps[self.index(r.job_id)].state))
            .collect()
    }

    fn index(&self, id: Uuid) -> usize {
        self.steps.iter().position(|j| j.job_id == id).expect("a step")
    }

    /// Applies `cmd` to step i; then, as the ledger's `follow` does, the
    /// parent's count and the release of its dependents, until quiet.
    fn step_write(&mut self, i: usize, cmd: Command) -> bool {
        let ctx = self.ctx();
        let Ok(ev) = decide(&self.steps[i], &cmd, &ctx) else {
            return false;
        };
        let before = self.steps[i].state;
        self.steps[i] = apply(Some(&self.steps[i]), &ev).expect("decide's event applies");
        queued_reason_is_listed(&self.steps[i]);
        let after = self.steps[i].state;
        let released = matches!(
            ev.body,
            EventBody::DependenciesResolved { .. } | EventBody::HoldReleased { .. }
        );
        if released && after == JobState::Queued {
            // Released: every prerequisite succeeded, or the policy says
            // run and every one has ended.
            let link = self.link(i);
            let pre: Vec<JobState> = link
                .after
                .iter()
                .map(|r| self.steps[self.index(r.job_id)].state)
                .collect();
            let ok = match self.steps[i].reason {
                Reason::DependenciesMet => pre.iter().all(|s| *s == JobState::Succeeded),
                Reason::DependencyFailedRun => {
                    link.on_dependency_failure == DependencyPolicy::Run
                        && pre.iter().all(|s| s.is_terminal())
                        && pre.iter().any(|s| *s != JobState::Succeeded)
                }
                Reason::HoldReleased => {
                    link.on_dependency_failure == DependencyPolicy::Hold
                        && pre.iter().all(|s| s.is_terminal())
                }
                _ => false,
            };
            assert!(
                ok,
                "step {} released too early: {pre:?} ({})",
                link.step, self.steps[i].reason
            );
        }
        if after.is_terminal() && !before.is_terminal() {
            let link = self.link(i);
            let c = Command::StepFinished {
                step: link.step.clone(),
                job_id: self.steps[i].job_id,
                status: StepStatus::of(after),
                version: self.steps[i].version,
                reason: self.steps[i].reason,
            };
            self.parent_write(c);
            for d in link.then {
                let d = self.index(d);
                if self.steps[d].state == JobState::Waiting {
                    let prerequisites = self
                        .link(d)
                        .after
                        .iter()
                        .map(|r| (r.step.clone(), self.steps[self.index(r.job_id)].state))
                        .collect();
                    self.step_write(
                        d,
                        Command::Resolve {
                            prerequisites,
                            workflow_cancelled: false,
                        },
                    );
                }
            }
        } else if before.is_terminal() && !after.is_terminal() {
            let c = Command::StepReopened {
                step: self.link(i).step,
                job_id: self.steps[i].job_id,
                previous: StepStatus::of(before),
                version: self.steps[i].version,
            };
            self.parent_write(c);
        }
        true
    }

    fn parent_write(&mut self, cmd: Command) {
        let ctx = self.ctx();
        let ev = decide(&self.parent, &cmd, &ctx).expect("the parent counts every step's end");
        self.parent = apply(Some(&self.parent), &ev).expect("the parent's event applies");
        queued_reason_is_listed(&self.parent);
        self.parent_events.push(ev);
        let states: Vec<JobState> = self.steps.iter().map(|j| j.state).collect();
        assert_eq!(self.parent.state, table(&states), "rule table over {states:?}");
        let any = |s: JobState| states.contains(&s);
        if any(JobState::Dead) {
            assert!(!matches!(self.parent.state, JobState::Running | JobState::Queued));
        }
        if states.iter().any(|s| !s.is_terminal()) {
            assert!(
                !self.parent.state.is_terminal(),
                "an open step: the parent is not done"
            );
        }
        if states.iter().all(|s| *s == JobState::Succeeded) {
            assert_eq!(self.parent.state, JobState::Succeeded);
        }
    }
}

/// The rule table, written again from docs/state-machine.md over the steps'
/// own states (not the parent's tally).
fn table(states: &[JobState]) -> JobState {
    let open = states.iter().any(|s| !s.is_terminal());
    let dead = states.contains(&JobState::Dead);
    let cancelled = states.contains(&JobState::Cancelled);
    match (open, dead || cancelled) {
        (true, false) => JobState::Running,
        (true, true) => JobState::Failing,
        (false, _) if dead => JobState::Dead,
        (false, _) if cancelled => JobState::Cancelled,
        _ => JobState::Succeeded,
    }
}

fn new_job(kind: &str) -> NewJob {
    NewJob {
        queue: "q".into(),
        kind: kind.into(),
        job_key: None,
        payload: json!({}),
        priority: 0,
        run_at: None,
        delay_ms: None,
        policy: None,
        concurrency_key: None,
        unique_for_ms: None,
    }
}

fn build(shape: &[(Vec<usize>, DependencyPolicy)]) -> World {
    let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
    let ctx = Ctx {
        now,
        actor: "api".into(),
        jitter: 0.0,
        trace: None,
    };
    let policy = Policy {
        max_attempts: 1,
        ..Policy::default()
    };
    let parent_id = Uuid::now_v7();
    let ids: Vec<Uuid> = shape.iter().map(|_| Uuid::now_v7()).collect();
    let name = |i: usize| format!("s{i}");
    let tie = WorkflowTie::Parent {
        fan_in: None,
        steps: ids
            .iter()
            .enumerate()
            .map(|(i, id)| StepRef {
                step: name(i),
                job_id: *id,
            })
            .collect(),
    };
    let first = decide_enqueue_tied(parent_id, 1, &new_job("wf"), &policy, Some(&tie), &ctx);
    let parent = apply(None, &first).unwrap();
    let steps = shape
        .iter()
        .enumerate()
        .map(|(i, (after, on))| {
            let link = StepLink {
                parent: parent_id,
                step: name(i),
                after: after
                    .iter()
                    .map(|&a| StepRef {
                        step: name(a),
                        job_id: ids[a],
                    })
                    .collect(),
                then: (0..shape.len())
                    .filter(|&d| shape[d].0.contains(&i))
                    .map(|d| ids[d])
                    .collect(),
                on_dependency_failure: *on,
            };
            let ev = decide_enqueue_tied(
                ids[i],
                2 + i as i64,
                &new_job(&name(i)),
                &policy,
                Some(&WorkflowTie::Step(link)),
                &ctx,
            );
            apply(None, &ev).unwrap()
        })
        .collect();
    World {
        parent,
        parent_events: vec![first],
        steps,
        now,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    #[test]
    fn the_parent_obeys_the_rule_table_at_every_event(
        shape in dag(),
        picks in proptest::collection::vec((any::<prop::sample::Index>(), outcome(), any::<bool>()), 1..60),
    ) {
        let mut w = build(&shape);
        for (pick, outcome, replay_or_release) in picks {
            let i = pick.index(w.steps.len());
            let job = w.steps[i].clone();
            match job.state {
                JobState::Queued => {
                    match outcome {
                        Outcome::Cancel => { w.step_write(i, Command::Cancel { note: None }); }
                        Outcome::Succeed | Outcome::Die => {
                            let claim = Command::Claim { holder: "h".into(), lease_ms: 60_000 };
                            prop_assert!(w.step_write(i, claim), "claim");
                            let fence = Fence { epoch: w.steps[i].epoch, token: w.steps[i].token };
                            let cmd = match outcome {
                                Outcome::Succeed => Command::Complete { fence, result: None },
                                _ => Command::Fail { fence, class: ErrorClass::Permanent, code: "no".into(), message: None },
                            };
                            prop_assert!(w.step_write(i, cmd), "complete or fail");
                        }
                    }
                }
                JobState::Waiting if job.reason == Reason::DependencyHeld && replay_or_release => {
                    let prerequisites = w.prerequisites(i);
                    let open = prerequisites.iter().any(|(_, s)| !s.is_terminal());
                    let c = Command::ReleaseHold { operator: "o".into(), note: "n".into(), prerequisites };
                    // A person lets a held step go only once every prerequisite ended.
                    prop_assert_eq!(w.step_write(i, c), !open, "release hold");
                }
                JobState::Waiting if matches!(outcome, Outcome::Cancel) => {
                    let c = Command::Cancel { note: None };
                    prop_assert!(w.step_write(i, c), "cancel a waiting step");
                }
                JobState::Dead if replay_or_release => {
                    let c = Command::Replay { operator: "o".into(), note: "n".into() };
                    prop_assert!(w.step_write(i, c), "replay");
                }
                _ => {}
            }
        }
        // The parent's stream alone replays to the same parent.
        let mut replayed: Option<Job> = None;
        for ev in &w.parent_events {
            replayed = Some(apply(replayed.as_ref(), ev).expect("the parent's own stream replays"));
        }
        prop_assert_eq!(replayed.as_ref(), Some(&w.parent));
    }

    #[test]
    fn check_accepts_exactly_the_acyclic_specs(edges in proptest::collection::vec((0usize..6, 0usize..6), 0..12)) {
        let n = 6;
        let mut after: Vec<Vec<usize>> = vec![vec![]; n];
        for (a, b) in edges {
            if a != b && !after[a].contains(&b) {
                after[a].push(b);
            }
        }
        let spec = WorkflowSpec {
            queue: "q".into(),
            name: "wf".into(),
            key: None,
            payload: json!(null),
            steps: (0..n)
                .map(|i| StepSpec {
                    name: format!("s{i}"),
                    queue: None,
                    kind: "k".into(),
                    key: None,
                    payload: json!(null),
                    after: after[i].iter().map(|j| format!("s{j}")).collect(),
                    on_dependency_failure: DependencyPolicy::Cancel,
                    priority: 0,
                    policy: None,
                })
                .collect(),
            finally: None,
        };
        match check(&spec) {
            Ok(order) => {
                let pos: Vec<usize> = (0..n).map(|i| order.iter().position(|&x| x == i).unwrap()).collect();
                for i in 0..n {
                    for &j in &after[i] {
                        prop_assert!(pos[j] < pos[i], "s{j} must come before s{i}");
                    }
                }
            }
            Err(WorkflowError::Cycle(names)) => {
                // The named steps really form a cycle: each waits for the next.
                let ring: Vec<usize> = names.split(" → ").map(|s| s[1..].parse().unwrap()).collect();
                for k in 0..ring.len() {
                    let (x, y) = (ring[k], ring[(k + 1) % ring.len()]);
                    prop_assert!(after[y].contains(&x), "{names}: s{y} does not wait for s{x}");
                }
                prop_assert!(has_cycle(&after), "a cycle reported where there is none");
            }
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }
}

fn has_cycle(after: &[Vec<usize>]) -> bool {
    fn visit(i: usize, after: &[Vec<usize>], mark: &mut [u8]) -> bool {
        match mark[i] {
            1 => return true,
            2 => return false,
            _ => {}
        }
        mark[i] = 1;
        if after[i].iter().any(|&j| visit(j, after, mark)) {
            return true;
        }
        mark[i] = 2;
        false
    }
    let mut mark = vec![0u8; after.len()];
    (0..after.len()).any(|i| visit(i, after, &mut mark))
}
