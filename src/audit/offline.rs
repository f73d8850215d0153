//! `audit`: checks exported segments with no database. Every hash link,
//! every job replayed through the same state machine as `verify`, the
//! Merkle root recomputed and held against the manifest, every signed
//! checkpoint in the segments and every head the auditor holds (`--head`),
//! continuity across consecutive segments. Each finding names its place;
//! the caller prints one line per finding.

use ed25519_dalek::VerifyingKey;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use uuid::Uuid;

use super::export::{Header, Manifest, FORMAT};
use super::lines::{parse_in_parallel, read_header, Parsed, Seen};
use super::{io, AuditError, AuditResult};
use crate::domain::apply::apply_owned;
use crate::domain::checkpoint::{Checkpoint, LOG_STREAM};
use crate::domain::merkle::{event_leaf, Frontier, Hash};
use crate::domain::{Event, Job};

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
    /// The largest tree size a verified signed head covers (`--pubkey`).
    pub signed_through: Option<u64>,
    pub findings: u64,
    pub from_index: Option<u64>,
    pub end_index: u64,
    pub root: String,
    /// The first segment started past leaf 0: its prefix (the peaks in its
    /// header) is taken on trust, and jobs begun before it are linked from
    /// their first event in it, not replayed.
    pub trusted_prefix: bool,
}

struct Track {
    version: i64,
    hash: String,
    /// `None`: its history began before the audited segments (not replayed).
    job: Option<Job>,
    /// Versions that arrived before their predecessor (log order is by
    /// transaction, docs/log-reader.md): `version -> (index, event)`.
    early: BTreeMap<i64, (u64, Box<Seen>)>,
    /// For a job first met past its version 1 behind a trusted prefix: the
    /// lowest version met and its link, so a predecessor that comes later in
    /// log order is linked backwards.
    first: Option<(i64, Option<String>)>,
}

/// What one segment showed, for its manifest and head lines.
#[derive(Default)]
struct SegmentSeen {
    /// Each job's highest version in the segment and its hash.
    heads: HashMap<Uuid, (i64, String)>,
    head_lines: HashSet<Uuid>,
    events: u64,
    first_position: Option<i64>,
    last_position: Option<i64>,
    schemas: BTreeSet<i16>,
    manifests: u32,
}

/// A head the auditor holds from outside the files (the topic, a proof).
struct Held {
    origin: String,
    checkpoint: Checkpoint,
}

pub struct Auditor<'a> {
    pubkey: Option<VerifyingKey>,
    report: AuditReport,
    frontier: Option<Frontier>,
    log_id: Option<Uuid>,
    jobs: HashMap<Uuid, Track>,
    /// Tree sizes whose root to keep (announced by headers, held heads), and
    /// the roots kept, across segments.
    wanted: HashSet<u64>,
    roots: HashMap<u64, Hash>,
    held: Vec<Held>,
    file: String,
    on_finding: Box<dyn FnMut(&Finding) + 'a>,
    /// Compressed bytes read, for a progress bar (`progress()`).
    progress: std::sync::Arc<super::Progress>,
}

impl<'a> Auditor<'a> {
    pub fn new(pubkey: Option<VerifyingKey>, on_finding: impl FnMut(&Finding) + 'a) -> Self {
        Auditor {
            pubkey,
            report: AuditReport::default(),
            frontier: None,
            log_id: None,
            jobs: HashMap::new(),
            wanted: HashSet::new(),
            roots: HashMap::new(),
            held: vec![],
            file: String::new(),
            on_finding: Box::new(on_finding),
            progress: Default::default(),
        }
    }

    /// The compressed bytes this auditor has read (`done`), for a bar whose
    /// `total` the caller sets from the files' sizes.
    pub fn progress(&self) -> std::sync::Arc<super::Progress> {
        self.progress.clone()
    }

