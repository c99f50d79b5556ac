//! Random policies, times and operator commands, decided by a Lua script on
//! a `TIME` the test sets and by the memory store (the pure functions of
//! `src/algorithm/`) on the same microsecond.

use std::time::Duration;

use tower_redis_ratelimit::policy::{MAX_COST, MAX_MAX, MAX_WINDOW};
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::store::scripts;
use tower_redis_ratelimit::{Algorithm, Decision, Policy, Rate, Store};

use super::RedisServer;
use super::harness::{Harness, micros};
use super::rng::Rng;

const WINDOWS_US: [u64; 9] = [
    1_000,
    7_000,
    100_000,
    1_000_000,
    3_000_000,
    60_000_000,
    3_600_000_000,
    86_400_000_000,
    316_224_000_000_000,
];

/// What a run compares.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub algorithm: Algorithm,
    /// Rates have `max × window` (µs) at most this.
    pub limit: u128,
    /// Operator commands between the checks (else checks only).
    pub commands: bool,
    pub seed: u64,
    pub rounds: usize,
}

impl Setup {
    pub fn new(algorithm: Algorithm, seed: u64) -> Self {
        Self {
            algorithm,
            limit: u128::MAX,
            commands: true,
            seed,
            rounds: 300,
        }
    }
}

fn random_policy(rng: &mut Rng, setup: &Setup) -> Policy {
    // The sliding log keeps an entry per unit: keep its maxes small.
    let big = match setup.algorithm {
        Algorithm::SlidingLog | Algorithm::Concurrency => 10_000,
        _ => MAX_MAX,
    };
    loop {
        if setup.algorithm == Algorithm::Concurrency {
            let window = WINDOWS_US[rng.below(WINDOWS_US.len() as u64) as usize];
            let max = match rng.below(3) {
                0 => 1,
                1 => 1 + rng.below(10),
                _ => 1 + rng.below(big),
            };
            return Policy::concurrency(max)
                .unwrap()
                .with_lease(Duration::from_micros(window))
                .unwrap();
        }
        let n = 1 + rng.below(3) as usize;
        let mut rates = Vec::new();
        for _ in 0..n {
            let window = WINDOWS_US[rng.below(WINDOWS_US.len() as u64) as usize];
            let max = match rng.below(4) {
                0 => 1,
                1 | 2 => 1 + rng.below(10),
                _ => 1 + rng.below(big),
            };
            if u128::from(max) * u128::from(window) > setup.limit {
                continue;
            }
            rates.push(Rate::new(max, Duration::from_micros(window)).unwrap());
        }
        rates.sort_by_key(Rate::window);
        rates.dedup_by_key(|r| r.window());
        let Ok(policy) = Policy::new(rates) else {
            continue;
        };
        let smallest = policy.rates().iter().map(Rate::max).min().unwrap();
        let cost = match rng.below(3) {
            0 => 1 + rng.below(smallest.min(MAX_COST)),
            _ => 1,
        };
        let mut policy = policy
            .with_cost(cost)
            .unwrap()
            .with_algorithm(setup.algorithm)
            .unwrap();
        if setup.algorithm == Algorithm::SlidingLog && rng.below(3) == 0 {
            let spacing = WINDOWS_US[rng.below(4) as usize] / (1 + rng.below(4));
            policy = policy
                .with_min_spacing(Duration::from_micros(spacing))
                .unwrap();
        }
        return policy;
    }
}

/// The next time to check at: often a window edge of one of the rates,
/// or one microsecond before it.
fn next_time(rng: &mut Rng, policy: &Policy, now: u64) -> u64 {
    let rates = policy.rates();
    let w = micros(rates[rng.below(rates.len() as u64) as usize].window());
    let edge = (now / w + 1 + rng.below(2)) * w;
    match rng.below(8) {
        0 => now,
        1 => now + 1,
        2 => edge,
        3 => edge - 1,
        4 => now + rng.below(w),
        5 => now + rng.below(w / 3 + 1),
        6 => edge + rng.below(w),
        _ => now + rng.below(micros(policy.longest_window()) * 3),
    }
}

