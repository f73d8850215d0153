//! Migrating on a cluster that has never seen jobledger: roles are
//! cluster-wide, so two databases migrated at once race to create them.
//! Needs a cluster without the roles, so this test makes a throwaway one
//! (the Debian PostgreSQL 15 binaries, run as `postgres` when we are root) on
//! a free loopback port and stops it at the end.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use jobledger::ledger::Ledger;
use sqlx::{Connection, PgConnection};

/// The newest installed PostgreSQL's binaries (Debian's layout).
fn bin() -> String {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's binaries under /usr/lib/postgresql (scripts/pg-up installs them)")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort();
    format!(
        "/usr/lib/postgresql/{}/bin",
        versions.last().expect("a PostgreSQL version")
    )
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false)
}

struct Cluster {
    dir: PathBuf,
    port: u16,
}

fn as_postgres(cmd: &str, args: &[&str]) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", cmd]).args(args);
        c
    } else {
        let mut c = Command::new(cmd);
        c.args(args);
        c
    }
}

fn run(mut c: Command) {
    let out = c.output().expect("spawn");
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Cluster {
    /// Made as an owner first, so a failure half-way still stops and removes it.
    fn start() -> Cluster {
        // Under /tmp whatever TMPDIR says: the socket path must stay short.
        let id = uuid::Uuid::new_v4().simple().to_string();
        let mut cluster = Cluster {
            dir: PathBuf::from(format!("/tmp/jl-cluster-{}", &id[..12])),
            port: 0,
        };
        let dir = cluster.dir.clone();
        std::fs::create_dir(&dir).unwrap();
        if is_root() {
            let mut c = Command::new("chown");
            c.args(["postgres:postgres", dir.to_str().unwrap()]);
            run(c);
        }
        let data = dir.join("data");
        let initdb = format!("{}/initdb", bin());
        run(as_postgres(
            &initdb,
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
        ));
        cluster.port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            cluster.port,
            dir.display()
        );
        let pg_ctl = format!("{}/pg_ctl", bin());
        let log = dir.join("log");
        run(as_postgres(
            &pg_ctl,
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &opts,
                "-w",
                "start",
            ],
        ));
        cluster
    }

    fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let pg_ctl = format!("{}/pg_ctl", bin());
        let _ = as_postgres(
            &pg_ctl,
            &["-D", data.to_str().unwrap(), "-m", "immediate", "stop"],
        )
        .output();
        let _ = std::fs::remove_dir_all(Path::new(&self.dir));
    }
}

/// Another database's migration is creating `jobledger_worker` right now
/// (held open by a gate: an uncommitted `CREATE ROLE`). Ours must wait for it
/// and then take the role as made, not fail its migration on the
/// catalogue's unique index (what a plain `IF NOT EXISTS … CREATE ROLE` did).
#[tokio::test]
async fn two_databases_migrating_at_once_on_a_fresh_cluster_both_succeed() {
    let cluster = Cluster::start();
    let mut other = PgConnection::connect(&cluster.url("postgres")).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("CREATE ROLE jobledger_worker LOGIN")
        .execute(&mut other)
        .await
        .unwrap();

    let url = cluster.url("jl_race");
    let ours = tokio::spawn(async move { Ledger::connect_and_migrate(&url, 4).await.map(|_| ()) });

    // Gate: wait until our migration is blocked behind the other's role.
    let mut probe = PgConnection::connect(&cluster.url("postgres")).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "our migration never queued behind the other's role"
        );
        let blocked: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
             WHERE datname = 'jl_race' AND wait_event_type = 'Lock')",
        )
        .fetch_one(&mut probe)
        .await
        .unwrap();
        if blocked {
            break;
        }
        assert!(
            !ours.is_finished(),
            "our migration finished without meeting the other: {:?}",
            ours.await
        );
        tokio::time::sleep(Duration::from_millis(20)).await; // polling a gate, not timing
    }
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    ours.await
        .unwrap()
        .expect("our migration survives the concurrent role creation");

    // And the database really is migrated, with the roles' grants in place.
    let mut conn = PgConnection::connect(&cluster.url("jl_race")).await.unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        applied as usize,
        jobledger::store::schema::MIGRATOR.iter().count()
    );
    let granted: bool = sqlx::query_scalar(
        "SELECT has_table_privilege('jobledger_reader', 'jobledger.jobs', 'SELECT') \
         AND has_table_privilege('jobledger_admin', 'jobledger.jobs', 'UPDATE')",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(granted);
}
