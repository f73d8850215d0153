//! A handler that runs a shell command per job, so any language can work
//! jobs: the payload on stdin, the job's fields in environment variables.
//!
//! Exit status contract:
//! - 0: success; stdout is the result (JSON if it parses, else a string)
//! - 75 (EX_TEMPFAIL): transient failure, retried with backoff
//! - after a cancel request the command gets SIGTERM; if it then exits by
//!   that signal or with 143, the cancel is confirmed (it stopped at a safe
//!   point); exit 0 still means it finished (`cancel_after_submit`)
//! - anything else: permanent failure (`exit_<code>`, stderr's tail as message)
//!
//! When the lease is lost the command is killed (SIGKILL): nothing it does
//! can be recorded any more.
//!
//! Every command runs in a process group of its own, and every signal goes
//! to the whole group: a cancel, a lost lease, a shutdown and a dropped
//! handler reach the children `sh` started, not just `sh`. No outcome is
//! written until every process of the group has exited: a cancel is
//! confirmed only when the command stopped on SIGTERM and none of its
//! processes outlived it. A process that ignores SIGTERM is killed after a
//! grace period, and then nobody can say what it did: the job fails
//! permanently (`exec_group_killed`, dead), never `cancelled`.

use nix::sys::signal::{killpg, Signal as NixSignal};
use nix::unistd::Pid;
use serde_json::Value;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use super::handler::{HandlerFn, HandlerOutcome, JobContext, StopReason};

pub const EXIT_TRANSIENT: i32 = 75;
const MAX_OUTPUT: usize = 1024 * 1024;
/// How long the group's processes get to exit after SIGTERM (or after `sh`
/// itself exited) before the next signal.
const GROUP_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

pub fn exec_handler(command: &str) -> HandlerFn {
    let command = Arc::new(command.to_string());
    Arc::new(move |ctx| {
        let command = command.clone();
        Box::pin(async move { run(ctx, &command).await })
    })
}

async fn run(ctx: JobContext, command: &str) -> HandlerOutcome {
    let job = ctx.job();
    let mut child = match Command::new("sh")
        .arg("-c")
        .arg(command)
        .env("JOBLEDGER_JOB_ID", job.job_id.to_string())
        .env("JOBLEDGER_QUEUE", &job.queue)
        .env("JOBLEDGER_KIND", &job.kind)
        .env("JOBLEDGER_KEY", job.job_key.as_deref().unwrap_or(""))
        .env("JOBLEDGER_EPOCH", job.epoch.to_string())
        .env("JOBLEDGER_TOKEN", job.token.to_string())
        .env("JOBLEDGER_ATTEMPT", job.attempt.to_string())
        .env("JOBLEDGER_RUN", job.run.to_string())
        .env("JOBLEDGER_NEXT_ACTION", job.next_action.as_str())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            return HandlerOutcome::Transient {
                code: "exec_spawn_failed".into(),
                message: Some(e.to_string()),
            }
        }
    };
    // The group's id is `sh`'s pid; the guard kills the whole group if this
    // future is dropped (worker drain timeout, abort) before it ended.
    let mut group = Group::of(child.id());
    let payload = serde_json::to_vec(&job.payload).unwrap_or_default();
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    // Feed and drain concurrently so a chatty command cannot deadlock on a
    // full pipe.
    let feed = tokio::spawn(async move {
        let _ = stdin.write_all(&payload).await;
    });
    let out = tokio::spawn(async move { read_capped(&mut stdout).await });
    let err = tokio::spawn(async move { read_capped(&mut stderr).await });

    let mut cancel_sent = false;
    let status = loop {
        tokio::select! {
            s = child.wait() => break s,
            _ = ctx.cancelled(), if !cancel_sent => {
                cancel_sent = true;
                match ctx.stop_reason() {
                    Some(StopReason::LeaseLost) => group.signal(NixSignal::SIGKILL),
                    _ => group.signal(NixSignal::SIGTERM),
                }
            }
        }
    };
    // Children may outlive `sh` (and hold its pipes open): nothing is
    // decided until the whole group is gone.
    let ended = group.wait_empty(cancel_sent).await;
    let _ = feed.await;
    let stdout = out.await.unwrap_or_default();
    let stderr = err.await.unwrap_or_default();
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            return HandlerOutcome::Transient {
                code: "exec_wait_failed".into(),
                message: Some(e.to_string()),
            }
        }
    };
    if ctx.stop_reason() == Some(StopReason::LeaseLost) {
        return HandlerOutcome::LeaseLost;
    }
    let tail = tail(&stderr);
    let terminated = status.signal() == Some(libc_sigterm()) || status.code() == Some(143);
    match status.code() {
        Some(0) => HandlerOutcome::Success(Some(result_of(&stdout))),
        // A process had to be killed: what it did before is unknown, so the
        // job must not read as cancelled (no further side effect) or retried.
        _ if ended == GroupEnd::Killed => HandlerOutcome::Permanent {
            code: "exec_group_killed".into(),
            message: Some(format!(
                "a process of the command outlived it and ignored SIGTERM for {}s; it was killed (side effects uncertain)",
                GROUP_GRACE.as_secs()
            )),
        },
        _ if cancel_sent && terminated && ctx.stop_reason() == Some(StopReason::CancelRequested) => {
            HandlerOutcome::Cancelled
        }
        Some(EXIT_TRANSIENT) => HandlerOutcome::Transient {
            code: "exit_75".into(),
            message: tail,
        },
        Some(code) => HandlerOutcome::Permanent {
            code: format!("exit_{code}"),
            message: tail,
        },
        None => HandlerOutcome::Transient {
            code: format!("killed_by_signal_{}", status.signal().unwrap_or(0)),
            message: tail,
        },
    }
}

