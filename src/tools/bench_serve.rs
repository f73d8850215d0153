//! `bench --only serve`: the server on top of a 1,000,000-event log.
//!
//! - Latency of the console's job page and of job searches (several filter
//!   sets, first and later pages), sequential requests, p50 / p99 / max.
//! - W3 over HTTP: the remote worker protocol (claim batches of 50, do
//!   nothing, complete the batch in one request) from 4 concurrent HTTP
//!   workers, against the library's W3 on as many jobs, in alternating
//!   rounds (this VM's speed wanders; see bench_workflows.rs).
//!
//! Every figure is checked in the database before it is printed.

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::tools::bench::{drain, enqueue_batched, noop_worker, report};
use jobledger::ledger::tokens::Role;
use jobledger::ledger::Ledger;

const ROUNDS: usize = 3;
const SAMPLES: usize = 400;

pub async fn serve(ledger: &Ledger, history_events: usize, jobs: usize) -> Result<()> {
    crate::tools::bench::history(ledger, history_events).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let stop = CancellationToken::new();
    let server = tokio::spawn(crate::serve::serve_on(
        listener,
        ledger.clone(),
        1 << 20,
        stop.clone(),
        Duration::from_secs(5),
    ));
    let result = async {
        let reader = ledger.create_token("bench-reader", Role::Reader).await?;
        let worker = ledger.create_token("bench-worker", Role::Worker).await?;
        latencies(ledger, &base, &reader).await?;
        http_w3(ledger, &base, &worker, jobs).await
    }
    .await;
    stop.cancel();
    server.await??;
    result
}

fn percentiles(mut ms: Vec<f64>) -> Value {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
    json!({ "samples": ms.len(), "p50_ms": (at(0.5) * 100.0).round() / 100.0,
            "p99_ms": (at(0.99) * 100.0).round() / 100.0, "max_ms": (ms[ms.len() - 1] * 100.0).round() / 100.0 })
}

async fn timed(
    client: &reqwest::Client,
    url: &str,
    cookie: Option<&str>,
    bearer: Option<&str>,
) -> Result<(f64, String)> {
    let mut req = client.get(url);
    if let Some(c) = cookie {
        req = req.header("cookie", c);
    }
    if let Some(b) = bearer {
        req = req.bearer_auth(b);
    }
    let started = Instant::now();
    let resp = req.send().await?;
    let status = resp.status();
    let body = resp.text().await?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    ensure!(status.is_success(), "{url}: {status}: {body}");
    Ok((ms, body))
}

async fn latencies(ledger: &Ledger, base: &str, token: &str) -> Result<()> {
    let events = ledger.count_events_total().await?;
    let client = reqwest::Client::new();
    let ids: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT job_id FROM jobledger.jobs ORDER BY random() LIMIT $1")
            .bind(SAMPLES as i64)
            .fetch_all(ledger.pool())
            .await?;
    let cookie = format!("jl_session={token}");
    let mut page = vec![];
    for id in &ids {
        let (ms, body) = timed(&client, &format!("{base}/console/jobs/{id}"), Some(&cookie), None).await?;
        ensure!(
            body.contains("What happened"),
            "the job page of {id} tells its story"
        );
        page.push(ms);
    }
    println!(
        "{}",
        json!({ "workload": "console job page", "events_in_log": events, "latency": percentiles(page) })
    );
    let searches = [
        "limit=50",
        "queue=history&limit=50",
        "queue=history&state=succeeded&limit=50",
        "state=succeeded&kind=noop&limit=50",
        "queue=history&reason=completed&since=2000-01-01T00:00:00Z&limit=50",
    ];
    let mut all = vec![];
    for q in searches {
        let mut cursor: Option<String> = None;
        for _ in 0..SAMPLES / searches.len() {
            let url = match &cursor {
                Some(c) => format!("{base}/v1/jobs?{q}&cursor={c}"),
                None => format!("{base}/v1/jobs?{q}"),
            };
            let (ms, body) = timed(&client, &url, None, Some(token)).await?;
            let v: Value = serde_json::from_str(&body)?;
            ensure!(
                v["jobs"].as_array().is_some_and(|j| !j.is_empty()),
                "{q}: a page of jobs"
            );
            // Walk 10 pages deep, then start again at the newest.
            cursor = v["next"]
                .as_str()
                .map(String::from)
                .filter(|_| all.len() % 10 != 9);
            all.push(ms);
        }
    }
    println!(
        "{}",
        json!({ "workload": "job search (5 filter sets, pages 1-10)", "events_in_log": events,
                           "latency": percentiles(all) })
    );
    for q in searches {
        let plan = ledger.explain_search(&search_of(q)).await?;
        ensure!(!plan.contains("Seq Scan on jobs"), "{q}: {plan}");
    }
    Ok(())
}

