//! `audit`: checks exported segments and proofs with no database. Every
//! hash link, every job replayed through the same state machine as
//! `verify`, the Merkle root recomputed and held against the manifest and
//! every signed checkpoint, continuity across consecutive segments. Each
//! finding names its position; the caller prints one line per finding.

use ed25519_dalek::VerifyingKey;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufRead;
use std::path::Path;
use uuid::Uuid;

use super::export::{checkpoint_of, EventLine, HeadLine, Header, Manifest, FORMAT};
use super::prove::{ConsistencyProof, InclusionProof};
use super::{io, AuditError, AuditResult};
use crate::domain::apply::apply_owned;
use crate::domain::checkpoint::LOG_STREAM;
use crate::domain::merkle::{event_leaf, verify_consistency, verify_inclusion, Frontier, Hash};
use crate::domain::{Event, Job};
use crate::store::EventRow;

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub file: String,
    pub index: Option<u64>,
    pub position: Option<i64>,
    pub job_id: Option<Uuid>,
    pub detail: String,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct AuditReport {
    pub segments: u64,
    pub events: u64,
    pub jobs: u64,
    pub checkpoints_checked: u64,
    pub findings: u64,
    pub from_index: Option<u64>,
    pub end_index: u64,
    pub root: String,
    /// The first segment started past leaf 0: its prefix (the peaks in its
    /// header) is taken on trust, and jobs begun before it are linked from
    /// their first event in it, not replayed.
    pub trusted_prefix: bool,
}

/// What the sequential part of the audit needs of one event: its place,
/// its chain fields, the stored hash's check, and the event as the domain
/// reads it (parsed on the reading thread).
struct Seen {
    label: u64,
    position: i64,
    job_id: Uuid,
    version: i64,
    hash: String,
    prev_hash: Option<String>,
    hash_ok: bool,
    checkpoint: Option<crate::domain::checkpoint::Checkpoint>,
    /// `None` for the log's own stream (not a job: nothing to replay).
    event: Option<Result<Event, String>>,
}

enum Parsed {
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

fn parse_in_parallel<'s, I>(
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

struct Track {
    version: i64,
    hash: String,
    /// `None`: its history began before the audited segments (not replayed).
    job: Option<Job>,
    /// Versions that arrived before their predecessor (log order is by
    /// transaction, docs/log-reader.md): `version -> (index, event)`.
    early: BTreeMap<i64, (u64, Box<Seen>)>,
}

pub struct Auditor<'a> {
    pubkey: Option<VerifyingKey>,
    report: AuditReport,
    frontier: Option<Frontier>,
    log_id: Option<Uuid>,
    jobs: HashMap<Uuid, Track>,
    file: String,
    on_finding: Box<dyn FnMut(&Finding) + 'a>,
}

impl<'a> Auditor<'a> {
    pub fn new(pubkey: Option<VerifyingKey>, on_finding: impl FnMut(&Finding) + 'a) -> Self {
        Auditor {
            pubkey,
            report: AuditReport::default(),
            frontier: None,
            log_id: None,
            jobs: HashMap::new(),
            file: String::new(),
            on_finding: Box::new(on_finding),
        }
    }

    fn find(&mut self, index: Option<u64>, position: Option<i64>, job_id: Option<Uuid>, detail: String) {
        self.report.findings += 1;
        let f = Finding {
            file: self.file.clone(),
            index,
            position,
            job_id,
            detail,
        };
        (self.on_finding)(&f);
    }

