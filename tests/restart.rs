//! Issue 10 item 4: a worker process that died (kill -9) and a new one in
//! its place: the new process has its own holder id, never renews the dead
//! one's leases, and takes its jobs over (reconcile) once they expire.

mod common;

use common::{eventually, fresh};
use jobledger::domain::{EventBody, JobState};
use serde_json::json;
use std::process::{Child, Command};

fn worker_process(db: &common::TestDb, cmd: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args([
            "worker",
            "--queue",
            "q",
            "--exec",
            cmd,
            "--lease",
            "2s",
            "--heartbeat",
            "200ms",
        ])
        .args(["--poll", "50ms", "--no-sweeper"])
        .env("DATABASE_URL", &db.url)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the worker binary starts")
}

#[tokio::test]
async fn a_restarted_worker_never_renews_its_predecessors_leases() {
    let db = fresh().await;
    let dir = std::env::temp_dir().join(format!("jl-restart-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let pid_file = dir.join("pid");
    let job = db.enqueue(Some("long"), json!({})).await;
    let mut a = worker_process(&db, &format!("echo $$ > {}; exec sleep 30", pid_file.display()));
    eventually("A runs the job", || async {
        pid_file.exists() && db.state_of(job.job_id).await == JobState::Leased
    })
    .await;
    let held = db.job(job.job_id).await;
    eventually("A renews its lease", || async {
        db.job(job.job_id).await.lease_until > held.lease_until
    })
    .await;
    a.kill().unwrap(); // kill -9: no drain, no release
    a.wait().unwrap();
    let last = db.job(job.job_id).await; // A's last renewal
    let mut b = worker_process(&db, "true");
    eventually("B takes the job over and finishes it", || async {
        db.state_of(job.job_id).await == JobState::Succeeded
    })
    .await;
    let _ = b.kill();
    let _ = b.wait();
    if let Ok(pid) = std::fs::read_to_string(&pid_file) {
        let _ = Command::new("kill").args(["-9", pid.trim()]).status(); // A's orphaned command
    }
    let history = db.ledger.history(job.job_id).await.unwrap();
    let takeover = history
        .iter()
        .find(|h| matches!(h.event.body, EventBody::TakenOver { .. }))
        .expect("B took the job over (it did not adopt A's lease)");
    assert_ne!(
        takeover.event.actor,
        last.holder.clone().unwrap(),
        "B has a holder id of its own"
    );
    assert_eq!(takeover.event.token, last.token + 1);
    assert!(
        takeover.event.recorded_at >= last.lease_until.unwrap(),
        "only after A's lease expired: nobody renewed it ({} < {})",
        takeover.event.recorded_at,
        last.lease_until.unwrap()
    );
    let renewals_after_death = history
        .iter()
        .filter(|h| h.event.version > last.version && h.event.token == last.token)
        .count();
    assert_eq!(
        renewals_after_death, 0,
        "no write for A's token after A died: {history:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
