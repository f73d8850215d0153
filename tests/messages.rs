//! The relay's message format without a broker: keys and headers, as
//! pure functions of an event and its job.

/// The key rule itself (tests/kafka.rs checks it on the broker), for queue
/// names that test does not use: a queue that already contains the escape (`%2F`, `%25`) never
/// shares a key with the queue whose `/` or `%` that escape stands for.
#[test]
fn message_keys_of_distinct_queue_and_key_pairs_are_distinct() {
    use jobledger::relay::message::message_key;
    let pairs = [
        ("a/b", "x"),
        ("a%2Fb", "x"),
        ("a%252Fb", "x"),
        ("a", "b/x"),
        ("a%", "x"),
        ("a%25", "x"),
    ];
    let keys: std::collections::HashSet<String> = pairs
        .iter()
        .map(|(q, k)| message_key(q, Some(k), &uuid::Uuid::nil()))
        .collect();
    assert_eq!(keys.len(), pairs.len(), "{keys:?}");
}
