//! Periodic schedules against the real database: a slot fires once with
//! two schedulers racing, after a restart and across clock steps; missed
//! slots follow the policy; daylight-saving days fire as documented. Time
//! moves by the database clock plus the scheduler's skew (its drill knob
//! for a stepped clock), never by sleeping.

mod common;

use chrono::Duration as Skew;
use common::{fresh, TestDb};
use jobledger::domain::schedule::{Missed, ScheduleSpec};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

fn spec(cron: &str, tz: &str, missed: Missed, n: u32) -> ScheduleSpec {
    ScheduleSpec {
        cron: cron.into(),
        tz: tz.into(),
        queue: "reports".into(),
        kind: "report".into(),
        payload: json!({ "scope": "all" }),
        priority: 0,
        missed,
        max_catch_up: n,
    }
}

/// The database clock, which the scheduler fires by.
async fn db_clock(db: &TestDb) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(db.ledger.pool())
        .await
        .unwrap()
}

async fn keys(db: &TestDb, prefix: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT job_key FROM jobledger.jobs WHERE job_key LIKE $1 ORDER BY job_key")
        .bind(format!("schedule:{prefix}:%"))
        .fetch_all(db.ledger.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_slot_fires_once_with_two_schedulers_racing() {
    let db = fresh().await;
    let l = &db.ledger;
    let created = l
        .create_schedule(
            "minutely",
            &spec("* * * * *", "UTC", Missed::Skip, 0),
            "ops",
            "reports",
        )
        .await
        .unwrap();
    let lease = Duration::from_secs(30);
    let old = l.acquire_scheduler_lease("node-a", lease).await.unwrap().unwrap();
    assert_eq!(
        l.acquire_scheduler_lease("node-b", lease).await.unwrap(),
        None,
        "one scheduler at a time"
    );
    // node-a restarts and takes its lease again: the old incarnation's
    // token is fenced; both fire at once.
    let new = l.acquire_scheduler_lease("node-a", lease).await.unwrap().unwrap();
    assert!(new > old);
    let start = Arc::new(Barrier::new(3));
    // A second past the next slot by the database clock: a fixed 61 s made
    // two slots due (one skipped) when the test began in a minute's last
    // second, as it once did in the suite.
    let now = db_clock(&db).await;
    let step = created.next_slot.unwrap() - now + Skew::seconds(1);
    let mut tasks = vec![];
    for token in [old, new, new] {
        let (l, start) = (l.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            l.fire_due(token, step).await.unwrap()
        }));
    }
    let mut fired = 0;
    let mut fenced = 0;
    for t in tasks {
        let f = t.await.unwrap();
        fired += f.fired.len();
        fenced += usize::from(f.fenced_out);
    }
    assert_eq!((fired, fenced), (1, 1), "one firing; the old token fired nothing");
    assert_eq!(keys(&db, "minutely").await.len(), 1);
    // A restart or a repeated step fires nothing more; a clock stepped
    // back neither; a minute later the next slot fires.
    assert!(l.fire_due(new, step).await.unwrap().fired.is_empty());
    assert!(l.fire_due(new, Skew::hours(-3)).await.unwrap().fired.is_empty());
    assert_eq!(
        l.fire_due(new, step + Skew::seconds(60))
            .await
            .unwrap()
            .fired
            .len(),
        1
    );
    assert!(l.fire_due(new, Skew::zero()).await.unwrap().fired.is_empty());
    let k = keys(&db, "minutely").await;
    assert_eq!(k.len(), 2, "{k:?}");
    // The schedule's stream says what happened.
    let h = l.schedule_history("minutely").await.unwrap();
    let actions: Vec<&str> = h.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["created", "fired", "fired"]);
    let job: uuid::Uuid = serde_json::from_value(h[1].data["job_id"].clone()).unwrap();
    let j = db.job(job).await;
    assert_eq!((j.queue.as_str(), j.kind.as_str()), ("reports", "report"));
    assert_eq!(l.history(job).await.unwrap()[0].event.actor, "scheduler");
    db.assert_verified().await;
}