/// A random operator command, or `None` for a check.
fn next_op(rng: &mut Rng, policy: &Policy, setup: &Setup) -> Option<Command> {
    if !setup.commands || rng.below(3) != 0 {
        return None;
    }
    let max = policy.rates().iter().map(Rate::max).min().unwrap();
    let units = match rng.below(6) {
        0 => 0,
        1 => 1,
        2 if setup.algorithm != Algorithm::SlidingLog => u64::MAX,
        _ => rng.below(max.saturating_mul(2).min(20_000)) + 1,
    };
    let rates = policy.rates();
    let window = micros(rates[rng.below(rates.len() as u64) as usize].window());
    Some(match rng.below(9) {
        0 => Command::Peek,
        1 => Command::Reset,
        2 | 3 => Command::Block(Duration::from_micros(match rng.below(3) {
            0 => 0,
            _ => rng.below(window * 2) + 1,
        })),
        4..=6 => Command::Penalty(units),
        _ => Command::Reward(units),
    })
}

/// The values both sides are compared on: allowed, retry after, then per
/// rate remaining, reset and wait (µs).
fn of_decision(d: &Decision) -> Vec<u64> {
    let mut out = vec![u64::from(d.allowed()), micros(d.retry_after())];
    for rate in d.rates() {
        out.extend([rate.remaining(), micros(rate.reset()), micros(rate.wait())]);
    }
    out
}

/// A decision as a check script replies it (`{-1, left}` for a blocked
/// key, else allowed, the wait a denial's spacing asks (here its whole
/// wait: [`of_reply`] reads the longest), then each rate's remaining, reset
/// and wait).
fn decision_ints(d: &Decision) -> Vec<i64> {
    let int = |n: u64| i64::try_from(n).unwrap();
    if d.blocked() {
        return vec![-1, int(micros(d.retry_after()))];
    }
    let spacing = if d.allowed() {
        0
    } else {
        micros(d.retry_after())
    };
    let mut out = vec![i64::from(d.allowed()), int(spacing)];
    for rate in d.rates() {
        out.extend([
            int(rate.remaining()),
            int(micros(rate.reset())),
            int(micros(rate.wait())),
        ]);
    }
    out
}

/// The same values from a script's reply (`{-1, left}` for a blocked key).
fn of_reply(reply: &[i64], rates: usize) -> Vec<u64> {
    let n = |i: usize| u64::try_from(reply[i]).unwrap();
    if reply[0] == -1 {
        let left = n(1);
        let mut out = vec![0, left];
        for _ in 0..rates {
            out.extend([0, left, left]);
        }
        return out;
    }
    let allowed = n(0) == 1;
    let mut retry = n(1);
    let mut out = vec![n(0), 0];
    for i in 0..rates {
        let (remaining, reset, wait) = (n(2 + 3 * i), n(3 + 3 * i), n(4 + 3 * i));
        retry = retry.max(wait);
        out.extend([remaining, reset, wait]);
    }
    if !allowed {
        out[1] = retry;
    }
    out
}

/// `source` with Redis's `TIME` replaced by the time the test sets, and
/// `PEXPIRE` (relative to Redis's real clock, which the test's times are
/// not) by nothing. `PEXPIREAT` stays: the test's times are in the future.
fn faked(source: &str) -> String {
    let time = "local t = redis.call('TIME')";
    assert!(source.contains(time));
    let source = source
        .replace(
            time,
            "local t = redis.call('HMGET', 'fake-time', 's', 'us')",
        )
        .replace("redis.call(", "call(")
        // A script that keeps `redis.call` in a local of its own.
        .replace("= redis.call,", "= call,");
    let (first, rest) = source.split_once('\n').unwrap();
    format!(
        "{first}\nlocal function call(name, ...)\n  if name == 'PEXPIRE' then\n    return 1\n  end\n  \
         return redis.call(name, ...)\nend\n{rest}"
    )
}