    /// A signed head the auditor already holds (read from the topic, or a
    /// proof): the log must still have it, whatever the files' own heads
    /// say. Its signature is checked now (with the public key, if given).
    pub fn hold(&mut self, origin: &str, checkpoint: Checkpoint) {
        if let Some(key) = &self.pubkey {
            if let Err(e) = checkpoint.verify(key) {
                self.file = origin.into();
                self.find(None, None, None, format!("the head you hold: {e}"));
            }
        }
        self.wanted.insert(checkpoint.head.tree_size);
        self.held.push(Held {
            origin: origin.into(),
            checkpoint,
        });
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
        let file = super::lines::Counted {
            inner: file,
            progress: self.progress.clone(),
        };
        // From here on the file is the auditor's evidence: whatever is wrong
        // with its content is a finding (exit 1), not a usage error (exit 2).
        let header = match read_header(file) {
            Ok(h) => h,
            Err(why) => {
                self.note(format!("line 1: {why}; the segment is not checked"));
                self.report.segments += 1;
                return Ok(());
            }
        };
        let (header, lines) = header;
        self.begin(&header);
        let mut seg = SegmentSeen::default();
        let mut manifest = None;
        // Lines are parsed and hashed on other threads, in chunks, and come
        // back in order; this one chains, replays and builds the tree.
        std::thread::scope(|scope| -> AuditResult<()> {
            for parsed in parse_in_parallel(scope, lines).flatten() {
                match parsed {
                    Parsed::Event(e) => self.event(e, &mut seg),
                    Parsed::Head(h) => {
                        if !seg.head_lines.insert(h.job_id) {
                            self.find(
                                None,
                                None,
                                Some(h.job_id),
                                "a second head line for the job".into(),
                            );
                        } else if seg.heads.get(&h.job_id) != Some(&(h.version, h.hash.clone())) {
                            let d = format!("the head line v{} {} is not the segment's", h.version, h.hash);
                            self.find(None, None, Some(h.job_id), d);
                        }
                    }
                    Parsed::Manifest(m) => {
                        seg.manifests += 1;
                        manifest = Some(m);
                    }
                    Parsed::Bad(d) => self.bad_line(&seg, d),
                    // A cut or corrupt file is a finding, not a usage error:
                    // the segments after it are still checked.
                    Parsed::Io(n, e) => {
                        self.bad_line(&seg, format!("line {n}: the file cannot be read on ({e})"))
                    }
                }
            }
            Ok(())
        })?;
        match manifest {
            Some(m) => self.end(&m, &header, &seg),
            None => self.note("the segment has no manifest (truncated?)".into()),
        }
        self.report.segments += 1;
        Ok(())
    }

    /// A finding of the segment as a whole (no leaf, position or job).
    fn note(&mut self, detail: String) {
        self.find(None, None, None, detail);
    }

    /// A line that is not one an export writes, at the leaf it interrupts.
    fn bad_line(&mut self, seg: &SegmentSeen, d: String) {
        let at = self.frontier.as_ref().map(Frontier::size);
        let after = seg.last_position.map(|p| format!(", after position {p}"));
        self.find(at, None, None, format!("{d}{}", after.unwrap_or_default()));
    }

