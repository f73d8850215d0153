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
//! Every command's processes are found and signalled as a whole (its own
//! process group, plus every process carrying its environment tag:
//! `exec_procs`): a cancel, a lost lease, a shutdown and a dropped handler
//! reach the children `sh` started, not just `sh`. No outcome is written
//! until every one of them has exited. A cancel is confirmed only when no
//! process of the command ran after the stop: a command that takes
//! SIGTERM's default action is frozen with all its processes before it is
//! stopped; one that handles SIGTERM must stop its own processes before it
//! exits 143. Otherwise nobody can say what happened after the stop: the
//! job fails permanently and is dead (`exec_outlived`, or
//! `exec_group_killed` when the command ignored SIGTERM and was killed),
//! never `cancelled` and never retried.

use nix::sys::signal::Signal as NixSignal;
use serde_json::Value;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use super::exec_procs::{End, Procs, GRACE, TAG_VAR};
use super::handler::{HandlerFn, HandlerOutcome, JobContext, StopReason};

pub const EXIT_TRANSIENT: i32 = 75;
const MAX_OUTPUT: usize = 1024 * 1024;

pub fn exec_handler(command: &str) -> HandlerFn {
    let command = Arc::new(command.to_string());
    Arc::new(move |ctx| {
        let command = command.clone();
        Box::pin(async move { run(ctx, &command).await })
    })
}

async fn run(ctx: JobContext, command: &str) -> HandlerOutcome {
    let job = ctx.job();
    let tag = uuid::Uuid::new_v4().to_string();
    let mut cmd = Command::new("sh");
    // The handler's span, for the command to continue the job's trace
    // (the variable OpenTelemetry's environment propagation reads). Never
    // the worker's own TRACEPARENT: that would file every job under it.
    match ctx.traceparent() {
        Some(tp) => cmd.env("TRACEPARENT", tp),
        None => cmd.env_remove("TRACEPARENT"),
    };
    let mut child = match cmd
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
        .env(TAG_VAR, &tag)
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
    // The group's id is `sh`'s pid; the guard kills every process of the
    // command if this future is dropped (drain timeout, abort) before it ended.
    let mut procs = Procs::of(child.id(), tag);
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
    // A command that ignores its stop is killed `GRACE` after it.
    let mut stop_deadline: Option<tokio::time::Instant> = None;
    let status = loop {
        let deadline = async {
            match stop_deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            s = child.wait() => break s,
            _ = ctx.cancelled(), if !cancel_sent => {
                cancel_sent = true;
                match ctx.stop_reason() {
                    Some(StopReason::LeaseLost) => procs.kill_all(),
                    _ => {
                        procs.stop();
                        stop_deadline = Some(tokio::time::Instant::now() + GRACE);
                    }
                }
            }
            _ = deadline => {
                procs.force();
                stop_deadline = None;
            }
        }
    };
    // Children may outlive `sh` (and hold its pipes open): nothing is
    // decided until every process of the command is gone.
    let ended = procs.wait_gone().await;
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
        // A process went on after the command (or after its stop) with
        // SIGTERM caught or ignored: what it did is unknown, so the job must
        // not read as cancelled (no further side effect) or be retried.
        _ if ended == End::Killed => HandlerOutcome::Permanent {
            code: "exec_group_killed".into(),
            message: Some(format!(
                "a process of the command was still running {}s after SIGTERM; it was killed (side effects uncertain)",
                GRACE.as_secs()
            )),
        },
        _ if ended == End::Outlived => HandlerOutcome::Permanent {
            code: "exec_outlived".into(),
            message: Some(
                "the command handled SIGTERM but exited while some of its processes still ran; they were killed \
                 (side effects uncertain)"
                    .into(),
            ),
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