fn sources(algorithm: Algorithm) -> (&'static str, &'static str) {
    match algorithm {
        Algorithm::SlidingLog => (
            scripts::SLIDING_LOG_SCRIPT,
            scripts::SLIDING_LOG_COMMAND_SCRIPT,
        ),
        Algorithm::FixedWindow => (
            scripts::FIXED_WINDOW_SCRIPT,
            scripts::FIXED_WINDOW_COMMAND_SCRIPT,
        ),
        Algorithm::SlidingWindow => (
            scripts::SLIDING_WINDOW_SCRIPT,
            scripts::SLIDING_WINDOW_COMMAND_SCRIPT,
        ),
        Algorithm::Gcra => (scripts::GCRA_SCRIPT, scripts::GCRA_COMMAND_SCRIPT),
        Algorithm::Concurrency => (
            scripts::CONCURRENCY_SCRIPT,
            scripts::CONCURRENCY_COMMAND_SCRIPT,
        ),
        other => panic!("no script for {other}"),
    }
}

/// The algorithm's arguments, as `RedisStore` sends them.
fn algorithm_args(invocation: &mut redis::ScriptInvocation<'_>, policy: &Policy, id: &str) {
    match policy.algorithm() {
        Algorithm::Concurrency => {
            let rate = policy.rates()[0];
            invocation
                .arg(rate.max())
                .arg(micros(rate.window()))
                .arg(id)
                .arg(1_000_000u64);
            return;
        }
        Algorithm::SlidingLog => {
            invocation
                .arg(policy.cost())
                .arg(policy.min_spacing().map_or(0, micros))
                .arg(id);
        }
        _ => {
            invocation.arg(policy.cost());
        }
    }
    for rate in policy.rates() {
        invocation.arg(rate.max()).arg(micros(rate.window()));
    }
}

