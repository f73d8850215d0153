//! `jobledger worker --exec`: the exit-status contract of the exec handler,
//! through a real Worker and real shell commands.

mod common;

use common::{eventually, fresh, new_job};
use jobledger::domain::{ErrorClass, JobState, Policy, Reason};
use jobledger::worker::exec::exec_handler;
use jobledger::worker::Worker;
use serde_json::json;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

async fn run_one(db: &common::TestDb, command: &str, payload: serde_json::Value) -> jobledger::domain::Job {
    let mut n = new_job("q", Some("key-1"), payload);
    n.policy = Some(Policy {
        max_attempts: 2,
        backoff_base_ms: 3_600_000,
        backoff_cap_ms: 3_600_000,
        ..Policy::default()
    });
    let job = db.ledger.enqueue(n).await.unwrap().job;
    let w = Worker::builder(db.ledger.clone())
        .queue("q")
        .poll_every(Duration::from_millis(20))
        .sweeper(None)
        .any_kind(exec_handler(command))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let h = tokio::spawn(async move { w.run(s).await.unwrap() });
    eventually("the command ran", || async {
        db.job(job.job_id).await.attempt == 1 && !db.job(job.job_id).await.state.is_held()
    })
    .await;
    stop.cancel();
    h.await.unwrap();
    db.job(job.job_id).await
}

#[tokio::test]
async fn exit_zero_is_success_with_stdout_as_the_result() {
    let db = fresh().await;
    let cmd = r#"amount=$(cat | sed 's/[^0-9]//g'); printf '{"amount": %s, "key": "%s", "attempt": %s, "next": "%s"}' "$amount" "$JOBLEDGER_KEY" "$JOBLEDGER_ATTEMPT" "$JOBLEDGER_NEXT_ACTION""#;
    let j = run_one(&db, cmd, json!({"amount": 42})).await;
    assert_eq!(j.state, JobState::Succeeded);
    assert_eq!(
        j.result.unwrap(),
        json!({"amount": 42, "key": "key-1", "attempt": 1, "next": "execute"})
    );

    let db = fresh().await;
    let j = run_one(&db, "echo plain text", json!({})).await;
    assert_eq!(j.result.unwrap(), json!("plain text"));
}

#[tokio::test]
async fn exit_75_is_transient() {
    let db = fresh().await;
    let j = run_one(&db, "echo 'provider busy' >&2; exit 75", json!({})).await;
    assert_eq!((j.state, j.reason), (JobState::Queued, Reason::RetryScheduled));
    let e = j.last_error.unwrap();
    assert_eq!(
        (e.class, e.code.as_str(), e.message.as_deref()),
        (ErrorClass::Transient, "exit_75", Some("provider busy"))
    );
}

#[tokio::test]
async fn other_exit_codes_are_permanent() {
    let db = fresh().await;
    let j = run_one(&db, "echo 'bad request' >&2; exit 3", json!({})).await;
    assert_eq!((j.state, j.reason), (JobState::Dead, Reason::PermanentError));
    let e = j.last_error.unwrap();
    assert_eq!((e.class, e.code.as_str()), (ErrorClass::Permanent, "exit_3"));
}

#[tokio::test]
async fn a_cancel_terminates_the_command_and_is_confirmed() {
    let db = fresh().await;
    let mark = std::env::temp_dir().join(format!("jl-exec-{}", uuid::Uuid::new_v4()));
    let cmd = format!(
        "trap 'exit 143' TERM; touch {}; while :; do sleep 0.02; done",
        mark.display()
    );
    let job = db.enqueue(None, json!({})).await;
    let w = Worker::builder(db.ledger.clone())
        .queue("q")
        .poll_every(Duration::from_millis(20))
        .sweeper(None)
        .any_kind(exec_handler(&cmd))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let h = tokio::spawn(async move { w.run(s).await.unwrap() });
    eventually("the command started", || async { mark.exists() }).await;
    db.ledger.cancel(job.job_id, None).await.unwrap();
    eventually("the cancel is confirmed", || async {
        db.state_of(job.job_id).await == JobState::Cancelled
    })
    .await;
    stop.cancel();
    let report = h.await.unwrap();
    assert_eq!(report.cancelled, 1);
    assert_eq!(db.job(job.job_id).await.reason, Reason::CancelConfirmed);
    let _ = std::fs::remove_file(mark);
}

