//! Single enqueues that overlap share a statement and its commit (issue 15,
//! W1; `ledger::combine`): each job keeps its own event, epoch, hash chain
//! and trace, each call its own answer.

mod common;

use common::{eventually, fresh, new_job, within};
use jobledger::ledger::{Enqueued, Ledger, LedgerHooks};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, Mutex};
use uuid::Uuid;

/// A ledger whose first enqueue statement waits at a gate after drawing
/// its epochs (the hook's calls counted): while it waits, later single
/// enqueues queue for the next shared statement.
struct Gated {
    ledger: Ledger,
    reached: mpsc::Receiver<()>,
    open: mpsc::Sender<()>,
    calls: Arc<AtomicUsize>,
}

fn gated(ledger: &Ledger) -> Gated {
    gated_then(ledger, false)
}

/// `gated`, the first statement's task panicking once the gate opens when
/// `panics`.
fn gated_then(ledger: &Ledger, panics: bool) -> Gated {
    let (reached_tx, reached) = mpsc::channel::<()>(1);
    let (open, gate) = mpsc::channel::<()>(1);
    let gate = Arc::new(Mutex::new(gate));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let ledger = ledger.clone().with_hooks(LedgerHooks {
        after_epochs: Some(Arc::new(move || {
            let (reached, gate) = (reached_tx.clone(), gate.clone());
            let first = c.fetch_add(1, Ordering::SeqCst) == 0;
            Box::pin(async move {
                if first {
                    reached.send(()).await.unwrap();
                    gate.lock().await.recv().await;
                    assert!(!panics, "the test's hook stops the shared task");
                }
            })
        })),
        before_wake: None,
    });
    Gated {
        ledger,
        reached,
        open,
        calls,
    }
}

/// A call's caller's traceparent and its answer.
type Answer = (Option<String>, Result<Enqueued, String>);
type Call = tokio::task::JoinHandle<Answer>;

impl Gated {
    /// The first call, its statement held at the gate.
    async fn hold_first(&mut self) -> Call {
        let first = call(&self.ledger, json!({ "n": 0 }));
        within("the first statement's gate", self.reached.recv())
            .await
            .unwrap();
        first
    }

    /// Opens the gate: the first call's answer.
    async fn release(&self, first: Call) -> Answer {
        self.open.send(()).await.unwrap();
        within("the first", first).await.unwrap()
    }
}

/// A single enqueue under a span of its own (`caller`, a trace of its own
/// when tracing is on): the caller's traceparent and the answer.
fn call(ledger: &Ledger, payload: Value) -> Call {
    use tracing::Instrument;
    let ledger = ledger.clone();
    tokio::spawn(
        async move {
            let caller = jobledger::telemetry::current();
            let got = ledger.enqueue(new_job("q", None, payload)).await;
            (caller, got.map_err(|e| e.to_string()))
        }
        .instrument(tracing::info_span!(parent: None, "caller")),
    )
}

/// Waits until `n` single enqueues wait for the next shared statement.
async fn queued(ledger: &Ledger, n: usize) {
    let ledger = ledger.clone();
    eventually(&format!("{n} calls queued"), || {
        let l = ledger.clone();
        async move { l.enqueues_waiting() == n }
    })
    .await;
}

async fn txids(db: &common::TestDb, ids: &[Uuid]) -> Vec<i64> {
    let mut out = vec![];
    for id in ids {
        let t: i64 = sqlx::query_scalar(
            "SELECT txid::text::int8 FROM jobledger.events WHERE job_id = $1 AND version = 1",
        )
        .bind(id)
        .fetch_one(db.ledger.pool())
        .await
        .unwrap();
        out.push(t);
    }
    out
}

