//! The auditor's kit against the real PostgreSQL: signed checkpoints,
//! proofs checked offline, exports audited offline, and tampering by the
//! database superuser (triggers bypassed), with and without the attacker
//! recomputing the hash chain.

mod common;

use common::auditkit::{audit, job_with, new_kit, Kit};
use common::new_job;
use ed25519_dalek::SigningKey;
use jobledger::audit::checkpointer::{CheckpointConfig, Checkpointer};
use jobledger::audit::proofcheck::audit_proof;
use serde_json::json;
use std::time::Duration;

#[tokio::test]
async fn proofs_and_exports_check_offline() {
    let kit = new_kit().await;
    assert!(kit.problems().await.is_empty());
    assert!(kit.export_and_audit("a.zst").await.is_empty());
    let (job, _) = job_with(&kit, "observed").await;
    let proof = kit.db.ledger.prove_job(job).await.unwrap();
    assert_eq!(proof.events.len(), 4, "enqueued, claimed, observed, succeeded");
    let file = kit.path("p.json");
    std::fs::write(&file, serde_json::to_vec(&proof).unwrap()).unwrap();
    assert_eq!(audit_proof(&file, &kit.public).unwrap(), Vec::<String>::new());

    // More work, a second head; the second extends the first; two
    // consecutive segments audit as one log.
    let (to, _) = (
        kit.db.ledger.export(0, None, &kit.path("s1.zst")).await.unwrap(),
        (),
    );
    for i in 0..300 {
        kit.db
            .ledger
            .enqueue(new_job("r", None, json!({ "i": i })))
            .await
            .unwrap();
    }
    kit.checkpoint().await;
    let c = kit.db.ledger.prove_consistency(1, 2).await.unwrap();
    let file = kit.path("c.json");
    std::fs::write(&file, serde_json::to_vec(&c).unwrap()).unwrap();
    assert_eq!(audit_proof(&file, &kit.public).unwrap(), Vec::<String>::new());
    kit.db
        .ledger
        .export(to.manifest.end_index, None, &kit.path("s2.zst"))
        .await
        .unwrap();
    assert!(audit(&[kit.path("s1.zst"), kit.path("s2.zst")], Some(kit.public)).is_empty());
    // A gap between segments is a finding; so is the other key.
    kit.db
        .ledger
        .export(to.manifest.end_index + 1, None, &kit.path("s3.zst"))
        .await
        .unwrap();
    let gap = audit(&[kit.path("s1.zst"), kit.path("s3.zst")], Some(kit.public));
    assert!(
        gap.iter().any(|f| f.detail.contains("previous segment ended")),
        "{gap:?}"
    );
    let other = SigningKey::from_bytes(&[7u8; 32]).verifying_key();
    assert!(!audit_proof(&file, &other).unwrap().is_empty());
    let forged = audit(&[kit.path("a.zst")], Some(other));
    assert!(
        forged.iter().any(|f| f.detail.contains("not by the key given")),
        "{forged:?}"
    );
}

