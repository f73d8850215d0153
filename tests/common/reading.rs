//! Reading the whole log through a `LogReader`, as the reader tests do.

use jobledger::reader::{Batch, Checkpoint, LogEvent, LogReader};
use std::time::Duration;

/// Reads until every committed event of this database is behind the
/// checkpoint. An empty batch alone does not mean that: the snapshot horizon
/// is cluster-wide, so another test's open transaction (these tests hold some
/// on purpose) can hold the reader back for a while. It must never make the
/// reader skip anything, which is what the callers assert.
pub async fn drain(reader: &LogReader, from: Checkpoint, limit: i64) -> (Vec<LogEvent>, Checkpoint) {
    drain_data_of(reader, from, limit, None, None).await
}

/// `drain` with `data` only on the named kinds of event, and of it only
/// the named keys.
pub async fn drain_data_of(
    reader: &LogReader,
    from: Checkpoint,
    limit: i64,
    data_of: Option<&[&str]>,
    keys: Option<&[&str]>,
) -> (Vec<LogEvent>, Checkpoint) {
    drain_wanted(reader, from, limit, data_of, keys, true).await
}

/// `drain_data_of`, with the hash chain's columns only when `hashes`.
pub async fn drain_wanted(
    reader: &LogReader,
    from: Checkpoint,
    limit: i64,
    data_of: Option<&[&str]>,
    keys: Option<&[&str]>,
    hashes: bool,
) -> (Vec<LogEvent>, Checkpoint) {
    drain_by(reader, from, |cp| {
        reader.read_data(cp, limit, data_of, keys, hashes)
    })
    .await
}

/// `drain` with each event's data unparsed (`read_raw`, as the relay reads).
pub async fn drain_raw(reader: &LogReader, from: Checkpoint, limit: i64) -> (Vec<LogEvent>, Checkpoint) {
    drain_by(reader, from, |cp| reader.read_raw(cp, limit)).await
}

async fn drain_by<F, R>(reader: &LogReader, from: Checkpoint, read: F) -> (Vec<LogEvent>, Checkpoint)
where
    F: Fn(Checkpoint) -> R,
    R: std::future::Future<Output = jobledger::ledger::LedgerResult<Batch>>,
{
    let mut cp = from;
    let mut out = vec![];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let b = read(cp).await.unwrap();
        if b.events.is_empty() {
            if !reader.behind(cp).await.unwrap() {
                return (out, cp);
            }
            if std::time::Instant::now() > deadline {
                let lag = reader.lag(cp).await.unwrap();
                panic!("the reader is still held back after 30 s: {lag:?}");
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            continue;
        }
        out.extend(b.events);
        cp = b.next;
    }
}
