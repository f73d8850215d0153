//! A fake external refund provider, as the seeds test against: it executes
//! every refund call it receives (no idempotency of its own), so a duplicate
//! execution is visible, and it can be told to fail or to lose responses.
// One file shared by the binary's tools and the tests that include it
// (`#[path]`): each uses a different part.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    #[error("provider busy, try again")]
    Transient,
    #[error("refund refused: {0}")]
    Permanent(String),
}

#[derive(Default)]
struct State {
    refunds: HashMap<String, String>,
    executions: HashMap<String, u32>,
    transient_once: HashSet<String>,
    always_transient: HashSet<String>,
    permanent: HashSet<String>,
    calls: u64,
    lookups: u64,
}

#[derive(Default)]
pub struct FakeProvider {
    state: Mutex<State>,
}

impl FakeProvider {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().expect("provider state"))
    }

    pub fn fail_once(&self, key: &str) {
        self.with(|s| s.transient_once.insert(key.to_string()));
    }
    pub fn fail_always(&self, key: &str) {
        self.with(|s| s.always_transient.insert(key.to_string()));
    }
    pub fn refuse(&self, key: &str) {
        self.with(|s| s.permanent.insert(key.to_string()));
    }

    /// Executes a refund for `key` (every call that succeeds is an execution).
    pub fn refund(&self, key: &str) -> Result<String, ProviderError> {
        self.with(|s| {
            s.calls += 1;
            if s.permanent.contains(key) {
                return Err(ProviderError::Permanent("account_closed".into()));
            }
            if s.transient_once.remove(key) || s.always_transient.contains(key) {
                return Err(ProviderError::Transient);
            }
            let n = s.executions.entry(key.to_string()).or_insert(0);
            *n += 1;
            let id = format!("re_{key}_{n}");
            s.refunds.insert(key.to_string(), id.clone());
            Ok(id)
        })
    }

    /// Reconciliation: what the provider knows about `key`.
    pub fn lookup(&self, key: &str) -> Option<String> {
        self.with(|s| {
            s.lookups += 1;
            s.refunds.get(key).cloned()
        })
    }

    pub fn executions(&self, key: &str) -> u32 {
        self.with(|s| s.executions.get(key).copied().unwrap_or(0))
    }

    /// Keys refunded more than once: must always be zero.
    pub fn duplicate_refunds(&self) -> u64 {
        self.with(|s| s.executions.values().filter(|n| **n > 1).count() as u64)
    }

    pub fn refunds(&self) -> u64 {
        self.with(|s| s.refunds.len() as u64)
    }

    /// (refund calls, lookups): the reconcile share of provider traffic.
    pub fn traffic(&self) -> (u64, u64) {
        self.with(|s| (s.calls, s.lookups))
    }
}
