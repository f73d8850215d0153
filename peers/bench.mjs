// The peers' side of `scripts/peers`: graphile-worker 0.18 and pg-boss 12.38
// on the workloads of `jobledger bench` (docs/benchmarks.md), each in a fresh
// database, each count verified in the database before a figure is printed.
// Prints one JSON line per figure, as `jobledger bench` does.
//
//   node bench.mjs [--url postgres://…/postgres] [--w1 10000] [--w2 100000] [--w3 50000] [--only graphile,pgboss]
//
// Payloads are `{ i }`, as jobledger's bench enqueues; handlers do nothing.
import pg from "pg";
import { run, makeWorkerUtils } from "graphile-worker";
import { PgBoss } from "pg-boss";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const adminUrl = args.url ?? "postgres://postgres@127.0.0.1:5432/postgres";
const N = { w1: +(args.w1 ?? 10000), w2: +(args.w2 ?? 100000), w3: +(args.w3 ?? 50000) };
const only = (args.only ?? "graphile,pgboss").split(",");
const HANDLERS = 16;

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const report = (system, workload, jobs, seconds, extra = {}) =>
  console.log(JSON.stringify({ system, workload, jobs, seconds: +seconds.toFixed(3), jobs_per_s: Math.round(jobs / seconds), ...extra }));

// A fresh database per system and workload: no workload starts on another's
// dead tuples.
async function freshDb(name) {
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.query(`CREATE DATABASE ${name}`);
  await admin.end();
  const u = new URL(adminUrl);
  u.pathname = `/${name}`;
  return u.toString();
}

async function dropDb(name) {
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.end();
}

async function scalar(url, sql, params = []) {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    return Number((await c.query(sql, params)).rows[0].n);
  } finally {
    await c.end();
  }
}

function expect(system, what, got, want) {
  if (got !== want) throw new Error(`${system}: ${what}: ${got} in the database, not ${want}`);
}

// Polls the database until `done` holds; the clock stops at the first poll
// that sees it (every 20 ms), as jobledger's drain stops at its counter.
async function until(url, sql, want) {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    for (;;) {
      if (Number((await c.query(sql)).rows[0].n) === want) return;
      await sleep(20);
    }
  } finally {
    await c.end();
  }
}

const chunks = (n, size) => Array.from({ length: Math.ceil(n / size) }, (_, c) =>
  Array.from({ length: Math.min(size, n - c * size) }, (_, k) => c * size + k));

// ---- graphile-worker -------------------------------------------------------

// W1's shape for every system: 8 clients, each enqueueing every 8th job,
// one call (one transaction) per job; returns the seconds it took.
async function eightClients(n, enqueue) {
  const t0 = performance.now();
  await Promise.all(Array.from({ length: 8 }, async (_, c) => {
    for (let i = c; i < n; i += 8) await enqueue(i);
  }));
  return (performance.now() - t0) / 1000;
}

const GW_COUNT = "SELECT count(*) AS n FROM graphile_worker._private_jobs";

// On a pool of our own, with an error handler, ended on release: the
// utilities' own pool could still hold a connection when the database was
// dropped with FORCE, and raised that as an unhandled error that killed
// the script (once in three runs on 2026-12-04, after W1).
async function gwUtils(url, pool = 10) {
  const pgPool = new pg.Pool({ connectionString: url, max: pool });
  pgPool.on("error", (e) => console.error(`graphile-worker pool: ${e.message}`));
  // graphile-worker asks for a handler on each client too.
  pgPool.on("connect", (c) => c.on("error", (e) => console.error(`graphile-worker client: ${e.message}`)));
  const utils = await makeWorkerUtils({ pgPool });
  await utils.migrate();
  const release = utils.release.bind(utils);
  utils.release = async () => {
    await release();
    await pgPool.end();
  };
  return utils;
}

async function gwW1(n) {
  const url = await freshDb("peers_gw_w1");
  const utils = await gwUtils(url, 8);
  const s = await eightClients(n, (i) => utils.addJob("noop", { i }));
  await utils.release();
  expect("graphile-worker", "W1 jobs", await scalar(url, GW_COUNT), n);
  report("graphile-worker", "W1 enqueue, 1 per tx, 8 clients (addJob)", n, s);
  await dropDb("peers_gw_w1");
}

async function gwW2(n) {
  const url = await freshDb("peers_gw_w2");
  const utils = await gwUtils(url, 1);
  const t0 = performance.now();
  for (const c of chunks(n, 1000)) await utils.addJobs(c.map((i) => ({ identifier: "noop", payload: { i } })));
  const s = (performance.now() - t0) / 1000;
  await utils.release();
  expect("graphile-worker", "W2 jobs", await scalar(url, GW_COUNT), n);
  report("graphile-worker", "W2 enqueue, batches of 1000, 1 client (addJobs)", n, s);
  await dropDb("peers_gw_w2");
}