    /// Starts a segment: continuity with the previous one, or the trusted
    /// prefix of a first segment that does not start at leaf 0.
    fn begin(&mut self, h: &Header) {
        if h.format != FORMAT {
            self.note(format!("export format {} (this build reads {FORMAT})", h.format));
        }
        if let Some(id) = self.log_id.filter(|id| *id != h.log_id) {
            self.note(format!("segment of log {}, not of {id}", h.log_id));
        }
        self.log_id = Some(h.log_id);
        self.wanted.extend(h.checkpoint_sizes.iter().copied());
        let peaks: Option<Vec<Hash>> = h
            .prefix_peaks
            .iter()
            .map(|p| hex::decode(p).ok().and_then(|b| b.try_into().ok()))
            .collect();
        let at = Some(h.from_index);
        match &self.frontier {
            Some(f) if f.size() != h.from_index => {
                let d = format!(
                    "starts at leaf {}, the previous segment ended at {}",
                    h.from_index,
                    f.size()
                );
                self.find(at, None, None, d);
            }
            Some(f) if peaks.as_deref() != Some(&f.peaks()[..]) => {
                self.find(
                    at,
                    None,
                    None,
                    "its prefix is not the tree the previous segment built".into(),
                );
            }
            Some(_) => {}
            None => {
                self.report.from_index = Some(h.from_index);
                self.report.trusted_prefix = h.from_index > 0;
                let f = peaks.and_then(|p| Frontier::from_peaks(h.from_index, p));
                if f.is_none() {
                    self.find(at, None, None, "its prefix peaks do not make a tree".into());
                }
                let f = f.unwrap_or_default();
                if f.size() > 0 {
                    self.roots.insert(f.size(), f.root());
                }
                // An empty first segment ends where it starts.
                self.report.end_index = f.size();
                self.frontier = Some(f);
            }
        }
    }

    fn event(&mut self, e: Box<Seen>, seg: &mut SegmentSeen) {
        let f = self.frontier.as_mut().expect("begun");
        let index = f.size();
        f.push(event_leaf(e.position, &e.hash));
        if self.wanted.remove(&f.size()) {
            self.roots.insert(f.size(), f.root());
        }
        self.report.events += 1;
        self.report.end_index = f.size();
        seg.events += 1;
        seg.first_position.get_or_insert(e.position);
        seg.last_position = Some(e.position);
        seg.schemas.insert(e.schema);
        let (pos, job) = (Some(e.position), Some(e.job_id));
        if e.label != index {
            self.find(Some(index), pos, job, format!("is labelled leaf {}", e.label));
        }
        if !e.hash_ok {
            let d = format!("hash mismatch: the event's content does not hash to {}", e.hash);
            self.find(Some(index), pos, job, d);
        }
        let head = seg.heads.entry(e.job_id).or_insert((e.version, e.hash.clone()));
        if e.version > head.0 {
            *head = (e.version, e.hash.clone());
        }
        match (&e.checkpoint, e.job_id == LOG_STREAM) {
            (Some(cp), _) => self.checkpoint(index, &e, cp),
            (None, true) => self.find(
                Some(index),
                pos,
                job,
                format!("checkpoint v{} is unreadable", e.version),
            ),
            (None, false) => {}
        }
        self.link(index, e);
    }

    /// The root the files give at `size`, held against a signed one.
    fn signed_root(&mut self, size: u64, root: &str) -> Result<(), String> {
        let end = self.frontier.as_ref().map_or(0, Frontier::size);
        match self.roots.get(&size) {
            Some(r) if hex::encode(r) == root => Ok(()),
            Some(r) => Err(format!(
                "signed root {root} over {size} leaves; the log's is {}: an event before leaf {size} was \
                 changed, removed or added",
                hex::encode(r)
            )),
            None if self.report.trusted_prefix && size < self.report.from_index.unwrap_or(0) => Ok(()),
            None if size > end => Err(format!("signs {size} leaves; the log here has {end}")),
            None => Err(format!("signs {size} leaves, a size no header announced")),
        }
    }

