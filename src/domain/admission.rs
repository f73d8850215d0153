//! Admission: what decides when a queued job may be leased besides its
//! state and `run_at` — per-key concurrency limits and per-queue rate
//! limits (queue controls, see `queue`), and a job's own terms, written in
//! its `enqueued` event and never changed after.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A job's admission terms (absent from the event when it has none, so
/// the events and hashes of jobs without them are what they were).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// Jobs of one queue with the same key share the slots a limit gives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<String>,
    /// Until then (by the database clock at the enqueue), an enqueue of the
    /// same (queue, job_key) returns this job; after it, a finished job
    /// gives way to a new lifecycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unique_until: Option<DateTime<Utc>>,
}

impl Admission {
    pub fn is_empty(&self) -> bool {
        self.concurrency_key.is_none() && self.unique_until.is_none()
    }
}

/// At most `max` jobs of the queue with the same concurrency key leased at
/// once, for keyed jobs of `kind` (any kind if none) whose key matches the
/// glob `key` (any key if none). A job under several limits gets the
/// smallest `max`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConcurrencyLimit {
    pub kind: Option<String>,
    /// A glob: `*` any run of characters, `?` one; everything else literal.
    pub key: Option<String>,
    /// The glob as a SQL LIKE pattern (what the claim query matches with).
    pub like: Option<String>,
    pub max: i32,
}

impl ConcurrencyLimit {
    pub fn new(kind: Option<String>, key: Option<String>, max: i32) -> Self {
        let like = key.as_deref().map(glob_to_like);
        ConcurrencyLimit { kind, key, like, max }
    }

    /// Whether a job of `kind` with concurrency key `key` is under it.
    pub fn covers(&self, kind: &str, key: &str) -> bool {
        self.kind.as_deref().is_none_or(|k| k == kind)
            && self.key.as_deref().is_none_or(|g| glob_match(g, key))
    }
}

/// At most `max` claims (leases granted, takeovers included) from the queue
/// in any window of `per_ms`, across every worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimit {
    pub max: i32,
    pub per_ms: i64,
}

/// The smallest `max` of the limits covering a job (None: unlimited).
pub fn cap_of<'a>(
    limits: impl IntoIterator<Item = &'a ConcurrencyLimit>,
    kind: &str,
    key: &str,
) -> Option<i32> {
    limits
        .into_iter()
        .filter(|l| l.covers(kind, key))
        .map(|l| l.max)
        .min()
}

/// `*` → `%`, `?` → `_`, and LIKE's own `%`, `_` and `\` escaped.
pub fn glob_to_like(glob: &str) -> String {
    let mut out = String::with_capacity(glob.len());
    for c in glob.chars() {
        match c {
            '*' => out.push('%'),
            '?' => out.push('_'),
            '%' | '_' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// The glob's meaning, the same as its LIKE form's (tested against each other).
pub fn glob_match(glob: &str, s: &str) -> bool {
    let (g, s): (Vec<char>, Vec<char>) = (glob.chars().collect(), s.chars().collect());
    // Classic two-pointer wildcard match with backtracking to the last `*`.
    let (mut gi, mut si, mut star, mut mark) = (0, 0, None, 0);
    while si < s.len() {
        if gi < g.len() && (g[gi] == '?' || g[gi] == s[si]) && g[gi] != '*' {
            gi += 1;
            si += 1;
        } else if gi < g.len() && g[gi] == '*' {
            star = Some(gi);
            mark = si;
            gi += 1;
        } else if let Some(st) = star {
            gi = st + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    g[gi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("tenant-*", "tenant-42"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(!glob_match("tenant-*", "other"));
        assert!(glob_match("*-eu-*", "acme-eu-1"));
        assert_eq!(glob_to_like("a_b%c*?\\"), "a\\_b\\%c%_\\\\");
    }

    #[test]
    fn the_smallest_covering_limit_wins() {
        let l = [
            ConcurrencyLimit::new(None, None, 5),
            ConcurrencyLimit::new(Some("export".into()), None, 2),
            ConcurrencyLimit::new(None, Some("vip-*".into()), 1),
        ];
        assert_eq!(cap_of(&l, "mail", "x"), Some(5));
        assert_eq!(cap_of(&l, "export", "x"), Some(2));
        assert_eq!(cap_of(&l, "mail", "vip-1"), Some(1));
        assert_eq!(cap_of(&[], "mail", "x"), None);
    }
}