async function gwW3(n, tuned) {
  const db = tuned ? "peers_gw_w3t" : "peers_gw_w3";
  const url = await freshDb(db);
  const utils = await gwUtils(url);
  for (const c of chunks(n, 1000)) await utils.addJobs(c.map((i) => ({ identifier: "noop", payload: { i } })));
  await utils.release();
  expect("graphile-worker", "W3 jobs enqueued", await scalar(url, GW_COUNT), n);
  let handled = 0;
  const worker = { localQueue: { size: 500 }, completeJobBatchDelay: 0 };
  // Our own pool, ended before the drop: the runner's stop() left its pool's
  // idle connections open, and the drop's FORCE then killed them, which the
  // pool raised as an unhandled error and the script died (twice in a row).
  const pgPool = new pg.Pool({ connectionString: url, max: 10 }); // graphile-worker's default maxPoolSize
  // An idle connection's error (the server going away) is reported, not
  // thrown: the figure is checked against the database regardless.
  pgPool.on("error", (e) => console.error(`graphile-worker pool: ${e.message}`));
  pgPool.on("connect", (c) => c.on("error", (e) => console.error(`graphile-worker client: ${e.message}`)));
  const t0 = performance.now();
  const runner = await run({
    pgPool,
    concurrency: HANDLERS,
    noHandleSignals: true,
    pollInterval: 100,
    taskList: { noop: async () => { handled++; } },
    logger: quietGraphileLogger(),
    ...(tuned ? { preset: { worker } } : {}),
  });
  // A completed job is deleted: the table empties when every completion committed.
  await until(url, GW_COUNT, 0);
  const s = (performance.now() - t0) / 1000;
  await runner.stop();
  await pgPool.end();
  expect("graphile-worker", "W3 handler runs", handled, n);
  report("graphile-worker", tuned ? "W3 drain, 16 handlers, localQueue 500, batched completions" : "W3 drain, 16 handlers, defaults", n, s);
  await dropDb(db);
}

// graphile-worker logs every job at info: silence all but errors.
function quietGraphileLogger() {
  return {
    scope: () => quietGraphileLogger(),
    error: (m) => console.error(m),
    warn: () => {},
    info: () => {},
    debug: () => {},
  };
}

// ---- pg-boss ---------------------------------------------------------------

const PB_ALL = "SELECT count(*) AS n FROM pgboss.job WHERE name = 'noop'";
const PB_DONE = "SELECT count(*) AS n FROM pgboss.job WHERE name = 'noop' AND state = 'completed'";

async function pgBoss(url, max = 10) {
  const boss = new PgBoss({ connectionString: url, max, supervise: false, schedule: false });
  boss.on("error", (e) => console.error("pg-boss:", e.message));
  await boss.start();
  await boss.createQueue("noop");
  return boss;
}

async function pbW1(n) {
  const url = await freshDb("peers_pb_w1");
  const boss = await pgBoss(url, 8);
  const s = await eightClients(n, (i) => boss.send("noop", { i }));
  await boss.stop({ graceful: false, wait: true });
  expect("pg-boss", "W1 jobs", await scalar(url, PB_ALL), n);
  report("pg-boss", "W1 enqueue, 1 per tx, 8 clients (send)", n, s);
  await dropDb("peers_pb_w1");
}

async function pbW2(n) {
  const url = await freshDb("peers_pb_w2");
  const boss = await pgBoss(url, 1);
  const t0 = performance.now();
  for (const c of chunks(n, 1000)) await boss.insert("noop", c.map((i) => ({ data: { i } })));
  const s = (performance.now() - t0) / 1000;
  await boss.stop({ graceful: false, wait: true });
  expect("pg-boss", "W2 jobs", await scalar(url, PB_ALL), n);
  report("pg-boss", "W2 enqueue, batches of 1000, 1 client (insert)", n, s);
  await dropDb("peers_pb_w2");
}

// pg-boss 12's defaults fetch one job per worker and then wait out the
// 2-second polling interval (its bursts need a batch size above 1 or its
// 60-second stats cache): 16 workers make 8 jobs/s whatever the machine. So
// the default drain runs 200 jobs, not the workload's 50,000 (about 25 s).
const PB_DEFAULT_W3 = 200;

async function pbW3(n, tuned) {
  if (!tuned) n = Math.min(n, PB_DEFAULT_W3);
  const db = tuned ? "peers_pb_w3t" : "peers_pb_w3";
  const url = await freshDb(db);
  const boss = await pgBoss(url, 20);
  for (const c of chunks(n, 1000)) await boss.insert("noop", c.map((i) => ({ data: { i } })));
  expect("pg-boss", "W3 jobs enqueued", await scalar(url, PB_ALL), n);
  let handled = 0;
  const opts = tuned
    ? { localConcurrency: HANDLERS, batchSize: 100, burstWhenBatchFull: true, pollingIntervalSeconds: 0.5 }
    : { localConcurrency: HANDLERS };
  const t0 = performance.now();
  await boss.work("noop", opts, async (jobs) => { handled += jobs.length; });
  await until(url, PB_DONE, n);
  const s = (performance.now() - t0) / 1000;
  await boss.stop({ graceful: true, wait: true });
  expect("pg-boss", "W3 handler runs", handled, n);
  report("pg-boss", tuned ? "W3 drain, 16 workers, batch handler of 100" : "W3 drain, 16 workers, defaults", n, s);
  await dropDb(db);
}

// ---- main ------------------------------------------------------------------

if (only.includes("graphile")) {
  await gwW1(N.w1);
  await gwW2(N.w2);
  await gwW3(N.w3, false);
  await gwW3(N.w3, true);
}
if (only.includes("pgboss")) {
  await pbW1(N.w1);
  await pbW2(N.w2);
  await pbW3(N.w3, false);
  await pbW3(N.w3, true);
}
