//! The console in a real browser: Debian's Chromium, headless, driven
//! through chromedriver (WebDriver; installed by scripts/browser-up). Sign
//! in, read the overview, paste a job id, read the job's story (the words,
//! not just a 200), replay a dead job by clicking and see the new edge,
//! resolve another with evidence; screenshots go to target/console/.
//! Also the console's guards without a browser: no session, a forged form.

mod common;

use common::serve::{csrf_in, Server};
use common::{fresh, new_job, TestDb};
use fantoccini::{Client, ClientBuilder, Locator};
use jobledger::domain::{ErrorClass, JobState};
use jobledger::ledger::tokens::Role;
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use uuid::Uuid;

struct Driver(Child, u16);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// chromedriver on a free loopback port, once it answers.
async fn driver() -> Driver {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver (scripts/browser-up installs it)");
    let status = format!("http://127.0.0.1:{port}/status");
    // A readiness poll, not a timing assumption: it only waits for the
    // driver process to listen.
    for _ in 0..200 {
        if reqwest::get(&status).await.is_ok() {
            return Driver(child, port);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("chromedriver did not answer on {port}");
}

async fn browser(d: &Driver) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({ "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,1000"] }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", d.1))
        .await
        .expect("a Chromium session")
}

async fn dead_job(db: &TestDb, key: &str, code: &str, message: &str) -> Uuid {
    let id = db
        .ledger
        .enqueue(new_job("refunds", Some(key), json!({ "amount": 42 })))
        .await
        .unwrap()
        .job
        .job_id;
    let lease = db
        .ledger
        .claim_job(id, "worker-3", Duration::from_secs(30))
        .await
        .unwrap()
        .1
        .unwrap();
    lease
        .fail(ErrorClass::Permanent, code, Some(message))
        .await
        .unwrap();
    id
}

/// The main text of the page that shows `css` (waiting for the navigation
/// a click started: WebDriver's click may return before the next page).
async fn text_of(c: &Client, css: &str) -> String {
    c.wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css}: {e}"));
    c.find(Locator::Css("main")).await.unwrap().text().await.unwrap()
}

async fn shot(c: &Client, name: &str) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/target/console");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(format!("{dir}/{name}.png"), c.screenshot().await.unwrap()).unwrap();
}

