//! Property tests of the canonical-JSON digest on arbitrary nested JSON
//! written as text in different ways: equal values give equal digests
//! whatever the key order and whitespace; different values differ; the
//! canonical form is itself JSON for the same value; hostile input (deep
//! nesting, odd strings) is an error or a digest, never a panic.

use jobledger::domain::{canonical_json, digest};
use proptest::prelude::*;
use serde_json::Value;

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e12f64..1e12).prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
        "[\\\\\"\u{0}-\u{1f}\u{7f}-\u{10ffff}]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Writes `v` as JSON text with object keys in reverse order and with
/// whitespace sprinkled between tokens.
fn write_shuffled(v: &Value, out: &mut String, depth: usize) {
    let pad = if depth % 2 == 0 { " \n\t" } else { "" };
    match v {
        Value::Object(m) => {
            out.push('{');
            out.push_str(pad);
            let entries: Vec<_> = m.iter().rev().collect();
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(pad);
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(pad);
                out.push(':');
                write_shuffled(v, out, depth + 1);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_shuffled(item, out, depth + 1);
            }
            out.push_str(pad);
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn equal_values_equal_digests(v in json_value()) {
        let mut text = String::new();
        write_shuffled(&v, &mut text, 0);
        let reread: Value = serde_json::from_str(&text).expect("the shuffled text is JSON");
        prop_assert_eq!(digest(&v), digest(&reread));
        let pretty: Value = serde_json::from_str(&serde_json::to_string_pretty(&v).unwrap()).unwrap();
        prop_assert_eq!(digest(&v), digest(&pretty));
    }

    #[test]
    fn canonical_form_is_json_for_the_same_value(v in json_value()) {
        let canonical = canonical_json(&v);
        let back: Value = serde_json::from_str(&canonical).expect("canonical form parses");
        prop_assert_eq!(digest(&back), digest(&v));
        prop_assert!(!canonical.contains('\n'));
        prop_assert_eq!(canonical_json(&back), canonical);
    }

    /// Digests are equal exactly when the values are (serde_json's value
    /// equality: numbers by value, so -0.0 == 0.0, but 1 != 1.0, as the
    /// canonical form says). `b` is `a` with one leaf changed or kept,
    /// so both sides of the "iff" come up often.
    #[test]
    fn digests_are_equal_exactly_when_values_are(a in json_value(), b_leaf in json_value(), change in any::<bool>()) {
        let b = if change { replace_first_leaf(&a, &b_leaf) } else { a.clone() };
        prop_assert_eq!(digest(&a) == digest(&b), a == b, "{} vs {}", a, b);
        // Wrapping changes the value, and so the digest.
        prop_assert_ne!(digest(&a), digest(&Value::Array(vec![a.clone()])));
    }

    /// Text near JSON (a value's text with one character changed) does not
    /// panic the digest; about half of it still parses, so the assertion
    /// runs (random text almost never parses).
    #[test]
    fn text_near_json_never_panics(v in json_value(), at in any::<usize>(), c in proptest::char::any()) {
        let mut text: Vec<char> = v.to_string().chars().collect();
        let i = at % (text.len() + 1);
        if i < text.len() && at % 2 == 0 { text[i] = c } else { text.insert(i, c) }
        let text: String = text.into_iter().collect();
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            prop_assert!(digest(&v).starts_with("v1:"));
            prop_assert_eq!(digest(&v), digest(&serde_json::from_str::<Value>(&canonical_json(&v)).unwrap()));
        }
    }
}

/// `v` with its first leaf (depth first) replaced by `leaf`.
fn replace_first_leaf(v: &Value, leaf: &Value) -> Value {
    match v {
        Value::Array(items) if !items.is_empty() => {
            let mut items = items.clone();
            items[0] = replace_first_leaf(&items[0], leaf);
            Value::Array(items)
        }
        Value::Object(map) if !map.is_empty() => {
            let mut map = map.clone();
            let k = map.keys().next().unwrap().clone();
            let inner = replace_first_leaf(&map[&k], leaf);
            map.insert(k, inner);
            Value::Object(map)
        }
        _ => leaf.clone(),
    }
}

/// serde_json's map is sorted here (no `preserve_order` feature anywhere in
/// the build): the canonical form's own key sort is then a second guard,
/// not the only one, and no test can tell them apart. If a dependency ever
/// turns `preserve_order` on, this fails and the key-order tests above start
/// to exercise the sort itself.
#[test]
fn serde_json_maps_are_sorted_in_this_build() {
    let v: Value = serde_json::from_str(r#"{"b": 1, "a": 2, "c": {"z": 0, "y": 1}}"#).unwrap();
    assert_eq!(v.to_string(), r#"{"a":2,"b":1,"c":{"y":1,"z":0}}"#);
    assert_eq!(canonical_json(&v), r#"{"a":2,"b":1,"c":{"y":1,"z":0}}"#);
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(
        serde_json::from_str::<Value>(&deep).is_err(),
        "the parser's depth limit refuses it"
    );
    let ok = format!("{}1{}", "[".repeat(100), "]".repeat(100));
    let v: Value = serde_json::from_str(&ok).unwrap();
    assert_eq!(canonical_json(&v), ok);
}

#[test]
fn float_spellings_of_one_number_agree_and_negative_zero_is_zero() {
    let a: Value = serde_json::from_str("1.5").unwrap();
    let b: Value = serde_json::from_str("1.50").unwrap();
    let c: Value = serde_json::from_str("15e-1").unwrap();
    assert_eq!(digest(&a), digest(&b));
    assert_eq!(digest(&a), digest(&c));
    let z: Value = serde_json::from_str("-0.0").unwrap();
    assert_eq!(digest(&z), digest(&serde_json::json!(0.0)));
    assert_ne!(digest(&serde_json::json!(1)), digest(&serde_json::json!("1")));
}
