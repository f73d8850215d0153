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
use crate::domain::checkpoint::LOG_STREAM;
use crate::domain::merkle::{event_leaf, verify_consistency, verify_inclusion, Frontier, Hash};
use crate::domain::{apply, Job};
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

struct Track {
    version: i64,
    hash: String,
    /// `None`: its history began before the audited segments (not replayed).
    job: Option<Job>,
    /// Versions that arrived before their predecessor (log order is by
    /// transaction, docs/log-reader.md): `version -> (index, event)`.
    early: BTreeMap<i64, (u64, EventRow)>,
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
        for l in lines {
            let l = l.map_err(|e| io(path, e))?;
            if l.starts_with("{\"kind\":\"event\"") {
                let e: EventLine = match serde_json::from_str::<EventLine>(&l) {
                    Ok(mut e) => {
                        e.event.position = e.position;
                        e
                    }
                    Err(err) => {
                        let at = self.frontier.as_ref().map(Frontier::size);
                        self.find(at, None, None, format!("unreadable event line: {err}"));
                        continue;
                    }
                };
                self.event(e, &mut wanted, &mut roots, &mut seen);
            } else if l.starts_with("{\"kind\":\"head\"") {
                let h: HeadLine =
                    serde_json::from_str(&l).map_err(|e| AuditError::BadInput(e.to_string()))?;
                if seen.get(&h.job_id) != Some(&(h.version, h.hash.clone())) {
                    self.find(
                        None,
                        None,
                        Some(h.job_id),
                        format!("manifest head v{} {} is not the segment's", h.version, h.hash),
                    );
                }
            } else if l.starts_with("{\"kind\":\"manifest\"") {
                manifest = Some(
                    serde_json::from_str::<Manifest>(&l).map_err(|e| AuditError::BadInput(e.to_string()))?,
                );
            } else {
                self.find(None, None, None, "a line of unknown kind".into());
            }
        }
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
        e: EventLine,
        wanted: &mut HashSet<u64>,
        roots: &mut HashMap<u64, Hash>,
        seen: &mut HashMap<Uuid, (i64, String)>,
    ) {
        let f = self.frontier.as_mut().expect("begun");
        let index = f.size();
        f.push(event_leaf(e.event.position, &e.event.hash));
        if wanted.remove(&f.size()) {
            roots.insert(f.size(), f.root());
        }
        self.report.events += 1;
        self.report.end_index = f.size();
        let (pos, job) = (Some(e.event.position), Some(e.event.job_id));
        if e.index != index {
            self.find(Some(index), pos, job, format!("is labelled leaf {}", e.index));
        }
        if e.event.stored_hash() != e.event.hash {
            self.find(
                Some(index),
                pos,
                job,
                format!(
                    "hash mismatch: the event's content does not hash to {}",
                    e.event.hash
                ),
            );
        }
        seen.insert(e.event.job_id, (e.event.version, e.event.hash.clone()));
        if let Some(cp) = checkpoint_of(&e.event) {
            self.checkpoint(index, &e.event, &cp, roots);
        }
        self.link(index, e.event);
    }

    fn checkpoint(
        &mut self,
        index: u64,
        row: &EventRow,
        cp: &crate::domain::checkpoint::Checkpoint,
        roots: &HashMap<u64, Hash>,
    ) {
        let (pos, job) = (Some(row.position), Some(row.job_id));
        self.report.checkpoints_checked += 1;
        if let Some(key) = &self.pubkey {
            if let Err(err) = cp.verify(key) {
                self.find(
                    Some(index),
                    pos,
                    job,
                    format!("checkpoint v{}: {err}", row.version),
                );
            }
        }
        if self.log_id.is_some_and(|id| id != cp.head.log_id) {
            self.find(
                Some(index),
                pos,
                job,
                format!("checkpoint v{} signs log {}", row.version, cp.head.log_id),
            );
        }
        let size = cp.head.tree_size;
        match roots.get(&size) {
            Some(r) if hex::encode(r) == cp.head.root => {}
            Some(r) => self.find(
                Some(index),
                pos,
                job,
                format!(
                    "checkpoint v{} signed root {} over {size} leaves; the log's is {}: an event before leaf {size} was changed, removed or added",
                    row.version,
                    cp.head.root,
                    hex::encode(r)
                ),
            ),
            None if self.report.trusted_prefix && size <= self.report.from_index.unwrap_or(0) => {}
            None => self.find(Some(index), pos, job, format!("checkpoint v{} signs {size} leaves, a size the header did not announce", row.version)),
        }
    }

    /// Chains and replays one event of a job, in version order.
    fn link(&mut self, index: u64, row: EventRow) {
        let id = row.job_id;
        let fresh = !self.jobs.contains_key(&id);
        if fresh {
            if row.version == 1 || self.report.trusted_prefix {
                self.start(index, row);
                self.drain(id);
            } else {
                self.jobs.insert(
                    id,
                    Track {
                        version: 0,
                        hash: String::new(),
                        job: None,
                        early: BTreeMap::from([(row.version, (index, row))]),
                    },
                );
            }
            return;
        }
        let t = self.jobs.get_mut(&id).expect("tracked");
        if row.version > t.version + 1 {
            t.early.insert(row.version, (index, row));
            return;
        }
        if row.version <= t.version {
            let detail = format!("version {} again (the chain is at {})", row.version, t.version);
            self.find(Some(index), Some(row.position), Some(id), detail);
            return;
        }
        self.next(index, row);
        self.drain(id);
    }

    fn start(&mut self, index: u64, row: EventRow) {
        let id = row.job_id;
        self.report.jobs += 1;
        let (version, hash) = (row.version, row.hash.clone());
        let replayed = row.version == 1 && id != LOG_STREAM;
        if row.version == 1 && row.prev_hash.is_some() {
            self.find(
                Some(index),
                Some(row.position),
                Some(id),
                "a first event with a prev_hash".into(),
            );
        }
        let job = if replayed {
            self.replay(index, None, &row)
        } else {
            None
        };
        self.jobs.insert(
            id,
            Track {
                version,
                hash,
                job,
                early: BTreeMap::new(),
            },
        );
    }

    fn next(&mut self, index: u64, row: EventRow) {
        let id = row.job_id;
        let t = self.jobs.get_mut(&id).expect("tracked");
        let linked = row.prev_hash.as_deref() == Some(t.hash.as_str());
        let prev_job = t.job.take();
        let was = t.version;
        t.version = row.version;
        t.hash = row.hash.clone();
        if !linked && was > 0 {
            self.find(
                Some(index),
                Some(row.position),
                Some(id),
                format!("does not link to version {was}"),
            );
        }
        let job = match prev_job {
            Some(j) if id != LOG_STREAM => self.replay(index, Some(j), &row),
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
            let (index, row) = entry.remove();
            self.next(index, row);
        }
    }

    fn replay(&mut self, index: u64, prev: Option<Job>, row: &EventRow) -> Option<Job> {
        let ev = match row.to_event() {
            Ok(ev) => ev,
            Err(e) => {
                self.find(Some(index), Some(row.position), Some(row.job_id), e.to_string());
                return None;
            }
        };
        match apply(prev.as_ref(), &ev) {
            Ok(j) => Some(j),
            Err(e) => {
                self.find(
                    Some(index),
                    Some(row.position),
                    Some(row.job_id),
                    format!("replay refused the event: {e}"),
                );
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
            .flat_map(|(id, t)| t.early.iter().map(move |(v, (i, r))| (*id, *v, *i, r.position)))
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
