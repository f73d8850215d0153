#!/usr/bin/env python3
"""A fenced consumer of jobledger's event topic, in Python (confluent-kafka).

It reads every message of the topic and keeps, per message key (one job:
`<queue>/<job_key>` or the job id), the highest (epoch, token, version) it
applied. A message below it is *stale* (an older lifecycle, or a writer a
takeover fenced out) and is rejected; an equal one is a *duplicate* (the
relay resent it). Everything else is applied: here, the job's latest state
is kept in a dict. Headers carry the fence, so nothing else of the body is
needed to decide; the body is checked against them (and its `schema`
version read: 1 and 2 are the versions this consumer knows, docs/schema.md).

A real consumer keeps `highest` in its own database in the same transaction
as its effect, and commits its offsets after (the Rust FencedConsumer does);
this example keeps them in memory and prints what it did as one JSON object:

    python3 consumer.py --brokers 127.0.0.1:9092 --topic jobledger.events \
        [--group G] [--idle-seconds 3] [--max-messages N]
"""

import argparse
import json
import sys
import time

from confluent_kafka import Consumer, KafkaError

KNOWN_SCHEMAS = {1, 2}


def header_map(msg):
    return {k: (v.decode() if v is not None else None) for k, v in (msg.headers() or [])}


def fence_of(headers, body):
    """(epoch, token, version) from the headers, checked against the body."""
    fence = tuple(int(headers[name]) for name in ("epoch", "token", "version"))
    if (body.get("epoch"), body.get("token"), body.get("version")) != fence:
        raise ValueError("headers and body disagree on the fence")
    schema = int(headers["schema"])
    if schema not in KNOWN_SCHEMAS or body.get("schema") != schema:
        raise ValueError(f"event schema {schema} is not one this consumer knows")
    return fence


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--brokers", default="127.0.0.1:9092")
    ap.add_argument("--topic", default="jobledger.events")
    ap.add_argument("--group", default="python-example")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--max-messages", type=int, default=0)
    args = ap.parse_args()

    consumer = Consumer({
        "bootstrap.servers": args.brokers,
        "group.id": args.group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    })
    consumer.subscribe([args.topic])
    highest = {}   # key -> (epoch, token, version) applied
    states = {}    # key -> (job_id, to_state)
    counts = {"applied": 0, "stale": 0, "duplicate": 0, "undecodable": 0}
    stale = []
    seen = 0
    last = time.monotonic()
    try:
        while time.monotonic() - last < args.idle_seconds:
            if args.max_messages and seen >= args.max_messages:
                break
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                    continue
                raise SystemExit(f"kafka: {msg.error()}")
            seen += 1
            last = time.monotonic()
            key = msg.key().decode()
            try:
                body = json.loads(msg.value())
                fence = fence_of(header_map(msg), body)
            except (ValueError, KeyError, TypeError) as e:
                counts["undecodable"] += 1
                print(json.dumps({"undecodable": str(e), "offset": msg.offset()}), file=sys.stderr)
                continue
            have = highest.get(key)
            if have is not None and fence < have:
                counts["stale"] += 1
                stale.append({"key": key, "fence": fence, "highest": have})
                continue
            if have == fence:
                counts["duplicate"] += 1
                continue
            highest[key] = fence
            states[key] = (body["job_id"], body["to_state"])
            counts["applied"] += 1
            consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()
    print(json.dumps({
        "messages": seen,
        **counts,
        "keys": len(highest),
        "stale_rejected": stale,
        "states": {k: {"job_id": j, "state": s, "fence": highest[k]} for k, (j, s) in states.items()},
    }))


if __name__ == "__main__":
    main()
