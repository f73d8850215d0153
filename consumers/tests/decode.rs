//! Fuzzing the consumer's decoder: any bytes and headers give an event or a
//! precise error (which sends the message to the dead-letter table), never a
//! panic.

use jobledger_consumers::decode::{decode_parts, DecodeError};
use proptest::prelude::*;
use serde_json::json;
use std::collections::HashMap;

fn run(
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: HashMap<&'static str, String>,
) -> Result<(), DecodeError> {
    let int = |n: &'static str| {
        headers
            .get(n)
            .ok_or(DecodeError::MissingHeader(n))?
            .parse::<i64>()
            .map_err(|_| DecodeError::BadHeader(n))
    };
    let text = |n: &'static str| headers.get(n).cloned().ok_or(DecodeError::MissingHeader(n));
    decode_parts(key.as_deref(), payload.as_deref(), int, text, 0, 0).map(|_| ())
}

proptest! {
    #[test]
    fn arbitrary_messages_never_panic(
        key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
        payload in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..200)),
        schema in "[0-9a-z-]{0,3}",
        epoch in "[0-9-]{0,4}",
    ) {
        let mut h = HashMap::new();
        h.insert("schema", schema);
        h.insert("epoch", epoch);
        h.insert("token", "1".to_string());
        h.insert("version", "1".to_string());
        h.insert("position", "1".to_string());
        h.insert("type", "x".to_string());
        let _ = run(key, payload, h);
    }
}

#[test]
fn invalid_utf8_and_wrong_shapes_are_precise_errors() {
    let good = |e: &str| -> HashMap<&'static str, String> {
        [
            ("schema", "1"),
            ("epoch", e),
            ("token", "2"),
            ("version", "3"),
            ("position", "4"),
            ("type", "succeeded"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect()
    };
    let body = br#"{"epoch": 5, "token": 2, "version": 3, "position": 4, "type": "succeeded",
        "job_id": "0192d1a2-0000-7000-8000-000000000001", "to_state": "succeeded", "reason": "completed",
        "hash": "h", "recorded_at": "2026-12-01T00:00:00.000001Z", "queue": "q", "job_key": null}"#
        .to_vec();
    assert_eq!(run(Some(b"k".to_vec()), Some(body.clone()), good("5")), Ok(()));
    // Every field a handler relies on is checked here, so a message that
    // decodes can be applied: none of these reaches a handler.
    let full: serde_json::Value = serde_json::from_slice(&body).unwrap();
    for (field, bad) in [
        ("job_id", serde_json::Value::Null),
        ("job_id", json!("not-a-uuid")),
        ("to_state", json!("")),
        ("reason", json!(7)),
        ("hash", serde_json::Value::Null),
        ("recorded_at", json!("yesterday")),
        ("queue", json!(["q"])),
        ("to_state", json!("a\u{0}b")),
    ] {
        let mut b = full.clone();
        b[field] = bad;
        assert_eq!(
            run(
                Some(b"k".to_vec()),
                Some(serde_json::to_vec(&b).unwrap()),
                good("5")
            ),
            Err(DecodeError::BadField(field)),
            "{field}"
        );
    }
    let mut b = full.clone();
    b.as_object_mut().unwrap().remove("job_id");
    assert_eq!(
        run(
            Some(b"k".to_vec()),
            Some(serde_json::to_vec(&b).unwrap()),
            good("5")
        ),
        Err(DecodeError::BadField("job_id"))
    );
    let mut b = full.clone();
    b["type"] = json!("claimed");
    assert_eq!(
        run(
            Some(b"k".to_vec()),
            Some(serde_json::to_vec(&b).unwrap()),
            good("5")
        ),
        Err(DecodeError::Mismatch("type"))
    );
    assert_eq!(
        run(Some(vec![0xff, 0xfe]), Some(body.clone()), good("5")),
        Err(DecodeError::KeyNotUtf8)
    );
    assert_eq!(run(None, Some(body.clone()), good("5")), Err(DecodeError::NoKey));
    assert!(matches!(
        run(Some(b"k".to_vec()), Some(vec![0xff, 0x00]), good("5")),
        Err(DecodeError::NotJson(_))
    ));
    assert!(matches!(
        run(Some(b"k".to_vec()), Some(b"[1,2]".to_vec()), good("5")),
        Err(DecodeError::NotJson(_))
    ));
    assert_eq!(
        run(Some(b"k".to_vec()), Some(body.clone()), good("6")),
        Err(DecodeError::Mismatch("epoch"))
    );
    let mut h = good("5");
    h.insert("schema", "3".into());
    assert_eq!(
        run(Some(b"k".to_vec()), Some(body.clone()), h),
        Err(DecodeError::UnknownSchema(3))
    );
    let mut h = good("5");
    h.insert("schema", "0".into());
    assert_eq!(
        run(Some(b"k".to_vec()), Some(body.clone()), h),
        Err(DecodeError::UnknownSchema(0))
    );
    // Schema 2 (today's) decodes; a body that names another schema than
    // its header is refused.
    let mut h = good("5");
    h.insert("schema", "2".into());
    assert!(run(Some(b"k".to_vec()), Some(body.clone()), h).is_ok());
    let mut relabelled: serde_json::Value = serde_json::from_slice(&body).unwrap();
    relabelled["schema"] = 1.into();
    let mut h = good("5");
    h.insert("schema", "2".into());
    assert_eq!(
        run(
            Some(b"k".to_vec()),
            Some(serde_json::to_vec(&relabelled).unwrap()),
            h
        ),
        Err(DecodeError::Mismatch("schema"))
    );
    let mut h = good("5");
    h.remove("token");
    assert_eq!(
        run(Some(b"k".to_vec()), Some(body), h),
        Err(DecodeError::MissingHeader("token"))
    );
}