    /// Checks one segment file (segments in log order, each continuing the last).
    pub fn segment(&mut self, path: &Path) -> AuditResult<()> {
        self.file = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|e| io(path, e))?;
        let reader = zstd::stream::read::Decoder::new(file).map_err(|e| io(path, e))?;
        let mut lines = std::io::BufReader::with_capacity(1 << 20, reader).lines();
        let first = lines
            .next()
            .ok_or_else(|| AuditError::BadInput(format!("{}: empty", self.file)))?
            .map_err(|e| io(path, e))?;
        let header: Header = serde_json::from_str(&first)
            .map_err(|e| AuditError::BadInput(format!("{}: not a segment header: {e}", self.file)))?;
        let mut wanted: HashSet<u64> = self.begin(&header).into_iter().collect();
        let mut roots: HashMap<u64, Hash> = HashMap::new();
        let mut seen: HashMap<Uuid, (i64, String)> = HashMap::new();
        let mut manifest = None;
        // Lines are parsed and hashed on other threads, in chunks, and come
        // back in order; this one chains, replays and builds the tree.
        std::thread::scope(|scope| -> AuditResult<()> {
            let results = parse_in_parallel(scope, lines);
            for parsed in results.flatten() {
                match parsed {
                    Parsed::Event(e) => self.event(e, &mut wanted, &mut roots, &mut seen),
                    Parsed::Head(h) => {
                        if seen.get(&h.job_id) != Some(&(h.version, h.hash.clone())) {
                            let d = format!("manifest head v{} {} is not the segment's", h.version, h.hash);
                            self.find(None, None, Some(h.job_id), d);
                        }
                    }
                    Parsed::Manifest(m) => manifest = Some(m),
                    Parsed::Bad(d) => {
                        let at = self.frontier.as_ref().map(Frontier::size);
                        self.find(at, None, None, d);
                    }
                    Parsed::Io(e) => return Err(io(path, e)),
                }
            }
            Ok(())
        })?;
        match manifest {
            Some(m) => self.end(&m, &seen),
            None => self.find(
                None,
                None,
                None,
                "the segment has no manifest (truncated?)".into(),
            ),
        }
        self.report.segments += 1;
        Ok(())
    }

    /// Starts a segment: continuity with the previous one, or the trusted
    /// prefix of a first segment that does not start at leaf 0.
    fn begin(&mut self, h: &Header) -> Vec<u64> {
        if h.format != FORMAT {
            self.find(
                None,
                None,
                None,
                format!("export format {} (this build reads {FORMAT})", h.format),
            );
        }
        if self.log_id.is_some_and(|id| id != h.log_id) {
            self.find(
                None,
                None,
                None,
                format!(
                    "segment of log {}, not of {}",
                    h.log_id,
                    self.log_id.unwrap_or_default()
                ),
            );
        }
        self.log_id = Some(h.log_id);
        let peaks: Option<Vec<Hash>> = h
            .prefix_peaks
            .iter()
            .map(|p| hex::decode(p).ok().and_then(|b| b.try_into().ok()))
            .collect();
        match &self.frontier {
            Some(f) => {
                if f.size() != h.from_index {
                    self.find(
                        Some(h.from_index),
                        None,
                        None,
                        format!(
                            "starts at leaf {}, the previous segment ended at {}",
                            h.from_index,
                            f.size()
                        ),
                    );
                } else if peaks.as_deref() != Some(&f.peaks()[..]) {
                    self.find(
                        Some(h.from_index),
                        None,
                        None,
                        "its prefix is not the tree the previous segment built".into(),
                    );
                }
            }
            None => {
                self.report.from_index = Some(h.from_index);
                self.report.trusted_prefix = h.from_index > 0;
                let f = peaks.and_then(|p| Frontier::from_peaks(h.from_index, p));
                if f.is_none() {
                    self.find(
                        Some(h.from_index),
                        None,
                        None,
                        "its prefix peaks do not make a tree".into(),
                    );
                }
                self.frontier = Some(f.unwrap_or_default());
            }
        }
        h.checkpoint_sizes.clone()
    }

    fn event(
        &mut self,
        e: Box<Seen>,
        wanted: &mut HashSet<u64>,
        roots: &mut HashMap<u64, Hash>,
        seen: &mut HashMap<Uuid, (i64, String)>,
    ) {
        let f = self.frontier.as_mut().expect("begun");
        let index = f.size();
        f.push(event_leaf(e.position, &e.hash));
        if wanted.remove(&f.size()) {
            roots.insert(f.size(), f.root());
        }
        self.report.events += 1;
        self.report.end_index = f.size();
        let (pos, job) = (Some(e.position), Some(e.job_id));
        if e.label != index {
            self.find(Some(index), pos, job, format!("is labelled leaf {}", e.label));
        }
        if !e.hash_ok {
            let d = format!("hash mismatch: the event's content does not hash to {}", e.hash);
            self.find(Some(index), pos, job, d);
        }
        seen.insert(e.job_id, (e.version, e.hash.clone()));
        if let Some(cp) = &e.checkpoint {
            self.checkpoint(index, &e, cp, roots);
        }
        self.link(index, e);
    }

    fn checkpoint(
        &mut self,
        index: u64,
        e: &Seen,
        cp: &crate::domain::checkpoint::Checkpoint,
        roots: &HashMap<u64, Hash>,
    ) {
        let (pos, job, v) = (Some(e.position), Some(e.job_id), e.version);
        self.report.checkpoints_checked += 1;
        if let Some(key) = &self.pubkey {
            if let Err(err) = cp.verify(key) {
                self.find(Some(index), pos, job, format!("checkpoint v{v}: {err}"));
            }
        }
        if self.log_id.is_some_and(|id| id != cp.head.log_id) {
            self.find(
                Some(index),
                pos,
                job,
                format!("checkpoint v{v} signs log {}", cp.head.log_id),
            );
        }
        let size = cp.head.tree_size;
        let detail = match roots.get(&size) {
            Some(r) if hex::encode(r) == cp.head.root => return,
            Some(r) => format!(
                "checkpoint v{v} signed root {} over {size} leaves; the log's is {}: \
                 an event before leaf {size} was changed, removed or added",
                cp.head.root,
                hex::encode(r)
            ),
            None if self.report.trusted_prefix && size <= self.report.from_index.unwrap_or(0) => return,
            None => format!("checkpoint v{v} signs {size} leaves, a size the header did not announce"),
        };
        self.find(Some(index), pos, job, detail);
    }

    /// Chains and replays one event of a job, in version order.
    fn link(&mut self, index: u64, e: Box<Seen>) {
        let id = e.job_id;
        let Some(t) = self.jobs.get_mut(&id) else {
            if e.version == 1 || self.report.trusted_prefix {
                self.start(index, e);
                self.drain(id);
            } else {
                let early = BTreeMap::from([(e.version, (index, e))]);
                let t = Track {
                    version: 0,
                    hash: String::new(),
                    job: None,
                    early,
                };
                self.jobs.insert(id, t);
            }
            return;
        };
        if e.version > t.version + 1 {
            t.early.insert(e.version, (index, e));
            return;
        }
        if e.version <= t.version {
            let detail = format!("version {} again (the chain is at {})", e.version, t.version);
            self.find(Some(index), Some(e.position), Some(id), detail);
            return;
        }
        self.next(index, e);
        self.drain(id);
    }

    fn start(&mut self, index: u64, mut e: Box<Seen>) {
        let id = e.job_id;
        self.report.jobs += 1;
        if e.version == 1 && e.prev_hash.is_some() {
            let d = "a first event with a prev_hash".to_string();
            self.find(Some(index), Some(e.position), Some(id), d);
        }
        // A job first seen past its version 1 (a trusted prefix) is linked
        // from here on, not replayed: its state before is not in the files.
        let job = match e.event.take() {
            Some(ev) if e.version == 1 => self.replay(index, None, &e, ev),
            _ => None,
        };
        let t = Track {
            version: e.version,
            hash: e.hash,
            job,
            early: BTreeMap::new(),
        };
        self.jobs.insert(id, t);
    }

    fn next(&mut self, index: u64, mut e: Box<Seen>) {
        let id = e.job_id;
        let t = self.jobs.get_mut(&id).expect("tracked");
        let linked = e.prev_hash.as_deref() == Some(t.hash.as_str());
        let prev_job = t.job.take();
        let was = t.version;
        t.version = e.version;
        t.hash = e.hash.clone();
        if !linked && was > 0 {
            self.find(
                Some(index),
                Some(e.position),
                Some(id),
                format!("does not link to version {was}"),
            );
        }
        let job = match (prev_job, e.event.take()) {
            (Some(j), Some(ev)) => self.replay(index, Some(j), &e, ev),
            _ => None,
        };
        self.jobs.get_mut(&id).expect("tracked").job = job;
    }

    fn drain(&mut self, id: Uuid) {
        loop {
            let t = self.jobs.get_mut(&id).expect("tracked");
            let Some(entry) = t.early.first_entry() else {
                return;
            };
            if *entry.key() != t.version + 1 {
                return;
            }
            let (index, e) = entry.remove();
            self.next(index, e);
        }
    }

    fn replay(&mut self, index: u64, prev: Option<Job>, e: &Seen, ev: Result<Event, String>) -> Option<Job> {
        let (pos, job) = (Some(e.position), Some(e.job_id));
        let ev = match ev {
            Ok(ev) => ev,
            Err(d) => {
                self.find(Some(index), pos, job, d);
                return None;
            }
        };
        match apply_owned(prev, &ev) {
            Ok(j) => Some(j),
            Err(err) => {
                self.find(Some(index), pos, job, format!("replay refused the event: {err}"));
                None
            }
        }
    }

    fn end(&mut self, m: &Manifest, seen: &HashMap<Uuid, (i64, String)>) {
        let f = self.frontier.as_ref().expect("begun");
        let (size, root) = (f.size(), hex::encode(f.root()));
        if m.end_index != size {
            self.find(
                Some(size),
                None,
                None,
                format!("the manifest says the segment ends at leaf {}", m.end_index),
            );
        }
        if m.root != root {
            self.find(
                Some(size),
                None,
                None,
                format!("the manifest's root {} is not the log's {root}", m.root),
            );
        }
        if m.jobs != seen.len() as u64 {
            self.find(
                None,
                None,
                None,
                format!(
                    "the manifest lists {} heads; the segment has {} jobs",
                    m.jobs,
                    seen.len()
                ),
            );
        }
        self.report.root = root;
    }

    /// Ends the audit: versions still waiting for a predecessor are gaps.
    pub fn finish(mut self) -> AuditReport {
        let gaps: Vec<(Uuid, i64, u64, i64)> = self
            .jobs
            .iter()
            .flat_map(|(id, t)| t.early.iter().map(move |(v, (i, e))| (*id, *v, *i, e.position)))
            .collect();
        for (id, v, index, position) in gaps {
            self.find(
                Some(index),
                Some(position),
                Some(id),
                format!("version {v} came without the versions before it"),
            );
        }
        self.report
    }
}

