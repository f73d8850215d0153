//! A throwaway PostgreSQL cluster under target/, for running the demo on a
//! machine where nothing answers at the database URL but PostgreSQL's own
//! binaries are installed. Removed when dropped.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct PrivateCluster {
    bin: PathBuf,
    dir: PathBuf,
    pub url: String,
    as_postgres: bool,
}

fn find_bin() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| d.join("initdb").exists() && d.join("pg_ctl").exists())
        .collect();
    dirs.sort_by_key(|d| {
        d.parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .and_then(|v| v.parse::<u32>().ok())
    });
    dirs.pop()
}

fn uid_of(user: &str) -> Option<(u32, u32)> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").arg(flag).arg(user).output().ok()?;
        String::from_utf8(out.stdout).ok()?.trim().parse().ok()
    };
    Some((id("-u")?, id("-g")?))
}

impl PrivateCluster {
    pub fn start() -> Result<Self> {
        let Some(bin) = find_bin() else {
            bail!("no PostgreSQL binaries (initdb, pg_ctl) under /usr/lib/postgresql")
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = std::env::current_dir()?
            .join("target")
            .join(format!("demo-pg-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        // initdb refuses to run as root; run the cluster as `postgres` then.
        let as_postgres = uid_of("root").is_some_and(|(u, _)| u == current_uid());
        if as_postgres {
            let (uid, gid) = uid_of("postgres").context("running as root, but there is no postgres user")?;
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let me = PrivateCluster {
            bin,
            dir,
            url: format!("postgres://postgres@127.0.0.1:{port}/jobledger"),
            as_postgres,
        };
        me.run(
            "initdb",
            &["-D", me.path(), "-A", "trust", "-U", "postgres", "--no-sync"],
        )?;
        let opts = format!("-p {port} -c listen_addresses=127.0.0.1 -k {}", me.path());
        let log = me.dir.join("log");
        me.run(
            "pg_ctl",
            &[
                "-D",
                me.path(),
                "-o",
                &opts,
                "-l",
                log.to_str().unwrap_or("log"),
                "-w",
                "start",
            ],
        )?;
        Ok(me)
    }

    fn path(&self) -> &str {
        self.dir.to_str().unwrap_or(".")
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<()> {
        let exe = self.bin.join(tool);
        let out = if self.as_postgres {
            Command::new("runuser")
                .arg("-u")
                .arg("postgres")
                .arg("--")
                .arg(&exe)
                .args(args)
                .output()
        } else {
            Command::new(&exe).args(args).output()
        }
        .with_context(|| format!("running {}", exe.display()))?;
        if !out.status.success() {
            bail!("{tool} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }
}

fn current_uid() -> u32 {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap_or(u32::MAX)
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = self.run("pg_ctl", &["-D", self.path(), "-m", "immediate", "-w", "stop"]);
        if Path::new(&self.dir).exists() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