fn search_of(q: &str) -> jobledger::ledger::search::Search {
    let mut s = jobledger::ledger::search::Search::default();
    for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
        match &*k {
            "queue" => s.queue = Some(v.into()),
            "state" => s.states = vec![v.into()],
            "kind" => s.kind = Some(v.into()),
            "reason" => s.reason = Some(v.into()),
            _ => {}
        }
    }
    s
}

/// One HTTP worker: claim 50, complete them in one request, until the
/// queue is empty. Returns the jobs it completed.
async fn http_worker(base: String, token: String, queue: String, name: String) -> Result<usize> {
    let client = reqwest::Client::new();
    let mut done = 0;
    loop {
        let claimed: Value = client
            .post(format!("{base}/v1/queues/{queue}/claim"))
            .bearer_auth(&token)
            .json(&json!({ "worker": name, "lease_ms": 60_000, "limit": 50 }))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let leases = claimed["leases"].as_array().context("leases")?;
        if leases.is_empty() {
            return Ok(done);
        }
        let items: Vec<Value> = leases
            .iter()
            .map(|l| json!({ "job_id": l["job_id"], "epoch": l["epoch"], "token": l["token"] }))
            .collect();
        let answers: Value = client
            .post(format!("{base}/v1/leases/complete"))
            .bearer_auth(&token)
            .json(&json!({ "worker": name, "items": items }))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        for a in answers["answers"].as_array().context("answers")? {
            ensure!(a["outcome"] == "committed", "an uncontested completion: {a}");
            done += 1;
        }
    }
}

async fn http_w3(ledger: &Ledger, base: &str, token: &str, jobs: usize) -> Result<()> {
    let mut ratios = vec![];
    for round in 0..ROUNDS {
        // The reference is the library's worker fetching as far ahead as the
        // HTTP workers claim (4 x 50): like for like. W3's default
        // (the worker's own prefetch, which follows the pace) is printed too.
        let mut lib_rate = 0.0;
        for (label, prefetch) in [("default", None), ("prefetch 200", Some(200))] {
            let q = format!("lib-{round}-{}", prefetch.unwrap_or(16));
            enqueue_batched(ledger, &q, jobs).await?;
            let lib = drain(noop_worker(ledger, &q, 16, prefetch)?, jobs).await?;
            if prefetch.is_some() {
                lib_rate = jobs as f64 / lib.as_secs_f64();
            }
            report(
                &format!("W3 drain no-op jobs, 16-way, {label} (library, reference)"),
                jobs,
                lib,
                json!({ "round": round }),
            );
        }
        let q = format!("http-{round}");
        enqueue_batched(ledger, &q, jobs).await?;
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..4 {
            tasks.spawn(http_worker(base.into(), token.into(), q.clone(), format!("w{w}")));
        }
        let mut done = 0;
        while let Some(r) = tasks.join_next().await {
            done += r??;
        }
        let took = started.elapsed();
        let succeeded = ledger
            .counts_by_state_in(&q)
            .await?
            .into_iter()
            .find(|(s, _)| s == "succeeded")
            .map_or(0, |(_, n)| n);
        ensure!(
            done == jobs && succeeded == jobs as i64,
            "HTTP W3 completed {done}, {succeeded} succeeded of {jobs}"
        );
        let ratio = jobs as f64 / took.as_secs_f64() / lib_rate;
        ratios.push(ratio);
        report(
            "W3 over HTTP: 4 workers, claim 50, batched complete",
            jobs,
            started.elapsed(),
            json!({ "round": round, "of_library_w3_prefetch_200": (ratio * 100.0).round() / 100.0 }),
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "{}",
        json!({ "workload": "W3 over HTTP against the library's with prefetch 200, median of the rounds",
                "rounds": ROUNDS, "of_library_w3_prefetch_200": (ratios[ROUNDS / 2] * 100.0).round() / 100.0,
                "min": (ratios[0] * 100.0).round() / 100.0, "max": (ratios[ROUNDS - 1] * 100.0).round() / 100.0 })
    );
    Ok(())
}
