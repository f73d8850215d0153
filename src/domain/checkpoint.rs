//! Signed checkpoints of the log: a tree head (the RFC 6962 root over the
//! first `tree_size` events in log order) signed with ed25519 by a key
//! kept outside the database. A checkpoint is itself appended to the log,
//! as an event of the reserved stream `LOG_STREAM` (never a job), hash
//! chained like a job's events, relayed like any event: whoever holds the
//! topic holds the operator to every head they signed.
//!
//! Pure: the bytes that are signed, the checkpoint event's parts, and the
//! checks an auditor runs offline.

use chrono::{DateTime, Utc};
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::digest::{canonical_json, fmt_time, hash_stored, HashInput};
use super::merkle::Hash;

/// The stream of the log's own events (checkpoints). No job has this id: a
/// job's id is a UUIDv7 drawn at enqueue.
pub const LOG_STREAM: Uuid = Uuid::nil();
/// The event type, state and reason of a checkpoint.
pub const CHECKPOINT: &str = "checkpoint";
pub const ALGORITHM: &str = "ed25519";
pub const TREE_HASH: &str = "rfc6962-sha256";

/// What is signed: one log (`log_id`, drawn once per ledger database), its
/// first `tree_size` events in log order with root `root`, the last of them
/// at `last_position`, as of `signed_at` (database clock).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeHead {
    pub log_id: Uuid,
    pub tree_size: u64,
    /// Lowercase hex of the 32-byte root.
    pub root: String,
    /// Position of the last event in the tree (0 for an empty tree).
    pub last_position: i64,
    pub signed_at: DateTime<Utc>,
}

impl TreeHead {
    /// The signed bytes: a domain label, then the head's canonical JSON.
    pub fn signing_bytes(&self) -> Vec<u8> {
        let v = serde_json::json!({
            "log_id": self.log_id.to_string(),
            "tree_size": self.tree_size,
            "root": self.root,
            "last_position": self.last_position,
            "signed_at": fmt_time(self.signed_at),
            "tree_hash": TREE_HASH,
        });
        let mut out = b"jobledger tree head v1\n".to_vec();
        out.extend_from_slice(canonical_json(&v).as_bytes());
        out
    }

    pub fn root_bytes(&self) -> Option<Hash> {
        hex::decode(&self.root).ok()?.try_into().ok()
    }
}

/// The `data` of a checkpoint event: the head, who signed it and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    #[serde(flatten)]
    pub head: TreeHead,
    pub algorithm: String,
    pub tree_hash: String,
    pub key_id: String,
    /// Lowercase hex of the 64-byte ed25519 signature of `signing_bytes`.
    pub signature: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckpointError {
    #[error("signed by key {found}, not by the key given ({expected})")]
    OtherKey { found: String, expected: String },
    #[error("the signature does not verify")]
    BadSignature,
    #[error("unknown algorithm {0}")]
    Algorithm(String),
    #[error("a key file holds 64 hex digits (a 32-byte key): {0}")]
    KeyFile(String),
}

/// The short name of a public key: the first 8 bytes of its SHA-256, hex.
pub fn key_id(key: &VerifyingKey) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

pub fn sign(head: TreeHead, key: &SigningKey) -> Checkpoint {
    let signature = key.sign(&head.signing_bytes());
    Checkpoint {
        head,
        algorithm: ALGORITHM.into(),
        tree_hash: TREE_HASH.into(),
        key_id: key_id(&key.verifying_key()),
        signature: hex::encode(signature.to_bytes()),
    }
}

impl Checkpoint {
    /// Checks the signature with `key` (the auditor's copy of the public key).
    pub fn verify(&self, key: &VerifyingKey) -> Result<(), CheckpointError> {
        if self.algorithm != ALGORITHM || self.tree_hash != TREE_HASH {
            return Err(CheckpointError::Algorithm(format!(
                "{}/{}",
                self.algorithm, self.tree_hash
            )));
        }
        if self.key_id != key_id(key) {
            return Err(CheckpointError::OtherKey {
                found: self.key_id.clone(),
                expected: key_id(key),
            });
        }
        let bytes: [u8; 64] = hex::decode(&self.signature)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or(CheckpointError::BadSignature)?;
        key.verify(&self.head.signing_bytes(), &Signature::from_bytes(&bytes))
            .map_err(|_| CheckpointError::BadSignature)
    }

    pub fn data(&self) -> Value {
        serde_json::to_value(self).expect("checkpoints serialise")
    }

    pub fn from_data(data: &Value) -> Option<Checkpoint> {
        serde_json::from_value(data.clone()).ok()
    }
}

/// The stored columns of the checkpoint event at `version` of the log
/// stream (the caller fills position and txid's place by inserting it).
pub struct CheckpointEvent {
    pub version: i64,
    pub actor: String,
    pub token: i64,
    pub data: Value,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Option<String>,
    pub hash: String,
    pub schema: i16,
}

/// The checkpoint as the next event of the log stream, hash chained to
/// `prev_hash` (the stream's last event), written in today's schema.
pub fn checkpoint_event(
    cp: &Checkpoint,
    version: i64,
    prev_hash: Option<String>,
    actor: &str,
    token: i64,
) -> CheckpointEvent {
    let data = cp.data();
    let schema = super::schema::CURRENT;
    let recorded_at = super::digest::to_micros(cp.head.signed_at);
    let hash = hash_stored(&HashInput {
        job_id: &LOG_STREAM.to_string(),
        version,
        epoch: 0,
        token,
        attempt: 0,
        run: 0,
        from_state: None,
        to_state: CHECKPOINT,
        reason: CHECKPOINT,
        error_class: None,
        actor,
        recorded_at,
        kind: CHECKPOINT,
        data: &data,
        prev_hash: prev_hash.as_deref(),
        schema,
    });
    CheckpointEvent {
        version,
        actor: actor.into(),
        token,
        data,
        recorded_at,
        prev_hash,
        hash,
        schema,
    }
}

/// Reads a key file: 64 hex digits, surrounding whitespace ignored.
pub fn parse_key_hex(text: &str) -> Result<[u8; 32], CheckpointError> {
    hex::decode(text.trim())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| CheckpointError::KeyFile(format!("{} characters", text.trim().len())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head() -> TreeHead {
        TreeHead {
            log_id: Uuid::from_u128(7),
            tree_size: 1000,
            root: hex::encode([9u8; 32]),
            last_position: 1234,
            signed_at: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        }
    }

    #[test]
    fn a_signed_head_verifies_and_nothing_else_does() {
        let key = SigningKey::from_bytes(&[3u8; 32]);
        let cp = sign(head(), &key);
        assert_eq!(cp.verify(&key.verifying_key()), Ok(()));
        let back = Checkpoint::from_data(&cp.data()).unwrap();
        assert_eq!(back, cp);
        for change in [
            |h: &mut TreeHead| h.tree_size += 1,
            |h: &mut TreeHead| h.root = hex::encode([8u8; 32]),
            |h: &mut TreeHead| h.last_position += 1,
            |h: &mut TreeHead| h.log_id = Uuid::from_u128(8),
        ] {
            let mut forged = cp.clone();
            change(&mut forged.head);
            assert_eq!(
                forged.verify(&key.verifying_key()),
                Err(CheckpointError::BadSignature)
            );
        }
        let other = SigningKey::from_bytes(&[4u8; 32]);
        assert!(matches!(
            cp.verify(&other.verifying_key()),
            Err(CheckpointError::OtherKey { .. })
        ));
    }
}
