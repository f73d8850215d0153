use super::*;
use chrono::TimeZone;

fn spec(cron: &str, tz: &str, missed: Missed, n: u32) -> ScheduleSpec {
    ScheduleSpec {
        cron: cron.into(),
        tz: tz.into(),
        queue: "q".into(),
        kind: "k".into(),
        payload: json!({}),
        priority: 0,
        missed,
        max_catch_up: n,
    }
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

fn all_slots(s: &ScheduleSpec, from: &str, to: &str) -> Vec<String> {
    let p = plan(&spec(&s.cron, &s.tz, Missed::All, 1000), utc(from), utc(to)).unwrap();
    p.fire.iter().map(|t| t.to_rfc3339()).collect()
}

#[test]
fn spring_forward_fires_the_gap_slot_once_after_the_gap() {
    // New York, 2026-03-08: 02:00 EST jumps to 03:00 EDT; 02:30 never exists.
    let daily = spec("30 2 * * *", "America/New_York", Missed::All, 0);
    assert_eq!(
        all_slots(&daily, "2026-03-07T00:00:00Z", "2026-03-10T00:00:00Z"),
        [
            "2026-03-07T07:30:00+00:00", // 02:30 EST
            "2026-03-08T07:00:00+00:00", // 03:00 EDT: the first instant after the gap
            "2026-03-09T06:30:00+00:00", // 02:30 EDT
        ]
    );
    let hourly = spec("0 * * * *", "America/New_York", Missed::All, 0);
    assert_eq!(
        all_slots(&hourly, "2026-03-08T05:30:00Z", "2026-03-08T09:30:00Z"),
        [
            "2026-03-08T06:00:00+00:00", // 01:00 EST
            "2026-03-08T07:00:00+00:00", // 02:00 (missing) and 03:00 EDT: one firing
            "2026-03-08T08:00:00+00:00", // 04:00 EDT
            "2026-03-08T09:00:00+00:00",
        ]
    );
}

#[test]
fn fall_back_fires_the_repeated_slot_once_in_its_first_pass() {
    // New York, 2026-11-01: 02:00 EDT falls back to 01:00 EST; 01:30 happens twice.
    let daily = spec("30 1 * * *", "America/New_York", Missed::All, 0);
    assert_eq!(
        all_slots(&daily, "2026-10-31T00:00:00Z", "2026-11-03T00:00:00Z"),
        [
            "2026-10-31T05:30:00+00:00", // 01:30 EDT
            "2026-11-01T05:30:00+00:00", // 01:30 EDT, the first pass; not again at 06:30Z
            "2026-11-02T06:30:00+00:00", // 01:30 EST
        ]
    );
    // A cursor inside the second pass never walks back into the first.
    let hourly = spec("30 * * * *", "America/New_York", Missed::All, 0);
    let slots = all_slots(&hourly, "2026-11-01T06:10:00Z", "2026-11-01T08:00:00Z");
    assert_eq!(
        slots,
        ["2026-11-01T07:30:00+00:00"],
        "02:30 EST; 01:30 EST is skipped"
    );
}

#[test]
fn missed_slot_policies() {
    let cursor = utc("2026-12-02T10:00:00Z");
    // Down from 10:00 to 10:10:20 with a per-minute schedule: 10:01..10:10.
    let now = utc("2026-12-02T10:10:20Z");
    let p = plan(&spec("* * * * *", "UTC", Missed::Skip, 0), cursor, now).unwrap();
    assert_eq!(p.fire, [utc("2026-12-02T10:10:00Z")], "only the on-time slot");
    assert_eq!(p.skipped.as_ref().unwrap().count, 9);
    let p = plan(&spec("* * * * *", "UTC", Missed::Once, 0), cursor, now).unwrap();
    assert_eq!(p.fire, [utc("2026-12-02T10:09:00Z"), utc("2026-12-02T10:10:00Z")]);
    assert_eq!(p.skipped.as_ref().unwrap().count, 8);
    let p = plan(&spec("* * * * *", "UTC", Missed::All, 3), cursor, now).unwrap();
    assert_eq!(p.fire.len(), 4, "the latest 3 missed and the on-time one");
    assert_eq!(p.fire[0], utc("2026-12-02T10:07:00Z"));
    let s = p.skipped.unwrap();
    assert_eq!(
        (s.first, s.last, s.count),
        (utc("2026-12-02T10:01:00Z"), utc("2026-12-02T10:06:00Z"), 6)
    );
    // Late by more than ON_TIME: nothing is on time.
    let late = utc("2026-12-02T10:11:30Z");
    let p = plan(&spec("*/5 * * * *", "UTC", Missed::Skip, 0), cursor, late).unwrap();
    assert!(p.fire.is_empty(), "10:10 is 90 s old");
    assert_eq!(p.skipped.unwrap().count, 2);
    let p = plan(&spec("*/5 * * * *", "UTC", Missed::Once, 0), cursor, late).unwrap();
    assert_eq!(
        p.fire,
        [utc("2026-12-02T10:10:00Z")],
        "one firing stands for the outage"
    );
    // Nothing due: nothing to record.
    assert_eq!(
        plan(&spec("0 0 1 1 *", "UTC", Missed::All, 9), cursor, now).unwrap(),
        Plan::default()
    );
}

#[test]
fn a_slot_fires_once_and_the_stream_replays() {
    let now = Utc.with_ymd_and_hms(2026, 12, 2, 10, 0, 0).unwrap();
    let s0 = ScheduleState {
        name: "nightly".into(),
        ..Default::default()
    };
    let sp = spec("* * * * *", "UTC", Missed::Skip, 0);
    let e = decide_schedule(&s0, &ScheduleCommand::Create(sp.clone()), "ops", "r", now).unwrap();
    let s1 = apply_schedule(&s0, &e).unwrap();
    assert_eq!(s1.cursor, now);
    let slot = now + Duration::minutes(1);
    let fire = ScheduleCommand::Fire {
        slot,
        job_id: uuid::Uuid::nil(),
    };
    let e = decide_schedule(&s1, &fire, "scheduler", "slot", slot).unwrap();
    let s2 = apply_schedule(&s1, &e).unwrap();
    assert_eq!(
        decide_schedule(&s2, &fire, "scheduler", "slot", slot),
        Err(ScheduleRefusal::Already("the slot was already fired or skipped"))
    );
    // A forged second firing of the same slot does not replay.
    let mut again = e.clone();
    again.version = 3;
    again.prev_hash = s2.last_hash.clone();
    again.hash = schedule_event_hash(&again);
    assert!(apply_schedule(&s2, &again)
        .unwrap_err()
        .contains("not after the cursor"));
    let bad = spec("61 * * * *", "UTC", Missed::Skip, 0);
    assert!(matches!(
        decide_schedule(&s0, &ScheduleCommand::Create(bad), "ops", "r", now),
        Err(ScheduleRefusal::Invalid(_))
    ));
    let bad_tz = spec("* * * * *", "Mars/Olympus", Missed::Skip, 0);
    assert!(matches!(
        decide_schedule(&s0, &ScheduleCommand::Create(bad_tz), "ops", "r", now),
        Err(ScheduleRefusal::Invalid(_))
    ));
}

proptest::proptest! {
    /// Whatever the cursor, the time and the policy: fired and skipped slots
    /// are disjoint, lie in (cursor, now], and together are every due slot.
    #[test]
    fn plans_cover_every_due_slot_once(
        start in 0i64..(400 * 86_400),
        span in 0i64..(3 * 86_400),
        which in 0usize..4,
        policy in 0usize..3,
        n in 0u32..20,
    ) {
        let crons = ["*/7 * * * *", "30 1,2 * * *", "0 */3 * * *", "15 2 * * 0"];
        let missed = [Missed::Skip, Missed::Once, Missed::All][policy];
        let sp = spec(crons[which], "America/New_York", missed, n);
        let cursor = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap() + Duration::seconds(start);
        let now = cursor + Duration::seconds(span);
        let p = plan(&sp, cursor, now).unwrap();
        let all = plan(&spec(crons[which], "America/New_York", Missed::All, 1000), cursor, now).unwrap();
        let mut covered = p.fire.clone();
        proptest::prop_assert!(p.fire.windows(2).all(|w| w[0] < w[1]));
        proptest::prop_assert!(p.fire.iter().all(|s| *s > cursor && *s <= now));
        if let Some(k) = &p.skipped {
            proptest::prop_assert!(k.first > cursor && k.last <= now);
            proptest::prop_assert_eq!(k.count as usize + p.fire.len(), all.fire.len());
            covered.push(k.last);
        } else {
            proptest::prop_assert_eq!(p.fire.len(), all.fire.len());
        }
        proptest::prop_assert!(all.fire.windows(2).all(|w| w[0] < w[1]));
        if missed == Missed::All && n >= 1000 { proptest::prop_assert_eq!(&p.fire, &all.fire); }
    }
}