/// Checks a proof file (`prove`'s output) offline against `pubkey`.
pub fn audit_proof(path: &Path, pubkey: &VerifyingKey) -> AuditResult<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| AuditError::BadInput(format!("{}: {e}", path.display())))?;
    let bad = |e: serde_json::Error| AuditError::BadInput(format!("{}: {e}", path.display()));
    match v.get("proof").and_then(|p| p.as_str()) {
        Some("inclusion") => Ok(inclusion(&serde_json::from_value(v).map_err(bad)?, pubkey)),
        Some("consistency") => Ok(consistency(&serde_json::from_value(v).map_err(bad)?, pubkey)),
        _ => Err(AuditError::BadInput(format!("{}: not a proof", path.display()))),
    }
}

fn hashes(path: &[String]) -> Option<Vec<Hash>> {
    path.iter()
        .map(|h| hex::decode(h).ok()?.try_into().ok())
        .collect()
}

fn inclusion(p: &InclusionProof, key: &VerifyingKey) -> Vec<String> {
    let mut out = vec![];
    let head = &p.head.checkpoint;
    if let Err(e) = head.verify(key) {
        out.push(format!("checkpoint v{}: {e}", p.head.version));
    }
    let Some(root) = head.head.root_bytes() else {
        out.push("the head's root is not 32 bytes of hex".into());
        return out;
    };
    let mut prev: Option<&EventRow> = None;
    let events: Vec<(u64, &[String], EventRow)> = p
        .events
        .iter()
        .map(|e| {
            let mut r = e.event.clone();
            r.position = e.position;
            (e.leaf_index, e.path.as_slice(), r)
        })
        .collect();
    for (leaf_index, path, r) in &events {
        let at = format!("position {}", r.position);
        if r.job_id != p.job_id {
            out.push(format!("{at}: an event of job {}, not {}", r.job_id, p.job_id));
        }
        if r.stored_hash() != r.hash {
            out.push(format!("{at}: hash mismatch"));
        }
        if let Some(q) = prev.filter(|q| q.version + 1 == r.version) {
            if r.prev_hash.as_deref() != Some(q.hash.as_str()) {
                out.push(format!("{at}: does not link to version {}", q.version));
            }
        }
        let leaf = event_leaf(r.position, &r.hash);
        let ok = hashes(path)
            .is_some_and(|path| verify_inclusion(&leaf, *leaf_index, head.head.tree_size, &path, &root));
        if !ok {
            out.push(format!(
                "{at}: not in the tree of {} leaves that checkpoint v{} signed",
                head.head.tree_size, p.head.version
            ));
        }
        prev = Some(r);
    }
    out
}

fn consistency(p: &ConsistencyProof, key: &VerifyingKey) -> Vec<String> {
    let mut out = vec![];
    for h in [&p.old, &p.new] {
        if let Err(e) = h.checkpoint.verify(key) {
            out.push(format!("checkpoint v{}: {e}", h.version));
        }
    }
    let (old, new) = (&p.old.checkpoint.head, &p.new.checkpoint.head);
    let ok = match (old.root_bytes(), new.root_bytes(), hashes(&p.path)) {
        (Some(a), Some(b), Some(path)) => {
            old.log_id == new.log_id && verify_consistency(old.tree_size, new.tree_size, &a, &b, &path)
        }
        _ => false,
    };
    if !ok {
        out.push(format!(
            "checkpoint v{} ({} leaves) is not shown to extend v{} ({} leaves)",
            p.new.version, new.tree_size, p.old.version, old.tree_size
        ));
    }
    out
}
