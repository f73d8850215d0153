//! An OTLP/gRPC receiver on a loopback port that only counts the spans it
//! gets, by name: `bench --only traces` exports to it, so the cost measured
//! is the real exporter's (encoding, gRPC, the batch processor), and the
//! bench checks that every span it expected arrived.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Spans received, by name.
#[derive(Clone, Default)]
pub struct Counts(Arc<Mutex<HashMap<String, u64>>>);

impl Counts {
    pub fn get(&self, name: &str) -> u64 {
        self.0.lock().expect("counts").get(name).copied().unwrap_or(0)
    }
}

/// The key under which spans named `name` that had no parent are counted.
pub fn root(name: &str) -> String {
    format!("{name} (root)")
}

#[tonic::async_trait]
impl TraceService for Counts {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut counts = self.0.lock().expect("counts");
        for rs in req.into_inner().resource_spans {
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                // A span with no parent began a trace of its own: the bench
                // checks that no job's span did.
                if span.parent_span_id.is_empty() {
                    *counts.entry(root(&span.name)).or_default() += 1;
                }
                *counts.entry(span.name).or_default() += 1;
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Starts the receiver on an OS thread of its own (a one-thread runtime), so
/// the bench can tell its CPU time apart: a deployment's collector runs
/// elsewhere, and its decoding is not the traced program's cost. Returns
/// the endpoint, the counts and the thread's CPU clock.
pub fn start() -> std::io::Result<(String, Counts, ThreadCpu)> {
    let std_listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let counts = Counts::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let served = counts.clone();
    std::thread::Builder::new()
        .name("otlp-sink".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return eprintln!("otlp sink: {e}"),
            };
            let _ = tx.send(ThreadCpu::of_this_thread());
            rt.block_on(async move {
                let incoming = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => tonic::transport::server::TcpIncoming::from(l),
                    Err(e) => return eprintln!("otlp sink: {e}"),
                };
                let server = tonic::transport::Server::builder()
                    .add_service(TraceServiceServer::new(served))
                    .serve_with_incoming(incoming);
                if let Err(e) = server.await {
                    eprintln!("otlp sink: {e}");
                }
            });
        })?;
    let cpu = rx.recv().map_err(std::io::Error::other)?;
    Ok((format!("http://{addr}"), counts, cpu))
}

/// A thread's CPU time (user + system), read from /proc: the receiver's
/// share of a round.
#[derive(Clone)]
pub struct ThreadCpu(Option<std::path::PathBuf>);

impl ThreadCpu {
    /// `/proc/thread-self` links to `<pid>/task/<tid>`: keep the path.
    fn of_this_thread() -> Self {
        ThreadCpu(
            std::fs::read_link("/proc/thread-self")
                .ok()
                .map(|p| std::path::Path::new("/proc").join(p).join("stat")),
        )
    }

    /// Clock ticks so far; 0 where /proc cannot tell.
    pub fn ticks(&self) -> u64 {
        let Some(path) = &self.0 else { return 0 };
        std::fs::read_to_string(path).map(|s| stat_ticks(&s)).unwrap_or(0)
    }
}

/// This process's CPU time so far, in clock ticks (all its threads).
pub fn process_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .map(|s| stat_ticks(&s))
        .unwrap_or(0)
}

/// The CPU time so far of every live process named `postgres` (the server's
/// backends and its background processes), in clock ticks: PostgreSQL's
/// share of a round. Only a server on this machine is seen (0 otherwise),
/// every local cluster is counted, and a backend that exited during the
/// round is not: a diagnostic split, not the figure the bench stands on.
pub fn postgres_ticks() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|s| s.contains("(postgres)"))
        .map(|s| stat_ticks(&s))
        .sum()
}

/// utime + stime of a /proc `stat` line (fields 14 and 15; the command name
/// in parentheses may hold spaces, so count from its closing one).
fn stat_ticks(stat: &str) -> u64 {
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // After ')' the fields start at 3 (state), so field k is f[k - 3].
    n(11) + n(12)
}

/// The machine's busy CPU time so far, in clock ticks: user, nice, system,
/// irq and softirq of every core (/proc/stat), leaving out idle, I/O wait
/// and the time the hypervisor stole. 0 where /proc cannot tell.
pub fn machine_busy_ticks() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    let Some(line) = s.lines().find(|l| l.starts_with("cpu ")) else {
        return 0;
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    [0, 1, 2, 5, 6].iter().filter_map(|&i| f.get(i)).sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn stat_ticks_reads_utime_and_stime_past_a_name_with_spaces() {
        let line = "42 (a b) S 1 2 3 4 5 6 7 8 9 10 100 23 0 0";
        assert_eq!(super::stat_ticks(line), 123);
    }
}