#[tokio::test]
async fn missed_slots_follow_the_policy_after_an_outage() {
    let db = fresh().await;
    let l = &db.ledger;
    for (name, missed, n) in [
        ("skip", Missed::Skip, 0),
        ("once", Missed::Once, 0),
        ("all", Missed::All, 3),
    ] {
        l.create_schedule(name, &spec("* * * * *", "UTC", missed, n), "ops", "r")
            .await
            .unwrap();
    }
    let token = l
        .acquire_scheduler_lease("s", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    // Ten minutes and twenty seconds without a scheduler: ten or eleven
    // slots are due, the latest under a minute old (on time).
    let f = l.fire_due(token, Skew::seconds(620)).await.unwrap();
    assert_eq!(keys(&db, "skip").await.len(), 1, "only the on-time slot");
    assert_eq!(
        keys(&db, "once").await.len(),
        2,
        "one for the outage, and the on-time one"
    );
    assert_eq!(
        keys(&db, "all").await.len(),
        4,
        "the latest three missed, and the on-time one"
    );
    // Every due slot is fired or recorded as skipped: (due, summed over the
    // three) - 7 skipped, each schedule having ten or eleven due. Each reads
    // the clock in its own transaction, so a minute can turn between them:
    // any sum from 30 to 33, not only 30 or 33.
    assert!(f.fired.len() == 7 && (23..=26).contains(&f.skipped), "{f:?}");
    for name in ["skip", "once", "all"] {
        let h = l.schedule_history(name).await.unwrap();
        let skipped = h.iter().find(|e| e.action.as_str() == "skipped").unwrap();
        assert!(skipped.reason.starts_with("missed"), "{}", skipped.reason);
    }
    // Paused: nothing fires; resumed: the paused slots never do.
    l.pause_schedule("skip", "ops", "maintenance").await.unwrap();
    assert!(l
        .fire_due(token, Skew::seconds(1000))
        .await
        .unwrap()
        .fired
        .iter()
        .all(|(n, ..)| n != "skip"));
    let resumed = l.resume_schedule("skip", "ops", "back").await.unwrap();
    assert!(!resumed.paused && resumed.next_slot.is_some());
    assert_eq!(keys(&db, "skip").await.len(), 1);
    db.assert_verified().await;
}

/// New York's next daylight-saving year as of `today`: the first year whose
/// spring-forward day (the second Sunday of March) is two days or more
/// ahead, with that day and its fall-back day (the first Sunday of
/// November). The test fired fixed 2027 dates, and would have failed from
/// the day before 2027's spring-forward on.
fn next_dst_year(today: chrono::NaiveDate) -> (chrono::NaiveDate, chrono::NaiveDate) {
    use chrono::{Datelike, NaiveDate, Weekday};
    let sunday = |y, m, n| NaiveDate::from_weekday_of_month_opt(y, m, Weekday::Sun, n).unwrap();
    let year = if sunday(today.year(), 3, 2) - today >= chrono::Duration::days(2) {
        today.year()
    } else {
        today.year() + 1
    };
    (sunday(year, 3, 2), sunday(year, 11, 1))
}

#[test]
fn the_daylight_saving_year_moves_on() {
    let d = |y, m, day| chrono::NaiveDate::from_ymd_opt(y, m, day).unwrap();
    assert_eq!(next_dst_year(d(2026, 12, 5)), (d(2027, 3, 14), d(2027, 11, 7)));
    assert_eq!(next_dst_year(d(2027, 3, 12)), (d(2027, 3, 14), d(2027, 11, 7)));
    assert_eq!(next_dst_year(d(2027, 3, 13)), (d(2028, 3, 12), d(2028, 11, 5)));
    assert_eq!(next_dst_year(d(2027, 7, 1)), (d(2028, 3, 12), d(2028, 11, 5)));
}

#[tokio::test]
async fn daylight_saving_days_fire_as_documented() {
    let db = fresh().await;
    let l = &db.ledger;
    // New York springs forward on `spring_day` (02:30 never happens) and
    // falls back on `fall_day` (01:30 happens twice).
    l.create_schedule(
        "spring",
        &spec("30 2 * * *", "America/New_York", Missed::All, 1000),
        "ops",
        "r",
    )
    .await
    .unwrap();
    l.create_schedule(
        "fall",
        &spec("30 1 * * *", "America/New_York", Missed::All, 1000),
        "ops",
        "r",
    )
    .await
    .unwrap();
    let token = l
        .acquire_scheduler_lease("s", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let now = db_clock(&db).await;
    let (spring_day, fall_day) = next_dst_year(now.date_naive());
    let day = |d: chrono::NaiveDate, n: i64| d + chrono::Duration::days(n);
    let end = day(fall_day, 2).and_hms_opt(0, 0, 0).unwrap().and_utc();
    l.fire_due(token, end - now).await.unwrap();
    // Slot keys are UTC: 02:30 is 07:30 in winter (EST) and 06:30 in summer.
    let at = |d: chrono::NaiveDate, hm: &str| format!("{d}T{hm}:00.000000Z");
    let spring = keys(&db, "spring").await;
    for k in [
        at(day(spring_day, -1), "07:30"),
        at(spring_day, "07:00"),
        at(day(spring_day, 1), "06:30"),
    ] {
        assert!(
            spring.contains(&format!("schedule:spring:{k}")),
            "{k} in {spring:?}"
        );
    }
    let (skipped_a, skipped_b) = (at(spring_day, "06:30"), at(spring_day, "07:30"));
    assert!(!spring
        .iter()
        .any(|k| k.ends_with(&skipped_a) || k.ends_with(&skipped_b)));
    let fall = keys(&db, "fall").await;
    for k in [
        at(day(fall_day, -1), "05:30"),
        at(fall_day, "05:30"),
        at(day(fall_day, 1), "06:30"),
    ] {
        assert!(fall.contains(&format!("schedule:fall:{k}")), "{k} in {fall:?}");
    }
    assert!(
        !fall.iter().any(|k| k.ends_with(&at(fall_day, "06:30"))),
        "the repeated 01:30 fires once"
    );
    // One a day, no more, no fewer.
    let days = (day(fall_day, 1) - now.date_naive()).num_days() as usize;
    assert!(
        (days - 1..=days + 1).contains(&spring.len()),
        "{} slots over {days} days",
        spring.len()
    );
    // The same days fire in both from a cut between two New York days'
    // slots: 08:00 UTC is after both of a day's (01:30 and 02:30 there,
    // 05:30–07:30 UTC) and before the next day's. Counted from creation,
    // the two differ by one when the test runs between 01:30 and 02:30 in
    // New York (06:30–07:30 UTC in winter): that day's 01:30 has passed,
    // its 02:30 has not.
    let cut = day(now.date_naive(), 1).and_hms_opt(8, 0, 0).unwrap().and_utc();
    let from_cut = |keys: &[String]| {
        keys.iter()
            .filter(|k| {
                let at = k.splitn(3, ':').nth(2).expect("schedule:<name>:<slot>");
                chrono::DateTime::parse_from_rfc3339(at).unwrap() >= cut
            })
            .count()
    };
    assert_eq!(from_cut(&spring), from_cut(&fall), "one a day in both");
    db.assert_verified().await;
}

#[tokio::test]
async fn the_cli_manages_schedules_and_verify_catches_an_edited_stream() {
    let db = fresh().await;
    let jl = |args: &[&str]| common::cli::jl(&db.url, args);
    let out = jl(&[
        "schedule",
        "create",
        "nightly",
        "--cron",
        "0 3 * * *",
        "--tz",
        "Europe/Berlin",
        "--queue",
        "reports",
        "--kind",
        "report",
        "--missed",
        "once",
        "--operator",
        "alice",
        "--reason",
        "nightly export",
    ])
    .json();
    assert_eq!(out["name"], "nightly");
    // 03:00 in Berlin is 01:00 UTC in summer (CEST) and 02:00 in winter
    // (CET). The check it replaces could not fail: it also passed any string.
    let next = out["next_slot"].as_str().unwrap();
    assert!(
        ["T01:00:00Z", "T02:00:00Z"].iter().any(|t| next.ends_with(t)),
        "{next}"
    );
    let bad = jl(&[
        "schedule",
        "create",
        "bad",
        "--cron",
        "every day",
        "--queue",
        "q",
        "--kind",
        "k",
        "--operator",
        "a",
        "--reason",
        "r",
    ]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(bad.stderr.contains("cron expression"), "{}", bad.stderr);
    let bad_tz = jl(&[
        "schedule",
        "create",
        "bad",
        "--cron",
        "* * * * *",
        "--tz",
        "Mars/Base",
        "--queue",
        "q",
        "--kind",
        "k",
        "--operator",
        "a",
        "--reason",
        "r",
    ]);
    assert!(bad_tz.stderr.contains("IANA"), "{}", bad_tz.stderr);
    jl(&[
        "schedule",
        "pause",
        "nightly",
        "--operator",
        "bob",
        "--reason",
        "freeze",
    ]);
    let list = jl(&["schedule", "list"]).json();
    assert_eq!(list["paused"], true);
    jl(&[
        "schedule",
        "delete",
        "nightly",
        "--operator",
        "bob",
        "--reason",
        "gone",
    ]);
    let h = jl(&["schedule", "history", "nightly"]).stdout;
    let actions: Vec<String> = h
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["action"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(actions, ["created", "paused", "deleted"]);
    db.assert_verified().await;
    // A superuser rewrites who paused it: verify names the schedule.
    let mut c = db.conn().await;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut c)
        .await
        .unwrap();
    sqlx::query("UPDATE jobledger.schedule_events SET actor = 'mallory' WHERE version = 2")
        .execute(&mut c)
        .await
        .unwrap();
    let report = db.ledger.verify(None).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.detail.contains("schedule \"nightly\" v2: the hash")),
        "{:?}",
        report.problems
    );
}
