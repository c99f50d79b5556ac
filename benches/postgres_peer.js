// The peer of benches/postgres.rs: rate-limiter-flexible's RateLimiterPostgres
// (Node, `pg`) on the same database, measured as the crate is. Run by
// scripts/bench-postgres, which installs both packages into target/ and sets
// NODE_PATH; by hand:
//
//   BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//   NODE_PATH=target/pg-peer/node_modules node benches/postgres_peer.js
//
// Every key is consumed once before the measurements (its row exists).
// Prints one line per measurement, as the crate's bench does:
// `RESULT peer-<in flight>-<sync> <decisions/s> <WAL bytes a decision> <p99 µs>`,
// then `EXACT peer <admitted> <failed>`: a 100/min key hit 1,000 times at 50
// in flight. Settings: BENCH_SECONDS (each measurement, default 5), BENCH_KEYS
// (distinct keys, default 10,000).
'use strict';

const { Pool } = require('pg');
const { RateLimiterPostgres } = require('rate-limiter-flexible');

const seconds = Number(process.env.BENCH_SECONDS || 5);
const keys = Number(process.env.BENCH_KEYS || 10000);
const url = process.env.BENCH_DATABASE_URL;
if (!url) throw new Error('set BENCH_DATABASE_URL (scripts/bench-postgres does)');

function limiter(pool, options) {
  return new Promise((resolve, reject) => {
    const made = new RateLimiterPostgres(
      { storeClient: pool, storeType: 'pool', tableName: 'rlflx', ...options },
      (error) => (error ? reject(error) : resolve(made)),
    );
  });
}

async function walPosition(pool) {
  const { rows } = await pool.query(
    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal",
  );
  return Number(rows[0].wal);
}

async function measure(rl, prefix, inFlight) {
  let next = 0;
  let stop = false;
  const latencies = [];
  const started = process.hrtime.bigint();
  const worker = async () => {
    while (!stop) {
      const key = `${prefix}-${next++ % keys}`;
      const asked = process.hrtime.bigint();
      await rl.consume(key, 1);
      latencies.push(Number(process.hrtime.bigint() - asked) / 1000);
    }
  };
  const workers = Array.from({ length: inFlight }, worker);
  await new Promise((r) => setTimeout(r, seconds * 1000));
  stop = true;
  await Promise.all(workers);
  const elapsed = Number(process.hrtime.bigint() - started) / 1e9;
  latencies.sort((a, b) => a - b);
  return {
    rate: latencies.length / elapsed,
    p99: latencies[Math.floor((latencies.length * 99) / 100)],
    count: latencies.length,
  };
}

async function warm(rl, prefix) {
  let next = 0;
  const worker = async () => {
    while (next < keys) {
      await rl.consume(`${prefix}-${next++}`, 1);
    }
  };
  await Promise.all(Array.from({ length: 50 }, worker));
}

async function main() {
  for (const sync of ['on', 'off']) {
    const pool = new Pool({
      connectionString: url,
      max: 50,
      options: `-c synchronous_commit=${sync}`,
    });
    // A limit no key of the run reaches: every check is admitted and writes.
    const rl = await limiter(pool, { points: 1000000, duration: 60 });
    // Every key consumed once first, unmeasured: the rows exist.
    await warm(rl, sync);
    for (const inFlight of [1, 50]) {
      const before = await walPosition(pool);
      const { rate, p99, count } = await measure(rl, sync, inFlight);
      const wal = (await walPosition(pool)) - before;
      console.log(
        `RESULT peer-${inFlight}-${sync} ${rate.toFixed(0)} ${(wal / count).toFixed(0)} ${p99.toFixed(0)}`,
      );
    }
    if (sync === 'on') {
      const exact = await limiter(pool, { points: 100, duration: 60, keyPrefix: `exact${Date.now()}` });
      let admitted = 0;
      let failed = 0;
      let left = 1000;
      const worker = async () => {
        while (left > 0) {
          left -= 1;
          try {
            await exact.consume('one-key', 1);
            admitted += 1;
          } catch (e) {
            if (!(e && typeof e.msBeforeNext === 'number')) failed += 1;
          }
        }
      };
      await Promise.all(Array.from({ length: 50 }, worker));
      console.log(`EXACT peer ${admitted} ${failed}`);
    }
    await pool.end();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
