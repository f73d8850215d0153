#!/usr/bin/env python3
"""A jobledger worker in Python, through the HTTP API alone (stdlib only).

It claims jobs in batches, runs a handler per kind, completes the batch in
one request, and heartbeats its leases from a second thread while handlers
run. Every write carries the lease's (epoch, token): if the lease was taken
over meanwhile, the server answers `stale` (409) and the write changes
nothing, so this worker can never overwrite its successor's decision. A
heartbeat answering `cancel_requested` means an operator asked for a cancel:
the worker confirms it instead of completing.

    python3 worker.py --url http://127.0.0.1:8080 --token "$TOKEN" --queue q

Exit 0 after `--exit-when-idle` finds the queue empty; prints one JSON line
of counts at the end.
"""

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request


class Api:
    def __init__(self, url, token, worker):
        self.url, self.token, self.worker = url.rstrip("/"), token, worker

    def post(self, path, body):
        """(status, answer): 4xx answers are outcomes, not exceptions."""
        body = dict(body, worker=self.worker)
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Authorization": "Bearer " + self.token,
                     "Content-Type": "application/json"},
            method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            answer = json.load(e)
            if "outcome" not in answer:  # a refusal of the request itself
                raise RuntimeError(f"{path}: {e.code} {answer.get('error')}") from None
            return e.code, answer  # stale / conflict / invalid_transition


def fence(lease):
    return {"job_id": lease["job_id"], "epoch": lease["epoch"], "token": lease["token"]}


# The handlers: kind -> function(payload) -> result. Raising PermanentError
# ends the job dead; any other exception is transient (retried by policy).
class PermanentError(Exception):
    pass


def add(payload):
    return {"sum": payload["a"] + payload["b"]}


def shout(payload):
    if not isinstance(payload.get("text"), str):
        raise PermanentError("payload.text must be a string")
    return {"text": payload["text"].upper()}


HANDLERS = {"add": add, "shout": shout}


class Heartbeats(threading.Thread):
    """Extends the held leases every lease_ms/3 until stopped; remembers the
    ones an operator asked to cancel and the ones lost to a takeover."""

    def __init__(self, api, lease_ms):
        super().__init__(daemon=True)
        self.api, self.lease_ms = api, lease_ms
        self.held, self.cancel, self.lost = [], set(), set()
        self.lock, self.stop = threading.Lock(), threading.Event()

    def run(self):
        while not self.stop.wait(self.lease_ms / 3000):
            with self.lock:
                items = [fence(l) for l in self.held]
            if not items:
                continue
            _, answer = self.api.post("/v1/leases/heartbeat",
                                      {"lease_ms": self.lease_ms, "items": items})
            with self.lock:
                for a in answer["answers"]:
                    if a["outcome"] == "stale":
                        self.lost.add(a["job_id"])
                    elif a.get("state") == "cancel_requested":
                        self.cancel.add(a["job_id"])


def work_batch(api, leases, beats, counts):
    done = []
    for lease in leases:
        counts["claimed"] += 1
        handler = HANDLERS.get(lease["kind"])
        try:
            if lease["next_action"] == "reconcile":
                # A takeover: a real handler would first ask the outside world
                # whether the last holder's call went through. These handlers
                # have no outside effect, so running them again is safe.
                pass
            if handler is None:
                raise PermanentError(f"no handler for kind {lease['kind']!r}")
            done.append(dict(fence(lease), result=handler(lease["payload"])))
        except Exception as e:  # noqa: BLE001 - every failure is recorded
            permanent = isinstance(e, PermanentError)
            status, answer = api.post(f"/v1/jobs/{lease['job_id']}/fail", {
                "epoch": lease["epoch"], "token": lease["token"],
                "class": "permanent" if permanent else "transient",
                "code": type(e).__name__, "message": str(e)})
            counts["failed" if status == 200 else answer["outcome"]] += 1
    with beats.lock:
        cancel = {d["job_id"] for d in done} & beats.cancel
    for item in [d for d in done if d["job_id"] in cancel]:
        api.post(f"/v1/jobs/{item['job_id']}/confirm-cancel",
                 {"epoch": item["epoch"], "token": item["token"]})
        counts["cancelled"] += 1
    done = [d for d in done if d["job_id"] not in cancel]
    if done:
        _, answer = api.post("/v1/leases/complete", {"items": done})
        for a in answer["answers"]:
            key = "completed" if a["outcome"] in ("committed", "already_committed") else a["outcome"]
            counts[key] += 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--token", default=os.environ.get("JOBLEDGER_TOKEN"))
    p.add_argument("--queue", required=True)
    p.add_argument("--worker", default=f"py-{os.getpid()}")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--lease-ms", type=int, default=30_000)
    p.add_argument("--exit-when-idle", action="store_true")
    args = p.parse_args()
    if not args.token:
        sys.exit("give --token or set JOBLEDGER_TOKEN")
    api = Api(args.url, args.token, args.worker)
    counts = {k: 0 for k in ("claimed", "completed", "failed", "cancelled", "stale", "conflict",
                             "invalid_transition")}
    beats = Heartbeats(api, args.lease_ms)
    beats.start()
    while True:
        _, answer = api.post(f"/v1/queues/{urllib.parse.quote(args.queue, safe='')}/claim",
                             {"lease_ms": args.lease_ms, "limit": args.batch})
        leases = answer["leases"]
        if not leases:
            if args.exit_when_idle:
                break
            time.sleep(0.5)
            continue
        with beats.lock:
            beats.held = leases
        work_batch(api, leases, beats, counts)
        with beats.lock:
            beats.held = []
    beats.stop.set()
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