/// Edit, delete, reorder, insert: each named at its position by `verify`
/// and by the offline audit of a fresh export, and caught by the tree.
#[tokio::test]
async fn tampering_is_named_at_its_position() {
    // Edit: the result of a success, hash left as it was.
    let kit = new_kit().await;
    let (_, ev) = job_with(&kit, "succeeded").await;
    kit.around(&format!(
        "UPDATE jobledger.events SET data = jsonb_set(data, '{{result}}', '{{\"refund\": 999}}') WHERE position = {}",
        ev.position
    ))
    .await;
    let p = kit.problems().await;
    assert_eq!(p.first().and_then(|p| p.position), Some(ev.position), "{p:?}");
    assert!(p[0].detail.contains("hash mismatch"), "{p:?}");
    let f = kit.export_and_audit("edit.zst").await;
    assert_eq!(f.first().and_then(|f| f.position), Some(ev.position), "{f:?}");

    // Delete: a claim from the middle of a job's chain.
    let kit = kit_after_delete().await;
    let (deleted, next) = kit.1;
    let p = kit.0.problems().await;
    assert!(
        p.iter().any(|p| p.position == Some(next)),
        "the event after the hole: {p:?}"
    );
    assert!(
        p.iter()
            .any(|p| p.job_id.is_nil() && p.detail.contains("not what the tree recorded")),
        "{p:?}"
    );
    let f = kit.0.export_and_audit("delete.zst").await;
    assert!(f.iter().any(|f| f.position == Some(next)), "{f:?}");
    assert!(
        f.iter().any(|f| f.detail.contains("checkpoint v1 signed root")),
        "{f:?}"
    );
    let _ = deleted;

    // Reorder: an event moved to the end of the log (its chain still links:
    // only the tree sees that the log's order changed).
    let kit = new_kit().await;
    let (_, ev) = job_with(&kit, "failed").await;
    let cols = jobledger::store::rows::EVENT_COLUMNS;
    kit.around(&format!(
        "WITH moved AS (DELETE FROM jobledger.events WHERE position = {} RETURNING *) \
         INSERT INTO jobledger.events (position, txid, {cols}) OVERRIDING SYSTEM VALUE \
         SELECT (SELECT max(position) + 1 FROM jobledger.events), (SELECT max(txid) FROM jobledger.events), {cols} \
         FROM moved",
        ev.position
    ))
    .await;
    let p = kit.problems().await;
    assert!(
        p.iter().any(|p| p.detail.contains("not what the tree recorded")),
        "{p:?}"
    );
    assert!(
        p.iter().any(|p| p.detail.contains("checkpoint v1 signed root")),
        "{p:?}"
    );
    let f = kit.export_and_audit("reorder.zst").await;
    assert!(
        f.iter().any(|f| f.detail.contains("checkpoint v1 signed root")),
        "{f:?}"
    );

    // Insert: an observation slipped into the signed past, well formed and
    // linked (the attacker computed its hash).
    let kit = new_kit().await;
    let (job, _) = job_with(&kit, "succeeded").await;
    let mut last = kit.events_of(job).await.pop().unwrap();
    let first_txid: i64 = kit
        .db
        .count("SELECT min(txid::text::bigint) FROM jobledger.events")
        .await;
    last.prev_hash = Some(last.hash.clone());
    last.version += 1;
    last.kind = "observed".into();
    last.reason = "observation".into();
    last.from_state = Some(last.to_state.clone());
    last.data = json!({ "key": "forged", "data": {}, "digest": "v1:00", "by": null });
    let h = last.stored_hash();
    kit.around(&format!(
        "INSERT INTO jobledger.events (position, txid, job_id, version, type, from_state, to_state, reason, actor, \
           epoch, token, attempt, run, data, recorded_at, prev_hash, hash, schema) OVERRIDING SYSTEM VALUE \
         SELECT max(position) + 1, '{first_txid}'::text::xid8, '{job}', {}, 'observed', '{}', '{}', 'observation', 'mallory', \
           {}, {}, {}, {}, '{}', '{}', '{}', '{h}', 2 FROM jobledger.events",
        last.version,
        last.to_state,
        last.to_state,
        last.epoch,
        last.token,
        last.attempt,
        last.run,
        last.data,
        jobledger::domain::digest::fmt_time(last.recorded_at),
        last.prev_hash.clone().unwrap()
    ))
    .await;
    let p = kit.problems().await;
    assert!(
        p.iter().any(|p| p.detail.contains("not what the tree recorded")),
        "{p:?}"
    );
    let f = kit.export_and_audit("insert.zst").await;
    assert!(
        f.iter().any(|f| f.detail.contains("checkpoint v1 signed root")),
        "{f:?}"
    );
}

async fn kit_after_delete() -> (Kit, (i64, i64)) {
    let kit = new_kit().await;
    let (job, _) = job_with(&kit, "observed").await;
    let evs = kit.events_of(job).await;
    let (gone, next) = (evs[1].position, evs[2].position);
    kit.around(&format!("DELETE FROM jobledger.events WHERE position = {gone}"))
        .await;
    (kit, (gone, next))
}

