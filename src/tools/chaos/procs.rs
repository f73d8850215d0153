//! The processes a chaos run starts, kills, freezes and restarts: workers,
//! the relay, the status-mirror consumer and a private tansu broker.

use anyhow::{Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// Every child alive, so an interrupted run (SIGINT/SIGTERM of the
/// orchestrator) takes them down with it instead of leaving them running.
static ALIVE: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

fn alive() -> std::sync::MutexGuard<'static, Vec<i32>> {
    ALIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// On SIGINT or SIGTERM: SIGKILL every child, then exit 130.
pub fn kill_children_on_signal() {
    let stop = tokio_util::sync::CancellationToken::new();
    jobledger::worker::cancel_on_signals(stop.clone());
    tokio::spawn(async move {
        stop.cancelled().await;
        for pid in alive().iter() {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        super::say!("chaos: interrupted; killed every child process");
        std::process::exit(130);
    });
}

/// A child process under chaos, restartable with the same command line.
pub struct Proc {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Kept apart from `child`: tokio forgets a child's pid once it is reaped.
    pid: Option<i32>,
}

impl Proc {
    pub fn new(name: &str, program: PathBuf, args: Vec<String>, dir: &Path) -> Self {
        Proc {
            name: name.into(),
            program,
            args,
            dir: dir.to_path_buf(),
            log: dir.join(format!("{name}.log")),
            child: None,
            pid: None,
        }
    }

    pub fn start(&mut self) -> Result<()> {
        let log = OpenOptions::new().create(true).append(true).open(&self.log)?;
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log.with_extension("out"))?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .current_dir(&self.dir)
            .env(
                "RUST_LOG",
                std::env::var("JOBLEDGER_CHAOS_LOG").unwrap_or_else(|_| "warn,jobledger=info".into()),
            )
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.name))?;
        self.pid = child.id().map(|p| p as i32);
        alive().extend(self.pid);
        self.child = Some(child);
        Ok(())
    }

    pub fn pid(&self) -> Option<Pid> {
        self.pid.map(Pid::from_raw)
    }

    /// The child, no longer counted among the living.
    fn take(&mut self) -> Option<Child> {
        if let Some(pid) = self.pid.take() {
            alive().retain(|p| *p != pid);
        }
        self.child.take()
    }

    pub fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(pid, sig);
        }
    }

    /// kill -9: no drain, no release; leases expire and get taken over.
    pub async fn kill9(&mut self) {
        if let Some(mut c) = self.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }

    /// SIGTERM and wait (a graceful stop), SIGKILL after `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        self.signal(Signal::SIGCONT);
        self.signal(Signal::SIGTERM);
        if let Some(mut c) = self.take() {
            if tokio::time::timeout(grace, c.wait()).await.is_err() {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }

    /// Whether it died on its own (a crash loop would show here).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if status.is_some() {
            self.take();
        }
        status
    }

    pub fn out_path(&self) -> PathBuf {
        self.log.with_extension("out")
    }
}

pub fn tansu_binary() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_default();
    let installed = PathBuf::from(format!("{home}/.cargo/bin/tansu"));
    if installed.exists() {
        installed
    } else {
        PathBuf::from("tansu")
    }
}

/// A private broker on a free loopback port, so freezing or restarting it
/// never disturbs anything else on the machine.
pub fn broker(dir: &Path, port: u16, durable: bool) -> Proc {
    let url = format!("tcp://127.0.0.1:{port}");
    let storage = if durable {
        "sqlite://tansu.db".to_string()
    } else {
        "memory://tansu/".to_string()
    };
    Proc::new(
        "broker",
        tansu_binary(),
        vec![
            "broker".into(),
            "--listener-url".into(),
            url.clone(),
            "--advertised-listener-url".into(),
            url,
            "--storage-engine".into(),
            storage,
        ],
        dir,
    )
}

pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub async fn wait_for_port(port: u16, within: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "nothing answers on 127.0.0.1:{port}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// `pg_ctlcluster <version> <cluster> restart` for the cluster serving
/// `port`: every connection drops; clients must reconnect on their own.
pub async fn restart_postgres(port: u16) -> Result<String> {
    let out = Command::new("pg_lsclusters").arg("--no-header").output().await;
    let out = out.context("pg_lsclusters (postgresql-common) is not installed")?;
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
    let cluster = listing
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == port.to_string())
        .with_context(|| format!("no cluster on port {port} in pg_lsclusters"))?;
    let (version, name) = (cluster[0].to_string(), cluster[1].to_string());
    let status = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, &name, "restart"])
        .status()
        .await
        .context("pg_ctlcluster")?;
    anyhow::ensure!(status.success(), "pg_ctlcluster {version} {name} restart failed");
    Ok(format!("{version}/{name}"))
}
