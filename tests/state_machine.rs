//! Property tests of the pure state machine: random command sequences, from
//! current, old and never-issued tokens, with time moving. The invariants
//! hold after every step, and replaying the events from scratch gives the
//! inline projection.

use chrono::{DateTime, Duration, TimeZone, Utc};
use jobledger::domain::{
    apply, decide, decide_enqueue, edge_allowed, event_hash, ApplyError, Command, Ctx, ErrorClass, Event,
    EventBody, ExpiryPolicy, Fence, Job, JobState, NewJob, Outcome, Policy, ReceiptPolicy, ReceiptStatus,
};
use proptest::prelude::*;
use serde_json::json;
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Tok {
    Current,
    Older(i64),
    Newer,
    OtherEpoch,
}

#[derive(Clone, Debug)]
enum Op {
    Claim,
    Heartbeat(Tok),
    Progress(Tok),
    Complete(Tok, u8),
    Submit(Tok, u8),
    Fail(Tok, bool),
    ConfirmCancel(Tok),
    Release(Tok),
    Snooze(Tok),
    Observe(Option<Tok>, u8, u8),
    Cancel,
    Receipt(u8, bool),
    Replay,
    /// An operator's verdict: succeeded or cancelled; on the current version or an old one.
    Resolve(bool, bool),
    /// A correction of version n (may be beyond the job's last one).
    Annotate(i64),
    Expire,
    Purge,
    Advance(i64),
}

fn tok() -> impl Strategy<Value = Tok> {
    prop_oneof![
        4 => Just(Tok::Current),
        2 => (1i64..3).prop_map(Tok::Older),
        1 => Just(Tok::Newer),
        1 => Just(Tok::OtherEpoch),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Claim),
        2 => tok().prop_map(Op::Heartbeat),
        2 => tok().prop_map(Op::Progress),
        3 => (tok(), 0u8..2).prop_map(|(t, r)| Op::Complete(t, r)),
        2 => (tok(), 0u8..2).prop_map(|(t, r)| Op::Submit(t, r)),
        3 => (tok(), any::<bool>()).prop_map(|(t, p)| Op::Fail(t, p)),
        1 => tok().prop_map(Op::ConfirmCancel),
        1 => tok().prop_map(Op::Release),
        1 => tok().prop_map(Op::Snooze),
        1 => (proptest::option::of(tok()), 0u8..2, 0u8..2).prop_map(|(t, k, d)| Op::Observe(t, k, d)),
        2 => Just(Op::Cancel),
        2 => (0u8..3, any::<bool>()).prop_map(|(s, ok)| Op::Receipt(s, ok)),
        1 => Just(Op::Replay),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(s, cur)| Op::Resolve(s, cur)),
        1 => (0i64..12).prop_map(Op::Annotate),
        2 => Just(Op::Expire),
        1 => Just(Op::Purge),
        4 => (1i64..120_000).prop_map(Op::Advance),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    (
        1i32..5,
        prop_oneof![
            Just(ExpiryPolicy::Reconcile),
            Just(ExpiryPolicy::Requeue),
            Just(ExpiryPolicy::Dead)
        ],
        any::<bool>(),
    )
        .prop_map(|(max_attempts, on_lease_expiry, reconcile_receipts)| Policy {
            max_attempts,
            backoff_base_ms: 1_000,
            backoff_cap_ms: 30_000,
            on_lease_expiry,
            receipt_timeout_ms: 60_000,
            on_receipt_timeout: if reconcile_receipts {
                ReceiptPolicy::Reconcile
            } else {
                ReceiptPolicy::Dead
            },
        })
}

fn fence(job: &Job, t: &Tok) -> Fence {
    match t {
        Tok::Current => Fence {
            epoch: job.epoch,
            token: job.token,
        },
        Tok::Older(n) => Fence {
            epoch: job.epoch,
            token: (job.token - n).max(0),
        },
        Tok::Newer => Fence {
            epoch: job.epoch,
            token: job.token + 1,
        },
        Tok::OtherEpoch => Fence {
            epoch: job.epoch + 1,
            token: job.token,
        },
    }
}