async fn http_get(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    Some(out)
}

/// `jobledger worker --exec ... --metrics-addr`: the Prometheus endpoint
/// shows what the seeds ask to watch; SIGTERM drains and exits cleanly.
#[tokio::test]
async fn the_worker_binary_serves_metrics_and_stops_on_sigterm() {
    let db = fresh().await;
    for i in 0..3 {
        db.enqueue(Some(&format!("m{i}")), json!({"i": i})).await;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args([
            "worker",
            "--queue",
            "q",
            "--exec",
            "cat",
            "--poll",
            "50ms",
            "--heartbeat",
            "1s",
            "--lease",
            "5s",
        ])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &db.url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    eventually("the jobs are done", || async { db.open_jobs().await == 0 }).await;
    eventually("the sweeper refreshed the gauges", || async {
        http_get(port, "/metrics")
            .await
            .unwrap_or_default()
            .contains("jobledger_jobs{state=\"succeeded\"} 3")
    })
    .await;
    let body = http_get(port, "/metrics").await.unwrap();
    for name in [
        "jobledger_claimed_total",
        "jobledger_handler_runs_total{kind=\"refund\",next_action=\"execute\"} 3",
        "jobledger_outcomes_total{outcome=\"committed\"} 3",
        "jobledger_claim_seconds",
        "jobledger_complete_seconds",
    ] {
        assert!(body.contains(name), "{name} missing from:\n{body}");
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["succeeded"], 3);
}

/// Whether process `pid` is alive (exists and is not a zombie).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().chars().next())
        })
        .is_some_and(|state| state != Some('Z') && state != Some('X'))
}

/// Waits for `path` to hold a pid, and answers it.
async fn pid_in(path: &std::path::Path) -> i32 {
    eventually("the command wrote its pid", || async {
        std::fs::read_to_string(path).is_ok_and(|s| s.trim().parse::<i32>().is_ok())
    })
    .await;
    std::fs::read_to_string(path).unwrap().trim().parse().unwrap()
}

fn scratch(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("jl-exec-{name}-{}", uuid::Uuid::new_v4()))
}

fn exec_worker(
    db: &common::TestDb,
    cmd: &str,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<jobledger::worker::WorkerReport>,
) {
    let w = Worker::builder(db.ledger.clone())
        .queue("q")
        .poll_every(Duration::from_millis(20))
        .sweeper(None)
        .drain_timeout(Duration::from_millis(300))
        .heartbeat_every(Duration::from_millis(100))
        .any_kind(exec_handler(cmd))
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    (stop, tokio::spawn(async move { w.run(s).await.unwrap() }))
}

