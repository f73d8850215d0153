//! The export's lines, parsed off the auditing thread: JSON, the stored
//! hash's check and the event as the domain reads it, in chunks that come
//! back in the file's order.

use uuid::Uuid;

use super::export::{checkpoint_of, EventLine, HeadLine, Manifest};
use crate::domain::checkpoint::LOG_STREAM;
use crate::domain::Event;

/// What the sequential part of the audit needs of one event: its place,
/// its chain fields, the stored hash's check, and the event as the domain
/// reads it (parsed on the reading thread).
pub(crate) struct Seen {
    pub label: u64,
    pub position: i64,
    pub job_id: Uuid,
    pub version: i64,
    pub hash: String,
    pub prev_hash: Option<String>,
    pub hash_ok: bool,
    pub schema: i16,
    pub checkpoint: Option<crate::domain::checkpoint::Checkpoint>,
    /// `None` for the log's own stream (not a job: nothing to replay).
    pub event: Option<Result<Event, String>>,
}

pub(crate) enum Parsed {
    Event(Box<Seen>),
    Head(HeadLine),
    Manifest(Manifest),
    Bad(String),
    Io(std::io::Error),
}

/// Lines per chunk, and parsing threads: the reading thread hands chunk k
/// to parser k mod PARSERS, and the chunks come back in the same turn, so
/// their order is the file's.
const CHUNK: usize = 512;
const PARSERS: usize = 2;

pub(crate) fn parse_in_parallel<'s, I>(
    scope: &'s std::thread::Scope<'s, '_>,
    lines: I,
) -> impl Iterator<Item = Vec<Parsed>> + 's
where
    I: Iterator<Item = std::io::Result<String>> + Send + 's,
{
    use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
    let (mut work, mut done): (Vec<SyncSender<Vec<_>>>, Vec<Receiver<Vec<Parsed>>>) = (vec![], vec![]);
    for _ in 0..PARSERS {
        let (wtx, wrx) = sync_channel::<Vec<std::io::Result<String>>>(8);
        let (dtx, drx) = sync_channel::<Vec<Parsed>>(8);
        scope.spawn(move || {
            for chunk in wrx {
                if dtx.send(chunk.into_iter().map(parse).collect()).is_err() {
                    return;
                }
            }
        });
        work.push(wtx);
        done.push(drx);
    }
    scope.spawn(move || {
        let mut chunk = Vec::with_capacity(CHUNK);
        let mut turn = 0;
        for l in lines {
            chunk.push(l);
            if chunk.len() == CHUNK {
                if work[turn]
                    .send(std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK)))
                    .is_err()
                {
                    return;
                }
                turn = (turn + 1) % PARSERS;
            }
        }
        if !chunk.is_empty() {
            let _ = work[turn].send(chunk);
        }
    });
    // The parsers' outputs, taken in the turn the chunks were handed out;
    // the first parser to run dry ends the segment.
    let mut turn = 0;
    std::iter::from_fn(move || {
        let next = done[turn].recv().ok();
        turn = (turn + 1) % PARSERS;
        next
    })
}

/// Parses one line: the costly part (JSON, the stored hash, the upcast),
/// run off the auditing thread.
fn parse(l: std::io::Result<String>) -> Parsed {
    let l = match l {
        Ok(l) => l,
        Err(e) => return Parsed::Io(e),
    };
    if l.starts_with("{\"kind\":\"event\"") {
        let mut e = match serde_json::from_str::<EventLine>(&l) {
            Ok(e) => e,
            Err(err) => return Parsed::Bad(format!("unreadable event line: {err}")),
        };
        e.event.position = e.position;
        let row = e.event;
        let hash_ok = row.stored_hash() == row.hash;
        let checkpoint = checkpoint_of(&row);
        let seen = Seen {
            label: e.index,
            position: row.position,
            job_id: row.job_id,
            version: row.version,
            hash: row.hash.clone(),
            prev_hash: row.prev_hash.clone(),
            hash_ok,
            schema: row.schema,
            checkpoint,
            event: None,
        };
        let event = (row.job_id != LOG_STREAM).then(|| row.into_event().map_err(|e| e.to_string()));
        return Parsed::Event(Box::new(Seen { event, ..seen }));
    }
    if l.starts_with("{\"kind\":\"head\"") {
        return serde_json::from_str(&l)
            .map_or_else(|e| Parsed::Bad(format!("unreadable head: {e}")), Parsed::Head);
    }
    if l.starts_with("{\"kind\":\"manifest\"") {
        return serde_json::from_str(&l).map_or_else(
            |e| Parsed::Bad(format!("unreadable manifest: {e}")),
            Parsed::Manifest,
        );
    }
    Parsed::Bad("a line of unknown kind".into())
}

/// A reader that adds the bytes it reads to a progress counter.
pub(super) struct Counted<R> {
    pub inner: R,
    pub progress: std::sync::Arc<super::Progress>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress
            .done
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}
