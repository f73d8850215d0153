//! Job search for the front doors: filters checked here once, the query in
//! `store::search`, an opaque cursor that pages newest first without
//! skipping or repeating a job (the order is (enqueued at, job id), which
//! no later write changes).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::error::{LedgerError, LedgerResult};
use super::Ledger;
use crate::domain::{Job, JobState, Reason};
use crate::store::jobs;
use crate::store::search::{self, JobFilter};

/// What a caller asks for; every field optional.
#[derive(Debug, Clone, Default)]
pub struct Search {
    pub queue: Option<String>,
    pub kind: Option<String>,
    pub states: Vec<String>,
    /// A key names at most one job per queue: needs `queue`.
    pub key: Option<String>,
    pub reason: Option<String>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// The previous page's `next`.
    pub cursor: Option<String>,
    /// 1 to 500; default 50.
    pub limit: Option<i64>,
}

/// One page, newest first; `next` is absent on the last page.
#[derive(Debug, Clone)]
pub struct Page {
    pub jobs: Vec<Job>,
    pub next: Option<String>,
}

pub const MAX_PAGE: i64 = 500;

fn bad(why: impl Into<String>) -> LedgerError {
    LedgerError::BadInput(why.into())
}

fn cursor_of(j: &Job) -> String {
    format!("{}.{}", j.created_at.timestamp_micros(), j.job_id.simple())
}

fn parse_cursor(c: &str) -> LedgerResult<(DateTime<Utc>, Uuid)> {
    let broken = || bad(format!("cursor {c:?} is not one this server handed out"));
    let (micros, id) = c.split_once('.').ok_or_else(broken)?;
    let at = micros
        .parse::<i64>()
        .ok()
        .and_then(DateTime::from_timestamp_micros)
        .ok_or_else(broken)?;
    Ok((at, Uuid::parse_str(id).map_err(|_| broken())?))
}

impl Search {
    fn filter(&self) -> LedgerResult<JobFilter> {
        let mut states: Vec<String> = if self.states.is_empty() {
            JobState::ALL.iter().map(|s| s.as_str().to_string()).collect()
        } else {
            for s in &self.states {
                JobState::parse(s).ok_or_else(|| bad(format!("no state {s:?}")))?;
            }
            let mut s = self.states.clone();
            s.sort();
            s.dedup();
            s
        };
        if let Some(r) = &self.reason {
            let reason = Reason::parse(r).ok_or_else(|| bad(format!("no reason code {r:?}")))?;
            // Queued jobs have a search index without the reason: a reason
            // no queued job can carry would read all of them to find none.
            if !reason.may_be_queued() {
                states.retain(|s| s != JobState::Queued.as_str());
            }
        }
        if let (Some(a), Some(b)) = (self.since, self.until) {
            if a >= b {
                return Err(bad("since must be before until"));
            }
        }
        Ok(JobFilter {
            queue: self.queue.clone(),
            states,
            kind: self.kind.clone(),
            reason: self.reason.clone(),
            since: self.since,
            until: self.until,
        })
    }
}

impl Ledger {
    /// Jobs matching `s`, newest first, one page at a time.
    pub async fn search(&self, s: &Search) -> LedgerResult<Page> {
        let limit = s.limit.unwrap_or(50);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(bad(format!("limit is 1 to {MAX_PAGE}")));
        }
        for (what, v) in [("queue", &s.queue), ("kind", &s.kind), ("key", &s.key)] {
            if let Some(v) = v {
                self.limits.name(what, v)?;
            }
        }
        let f = s.filter()?;
        let after = s.cursor.as_deref().map(parse_cursor).transpose()?;
        let rows = match (&s.key, &s.queue) {
            (Some(_), None) => return Err(bad("a key is unique per queue: give the queue too")),
            (Some(key), Some(queue)) => {
                // At most one job: the page is it (if it passes the other
                // filters and the cursor), and there is no next page.
                let row = jobs::find_job_by_key(&self.pool, queue, key).await?;
                let job = row.map(Job::try_from).transpose()?;
                let keep = job.filter(|j| matches_filter(j, &f, after));
                return Ok(Page {
                    jobs: keep.into_iter().collect(),
                    next: None,
                });
            }
            _ => search::search_jobs(&self.pool, &f, after, limit).await?,
        };
        let jobs = rows
            .into_iter()
            .map(Job::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let next = (jobs.len() as i64 == limit)
            .then(|| jobs.last().map(cursor_of))
            .flatten();
        Ok(Page { jobs, next })
    }

    /// The plan of a search (no sequential scan: the tests and the bench
    /// check it).
    pub async fn explain_search(&self, s: &Search) -> LedgerResult<String> {
        Ok(search::explain_search(&self.pool, &s.filter()?).await?)
    }
}

fn matches_filter(j: &Job, f: &JobFilter, after: Option<(DateTime<Utc>, Uuid)>) -> bool {
    f.states.iter().any(|s| s == j.state.as_str())
        && f.kind.as_ref().is_none_or(|k| *k == j.kind)
        && f.reason.as_ref().is_none_or(|r| r == j.reason.as_str())
        && f.since.is_none_or(|t| j.created_at >= t)
        && f.until.is_none_or(|t| j.created_at < t)
        && after.is_none_or(|a| (j.created_at, j.job_id) < a)
}
