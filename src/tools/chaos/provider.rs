//! The chaos run's fake refund provider: a line protocol on a loopback port,
//! served by the orchestrator (which no fault touches), so worker processes
//! that die or freeze are just unreliable clients of it, as in production.
//!
//! It has no idempotency of its own: every accepted REFUND executes, so a
//! duplicate is visible in its log. It misbehaves on purpose: some calls fail
//! transiently (nothing executed), some execute and never answer (the
//! connection closes), some execute and answer late. It refuses work whose
//! deadline passed: a worker passes its lease end, so a frozen worker that
//! wakes after its successor reconciled cannot execute behind its back.
//!
//! Requests, one per connection:
//!   `REFUND <key> <job_id> <epoch> <token> <deadline_unix_ms> <refuse 0|1>`
//!     → `OK <refund_id>` | `TRANSIENT` | `PERMANENT <code>` | `EXPIRED` | nothing
//!   `LOOKUP <key>` → `FOUND <refund_id>` | `NONE`

use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// One executed refund, as the provider recorded it.
#[derive(Clone, Debug)]
pub struct Execution {
    pub key: String,
    pub refund_id: String,
    pub job_id: String,
    pub epoch: i64,
    pub token: i64,
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ProviderStats {
    pub refund_calls: u64,
    pub lookups: u64,
    pub executed: u64,
    pub transient: u64,
    pub lost_responses: u64,
    pub late_responses: u64,
    pub refused: u64,
    pub expired: u64,
}

/// How often the provider misbehaves, per REFUND call.
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    pub transient: f64,
    pub lost: f64,
    pub late: f64,
    pub late_by: Duration,
}

struct State {
    rng: StdRng,
    faults: Faults,
    executions: Vec<Execution>,
    by_key: HashMap<String, String>,
    stats: ProviderStats,
}

#[derive(Clone)]
pub struct Provider {
    state: Arc<Mutex<State>>,
}

enum Answer {
    /// After the provider's usual latency.
    Now(String),
    Late(String, Duration),
    Never,
}

impl Provider {
    pub fn new(seed: u64, faults: Faults) -> Self {
        Provider {
            state: Arc::new(Mutex::new(State {
                rng: StdRng::seed_from_u64(seed),
                faults,
                executions: vec![],
                by_key: HashMap::new(),
                stats: ProviderStats::default(),
            })),
        }
    }

    /// Serves on an ephemeral loopback port until `stop`; answers the address.
    pub async fn serve(&self, stop: CancellationToken) -> std::io::Result<String> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = stop.cancelled() => return,
                    c = listener.accept() => c,
                };
                if let Ok((stream, _)) = conn {
                    let me = me.clone();
                    tokio::spawn(async move { me.serve_one(stream).await });
                }
            }
        });
        Ok(addr)
    }

    async fn serve_one(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let answer = self.handle(line.trim_end());
        let mut stream = reader.into_inner();
        let text = match answer {
            Answer::Never => return, // executed; the response is "lost"
            Answer::Now(t) => {
                let ms = 5 + rand::random::<u64>() % 40;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                t
            }
            Answer::Late(t, d) => {
                tokio::time::sleep(d).await;
                t
            }
        };
        let _ = stream.write_all(format!("{text}\n").as_bytes()).await;
    }

    fn handle(&self, line: &str) -> Answer {
        let parts: Vec<&str> = line.split(' ').collect();
        let mut s = self.state.lock().expect("provider state");
        match parts.as_slice() {
            ["LOOKUP", key] => {
                s.stats.lookups += 1;
                Answer::Now(match s.by_key.get(*key) {
                    Some(id) => format!("FOUND {id}"),
                    None => "NONE".into(),
                })
            }
            ["REFUND", key, job_id, epoch, token, deadline, refuse] => {
                s.stats.refund_calls += 1;
                let now_ms = chrono::Utc::now().timestamp_millis();
                if deadline.parse::<i64>().map_or(true, |d| now_ms > d) {
                    s.stats.expired += 1;
                    return Answer::Now("EXPIRED".into());
                }
                if *refuse == "1" {
                    s.stats.refused += 1;
                    return Answer::Now("PERMANENT account_closed".into());
                }
                let f = s.faults;
                let roll: f64 = s.rng.gen();
                if roll < f.transient {
                    s.stats.transient += 1;
                    return Answer::Now("TRANSIENT".into());
                }
                let n = s.executions.len() + 1;
                let refund_id = format!("re_{n}");
                s.executions.push(Execution {
                    key: key.to_string(),
                    refund_id: refund_id.clone(),
                    job_id: job_id.to_string(),
                    epoch: epoch.parse().unwrap_or(-1),
                    token: token.parse().unwrap_or(-1),
                });
                s.by_key.insert(key.to_string(), refund_id.clone());
                s.stats.executed += 1;
                if roll < f.transient + f.lost {
                    s.stats.lost_responses += 1;
                    Answer::Never
                } else if roll < f.transient + f.lost + f.late {
                    s.stats.late_responses += 1;
                    Answer::Late(format!("OK {refund_id}"), f.late_by)
                } else {
                    Answer::Now(format!("OK {refund_id}"))
                }
            }
            _ => Answer::Now("ERROR unreadable request".into()),
        }
    }

    pub fn executions(&self) -> Vec<Execution> {
        self.state.lock().expect("provider state").executions.clone()
    }

    pub fn stats(&self) -> ProviderStats {
        self.state.lock().expect("provider state").stats
    }
}

/// What a worker hears back from a REFUND.
#[derive(Debug, PartialEq, Eq)]
pub enum RefundReply {
    Ok(String),
    Transient,
    Permanent(String),
    /// The deadline had passed: nothing was executed.
    Expired,
    /// No answer (connection closed or timed out): it may or may not have
    /// executed. Only a lookup can tell.
    Unknown,
}

/// The client side, used by `chaos-worker`.
pub struct Client {
    pub addr: String,
    pub timeout: Duration,
}

impl Client {
    async fn call(&self, request: &str) -> Option<String> {
        let exchange = async {
            let mut stream = TcpStream::connect(&self.addr).await.ok()?;
            stream.write_all(format!("{request}\n").as_bytes()).await.ok()?;
            let mut line = String::new();
            let n = BufReader::new(stream).read_line(&mut line).await.ok()?;
            (n > 0).then(|| line.trim_end().to_string())
        };
        tokio::time::timeout(self.timeout, exchange).await.ok().flatten()
    }

    /// `None` when the provider could not be asked (retry later).
    pub async fn lookup(&self, key: &str) -> Option<Option<String>> {
        let answer = self.call(&format!("LOOKUP {key}")).await?;
        match answer.split_once(' ') {
            Some(("FOUND", id)) => Some(Some(id.to_string())),
            _ if answer == "NONE" => Some(None),
            _ => None,
        }
    }

    pub async fn refund(
        &self,
        key: &str,
        job_id: &str,
        epoch: i64,
        token: i64,
        deadline_ms: i64,
        refuse: bool,
    ) -> RefundReply {
        let request = format!(
            "REFUND {key} {job_id} {epoch} {token} {deadline_ms} {}",
            u8::from(refuse)
        );
        let Some(answer) = self.call(&request).await else {
            return RefundReply::Unknown;
        };
        match answer.split_once(' ') {
            Some(("OK", id)) => RefundReply::Ok(id.to_string()),
            Some(("PERMANENT", code)) => RefundReply::Permanent(code.to_string()),
            _ if answer == "TRANSIENT" => RefundReply::Transient,
            _ if answer == "EXPIRED" => RefundReply::Expired,
            _ => RefundReply::Unknown,
        }
    }
}