async fn fill(c: &Client, css: &str, value: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .send_keys(value)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_operator_reads_a_story_replays_and_resolves_in_the_browser() {
    let db = fresh().await;
    let token = db.ledger.create_token("alice", Role::Operator).await.unwrap();
    let declined = dead_job(&db, "r-1", "declined", "card declined").await;
    let unsure = dead_job(&db, "r-2", "provider_timeout", "no answer in 30 s").await;
    for i in 0..5 {
        db.ledger
            .enqueue(new_job("refunds", Some(&format!("q{i}")), json!({})))
            .await
            .unwrap();
    }
    // The overview's queue table reads the queue_stats projection.
    let run = common::cli::jl(&db.url, &["projections", "run"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let s = Server::start(&db.url);
    let d = driver().await;
    let c = browser(&d).await;

    c.goto(&format!("{}/console", s.base)).await.unwrap();
    assert!(
        c.current_url().await.unwrap().path().ends_with("/console/login"),
        "signed out: the sign-in form"
    );
    fill(&c, "input[name=token]", &token).await;
    c.find(Locator::Css("form.card button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let overview = text_of(&c, "table.queues").await;
    assert!(overview.contains("Dead jobs by reason"), "{overview}");
    assert!(overview.contains("permanent_error — 2"), "{overview}");
    let refunds = c
        .find(Locator::Css("table.queues tr:nth-child(2)"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        refunds.starts_with("refunds 5 0 0 0 0 0 0 2"),
        "queued 5, dead 2: {refunds}"
    );
    // Pause the queue from its row: recorded with the operator's name.
    fill(
        &c,
        "table.queues form.inline input[name=reason]",
        "provider maintenance",
    )
    .await;
    c.find(Locator::Css("table.queues form.inline button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css("table.queues .badge.sending"))
        .await
        .unwrap();
    let row = c
        .find(Locator::Css("table.queues tr:nth-child(2)"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(row.contains("paused by operator:alice"), "{row}");
    assert!(db.ledger.queue_status("refunds").await.unwrap().paused);
    shot(&c, "overview").await;

    // A job id pasted into the header's box opens the job.
    fill(&c, "header input[name=q]", &declined.to_string()).await;
    c.find(Locator::Css("header input[name=q]"))
        .await
        .unwrap()
        .send_keys("\u{E007}")
        .await
        .unwrap();
    let page = text_of(&c, "ol.story").await;
    for words in [
        "enqueued by api as refund in refunds",
        "taken by worker-3 (attempt 1)",
        "failed permanently (declined: card declined) → dead",
        "committed (no relay running)",
    ] {
        assert!(page.contains(words), "{words:?} in:\n{page}");
    }
    // Each line opens to the raw event: token, actor, hash.
    c.find(Locator::Css("ol.story li:nth-child(3) summary"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let raw = c
        .find(Locator::Css("ol.story li:nth-child(3) pre.raw"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        raw.contains("\"hash\"") && raw.contains("\"actor\": \"worker-3\""),
        "{raw}"
    );
    shot(&c, "job").await;

    // Replay it by clicking: the new edge appears.
    fill(
        &c,
        "form[action$=replay] input[name=reason]",
        "card fixed by the customer",
    )
    .await;
    c.find(Locator::Css("form[action$=replay] button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let page = text_of(&c, "p.flash").await;
    assert!(page.contains("Your replay was committed"), "{page}");
    assert!(
        page.contains("replayed by alice: “card fixed by the customer”"),
        "{page}"
    );
    assert_eq!(db.job(declined).await.state, JobState::Queued);

    // Resolve the other with evidence.
    c.goto(&format!("{}/console/jobs/{unsure}", s.base))
        .await
        .unwrap();
    fill(
        &c,
        "form[action$=resolve] input[name=reason]",
        "seen in the provider's dashboard",
    )
    .await;
    fill(
        &c,
        "form[action$=resolve] textarea[name=evidence]",
        r#"{"refund_id": "re_123"}"#,
    )
    .await;
    c.find(Locator::Css("form[action$=resolve] button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let page = text_of(&c, "p.flash").await;
    assert!(
        page.contains(
            "resolved by alice after checking by hand: “seen in the provider's dashboard” → succeeded"
        ),
        "{page}"
    );
    shot(&c, "resolved").await;
    assert_eq!(db.job(unsure).await.state, JobState::Succeeded);
    let last = db.ledger.history(unsure).await.unwrap().pop().unwrap();
    assert_eq!(last.event.actor, "operator:alice");

    // The dead-jobs page, filtered by reason, with bulk replay.
    let third = dead_job(&db, "r-3", "declined", "card declined").await;
    c.goto(&format!("{}/console/dead?reason=permanent_error", s.base))
        .await
        .unwrap();
    c.find(Locator::Css(&format!("input[value='{third}']")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    fill(&c, "p.actions input[name=reason]", "retry the batch").await;
    c.find(Locator::Css("p.actions button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(text_of(&c, "ul.results").await.contains("Replayed 1 job(s)"));
    assert_eq!(db.job(third).await.state, JobState::Queued);
    c.close().await.unwrap();
    db.assert_verified().await;
}

#[tokio::test]
async fn the_console_refuses_strangers_and_forged_forms() {
    let db = fresh().await;
    let token = db.ledger.create_token("alice", Role::Operator).await.unwrap();
    let id = dead_job(&db, "r-1", "declined", "card declined").await;
    let s = Server::start(&db.url);
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = http
        .get(format!("{}/console/jobs/{id}", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 303, "no session: to the sign-in form");
    let cookie = format!("jl_session={token}");
    let replay = |csrf: &str, origin: Option<&str>| {
        let mut req = http
            .post(format!("{}/console/jobs/{id}/replay", s.base))
            .header("cookie", &cookie)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("csrf={csrf}&reason=forged"));
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        req.send()
    };
    assert_eq!(
        replay("nope", None).await.unwrap().status().as_u16(),
        403,
        "no CSRF value"
    );
    let page = http
        .get(format!("{}/console/jobs/{id}", s.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = csrf_in(&page);
    assert_eq!(
        replay(&csrf, Some("http://evil.example"))
            .await
            .unwrap()
            .status()
            .as_u16(),
        403,
        "another site's origin"
    );
    assert_eq!(db.job(id).await.state, JobState::Dead, "nothing was written");
    let ok = replay(&csrf, None).await.unwrap();
    assert_eq!(ok.status().as_u16(), 303, "the real form works");
    assert_eq!(db.job(id).await.state, JobState::Queued);
    let bad = http
        .get(format!("{}/console/jobs/not-an-id", s.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
}

#[tokio::test]
async fn each_event_says_whether_the_relay_has_published_it() {
    use jobledger::ledger::timeline::{story, Delivery};
    use jobledger::reader::{Checkpoint, LogReader};
    let db = fresh().await;
    let id = db.enqueue(Some("a"), json!({})).await.job_id;
    db.claim_one("w").await;
    let d = |s: &[jobledger::ledger::timeline::StoryLine]| {
        s.iter().map(|l| l.delivery.clone().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(
        d(&story(&db.ledger, id).await.unwrap()),
        vec![Delivery::NoRelay; 2]
    );
    // A relay whose checkpoint stands at the first event: the second is
    // committed and on its way.
    let relay = LogReader::open(db.ledger.pool().clone(), "relay:jobs")
        .await
        .unwrap();
    let first = db.ledger.history(id).await.unwrap()[0].position;
    let txid = db.ledger.txid_of_position(first).await.unwrap().unwrap();
    relay
        .store(Checkpoint {
            txid,
            position: first,
        })
        .await
        .unwrap();
    assert_eq!(
        d(&story(&db.ledger, id).await.unwrap()),
        vec![Delivery::Published, Delivery::Sending]
    );
    relay.skip_to_end().await.unwrap();
    assert_eq!(
        d(&story(&db.ledger, id).await.unwrap()),
        vec![Delivery::Published; 2]
    );
    // A second relay (another topic) still at the start: not yet published
    // everywhere.
    LogReader::open(db.ledger.pool().clone(), "relay:audit")
        .await
        .unwrap();
    assert_eq!(
        d(&story(&db.ledger, id).await.unwrap()),
        vec![Delivery::Sending; 2]
    );
}