/// Issue 9 item 5: the command's child makes its side effect 1.5 s after it
/// starts; the job is cancelled as soon as the child runs. Either the job is
/// `cancelled` and the effect never appears (every process of the command is
/// gone), or the effect may appear and the job is not `cancelled`. Children
/// that leave the process group (`timeout`, `setsid`) are still found (the
/// environment tag); children that ignore or catch SIGTERM are frozen before
/// the stop; a command that handles SIGTERM but leaves a child running is
/// dead (`exec_outlived`), never `cancelled`.
#[tokio::test]
async fn a_cancel_is_confirmed_only_when_no_process_of_the_command_can_act_after_it() {
    // (command, the outcome it must get; None: either, as long as the
    // invariant holds). The child writes its own pid.
    let child = "sh -c 'echo $$ > {pid}; sleep 1.5; echo effect >> {effect}'";
    type Expected = Option<(JobState, Option<&'static str>)>;
    let cases: Vec<(String, Expected)> = vec![
        // sh takes SIGTERM's default action: everything is frozen first.
        (format!("{child}; true"), Some((JobState::Cancelled, None))),
        (format!("{child} & wait"), Some((JobState::Cancelled, None))),
        (format!("setsid {child} & wait"), Some((JobState::Cancelled, None))),
        (
            "(trap '' TERM; echo $$ > {pid}; sleep 1.5; echo effect >> {effect}) & wait".to_string(),
            Some((JobState::Cancelled, None)),
        ),
        (
            "(trap 'echo effect >> {effect}; exit 0' TERM; echo $$ > {pid}; while :; do sleep 0.05; done) & wait"
                .to_string(),
            Some((JobState::Cancelled, None)),
        ),
        // `timeout` handles SIGTERM itself and moves its child to a new
        // group (the environment tag still finds it).
        (format!("timeout 30 {child}"), None),
        // The command handles SIGTERM but exits without stopping its child.
        (
            format!("trap 'exit 143' TERM; {child} & while :; do sleep 0.05; done"),
            Some((JobState::Dead, Some("exec_outlived"))),
        ),
    ];
    for (template, expected) in cases {
        let db = fresh().await;
        let (pid_file, effect) = (scratch("pid"), scratch("effect"));
        let cmd = template
            .replace("{pid}", &pid_file.display().to_string())
            .replace("{effect}", &effect.display().to_string());
        let job = db.enqueue(None, json!({})).await;
        let (stop, h) = exec_worker(&db, &cmd);
        let child = pid_in(&pid_file).await;
        db.ledger.cancel(job.job_id, None).await.unwrap();
        eventually("the job ended", || async {
            db.job(job.job_id).await.state.is_terminal()
        })
        .await;
        let j = db.job(job.job_id).await;
        // Decided by processes, not by time: the outcome is written only
        // once every process of the command is gone, so no effect can
        // appear any more.
        assert!(!alive(child), "{cmd}: a process outlived the outcome");
        if j.state == JobState::Cancelled {
            assert!(
                !effect.exists(),
                "{cmd}: the side effect happened after a confirmed cancel"
            );
        }
        if let Some((state, code)) = expected {
            assert_eq!(j.state, state, "{cmd}");
            if let Some(code) = code {
                assert_eq!(j.last_error.unwrap().code, code, "{cmd}");
            }
        }
        stop.cancel();
        h.await.unwrap();
        let _ = std::fs::remove_file(pid_file);
        let _ = std::fs::remove_file(effect);
    }
}

/// A command that ignores SIGTERM is killed after the grace period; nobody
/// can say what it did meanwhile, so the job is dead (`exec_group_killed`),
/// never `cancelled`.
#[tokio::test]
async fn a_command_ignoring_sigterm_is_killed_and_the_cancel_is_not_confirmed() {
    let db = fresh().await;
    let pid_file = scratch("pid");
    let cmd = format!(
        "trap '' TERM; sh -c 'echo $$ > {pid}; while :; do sleep 0.05; done'",
        pid = pid_file.display()
    );
    let job = db.enqueue(None, json!({})).await;
    let (stop, h) = exec_worker(&db, &cmd);
    let child = pid_in(&pid_file).await;
    db.ledger.cancel(job.job_id, None).await.unwrap();
    eventually("the job ended", || async {
        db.job(job.job_id).await.state.is_terminal()
    })
    .await;
    let j = db.job(job.job_id).await;
    assert_eq!((j.state, j.reason), (JobState::Dead, Reason::PermanentError));
    assert_eq!(j.last_error.unwrap().code, "exec_group_killed");
    assert!(!alive(child));
    stop.cancel();
    h.await.unwrap();
    let _ = std::fs::remove_file(pid_file);
}

/// A worker that stops while a command runs past its drain timeout leaves
/// no process of the command behind (the handler is dropped: the group is
/// killed), and a lost lease kills the group too.
#[tokio::test]
async fn shutdown_and_a_lost_lease_leave_no_process_behind() {
    let db = fresh().await;
    let pid_file = scratch("pid");
    let cmd = format!(
        "sh -c 'trap \"\" TERM; echo $$ > {pid}; while :; do sleep 0.05; done'; true",
        pid = pid_file.display()
    );
    db.enqueue(None, json!({})).await;
    let (stop, h) = exec_worker(&db, &cmd);
    let child = pid_in(&pid_file).await;
    stop.cancel();
    h.await.unwrap();
    assert!(!alive(child), "the command's child outlived the worker");

    let _ = std::fs::remove_file(&pid_file);
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let (stop, h) = exec_worker(&db, &cmd);
    let child = pid_in(&pid_file).await;
    // Another holder takes the job over: the worker's next heartbeat or
    // step is refused and the command's group is killed.
    db.expire_lease(job.job_id).await;
    let (r, _) = db
        .ledger
        .claim_job(job.job_id, "thief", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(r.committed());
    eventually("the group is gone", || async { !alive(child) }).await;
    stop.cancel();
    h.await.unwrap();
    let _ = std::fs::remove_file(pid_file);
}
