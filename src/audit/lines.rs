//! The export's lines, parsed off the auditing thread: JSON, the stored
//! hash's check and the event as the domain reads it, in chunks that come
//! back in the file's order.

use uuid::Uuid;

use super::export::{checkpoint_of, EventLine, HeadLine, Header, Manifest};
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
    /// The file cannot be read on from this line (a cut or corrupt stream).
    Io(u64, std::io::Error),
}

/// The longest line the audit reads: an event line holds a payload of up to
/// the ledger's limit (1 MB by default, more if configured) written as JSON,
/// whose escapes can grow it several times. A longer line is a finding, and
/// is skipped without being held in memory.
pub(crate) const MAX_LINE: usize = 16 << 20;

/// A line of the file: its text, or why it is not one (too long, not UTF-8).
pub(crate) type Line = Result<String, String>;

/// The file's lines, numbered from 1, none held past `MAX_LINE` bytes
/// (`BufRead::lines` would hold a line of any length).
pub(crate) struct Lines<R> {
    reader: R,
    number: u64,
    done: bool,
}

impl<R: std::io::BufRead> Lines<R> {
    pub fn new(reader: R) -> Self {
        Lines {
            reader,
            number: 0,
            done: false,
        }
    }

    /// The next line's bytes (without its end), or how many bytes a line
    /// too long had; `None` at the end of the file.
    fn bytes(&mut self) -> std::io::Result<Option<Result<Vec<u8>, usize>>> {
        let (mut buf, mut dropped, mut any) = (Vec::new(), 0usize, false);
        loop {
            let avail = match self.reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if avail.is_empty() {
                break;
            }
            any = true;
            let (take, end) = match memchr::memchr(b'\n', avail) {
                Some(i) => (i + 1, true),
                None => (avail.len(), false),
            };
            if dropped == 0 && buf.len() + take <= MAX_LINE + 1 {
                buf.extend_from_slice(&avail[..take]);
            } else {
                dropped += std::mem::take(&mut buf).len() + take;
            }
            self.reader.consume(take);
            if end {
                break;
            }
        }
        if !any {
            return Ok(None);
        }
        if dropped > 0 {
            return Ok(Some(Err(dropped)));
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        }
        Ok(Some(Ok(buf)))
    }
}

impl<R: std::io::BufRead> Iterator for Lines<R> {
    type Item = (u64, std::io::Result<Line>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        self.number += 1;
        let line = match self.bytes() {
            Ok(None) => return None,
            Ok(Some(Ok(b))) => String::from_utf8(b).map_err(|_| "a line that is not UTF-8".to_string()),
            Ok(Some(Err(n))) => Err(format!(
                "a line of {n} bytes, over the {MAX_LINE} the audit reads"
            )),
            Err(e) => {
                // Nothing after a broken stream can be trusted to be a line.
                self.done = true;
                return Some((self.number, Err(e)));
            }
        };
        Some((self.number, Ok(line)))
    }
}

/// Lines (or bytes) per chunk, and parsing threads: the reading thread hands
/// chunk k to parser k mod PARSERS, and the chunks come back in the same
/// turn, so their order is the file's. Chunks close at either bound, and
/// each channel holds `DEPTH` of them, so the lines in flight stay within a
/// few tens of MB whatever the file holds.
const CHUNK: usize = 512;
const CHUNK_BYTES: usize = 4 << 20;
const DEPTH: usize = 2;
const PARSERS: usize = 2;

type Numbered = (u64, std::io::Result<Line>);

pub(crate) fn parse_in_parallel<'s, I>(
    scope: &'s std::thread::Scope<'s, '_>,
    lines: I,
) -> impl Iterator<Item = Vec<Parsed>> + 's
where
    I: Iterator<Item = Numbered> + Send + 's,
{
    use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
    let mut work: Vec<SyncSender<Vec<Numbered>>> = vec![];
    let mut done: Vec<Receiver<Vec<Parsed>>> = vec![];
    for _ in 0..PARSERS {
        let (wtx, wrx) = sync_channel::<Vec<Numbered>>(DEPTH);
        let (dtx, drx) = sync_channel::<Vec<Parsed>>(DEPTH);
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
        let (mut chunk, mut bytes, mut turn) = (Vec::with_capacity(CHUNK), 0, 0);
        for l in lines {
            bytes += l.1.as_ref().map_or(0, |l| l.as_ref().map_or(0, String::len));
            chunk.push(l);
            if chunk.len() == CHUNK || bytes >= CHUNK_BYTES {
                if work[turn]
                    .send(std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK)))
                    .is_err()
                {
                    return;
                }
                bytes = 0;
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
/// run off the auditing thread. A bad line's finding names its line number.
fn parse((number, l): Numbered) -> Parsed {
    let l = match l {
        Ok(Ok(l)) => l,
        Ok(Err(why)) => return Parsed::Bad(format!("line {number}: {why}")),
        Err(e) => return Parsed::Io(number, e),
    };
    let bad =
        |what: &str, e: serde_json::Error| Parsed::Bad(format!("line {number}: unreadable {what}: {e}"));
    if l.starts_with("{\"kind\":\"event\"") {
        let mut e = match serde_json::from_str::<EventLine>(&l) {
            Ok(e) => e,
            Err(err) => return bad("event line", err),
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
        return serde_json::from_str(&l).map_or_else(|e| bad("head", e), Parsed::Head);
    }
    if l.starts_with("{\"kind\":\"manifest\"") {
        return serde_json::from_str(&l).map_or_else(|e| bad("manifest", e), Parsed::Manifest);
    }
    Parsed::Bad(format!("line {number}: a line of unknown kind"))
}

/// The largest leaf index a header may claim (far beyond any real log; it
/// keeps the tree's arithmetic from overflowing on a forged header).
const MAX_LEAVES: u64 = 1 << 48;

pub(crate) type FileLines = Lines<
    std::io::BufReader<zstd::stream::read::Decoder<'static, std::io::BufReader<Counted<std::fs::File>>>>,
>;

/// A segment's header, and the lines after it.
pub(crate) fn read_header(file: Counted<std::fs::File>) -> Result<(Header, FileLines), String> {
    let reader = zstd::stream::read::Decoder::new(file).map_err(|e| e.to_string())?;
    let mut lines = Lines::new(std::io::BufReader::with_capacity(1 << 20, reader));
    let (_, first) = lines.next().ok_or("the file is empty")?;
    let first = first.map_err(|e| format!("the file cannot be read ({e})"))??;
    let header: Header = serde_json::from_str(&first).map_err(|e| format!("not a segment header: {e}"))?;
    if header.from_index > MAX_LEAVES || header.checkpoint_sizes.iter().any(|s| *s > MAX_LEAVES) {
        return Err("the header names leaves no log has".into());
    }
    Ok((header, lines))
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
