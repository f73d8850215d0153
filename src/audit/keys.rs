//! Signing keys: an ed25519 key pair in two files, the secret outside the
//! database (`jobledger keygen`), the public one for auditors.

use ed25519_dalek::{SigningKey, VerifyingKey};
use rand::RngCore;
use std::path::Path;

use super::{io, AuditError, AuditResult};
use crate::domain::checkpoint::{key_id, parse_key_hex};

/// Writes a new key pair: `secret` (mode 0600, 64 hex digits of the seed)
/// and `secret` + `.pub` (64 hex digits of the public key). Refuses to
/// overwrite either, and a secret named like a public key.
pub fn keygen(secret: &Path) -> AuditResult<(String, std::path::PathBuf)> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut seed = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut seed);
    let key = SigningKey::from_bytes(&seed);
    if secret.extension().is_some_and(|e| e == "pub") {
        return Err(AuditError::BadInput(format!(
            "{} is named like a public key; name the secret key file",
            secret.display()
        )));
    }
    let mut public = secret.as_os_str().to_owned();
    public.push(".pub");
    let public = std::path::PathBuf::from(public);
    for p in [secret, public.as_path()] {
        if p.exists() {
            return Err(AuditError::BadInput(format!(
                "{} exists; not overwriting a key",
                p.display()
            )));
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(secret)
        .map_err(|e| io(secret, e))?;
    writeln!(f, "{}", hex::encode(seed)).map_err(|e| io(secret, e))?;
    std::fs::write(
        &public,
        format!("{}\n", hex::encode(key.verifying_key().as_bytes())),
    )
    .map_err(|e| io(&public, e))?;
    Ok((key_id(&key.verifying_key()), public))
}

pub fn signing_key(path: &Path) -> AuditResult<SigningKey> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let seed = parse_key_hex(&text).map_err(|e| AuditError::Key(format!("{}: {e}", path.display())))?;
    Ok(SigningKey::from_bytes(&seed))
}

pub fn public_key(path: &Path) -> AuditResult<VerifyingKey> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let bytes = parse_key_hex(&text).map_err(|e| AuditError::Key(format!("{}: {e}", path.display())))?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| AuditError::Key(format!("{}: {e}", path.display())))
}