/// The attacker recomputes the whole chain after editing (and rewrites
/// the stored tree too): the chain verifies, the job replays, and only the
/// signed checkpoints, which they cannot sign, still catch it.
#[tokio::test]
async fn signed_checkpoints_catch_a_recomputed_chain() {
    let kit = new_kit().await;
    let (job, ev) = job_with(&kit, "succeeded").await;
    kit.around(&format!(
        "UPDATE jobledger.events SET data = jsonb_set(data, '{{result}}', '{{\"refund\": 999}}') WHERE position = {}",
        ev.position
    ))
    .await;
    // The result is also in the projection: the attacker edits it too.
    kit.around(&format!(
        "UPDATE jobledger.jobs SET result = '{{\"refund\": 999}}' WHERE job_id = '{job}'"
    ))
    .await;
    kit.recompute_chain(job).await;
    let report = kit.db.ledger.verify(Some(job)).await.unwrap();
    assert!(
        report.ok(),
        "the chain alone no longer tells: {:?}",
        report.problems
    );
    let p = kit.problems().await;
    assert!(
        p.iter()
            .any(|p| p.position == Some(ev.position) && p.detail.contains("not what the tree recorded")),
        "the stored tree names the leaf: {p:?}"
    );
    assert!(
        p.iter().any(|p| p.detail.contains("checkpoint v1 signed root")),
        "{p:?}"
    );
    let f = kit.export_and_audit("recomputed.zst").await;
    assert!(
        f.iter().any(|f| f.detail.contains("checkpoint v1 signed root")),
        "{f:?}"
    );
    assert!(
        f.iter().all(|f| !f.detail.contains("hash mismatch")),
        "the chain is whole: {f:?}"
    );

    // The checkpointer refuses to sign over a tree that no longer extends
    // its last head, even with the stored blocks rewritten to match.
    let held = jobledger::audit::checkpointer::checkpoints(&kit.db.ledger)
        .await
        .unwrap()
        .pop()
        .unwrap()
        .2;
    kit.around(
        "DELETE FROM jobledger.merkle_blocks; \
         DELETE FROM jobledger.readers WHERE name = 'merkle'",
    )
    .await;
    let refused = kit.checkpointer().checkpoint_now().await.unwrap_err();
    assert!(refused.to_string().contains("refusing to sign"), "{refused}");
    // So the attacker removes the signed heads too and signs their own with
    // another key: the key and the head the auditor held both tell.
    kit.around("DELETE FROM jobledger.events WHERE job_id = '00000000-0000-0000-0000-000000000000'")
        .await;
    let forger = Checkpointer::new(
        kit.db.ledger.clone(),
        SigningKey::from_bytes(&[9u8; 32]),
        CheckpointConfig::default(),
    );
    forger.checkpoint_now().await.unwrap();
    let p = kit.problems().await;
    assert!(
        p.iter()
            .any(|p| p.detail.contains("checkpoint v1: signed by key")),
        "{p:?}"
    );
    let report = kit
        .db
        .ledger
        .verify_with(None, None, std::slice::from_ref(&held))
        .await
        .unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.detail.contains("the head you hold signed root")),
        "{:?}",
        report.problems
    );
    let out = kit.path("forged.zst");
    kit.db.ledger.export(0, None, &out).await.unwrap();
    let mut found = vec![];
    let mut a = jobledger::audit::offline::Auditor::new(Some(kit.public), |f| found.push(f.clone()));
    a.hold("held.json", held);
    a.segment(&out).unwrap();
    a.finish();
    assert!(
        found
            .iter()
            .any(|f| f.detail.contains("the head you hold signed root")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|f| f.detail.contains("not by the key given")),
        "{found:?}"
    );
}

/// A checkpointer whose lease another one took writes nothing: no block,
/// no head (the fence is the reader's lease token).
#[tokio::test]
async fn a_checkpointer_without_its_lease_writes_nothing() {
    let kit = new_kit().await;
    for i in 0..300 {
        kit.db
            .ledger
            .enqueue(new_job("r", None, json!({ "i": i })))
            .await
            .unwrap();
    }
    let heads = "SELECT count(*) FROM jobledger.events WHERE job_id = '00000000-0000-0000-0000-000000000000'";
    let (before_heads, before_blocks) = (
        kit.db.count(heads).await,
        kit.db.count("SELECT count(*) FROM jobledger.merkle_blocks").await,
    );
    let reader = jobledger::reader::LogReader::open(kit.db.ledger.pool().clone(), "merkle")
        .await
        .unwrap();
    kit.around(
        "UPDATE jobledger.readers SET lease_until = now() - interval '1 second' WHERE name = 'merkle'",
    )
    .await;
    let stalled = reader
        .acquire("stalled", Duration::from_millis(1))
        .await
        .unwrap()
        .unwrap();
    kit.around(
        "UPDATE jobledger.readers SET lease_until = now() - interval '1 second' WHERE name = 'merkle'",
    )
    .await;
    let successor = reader
        .acquire("successor", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(successor.is_some());
    let err = kit.checkpointer().catch_up_with(&stalled).await.unwrap_err();
    assert!(matches!(err, jobledger::audit::AuditError::LeaseLost), "{err}");
    assert_eq!(kit.db.count(heads).await, before_heads);
    assert_eq!(
        kit.db.count("SELECT count(*) FROM jobledger.merkle_blocks").await,
        before_blocks
    );
    // The successor's own catch-up signs.
    kit.checkpointer()
        .catch_up_with(successor.as_ref().unwrap())
        .await
        .unwrap();
    assert_eq!(kit.db.count(heads).await, before_heads + 1);
    assert!(kit.problems().await.is_empty());
}