fn libc_sigterm() -> i32 {
    NixSignal::SIGTERM as i32
}

/// How the command's process group ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GroupEnd {
    /// Every process exited by itself (or on the SIGTERM it was sent).
    Exited,
    /// Some process ignored SIGTERM past the grace period and was killed.
    Killed,
}

/// The command's process group; kills it (SIGKILL) when dropped before
/// every process in it was seen gone.
struct Group {
    pgid: Option<i32>,
}

impl Group {
    fn of(pid: Option<u32>) -> Self {
        Group {
            pgid: pid.map(|p| p as i32),
        }
    }

    fn signal(&self, sig: NixSignal) {
        if let Some(g) = self.pgid {
            let _ = killpg(Pid::from_raw(g), sig);
        }
    }

    /// Waits until no process of the group is alive. Stragglers get SIGTERM
    /// (unless `term_sent`), then SIGKILL, each after `GROUP_GRACE`.
    async fn wait_empty(&mut self, mut term_sent: bool) -> GroupEnd {
        let Some(g) = self.pgid else {
            return GroupEnd::Exited;
        };
        let mut end = GroupEnd::Exited;
        let mut deadline = tokio::time::Instant::now() + GROUP_GRACE;
        while group_alive(g) {
            if tokio::time::Instant::now() >= deadline {
                if term_sent {
                    self.signal(NixSignal::SIGKILL);
                    end = GroupEnd::Killed;
                } else {
                    self.signal(NixSignal::SIGTERM);
                    term_sent = true;
                }
                deadline = tokio::time::Instant::now() + GROUP_GRACE;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        self.pgid = None;
        end
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.signal(NixSignal::SIGKILL);
    }
}

/// Whether any process of group `pgid` is alive (not a zombie). Reads
/// `/proc/<pid>/stat`: after the command name, which ends at the last `)`,
/// come the state and then the parent and group ids. Zombies have done all
/// they will do; they are left to whoever reaps them.
fn group_alive(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        // No procfs: fall back to "does the group exist at all".
        return killpg(Pid::from_raw(pgid), None).is_ok();
    };
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .any(|stat| {
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let mut f = rest.split_whitespace();
            let state = f.next();
            let pgrp = f.nth(1).and_then(|p| p.parse::<i32>().ok());
            pgrp == Some(pgid) && !matches!(state, Some("Z") | Some("X"))
        })
}

async fn read_capped<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return buf,
            Ok(n) if buf.len() < MAX_OUTPUT => buf.extend_from_slice(&chunk[..n.min(MAX_OUTPUT - buf.len())]),
            Ok(_) => {} // keep draining, stop keeping
        }
    }
}

fn result_of(stdout: &[u8]) -> Value {
    let text = String::from_utf8_lossy(stdout);
    let trimmed = text.trim();
    serde_json::from_str(trimmed).unwrap_or_else(|_| Value::String(trimmed.to_string()))
}

fn tail(stderr: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(stderr);
    let t = text.trim();
    if t.is_empty() {
        return None;
    }
    let start = t.char_indices().rev().nth(999).map_or(0, |(i, _)| i);
    Some(t[start..].to_string())
}