/// Run the check and command scripts of `setup.algorithm` (on a `TIME` the
/// test sets) and the memory store side by side on random policies, times
/// and command sequences. How many answers differed (each is printed, with
/// the seed).
pub async fn run(server: &RedisServer, setup: Setup) -> usize {
    let (check_source, command_source) = sources(setup.algorithm);
    let check_script = redis::Script::new(&faked(check_source));
    // GCRA's and the sliding log's batch scripts decide each check apart
    // from a single check's script (GCRA replies what it saw, and the
    // client takes the decision from that: `decode_batched_reply`; the
    // sliding log's skips the search for a retry's entries): every other
    // round's checks go through them.
    let batch_script = match setup.algorithm {
        Algorithm::Gcra => Some(scripts::GCRA_BATCH_SCRIPT),
        Algorithm::SlidingLog => Some(scripts::SLIDING_LOG_BATCH_SCRIPT),
        _ => None,
    }
    .map(|source| redis::Script::new(&faked(source)));
    let command_script = redis::Script::new(&faked(command_source));
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut rng = Rng::new(setup.seed);
    let mut mismatches = 0;
    let (mut checks, mut denied, mut commands, mut blocked) = (0, 0, 0, 0);
    for round in 0..setup.rounds {
        let policy = random_policy(&mut rng, &setup);
        let Harness::Memory { store, clock } = Harness::memory() else {
            unreachable!()
        };
        let (key, block_key) = (format!("k{round}"), format!("b{round}"));
        // In the future (2033 on), so keys do not expire on Redis's real
        // clock; below 2^53 µs, where Redis's doubles are exact.
        let mut now = 2_000_000_000_000_000 + rng.below(1 << 40);
        for step in 0..40 {
            now = next_time(&mut rng, &policy, now);
            if now >= 8_000_000_000_000_000 {
                break;
            }
            redis::cmd("HSET")
                .arg("fake-time")
                .arg("s")
                .arg(now / 1_000_000)
                .arg("us")
                .arg(now % 1_000_000)
                .exec_async(&mut conn)
                .await
                .unwrap();
            clock.set(Duration::from_micros(now));
            let id = format!("{round}-{step}");
            let op = next_op(&mut rng, &policy, &setup);
            let batched = batch_script.as_ref().filter(|_| round % 2 == 1);
            let (reply, expected): (Vec<i64>, Decision) = match (op, batched) {
                (None, Some(batch)) => {
                    // The sliding log's request id follows the policy's
                    // arguments, where it is empty, after whether the batch
                    // is sent again (then each check looks for its entries
                    // first: they never are here): one such round in two.
                    let log = policy.algorithm() == Algorithm::SlidingLog;
                    let mut invocation = batch.key(&key);
                    invocation
                        .key(&block_key)
                        .arg(1)
                        .arg(1 + 2 * usize::from(log) + 2 * policy.rates().len());
                    algorithm_args(&mut invocation, &policy, if log { "" } else { &id });
                    if log {
                        invocation.arg(u8::from(round % 4 == 3)).arg(&id);
                    }
                    let reply: Vec<redis::Value> =
                        invocation.invoke_async(&mut conn).await.unwrap();
                    let [reply] = <[redis::Value; 1]>::try_from(reply).unwrap();
                    let decision = scripts::decode_batched_reply(reply, &policy)
                        .unwrap_or_else(|error| panic!("round {round}, step {step}: {error}"));
                    (
                        decision_ints(&decision),
                        store.check("k", &policy).await.unwrap(),
                    )
                }
                (None, None) => {
                    let mut invocation = check_script.key(&key);
                    invocation.key(&block_key);
                    algorithm_args(&mut invocation, &policy, &id);
                    // A check replies its integers as one string.
                    let reply: String = invocation.invoke_async(&mut conn).await.unwrap();
                    let reply = reply
                        .split(' ')
                        .map(|n| n.parse().unwrap_or_else(|_| panic!("reply {reply:?}")))
                        .collect();
                    (reply, store.check("k", &policy).await.unwrap())
                }
                (Some(command), _) => {
                    let (name, amount) = match command {
                        Command::Peek => ("peek", 0),
                        Command::Reset => ("reset", 0),
                        Command::Block(d) => ("block", micros(d.min(MAX_WINDOW))),
                        Command::Penalty(units) => ("penalty", units.min(MAX_MAX)),
                        Command::Reward(units) => ("reward", units.min(MAX_MAX)),
                        _ => unreachable!(),
                    };
                    let mut invocation = command_script.key(&key);
                    invocation.key(&block_key).arg(name).arg(amount).arg(&id);
                    algorithm_args(&mut invocation, &policy, &id);
                    let reply = invocation.invoke_async(&mut conn).await.unwrap();
                    (reply, store.command("k", &policy, command).await.unwrap())
                }
            };
            let got = of_reply(&reply, policy.rates().len());
            let want = of_decision(&expected);
            match op {
                None => {
                    checks += 1;
                    denied += usize::from(!expected.allowed());
                }
                Some(_) => commands += 1,
            }
            blocked += usize::from(reply[0] == -1);
            if got != want {
                mismatches += 1;
                eprintln!(
                    "seed {:#x}, round {round}, step {step}: {} {policy} cost {} at {now}, {op:?}: \
                     script {got:?}, memory {want:?}",
                    setup.seed,
                    setup.algorithm,
                    policy.cost()
                );
            }
        }
    }
    eprintln!(
        "{} (seed {:#x}): {checks} checks ({denied} denied), {commands} commands, {blocked} \
         answers of a blocked key, {mismatches} differ",
        setup.algorithm, setup.seed
    );
    assert!(
        denied > checks / 10 && denied < checks * 9 / 10,
        "{denied} of {checks} denied (seed {:#x})",
        setup.seed
    );
    if setup.commands {
        assert!(
            blocked > 0 && commands > checks / 4,
            "{commands} commands, {blocked} blocked"
        );
    }
    mismatches
}
