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

use nix::sys::signal::{kill, Signal as NixSignal};
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
                    Some(StopReason::LeaseLost) => { let _ = child.start_kill(); }
                    _ => terminate(&child),
                }
            }
        }
    };
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

fn terminate(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = kill(Pid::from_raw(pid as i32), NixSignal::SIGTERM);
    }
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
