//! The processes of one `worker --exec` command, found and signalled as a
//! whole.
//!
//! A command runs in a process group of its own, and its environment carries
//! a tag (`JOBLEDGER_EXEC_ID`, unique per run) that every descendant
//! inherits. A process belongs to the command when it is in the group *or*
//! carries the tag: `setsid`, `timeout` and job-control shells move their
//! children into new groups, but keep the environment. (A process that both
//! leaves the group and drops its environment escapes; only a cgroup could
//! hold it — see docs/guarantees.md.)
//!
//! A stop (cancel, shutdown) goes to the command itself (the top process,
//! `sh` or what it exec'd), as its contract says. When the command takes
//! SIGTERM's default action it dies at once and cannot wait for its
//! children, so first every process of the command is frozen (SIGSTOP, the
//! command first, rescanning until none runs: a frozen process cannot start
//! another), then the command gets SIGTERM and the rest SIGKILL: nothing of
//! the command runs after the stop. A command that handles SIGTERM itself
//! is trusted to stop its own processes before it exits; any still running
//! when it exited are killed and the stop counts as unconfirmed.
//!
//! Membership is read from `/proc`: `/proc/<pid>/stat` (after the command
//! name, which ends at the last `)`, come the state and then the parent and
//! group ids), `/proc/<pid>/environ` and `/proc/<pid>/status` (`SigBlk`,
//! `SigIgn`, `SigCgt`: whether SIGTERM ends the process). Zombies have done
//! all they will do; they are left to whoever reaps them.

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use std::time::Duration;

/// The environment variable that tags a command's processes.
pub const TAG_VAR: &str = "JOBLEDGER_EXEC_ID";

/// How long the command's processes get after SIGTERM (or after the command
/// itself exited) before the next signal.
pub const GRACE: Duration = Duration::from_secs(3);

/// How the command's processes ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Every process exited by itself, or was stopped before it could act
    /// again.
    Exited,
    /// The command handles SIGTERM itself and exited while some of its
    /// processes were still running: they may have acted after the stop.
    /// They were killed.
    Outlived,
    /// Some process was still running `GRACE` after SIGTERM and was killed.
    Killed,
}

/// How a stop was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stopping {
    No,
    /// The command handles SIGTERM: it alone got it, and its exit status
    /// says whether it stopped safely (its contract: it waits for its own
    /// processes first).
    TrustTop,
    /// The command takes SIGTERM's default action: every process of it was
    /// frozen (SIGSTOP) before the command got SIGTERM, and the others were
    /// then killed, so none of them ran after the stop.
    Frozen,
}

/// One live process of the command.
struct Member {
    pid: i32,
    stopped: bool,
}

/// The command's processes; freezes and kills them all when dropped before
/// they were seen gone (a dropped handler: worker drain timeout, abort).
pub struct Procs {
    top: Option<i32>,
    /// The command itself exited (and was reaped): its pid is no longer its.
    top_exited: bool,
    /// Killed because it ignored a stop.
    forced: bool,
    tag: String,
    stopping: Stopping,
    /// Test hook: sees every process of the command (pid, frozen) at the
    /// instant between the freeze and the signals of a default-action stop.
    #[cfg(test)]
    before_kills: Option<BeforeKills>,
}

/// `(pid, frozen)` of every process of the command.
#[cfg(test)]
type BeforeKills = Box<dyn FnMut(Vec<(i32, bool)>) + Send>;

impl Procs {
    /// `pid` is the command's (its group's id); `tag` the value of `TAG_VAR`
    /// in its environment.
    pub fn of(pid: Option<u32>, tag: String) -> Self {
        Procs {
            top: pid.map(|p| p as i32),
            top_exited: false,
            forced: false,
            tag,
            stopping: Stopping::No,
            #[cfg(test)]
            before_kills: None,
        }
    }

    /// A cancel or a shutdown: asks the command to stop with SIGTERM.
    pub fn stop(&mut self) {
        let Some(top) = self.top else { return };
        // Frozen before its disposition is read: a command that installs a
        // SIGTERM handler between the read and the stop would otherwise be
        // treated as one that dies at once, and run its handler (and any
        // side effect in it) after a stop that counted as confirmed.
        let _ = kill(Pid::from_raw(top), Signal::SIGSTOP);
        // SIGSTOP takes effect on the process's way back to user mode: until
        // `/proc` shows it stopped, a `sigaction` on the other core may still
        // land after the read. Never seen stopped (in uninterruptible sleep
        // for 200 ms): treated as handled, so never confirmed by freezing.
        // Gone: it can install nothing any more; its processes are frozen.
        let settled = wait_stopped(top);
        if settled && matches!(term_disposition(top), Disposition::Default) {
            if !self.freeze() {
                self.forced = true; // some process may still run: never confirmed
            }
            #[cfg(test)]
            if let Some(h) = self.before_kills.as_mut() {
                h(members(top, &self.tag)
                    .into_iter()
                    .map(|m| (m.pid, m.stopped))
                    .collect());
            }
            let _ = kill(Pid::from_raw(top), Signal::SIGTERM);
            let _ = kill(Pid::from_raw(top), Signal::SIGCONT);
            for m in members(top, &self.tag).into_iter().filter(|m| m.pid != top) {
                let _ = kill(Pid::from_raw(m.pid), Signal::SIGKILL);
            }
            self.stopping = Stopping::Frozen;
        } else {
            // Pending while it is stopped; its handler runs once it goes on.
            let _ = kill(Pid::from_raw(top), Signal::SIGTERM);
            let _ = kill(Pid::from_raw(top), Signal::SIGCONT);
            self.stopping = Stopping::TrustTop;
        }
    }

    /// The command ignored its stop for `GRACE`: everything is killed, and
    /// the end is `Killed`.
    pub fn force(&mut self) {
        self.kill_all();
        self.forced = true;
    }

