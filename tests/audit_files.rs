//! Broken export files, as the second review of the auditor's kit made
//! them: a cut stream, a line that is not UTF-8, a line too long to hold,
//! an empty segment. Each is a finding naming where (exit 1), never a usage
//! error that hides the findings before it, and the segments after a broken
//! one are still checked.

mod common;

use common::auditkit::new_kit;
use common::cli::jl;
use std::io::Write;

#[tokio::test]
async fn broken_files_are_findings_and_the_next_segments_are_checked() {
    let kit = new_kit().await;
    let (a, b) = (kit.path("a.zst"), kit.path("b.zst"));
    let a_s = a.to_str().unwrap();
    kit.db.ledger.export(0, Some(150), &a).await.unwrap();
    kit.db.ledger.export(150, None, &b).await.unwrap();
    assert_eq!(jl(&kit.db.url, &["audit", a_s, b.to_str().unwrap()]).code, 0);

    let text = {
        use std::io::Read;
        let mut s = String::new();
        zstd::stream::read::Decoder::new(std::fs::File::open(&a).unwrap())
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    let frame = |lines: &[&str]| {
        let mut z = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        for l in lines {
            writeln!(z, "{l}").unwrap();
        }
        z.finish().unwrap()
    };
    let all: Vec<&str> = text.lines().collect();

    // A file cut inside its first block: not even the header reads.
    let bytes = std::fs::read(&a).unwrap();
    let cut = kit.path("cut.zst");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let run = jl(
        &kit.db.url,
        &["audit", cut.to_str().unwrap(), b.to_str().unwrap()],
    );
    assert_eq!(run.code, 1, "{} / {}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("line 1: the file cannot be read (")
            && run.stdout.contains("the segment is not checked"),
        "{}",
        run.stdout
    );
    let report = run.lines().last().unwrap()["report"].clone();
    assert_eq!(
        report["segments"], 2,
        "the segment after the cut one was checked: {report}"
    );

    // A stream cut later: two frames, the second cut half-way.
    let (head, rest) = (frame(&all[..30]), frame(&all[30..]));
    let late = kit.path("late.zst");
    std::fs::write(&late, [&head[..], &rest[..rest.len() / 2]].concat()).unwrap();
    let run = jl(
        &kit.db.url,
        &["audit", late.to_str().unwrap(), b.to_str().unwrap()],
    );
    assert_eq!(run.code, 1, "{} / {}", run.stdout, run.stderr);
    let lines = run.lines();
    let broken = lines
        .iter()
        .find(|l| {
            l["finding"]["detail"]
                .as_str()
                .is_some_and(|d| d.contains("cannot be read on"))
        })
        .unwrap_or_else(|| panic!("{}", run.stdout));
    let detail = broken["finding"]["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("line ") && detail.contains(", after position "),
        "{detail}"
    );
    assert!(
        broken["finding"]["index"].as_u64().is_some_and(|i| i >= 29),
        "{broken}"
    );
    assert_eq!(lines.last().unwrap()["report"]["segments"], 2);

    // A line that is not UTF-8, and a line too long to hold, among honest ones.
    let mut lines: Vec<Vec<u8>> = text.lines().map(|l| l.as_bytes().to_vec()).collect();
    lines.insert(12, b"{\"kind\":\"event\"\xff\xfe}".to_vec());
    lines.insert(20, vec![b'x'; jobledger_max_line() + 10]);
    let bad = kit.path("bad.zst");
    let mut z = zstd::stream::write::Encoder::new(std::fs::File::create(&bad).unwrap(), 3).unwrap();
    for l in &lines {
        z.write_all(l).unwrap();
        z.write_all(b"\n").unwrap();
    }
    z.finish().unwrap();
    let run = jl(&kit.db.url, &["audit", bad.to_str().unwrap()]);
    assert_eq!(run.code, 1, "{} / {}", run.stdout, run.stderr);
    let details: Vec<String> = run
        .lines()
        .iter()
        .filter_map(|l| l["finding"]["detail"].as_str().map(str::to_string))
        .collect();
    assert!(
        details
            .iter()
            .any(|d| d.starts_with("line 13: a line that is not UTF-8, after position ")),
        "{details:?}"
    );
    assert!(
        details
            .iter()
            .any(|d| d.starts_with("line 21: a line of ") && d.contains("over the")),
        "{details:?}"
    );
    assert_eq!(details.len(), 2, "nothing else is wrong: {details:?}");

    // An empty segment ends where it starts.
    let empty = kit.path("empty.zst");
    kit.db.ledger.export(40, Some(40), &empty).await.unwrap();
    let run = jl(&kit.db.url, &["audit", empty.to_str().unwrap()]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let report = &run.json()["report"];
    assert_eq!(
        (report["from_index"].as_u64(), report["end_index"].as_u64()),
        (Some(40), Some(40)),
        "{report}"
    );
}

/// The audit's line limit (16 MiB; `audit::lines::MAX_LINE` is private).
fn jobledger_max_line() -> usize {
    16 << 20
}