/// Three calls that arrive while a statement runs are written by the next
/// statement, together: one transaction, three jobs, each with its own
/// `enqueued` event, epoch, hash and the trace of its own caller.
#[tokio::test]
async fn overlapping_single_enqueues_share_the_next_statement() {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;
    let db = fresh().await;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    // One thread (the test's runtime): the default holds for every task.
    let _default = tracing::subscriber::set_default(subscriber);
    jobledger::telemetry::set_enabled(true);
    let mut g = gated(&db.ledger);
    let first = g.hold_first().await;
    let later: Vec<Call> = (1..=3).map(|n| call(&g.ledger, json!({ "n": n }))).collect();
    queued(&g.ledger, 3).await;
    let mut answers = vec![g.release(first).await];
    for c in later {
        answers.push(within("a later call", c).await.unwrap());
    }
    jobledger::telemetry::set_enabled(false);
    let jobs: Vec<(Option<String>, Enqueued)> = answers
        .into_iter()
        .map(|(caller, got)| (caller, got.expect("each call enqueues")))
        .collect();
    assert!(jobs.iter().all(|(_, e)| e.created));
    assert_eq!(
        g.calls.load(Ordering::SeqCst),
        2,
        "the first alone, then one shared statement"
    );
    let ids: Vec<Uuid> = jobs.iter().map(|(_, e)| e.job.job_id).collect();
    let tx = txids(&db, &ids).await;
    assert_eq!(tx[1], tx[2], "shared");
    assert_eq!(tx[2], tx[3], "shared");
    assert_ne!(tx[0], tx[1], "the first committed before the others were sent");
    let mut epochs: Vec<i64> = jobs.iter().map(|(_, e)| e.job.epoch).collect();
    epochs.sort();
    epochs.dedup();
    assert_eq!(epochs.len(), 4, "an epoch each");
    for (n, (caller, e)) in jobs.iter().enumerate() {
        assert_eq!(
            e.job.payload,
            json!({ "n": n }),
            "each call's answer is its own job"
        );
        let caller = caller.as_deref().expect("the caller's span is traced");
        let job = e.job.traceparent.as_deref().expect("the job is traced");
        assert_eq!(
            job.get(3..35),
            caller.get(3..35),
            "job {n} is in its own caller's trace"
        );
    }
    let mut traces: Vec<&str> = jobs.iter().map(|(c, _)| &c.as_deref().unwrap()[3..35]).collect();
    traces.sort();
    traces.dedup();
    assert_eq!(traces.len(), 4, "four callers, four traces");
    db.assert_verified().await;
}

/// A shared statement the database refuses wrote nothing: each of its calls
/// enqueues alone and gets its own answer, the refused job its refusal.
#[tokio::test]
async fn a_refused_shared_statement_leaves_each_call_its_own_answer() {
    let db = fresh().await;
    // A rule the ledger does not know of (an operator's, say): the database
    // refuses one job of the shared statement, so the statement.
    sqlx::raw_sql(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN RAISE EXCEPTION 'refused by the test''s rule'; END $$; \
         CREATE TRIGGER refuse BEFORE INSERT ON jobledger.jobs FOR EACH ROW \
         WHEN (NEW.payload ? 'refuse') EXECUTE FUNCTION public.refuse();",
    )
    .execute(db.ledger.pool())
    .await
    .unwrap();
    let mut g = gated(&db.ledger);
    let first = g.hold_first().await;
    let later: Vec<Call> = [json!({ "n": 1 }), json!({ "refuse": true }), json!({ "n": 3 })]
        .into_iter()
        .map(|p| call(&g.ledger, p))
        .collect();
    queued(&g.ledger, 3).await;
    g.release(first).await.1.expect("the first enqueues");
    let mut got = vec![];
    for c in later {
        got.push(within("a later call", c).await.unwrap().1);
    }
    let refused = got[1].as_ref().expect_err("the refused job's call fails");
    assert!(refused.contains("refused by the test's rule"), "{refused}");
    let (one, three) = (got[0].as_ref().unwrap(), got[2].as_ref().unwrap());
    assert_eq!(one.job.payload, json!({ "n": 1 }));
    assert_eq!(three.job.payload, json!({ "n": 3 }));
    // The first alone, the shared statement, then each of its three alone.
    assert_eq!(g.calls.load(Ordering::SeqCst), 5);
    let tx = txids(&db, &[one.job.job_id, three.job.job_id]).await;
    assert_ne!(tx[0], tx[1], "each enqueued alone after the refusal");
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 3);
    assert_eq!(db.count("SELECT count(*) FROM jobledger.events").await, 3);
    db.assert_verified().await;
}