fn command(job: &Job, op: &Op, observed: &HashMap<String, String>) -> Option<Command> {
    Some(match op {
        Op::Claim => Command::Claim {
            holder: format!("w{}", job.token + 1),
            lease_ms: 30_000,
        },
        Op::Heartbeat(t) => Command::Heartbeat {
            fence: fence(job, t),
            lease_ms: 30_000,
        },
        Op::Progress(t) => Command::Progress {
            fence: fence(job, t),
            step: "s".into(),
            lease_ms: Some(30_000),
        },
        Op::Complete(t, r) => Command::Complete {
            fence: fence(job, t),
            result: Some(json!({ "r": r })),
        },
        Op::Submit(t, r) => Command::Submit {
            fence: fence(job, t),
            receipt_id: format!("rc{r}"),
        },
        Op::Fail(t, permanent) => Command::Fail {
            fence: fence(job, t),
            class: if *permanent {
                ErrorClass::Permanent
            } else {
                ErrorClass::Transient
            },
            code: "e".into(),
            message: None,
        },
        Op::ConfirmCancel(t) => Command::ConfirmCancel { fence: fence(job, t) },
        Op::Release(t) => Command::Release { fence: fence(job, t) },
        Op::Snooze(t) => Command::Snooze {
            fence: fence(job, t),
            delay_ms: 5_000,
        },
        Op::Observe(t, k, d) => {
            let key = format!("k{k}");
            Command::Observe {
                fence: t.as_ref().map(|t| fence(job, t)),
                existing: observed.get(&key).cloned(),
                key,
                data: json!({ "d": d }),
            }
        }
        Op::Cancel => Command::Cancel { note: None },
        Op::Receipt(s, right) => Command::Receipt {
            receipt_id: if *right {
                job.receipt_id.clone().unwrap_or_else(|| "none".into())
            } else {
                "wrong".into()
            },
            status: [
                ReceiptStatus::Succeeded,
                ReceiptStatus::Failed,
                ReceiptStatus::Pending,
            ][*s as usize],
        },
        Op::Replay => Command::Replay {
            operator: "op".into(),
            note: "n".into(),
        },
        Op::Resolve(succeeded, current) => Command::ResolveByOperator {
            operator: "op".into(),
            verdict: if *succeeded {
                JobState::Succeeded
            } else {
                JobState::Cancelled
            },
            note: "checked the provider".into(),
            evidence: json!({ "ticket": 7 }),
            expected_version: if *current { job.version } else { job.version - 1 },
        },
        Op::Annotate(v) => Command::Annotate {
            operator: "op".into(),
            corrects_position: *v,
            corrects_version: *v,
            note: "wrong reason".into(),
        },
        Op::Expire => Command::Expire,
        Op::Purge => Command::Purge,
        Op::Advance(_) => return None,
    })
}

