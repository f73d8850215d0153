//! Who may call the HTTP API: named bearer tokens with a role, stored as
//! SHA-256 hashes (shown once, at creation) and revocable.

use rand::RngCore;
use sha2::{Digest, Sha256};

use super::error::{LedgerError, LedgerResult};
use super::Ledger;
use crate::store::tokens::{self, TokenRow};

/// What a token may do. Not a ladder: an operator acts on jobs but does not
/// hold leases, a worker holds leases but does not replay or resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Reader,
    Worker,
    Operator,
    Admin,
}

/// The kinds of request the API tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Jobs, histories, queues, lag.
    Read,
    Enqueue,
    /// The remote worker protocol: claim and the fenced writes of a lease.
    Work,
    /// Cancel, replay, resolve, annotate.
    Operate,
    /// Tokens, projection rebuilds.
    Administer,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "reader" => Role::Reader,
            "worker" => Role::Worker,
            "operator" => Role::Operator,
            "admin" => Role::Admin,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Worker => "worker",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn may(self, action: Action) -> bool {
        use Action::*;
        match self {
            Role::Reader => action == Read,
            Role::Worker => matches!(action, Read | Enqueue | Work),
            Role::Operator => matches!(action, Read | Enqueue | Operate),
            Role::Admin => true,
        }
    }
}

/// A token the API accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl Ledger {
    /// Creates a token named `name` with `role`; answers the token itself,
    /// which is not stored and cannot be shown again.
    pub async fn create_token(&self, name: &str, role: Role) -> LedgerResult<String> {
        self.limits.name("token name", name)?;
        super::validate::typed("token name", name)?;
        // Actors read `operator:NAME`, `token:NAME` and `NAME/WORKER`: a
        // name with ':' or '/' could pass for another token's.
        if name.contains([':', '/']) {
            return Err(LedgerError::BadInput("a token name has no ':' or '/'".into()));
        }
        // The name becomes an actor (`operator:NAME`), which has the names'
        // limit: leave room for the prefix.
        if name.len() > 200 {
            return Err(LedgerError::BadInput(format!(
                "token name is {} bytes, over the limit of 200",
                name.len()
            )));
        }
        let mut raw = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut raw);
        let token = format!("jl_{}", hex::encode(raw));
        if !tokens::insert_token(self.pool(), name, role.as_str(), &hash(&token)).await? {
            return Err(LedgerError::BadInput(format!(
                "a token named {name:?} exists already"
            )));
        }
        Ok(token)
    }

    /// The caller a bearer token stands for, if it is live.
    pub async fn authenticate(&self, token: &str) -> LedgerResult<Option<Caller>> {
        let Some((name, role)) = tokens::live_token(self.pool(), &hash(token)).await? else {
            return Ok(None);
        };
        let role = Role::parse(&role)
            .ok_or_else(|| crate::store::StoreError::Corrupt(format!("token {name:?} has role {role:?}")))?;
        Ok(Some(Caller { name, role }))
    }

    /// Revokes the named token: from now on it is refused (401).
    pub async fn revoke_token(&self, name: &str) -> LedgerResult<()> {
        if !tokens::revoke_token(self.pool(), name).await? {
            return Err(LedgerError::BadInput(format!("no live token named {name:?}")));
        }
        Ok(())
    }

    pub async fn tokens(&self) -> LedgerResult<Vec<TokenRow>> {
        Ok(tokens::list_tokens(self.pool()).await?)
    }
}