    /// A lost lease: nothing the command does counts any more.
    pub fn kill_all(&mut self) {
        let _ = self.freeze();
        self.signal_all(Signal::SIGKILL);
        self.stopping = Stopping::Frozen;
    }

    /// Freezes the command and then every process of it, rescanning until
    /// no unfrozen one is left: a frozen process cannot start another.
    /// False when processes were still starting after 100 rescans (a fork
    /// storm): then nothing proves none of them acts after the stop.
    #[must_use]
    fn freeze(&self) -> bool {
        let Some(top) = self.top else { return true };
        if !self.top_exited {
            let _ = kill(Pid::from_raw(top), Signal::SIGSTOP);
        }
        for _ in 0..100 {
            let running: Vec<Member> = members(top, &self.tag)
                .into_iter()
                .filter(|m| !m.stopped)
                .collect();
            if running.is_empty() {
                return true;
            }
            for m in running {
                let _ = kill(Pid::from_raw(m.pid), Signal::SIGSTOP);
            }
        }
        false
    }

    fn signal_all(&self, sig: Signal) {
        let Some(top) = self.top else { return };
        let _ = killpg(Pid::from_raw(top), sig);
        for m in members(top, &self.tag) {
            let _ = kill(Pid::from_raw(m.pid), sig);
        }
    }

    /// Called once the command itself exited: waits until none of its
    /// processes is alive. After a stop the command trusted with SIGTERM
    /// (it handles it), any process still running outlived it and is
    /// killed. Without a stop, leftovers get SIGTERM after `GRACE`; whatever
    /// is left `GRACE` after SIGTERM is killed.
    pub async fn wait_gone(&mut self) -> End {
        let Some(top) = self.top else {
            return End::Exited;
        };
        self.top_exited = true;
        let mut end = if self.forced { End::Killed } else { End::Exited };
        if self.stopping == Stopping::TrustTop && !members(top, &self.tag).is_empty() {
            self.kill_all();
            end = End::Outlived;
        }
        let mut term_sent = self.stopping != Stopping::No;
        let mut deadline = tokio::time::Instant::now() + GRACE;
        while !members(top, &self.tag).is_empty() {
            if tokio::time::Instant::now() >= deadline {
                if term_sent {
                    self.kill_all();
                    end = End::Killed;
                } else {
                    self.signal_all(Signal::SIGTERM);
                    term_sent = true;
                }
                deadline = tokio::time::Instant::now() + GRACE;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.top = None;
        end
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// The live processes in group `pgid` or carrying `TAG_VAR=tag`.
fn members(pgid: i32, tag: &str) -> Vec<Member> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        // No procfs: the group alone, as one opaque member.
        return match killpg(Pid::from_raw(pgid), None) {
            Ok(()) => vec![Member {
                pid: -pgid,
                stopped: false,
            }],
            Err(_) => vec![],
        };
    };
    let needle = format!("{TAG_VAR}={tag}");
    let me = std::process::id() as i32;
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (_, rest) = stat.rsplit_once(')')?;
            let mut f = rest.split_whitespace();
            let state = f.next()?;
            let pgrp = f.nth(1)?.parse::<i32>().ok()?;
            if matches!(state, "Z" | "X") {
                return None;
            }
            let tagged = || {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()))
            };
            (pgrp == pgid || tagged()).then_some(Member {
                pid,
                stopped: state == "T",
            })
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Disposition {
    /// SIGTERM ends the process.
    Default,
    /// The process catches, ignores or blocks SIGTERM (or it is unknown).
    Handled,
}

/// Waits (up to 200 ms) until `pid` is stopped (state `T`) or gone (a
/// zombie, or reaped): true then, false while it still runs.
fn wait_stopped(pid: i32) -> bool {
    for _ in 0..200 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return true;
        };
        match stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
        {
            Some("T" | "t" | "Z" | "X") | None => return true,
            Some(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    false
}

/// What SIGTERM does to `pid`, from `/proc/<pid>/status`.
fn term_disposition(pid: i32) -> Disposition {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Disposition::Handled;
    };
    let term: u64 = 1 << (Signal::SIGTERM as u64 - 1);
    let handled = ["SigBlk:", "SigIgn:", "SigCgt:"].iter().any(|field| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_none_or(|mask| mask & term != 0)
    });
    if handled {
        Disposition::Handled
    } else {
        Disposition::Default
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::sync::{Arc, Mutex};

    /// Issue 10: a command with SIGTERM's default action has every process
    /// frozen before any of them is signalled, so none can act between the
    /// stop and its kill (a later kill alone leaves that window open).
    #[test]
    fn a_default_action_stop_freezes_every_process_before_signalling() {
        let tag = format!("freeze-test-{}", std::process::id());
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("sleep 30 & sleep 30 & wait")
            .env(TAG_VAR, &tag)
            .process_group(0)
            .spawn()
            .expect("sh");
        let top = child.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while members(top, &tag).len() < 3 {
            assert!(std::time::Instant::now() < deadline, "the two sleeps start");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let seen: Arc<Mutex<Vec<(i32, bool)>>> = Arc::default();
        let mut procs = Procs::of(Some(top as u32), tag.clone());
        let record = seen.clone();
        procs.before_kills = Some(Box::new(move |m| *record.lock().unwrap() = m));
        procs.stop();
        let seen = seen.lock().unwrap().clone();
        assert!(
            seen.len() >= 3,
            "the hook saw the command and its children: {seen:?}"
        );
        assert!(
            seen.iter().all(|(_, frozen)| *frozen),
            "every process frozen before any signal: {seen:?}"
        );
        let _ = child.wait();
        assert_eq!(procs.stopping, Stopping::Frozen);
    }
}
