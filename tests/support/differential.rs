//! Random policies and times, decided by a Lua script on a fixed `TIME` and
//! by the memory store on the same microsecond.

use std::time::Duration;

use tower_redis_ratelimit::{MAX_COST, MAX_MAX};
use tower_redis_ratelimit::{Policy, PolicyError, Rate, Store};

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

fn random_policy(
    rng: &mut Rng,
    algorithm: fn(Policy) -> Result<Policy, PolicyError>,
    limit: u128,
) -> Policy {
    loop {
        let n = 1 + rng.below(3) as usize;
        let mut rates = Vec::new();
        for _ in 0..n {
            let window = WINDOWS_US[rng.below(WINDOWS_US.len() as u64) as usize];
            let max = match rng.below(4) {
                0 => 1,
                1 | 2 => 1 + rng.below(10),
                _ => 1 + rng.below(MAX_MAX),
            };
            if u128::from(max) * u128::from(window) > limit {
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
        return algorithm(policy.with_cost(cost).unwrap()).unwrap();
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

/// Run the script `source` (with its `TIME` call replaced by a time the test
/// sets) and the memory store side by side on random policies, made with
/// `algorithm` from rates whose `max × window` (µs) is at most `limit`.
/// How many checks differed (each is printed).
pub async fn run(
    server: &RedisServer,
    source: &str,
    algorithm: fn(Policy) -> Result<Policy, PolicyError>,
    limit: u128,
) -> usize {
    let fake = "local t = redis.call('HMGET', 'fake-time', 's', 'us')";
    assert!(source.contains("local t = redis.call('TIME')"));
    let script = ::redis::Script::new(&source.replace("local t = redis.call('TIME')", fake));
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut rng = Rng::new(0x2545_f491_4f6c_dd1d);
    let mut mismatches = 0;
    let (mut checks, mut denied) = (0, 0);
    for round in 0..300 {
        let policy = random_policy(&mut rng, algorithm, limit);
        let Harness::Memory { store, clock } = Harness::memory() else {
            unreachable!()
        };
        let key = format!("k{round}");
        // In the future (2033 on), so keys do not expire on Redis's real
        // clock; below 2^53 µs, where Redis's doubles are exact.
        let mut now = 2_000_000_000_000_000 + rng.below(1 << 40);
        for _ in 0..40 {
            now = next_time(&mut rng, &policy, now);
            if now >= 8_000_000_000_000_000 {
                break;
            }
            ::redis::cmd("HSET")
                .arg("fake-time")
                .arg("s")
                .arg(now / 1_000_000)
                .arg("us")
                .arg(now % 1_000_000)
                .exec_async(&mut conn)
                .await
                .unwrap();
            let mut invocation = script.key(&key);
            invocation.arg(policy.cost());
            for rate in policy.rates() {
                invocation.arg(rate.max()).arg(micros(rate.window()));
            }
            let reply: Vec<u64> = invocation.invoke_async(&mut conn).await.unwrap();
            clock.set(Duration::from_micros(now));
            let d = store.check("k", &policy).await.unwrap();
            let mut expected = vec![u64::from(d.allowed())];
            for rate in d.rates() {
                expected.extend([rate.remaining(), micros(rate.reset()), micros(rate.wait())]);
            }
            checks += 1;
            denied += usize::from(!d.allowed());
            if reply != expected {
                mismatches += 1;
                eprintln!(
                    "{policy} cost {} at {now}: script {reply:?}, memory {expected:?}",
                    policy.cost()
                );
            }
        }
    }
    eprintln!("{checks} checks ({denied} denied), {mismatches} differ");
    assert!(
        denied > checks / 10 && denied < checks * 9 / 10,
        "{denied} of {checks} denied"
    );
    mismatches
}
