//! Runs the `jobledger` binary of this build: JSON lines on stdout, one-line
//! errors on stderr, an exit code.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Stdio};

/// One run of the binary.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect()
    }
    pub fn json(&self) -> Value {
        let mut l = self.lines();
        assert_eq!(
            l.len(),
            1,
            "expected one line, got {:?} / {}",
            self.stdout,
            self.stderr
        );
        l.pop().unwrap()
    }
}

pub fn jl(url: &str, args: &[&str]) -> Run {
    jl_stdin(url, args, None)
}

pub fn jl_stdin(url: &str, args: &[&str], stdin: Option<&str>) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run jobledger");
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}
