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

const BIN: &str = "/usr/lib/postgresql/15/bin";

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
    fn start() -> Cluster {
        let dir = std::env::temp_dir().join(format!("jl-cluster-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&dir).unwrap();
        run({
            let mut c = Command::new("chown");
            c.args(["postgres:postgres", dir.to_str().unwrap()]);
            c
        });
        let data = dir.join("data");
        let initdb = format!("{BIN}/initdb");
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
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            dir.display()
        );
        let pg_ctl = format!("{BIN}/pg_ctl");
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
        Cluster { dir, port }
    }

    fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let pg_ctl = format!("{BIN}/pg_ctl");
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
    loop {
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