fn check_invariants(job: &Job, events: &[Event], start: DateTime<Utc>) {
    // The log: contiguous versions, linked and correct hashes, legal edges.
    for (i, ev) in events.iter().enumerate() {
        assert_eq!(ev.version, i as i64 + 1);
        // Against the specification (the canonical JSON of the covered
        // object), not the fast writer `decide` itself used: every kind of
        // event the walk produces, not just `enqueued`.
        let spec = {
            use sha2::Digest;
            let covered = jobledger::domain::digest::covered_value(ev);
            hex::encode(sha2::Sha256::digest(
                jobledger::domain::canonical_json(&covered).as_bytes(),
            ))
        };
        assert_eq!(ev.hash, spec, "hash of v{} ({:?})", ev.version, ev.body);
        assert_eq!(event_hash(ev), spec);
        if i == 0 {
            assert!(ev.prev_hash.is_none());
        } else {
            assert_eq!(ev.prev_hash.as_deref(), Some(events[i - 1].hash.as_str()));
            assert!(
                edge_allowed(&ev.body, events[i - 1].to_state, ev.to_state),
                "{ev:?}"
            );
            // Tokens only move up, and only by a claim or takeover, by one.
            let (prev, now) = (events[i - 1].token, ev.token);
            match ev.body {
                EventBody::Claimed { .. } | EventBody::TakenOver { .. } => assert_eq!(now, prev + 1),
                _ => assert_eq!(now, prev),
            }
        }
    }
    // Replay from scratch equals the inline projection.
    let mut replayed: Option<Job> = None;
    for ev in events {
        replayed = Some(apply(replayed.as_ref(), ev).expect("replay accepts its own log"));
    }
    assert_eq!(replayed.as_ref(), Some(job));
    // One meaning per state.
    assert_eq!(job.state.is_held(), job.lease_until.is_some());
    assert_eq!(job.state.is_held(), job.holder.is_some());
    if job.state == JobState::AwaitingReceipt {
        assert!(job.receipt_id.is_some() && job.receipt_deadline.is_some());
    }
    assert!(
        job.attempt >= 0 && job.attempt <= job.policy.max_attempts,
        "attempt {}",
        job.attempt
    );
    assert!(job.updated_at >= start);
    // A success is final: never two per job.
    let successes = events
        .iter()
        .filter(|e| e.to_state == JobState::Succeeded && e.from_state != Some(JobState::Succeeded))
        .count();
    assert!(successes <= 1);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    #[test]
    fn random_command_sequences_keep_the_invariants(policy in policy(), ops in proptest::collection::vec(op(), 1..60), jitter in 0.0f64..1.0) {
        let start = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let mut now = start;
        let new = NewJob {
            queue: "q".into(), kind: "k".into(), job_key: Some("key".into()), payload: json!({"a": 1}),
            priority: 0, run_at: None, delay_ms: None, policy: Some(policy.clone()), concurrency_key: None, unique_for_ms: None,
        };
        let first = decide_enqueue(uuid::Uuid::now_v7(), 7, &new, &policy, &Ctx { now, actor: "api".into(), jitter, trace: None });
        let mut job = apply(None, &first).unwrap();
        let mut events = vec![first];
        let mut observed: HashMap<String, String> = HashMap::new();
        let mut purged = false;
        for op in &ops {
            if let Op::Advance(ms) = op {
                now += Duration::milliseconds(*ms);
                continue;
            }
            if purged {
                break;
            }
            let cmd = command(&job, op, &observed).unwrap();
            let before = job.clone();
            match decide(&job, &cmd, &Ctx { now, actor: "t".into(), jitter, trace: None }) {
                Ok(ev) => {
                    // Read back from its columns, the body is itself,
                    // borrowed or owned, as through a tagged JSON object.
                    let (kind, data) = ev.body.to_parts();
                    prop_assert_eq!(&EventBody::from_parts(&kind, &data).unwrap(), &ev.body);
                    prop_assert_eq!(&EventBody::from_parts_owned(&kind, data.clone()).unwrap(), &ev.body);
                    let tagged: EventBody = serde_json::from_value(json!({"type": kind, "data": data})).unwrap();
                    prop_assert_eq!(&tagged, &ev.body);
                    // A writer that does not hold the current token changes
                    // nothing but observations.
                    if let Some(f) = cmd.fence() {
                        if !matches!(cmd, Command::Observe { .. }) {
                            prop_assert!(f.token == before.token && f.epoch == before.epoch, "stale write accepted: {cmd:?}");
                            prop_assert!(before.state.is_held());
                        }
                    }
                    if let EventBody::Observed { key, digest, .. } = &ev.body {
                        observed.insert(key.clone(), digest.clone());
                    }
                    purged = matches!(ev.body, EventBody::Purged {});
                    job = apply(Some(&job), &ev).expect("apply accepts what decide produced");
                    // Any other token, attempt or run is refused on replay.
                    for (dt, da, dr) in [(1, 0, 0), (-1, 0, 0), (0, 1, 0), (0, -1, 0), (0, 0, 1), (0, 0, -1)] {
                        let mut forged = ev.clone();
                        forged.token += dt;
                        forged.attempt += da;
                        forged.run += dr;
                        let refused = apply(Some(&before), &forged);
                        prop_assert!(matches!(refused, Err(ApplyError::Counters { .. })), "{:?} accepted: {refused:?}", (dt, da, dr));
                    }
                    // Job search skips queued jobs for any other reason.
                    prop_assert!(job.state != JobState::Queued || job.reason.may_be_queued(), "{:?}", job.reason);
                    events.push(ev);
                }
                Err(r) => {
                    // Rejections name exactly one outcome and change nothing.
                    prop_assert!(r.outcome != Outcome::Committed);
                    prop_assert_eq!(&job, &before);
                }
            }
            check_invariants(&job, &events, start);
        }
    }

    /// Canonical JSON: equal values give equal digests regardless of key
    /// order; different values give different digests.
    #[test]
    fn digest_ignores_key_order(pairs in proptest::collection::btree_map("[a-z]{1,6}", any::<i32>(), 0..8)) {
        let forward: serde_json::Map<String, serde_json::Value> = pairs.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        let text_rev = format!("{{{}}}", pairs.iter().rev().map(|(k, v)| format!("\"{k}\" : {v}")).collect::<Vec<_>>().join(" , "));
        let reversed: serde_json::Value = serde_json::from_str(&text_rev).unwrap();
        prop_assert_eq!(jobledger::domain::digest(&serde_json::Value::Object(forward.clone())), jobledger::domain::digest(&reversed));
        let mut changed = forward.clone();
        changed.insert("zz_extra".into(), json!(1));
        prop_assert_ne!(jobledger::domain::digest(&serde_json::Value::Object(forward)), jobledger::domain::digest(&serde_json::Value::Object(changed)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    /// The fast hash writer hashes exactly the canonical JSON of the
    /// specified object, for any actor text, payload and optional fields.
    #[test]
    fn fast_hash_equals_the_specified_canonical_form(
        actor in ".{0,12}",
        key in proptest::option::of("[a-z\"\\\\]{0,6}"),
        n in any::<i64>(),
        f in any::<f64>().prop_filter("finite", |f| f.is_finite()),
        text in ".{0,10}",
    ) {
        let new = NewJob {
            queue: "q".into(), kind: "k".into(), job_key: key, payload: json!({"n": n, "f": f, "t": text, "z": [1, {"b": 2, "a": null}]}),
            priority: 0, run_at: None, delay_ms: None, policy: None, concurrency_key: None, unique_for_ms: None,
        };
        let ctx = Ctx { now: Utc::now(), actor, jitter: 0.5, trace: None };
        let ev = decide_enqueue(uuid::Uuid::now_v7(), 3, &new, &Policy::default(), &ctx);
        let spec = jobledger::domain::digest::covered_value(&ev);
        let expected = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(jobledger::domain::canonical_json(&spec).as_bytes()))
        };
        prop_assert_eq!(&ev.hash, &expected);
        prop_assert_eq!(event_hash(&ev), expected);
    }
}

/// A body whose type is unknown, or whose data lacks a field, is refused
/// when read from its columns, borrowed or owned.
#[test]
fn a_body_read_from_bad_columns_is_refused() {
    for (kind, data) in [
        ("no_such_event", json!({})),
        ("claimed", json!({"lease_until": "2026-01-01T00:00:00Z"})),
        ("purged", json!(5)),
    ] {
        assert!(EventBody::from_parts(kind, &data).is_err(), "{kind} {data}");
        assert!(
            EventBody::from_parts_owned(kind, data.clone()).is_err(),
            "{kind} {data}"
        );
        let tagged = serde_json::from_value::<EventBody>(json!({"type": kind, "data": data}));
        assert!(tagged.is_err(), "{kind} {data}");
    }
    assert_eq!(
        EventBody::from_parts("purged", &json!({})).unwrap(),
        EventBody::Purged {}
    );
}

/// Shapes the writer never makes, that serde's buffered reading of a tagged
/// object takes (a unit variant as a one-key map, a variant by its index),
/// read from the columns as that reading reads them: an edited event in
/// such a shape is named by its hash, as before, not by its parse.
#[test]
fn odd_shapes_read_from_the_columns_as_the_tagged_object_reads_them() {
    for (kind, data) in [
        (
            "claimed",
            json!({"holder": "w", "lease_until": "2026-12-02T18:38:54Z", "next_action": {"execute": {}}}),
        ),
        (
            "claimed",
            json!({"holder": "w", "lease_until": "2026-12-02T18:38:54Z", "next_action": "execute"}),
        ),
    ] {
        let tagged = serde_json::from_value::<EventBody>(json!({"type": kind, "data": data})).unwrap();
        assert_eq!(EventBody::from_parts(kind, &data).unwrap(), tagged, "{data}");
        assert_eq!(
            EventBody::from_parts_owned(kind, data.clone()).unwrap(),
            tagged,
            "{data}"
        );
    }
}