    fn checkpoint(&mut self, index: u64, e: &Seen, cp: &Checkpoint) {
        let (pos, job, v) = (Some(e.position), Some(e.job_id), e.version);
        self.report.checkpoints_checked += 1;
        if let Some(key) = &self.pubkey {
            match cp.verify(key) {
                Ok(()) => {
                    let s = self.report.signed_through.unwrap_or(0).max(cp.head.tree_size);
                    self.report.signed_through = Some(s);
                }
                Err(err) => self.find(Some(index), pos, job, format!("checkpoint v{v}: {err}")),
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
        if let Err(d) = self.signed_root(cp.head.tree_size, &cp.head.root) {
            self.find(Some(index), pos, job, format!("checkpoint v{v} {d}"));
        }
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
                    first: None,
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
            // Behind a trusted prefix, a job's earlier version may come after
            // a later one in log order: it must link to the lowest one met.
            if let Some((v, link)) = t.first.clone().filter(|(v, _)| e.version + 1 == *v) {
                t.first = Some((e.version, e.prev_hash.clone()));
                if link.as_deref() != Some(e.hash.as_str()) {
                    let d = format!("version {} does not link to version {v}", e.version);
                    self.find(Some(index), Some(e.position), Some(id), d);
                }
                return;
            }
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
        let first = (e.version > 1).then(|| (e.version, e.prev_hash.clone()));
        let t = Track {
            version: e.version,
            hash: e.hash,
            job,
            early: BTreeMap::new(),
            first,
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

    /// The manifest and the head lines against what the segment held.
    fn end(&mut self, m: &Manifest, h: &Header, seg: &SegmentSeen) {
        let f = self.frontier.as_ref().expect("begun");
        let (size, root) = (f.size(), hex::encode(f.root()));
        let schemas: Vec<i16> = seg.schemas.iter().copied().collect();
        let checks = [
            (seg.manifests == 1, format!("{} manifests", seg.manifests)),
            (
                m.format == FORMAT && m.log_id == h.log_id,
                "its format or log is not the header's".into(),
            ),
            (
                m.from_index == h.from_index,
                format!("it says the segment starts at leaf {}", m.from_index),
            ),
            (
                m.end_index == size,
                format!("it says the segment ends at leaf {}", m.end_index),
            ),
            (
                m.events == seg.events,
                format!("it counts {} events; the segment has {}", m.events, seg.events),
            ),
            (
                (m.first_position, m.last_position) == (seg.first_position, seg.last_position),
                "its first or last position is not the segment's".into(),
            ),
            (
                m.schemas == schemas,
                format!("it lists schemas {:?}; the events are {schemas:?}", m.schemas),
            ),
            (
                m.root == root,
                format!("its root {} is not the log's {root}", m.root),
            ),
            (
                m.jobs == seg.heads.len() as u64 && seg.head_lines.len() == seg.heads.len(),
                format!(
                    "it counts {} jobs, with {} head lines; the segment has {} jobs",
                    m.jobs,
                    seg.head_lines.len(),
                    seg.heads.len()
                ),
            ),
        ];
        for (ok, d) in checks {
            if !ok {
                self.find(Some(size), None, None, format!("manifest: {d}"));
            }
        }
        self.report.root = root;
    }

    /// Ends the audit: versions still waiting for a predecessor are gaps;
    /// the heads held from outside must be in the log.
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
        for h in std::mem::take(&mut self.held) {
            self.file = h.origin;
            if let Err(d) = self.signed_root(h.checkpoint.head.tree_size, &h.checkpoint.head.root) {
                self.find(None, None, None, format!("the head you hold {d}"));
            }
        }
        if self.pubkey.is_some() && self.report.signed_through.is_none() && self.report.segments > 0 {
            self.note(
                "no head in the audited segments is signed by the key: nothing here is held to a signature \
                 (pass the heads you hold with --head)"
                    .into(),
            );
        }
        self.report
    }
}

/// Reads a signed head from a file: a checkpoint's data, a relayed
/// checkpoint message's body, or a proof (its head).
pub fn read_head(path: &Path) -> AuditResult<Checkpoint> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| AuditError::BadInput(format!("{}: {e}", path.display())))?;
    let found = [
        &v,
        &v["data"],
        &v["checkpoint"],
        &v["head"]["checkpoint"],
        &v["new"]["checkpoint"],
    ]
    .into_iter()
    .find_map(Checkpoint::from_data);
    found.ok_or_else(|| AuditError::BadInput(format!("{}: no signed head in it", path.display())))
}
