//! `jobledger serve` run as the binary on a loopback port, and a JSON client.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

pub struct Server {
    child: Child,
    pub base: String,
}

impl Server {
    pub fn start(url: &str) -> Server {
        Self::start_with(url, &[])
    }

    /// With more arguments (global ones such as `--otlp-endpoint`).
    pub fn start_with(url: &str, more: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_jobledger"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(more)
            .env("DATABASE_URL", url)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run jobledger serve");
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        let v: Value = serde_json::from_str(&first).unwrap_or_else(|e| panic!("{first:?}: {e}"));
        let base = format!("http://{}", v["listening"].as_str().unwrap());
        Server { child, base }
    }

    /// SIGTERM, then the exit code.
    pub fn stop(mut self) -> i32 {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        self.child.wait().unwrap().code().unwrap_or(-1)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

pub async fn call(method: &str, url: &str, token: Option<&str>, body: Option<String>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let mut req = client.request(method.parse().unwrap(), url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b);
    }
    let resp = req.send().await.expect("the server answers");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    (status, v)
}

pub fn one_line(v: &Value) -> &str {
    let e = v["error"].as_str().unwrap_or_else(|| panic!("no error in {v}"));
    assert!(!e.contains('\n'), "one line: {e:?}");
    e
}

/// `POST base+path` with a JSON body and a bearer token.
pub async fn post(s: &Server, path: &str, token: &str, body: Value) -> (u16, Value) {
    call(
        "POST",
        &format!("{}{path}", s.base),
        Some(token),
        Some(body.to_string()),
    )
    .await
}

/// The CSRF value a console page's forms carry.
pub fn csrf_in(page: &str) -> String {
    page.split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no CSRF value in the page"))
        .to_string()
}