/// A call whose caller stops waiting while it is queued (a timeout, an HTTP
/// client gone) takes its job back: nothing of it is written, so a retry
/// does not make it twice.
#[tokio::test]
async fn a_call_given_up_while_queued_writes_nothing() {
    let db = fresh().await;
    let mut g = gated(&db.ledger);
    let first = g.hold_first().await;
    let given_up = call(&g.ledger, json!({ "n": 1 }));
    let kept = call(&g.ledger, json!({ "n": 2 }));
    queued(&g.ledger, 2).await;
    given_up.abort();
    assert!(given_up.await.unwrap_err().is_cancelled());
    g.release(first).await.1.expect("the first enqueues");
    let kept = within("the kept call", kept)
        .await
        .unwrap()
        .1
        .expect("the kept call enqueues");
    assert_eq!(kept.job.payload, json!({ "n": 2 }));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs WHERE payload = '{\"n\": 1}'")
            .await,
        0,
        "the call given up wrote nothing"
    );
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 2);
    db.assert_verified().await;
}

/// Calls of different actors queued together are written one statement per
/// actor, each event naming its own call's actor.
#[tokio::test]
async fn queued_calls_of_two_actors_keep_their_actors() {
    let db = fresh().await;
    let mut g = gated(&db.ledger);
    let first = g.hold_first().await;
    let calls: Vec<_> = ["a", "b", "a"]
        .into_iter()
        .enumerate()
        .map(|(n, actor)| {
            let l = g.ledger.clone();
            tokio::spawn(async move {
                l.enqueue_as(new_job("q", None, json!({ "n": n + 1 })), actor)
                    .await
            })
        })
        .collect();
    queued(&g.ledger, 3).await;
    g.release(first).await.1.expect("the first enqueues");
    let mut ids = vec![];
    for (c, actor) in calls.into_iter().zip(["a", "b", "a"]) {
        let e = within("a call", c).await.unwrap().expect("each call enqueues");
        let got: String =
            sqlx::query_scalar("SELECT actor FROM jobledger.events WHERE job_id = $1 AND version = 1")
                .bind(e.job.job_id)
                .fetch_one(db.ledger.pool())
                .await
                .unwrap();
        assert_eq!(got, actor);
        ids.push(e.job.job_id);
    }
    let tx = txids(&db, &ids).await;
    assert_eq!(tx[0], tx[2], "the two calls of actor a share a statement");
    assert_ne!(tx[0], tx[1], "actor b's call has its own");
    db.assert_verified().await;
}

/// A shared task that dies (here a hook panics in it) answers its calls and
/// the queued ones with an error and gives its slot back: the next call
/// enqueues, nothing waits forever.
#[tokio::test]
async fn a_shared_task_that_dies_answers_its_calls_and_frees_its_slot() {
    let db = fresh().await;
    let mut g = gated_then(&db.ledger, true);
    let first = g.hold_first().await;
    let waiting = call(&g.ledger, json!({ "n": 1 }));
    queued(&g.ledger, 1).await;
    let first = g.release(first).await;
    let waiting = within("an answer", waiting).await.unwrap();
    for (_, got) in [first, waiting] {
        let err = got.expect_err("the task died");
        assert!(err.contains("crashed"), "{err}");
    }
    assert_eq!(g.ledger.enqueues_waiting(), 0);
    let next = within("the next call", call(&g.ledger, json!({ "n": 2 })))
        .await
        .unwrap()
        .1
        .expect("the slot was given back");
    assert_eq!(next.job.payload, json!({ "n": 2 }));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        1,
        "only the next call's job"
    );
    db.assert_verified().await;
}

/// A call alone in its statement, given up while the shared task waits for
/// a connection (the pool busy), writes nothing either (helper-34).
#[tokio::test]
async fn a_call_given_up_while_its_statement_waits_for_a_connection_writes_nothing() {
    let db = fresh().await;
    let ledger = Ledger::connect(&db.url, 1).await.unwrap();
    let held = ledger.pool().acquire().await.unwrap();
    let given_up = call(&ledger, json!({ "gone": 1 }));
    // Taken from the queue by a running task, which waits for the pool's
    // connection.
    let l = ledger.clone();
    eventually("the call taken by the shared task", || {
        let l = l.clone();
        async move { l.shared_enqueue_running() && l.enqueues_waiting() == 0 }
    })
    .await;
    given_up.abort();
    assert!(given_up.await.unwrap_err().is_cancelled());
    drop(held);
    let next = within("the next call", call(&ledger, json!({ "n": 1 })))
        .await
        .unwrap()
        .1
        .expect("the next call enqueues");
    assert_eq!(next.job.payload, json!({ "n": 1 }));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs WHERE payload ? 'gone'")
            .await,
        0,
        "the call given up wrote nothing"
    );
    assert_eq!(db.count("SELECT count(*) FROM jobledger.jobs").await, 1);
}
