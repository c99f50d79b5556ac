//! Operator commands ([`Store::command`]: peek, reset, block, penalty,
//! reward) under network faults, through the fault-injecting proxy of
//! `tests/support/proxy.rs`, for every algorithm (both sliding-log
//! executions) and every connection source (`connect` pool, `from_pool`,
//! `from_connection_manager` with and without retries, cluster):
//!
//! 1. a penalty or a reward whose reply is lost after Redis ran it (dropped
//!    with the connection closed or hung, cut mid-way, or held beyond the
//!    store timeout) counts at most once: the call answers an error (or the
//!    state), and the key's state, peeked through a second store, shows the
//!    units applied exactly once;
//! 2. a peek, a reset or a block whose reply is lost the same ways is sent
//!    again where the store can tell (a dropped or cut connection: the call
//!    answers the state), and its effect holds exactly: a peek changes
//!    nothing, a reset leaves a full quota and no block, a block is in force
//!    from when Redis ran it for its length, and the counts are kept;
//! 3. any command refused before it ran (Redis refuses connections) is an
//!    error at once and applies nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::support::faults::{Algo, Connections, Loss, Rig, each_algorithm};
use crate::support::harness::away_from_a_boundary;
use crate::support::proxy::Match;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Decision, Policy, RedisStore, Store, StoreError};

/// The store timeout.
const TIMEOUT: Duration = Duration::from_millis(300);
/// Every policy allows 10 per hour (concurrency: 10 in flight, leases of an
/// hour): nothing refills during a test.
const MAX: u64 = 10;
const WINDOW: Duration = Duration::from_secs(3600);
/// How long a test block lasts.
const BLOCK: Duration = Duration::from_millis(1000);
/// How far a block's end, read back from Redis, may lie outside the span
/// the command was in flight (Redis rounds to the µs, the reply to the ms
/// of `PEXPIREAT`).
const BLOCK_SLACK: Duration = Duration::from_millis(3);
/// How long a command may take to fail while every connection is refused.
const AT_ONCE: Duration = Duration::from_millis(50);

/// An operator command, with the state its test key starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Penalty,
    Reward,
    Peek,
    Reset,
    Block,
}

impl Op {
    const ALL: [Self; 5] = [
        Self::Penalty,
        Self::Reward,
        Self::Peek,
        Self::Reset,
        Self::Block,
    ];

    fn command(self) -> Command {
        match self {
            Self::Penalty => Command::Penalty(3),
            Self::Reward => Command::Reward(2),
            Self::Peek => Command::Peek,
            Self::Reset => Command::Reset,
            Self::Block => Command::Block(BLOCK),
        }
    }

    /// The command's name among the script's arguments (`ARGV[1]` of
    /// `command.lua`). Other arguments contain it too (a block's Redis key,
    /// `{prefix}:block:{key}`), so faults match it exactly.
    fn name(self) -> &'static str {
        match self {
            Self::Penalty => "penalty",
            Self::Reward => "reward",
            Self::Peek => "peek",
            Self::Reset => "reset",
            Self::Block => "block",
        }
    }

    /// Units the key has used before the command (set by the other store):
    /// a reward needs something to give back, the others something to keep
    /// or forget. A reset's key is blocked too.
    fn used_before(self) -> u64 {
        match self {
            Self::Penalty => 0,
            Self::Reward => 6,
            Self::Peek | Self::Reset | Self::Block => 3,
        }
    }

    /// Units used after the command ran once (after a block: once it ended).
    fn used_after(self) -> u64 {
        match self {
            Self::Penalty => 3,
            Self::Reward => 4,
            Self::Peek | Self::Block => 3,
            Self::Reset => 0,
        }
    }

    /// Whether the store may send it again after a lost reply.
    fn idempotent(self) -> bool {
        matches!(self, Self::Peek | Self::Reset | Self::Block)
    }
}

/// The ways a command's reply is lost here: all after Redis ran it.
const LOSSES: [Loss; 4] = [Loss::DropClose, Loss::DropHang, Loss::Cut, Loss::Stalled];

/// A command's outcome, for messages.
fn show(outcome: &Result<Decision, StoreError>) -> String {
    match outcome {
        Ok(d) if d.allowed() => format!("Ok(admit, {} remaining)", d.remaining()),
        Ok(d) => format!("Ok(deny, retry after {:?})", d.retry_after()),
        Err(e) => format!("Err({e})"),
    }
}

/// A peek's state, for messages: the units the key has used, or its denial.
fn state(d: &Decision) -> String {
    if d.allowed() {
        format!("{} used", MAX - 1 - d.remaining())
    } else {
        format!("denied, retry after {:?}", d.retry_after())
    }
}

/// Whether `d` is the state of a key that used `used` units, not blocked:
/// a request of cost 1 admitted, `MAX - used - 1` left after it.
fn holds(d: &Decision, used: u64) -> bool {
    d.allowed() && d.remaining() == MAX - used - 1
}

/// Bring `key` to `op`'s starting state through store `b`.
async fn prepare(b: &RedisStore, key: &str, policy: &Policy, op: Op) {
    let used = op.used_before();
    if used > 0 {
        b.command(key, policy, Command::Penalty(used))
            .await
            .unwrap();
    }
    if op == Op::Reset {
        b.command(key, policy, Command::Block(WINDOW))
            .await
            .unwrap();
    }
    let start = b.command(key, policy, Command::Peek).await.unwrap();
    assert!(
        op == Op::Reset || holds(&start, used),
        "{op:?}: the key does not start at {used} used: {start:?}"
    );
}

/// Peek `key` through the unfaulted store `b`, and when it was sent. A
/// peek changes nothing: one that times out only because the machine is
/// loaded (every test of the suite shares its two cores) is sent again,
/// up to three times.
async fn peek_timed(
    b: &RedisStore,
    key: &str,
    policy: &Policy,
) -> Result<(Instant, Decision), String> {
    let mut failure = String::new();
    for _ in 0..3 {
        let sent = Instant::now();
        match b.command(key, policy, Command::Peek).await {
            Ok(decision) => return Ok((sent, decision)),
            Err(e) => failure = format!("the other store's peek failed, 3 times: {e}"),
        }
    }
    Err(failure)
}

/// [`peek_timed`], the decision alone.
async fn peek(b: &RedisStore, key: &str, policy: &Policy) -> Result<Decision, String> {
    Ok(peek_timed(b, key, policy).await?.1)
}

/// Where the scenarios of one algorithm start: the fixed and sliding
/// windows' counts stay in one window for the whole run.
async fn begin(algo: Algo) -> Policy {
    away_from_a_boundary(WINDOW, Duration::from_secs(120)).await;
    algo.policy(MAX, WINDOW)
}

// ---------------------------------------------------------------------------
// 1 and 2: lost replies.

/// For each way of losing a reply, store A runs `op` on a fresh key (put in
/// `op`'s starting state by store B) and loses the reply; then B peeks.
async fn lost_reply(
    rig: &Rig,
    algo: Algo,
    policy: &Policy,
    op: Op,
    loss: Loss,
) -> Result<(), String> {
    let (a, b) = (rig.store(0), rig.store(1));
    let key = format!("{op:?}-{loss:?}");
    prepare(b, &key, policy, op).await;
    let redis_key = a.redis_key(algo.tag(), &key);
    let proxy = rig.proxy(0, &redis_key);
    loss.arm(
        proxy,
        Match::command("EVALSHA").arg(&redis_key).arg_is(op.name()),
        TIMEOUT,
    );
    let sent = Instant::now();
    let outcome = a.command(&key, policy, op.command()).await;
    let returned = Instant::now();
    let mut case = format!("A's {:?}: {}", op.command(), show(&outcome));
    if proxy.armed() != 0 {
        return Err(format!("{case}: the fault never fired"));
    }
    if op.idempotent() && loss.fails_the_connection() && outcome.is_err() {
        return Err(format!(
            "{case}: not sent again after its connection failed (the store resends peeks, \
             resets and blocks)"
        ));
    }
    let used = op.used_after();
    if op == Op::Block {
        let (before, seen) = peek_timed(b, &key, policy).await?;
        let after = Instant::now();
        case.push_str(&format!("; B's peek: {}", state(&seen)));
        if seen.allowed() {
            return Err(format!("{case}: the block is not in force"));
        }
        // Redis ran the block (once or, resent, twice) while A's call was
        // in flight: it ends between BLOCK after A sent it and BLOCK after
        // A heard back.
        let left = seen.retry_after();
        let earliest = sent + BLOCK;
        let latest = returned + BLOCK;
        if after + left + BLOCK_SLACK < earliest || before + left > latest + BLOCK_SLACK {
            return Err(format!(
                "{case}: the block ends {:?} after A sent it (in flight {:?}), not {BLOCK:?}",
                (before + left).saturating_duration_since(sent),
                returned - sent
            ));
        }
        tokio::time::sleep_until((after + left + Duration::from_millis(150)).into()).await;
    }
    let seen = peek(b, &key, policy).await?;
    if !holds(&seen, used) {
        return Err(format!(
            "{case}; then B's peek: {}, expected {used} used{}",
            state(&seen),
            match op {
                Op::Penalty | Op::Reward =>
                    format!(" (applied once; twice: {})", 2 * used - op.used_before()),
                Op::Reset => " and no block".to_owned(),
                Op::Block => ", the block over and the counts kept".to_owned(),
                Op::Peek => ", as before".to_owned(),
            }
        ));
    }
    // A's own answer, if any, is the state the command left.
    if let Ok(d) = &outcome {
        let right = if op == Op::Block {
            !d.allowed() && d.retry_after() <= BLOCK
        } else {
            holds(d, used)
        };
        if !right {
            return Err(format!(
                "{case}: not the state the command leaves ({used} used{})",
                if op == Op::Block { ", blocked" } else { "" }
            ));
        }
    }
    Ok(())
}

/// [`lost_reply`] of each of `ops` and each way of losing a reply, on a
/// rig of two stores.
async fn lost_replies(rig: Rig, algo: Algo, ops: &[Op]) {
    let policy = begin(algo).await;
    let mut failures = Vec::new();
    for &op in ops {
        for loss in LOSSES {
            rig.reset().await;
            if let Err(failure) = lost_reply(&rig, algo, &policy, op, loss).await {
                failures.push(format!("{op:?}, {loss:?}: {failure}"));
            }
        }
    }
    assert!(failures.is_empty(), "\n  {}", failures.join("\n  "));
}

async fn lost_penalty_or_reward(rig: Rig, algo: Algo) {
    lost_replies(rig, algo, &[Op::Penalty, Op::Reward]).await;
}

async fn lost_peek_reset_or_block(rig: Rig, algo: Algo) {
    lost_replies(rig, algo, &[Op::Peek, Op::Reset, Op::Block]).await;
}

// ---------------------------------------------------------------------------
// 3: refused connections.

/// Every proxy refuses connections (and cuts the open ones) while store A
/// runs each command on a key B prepared: an error within [`AT_ONCE`] (on
/// the sources that learn of a refusal at once), and once connections are
/// accepted again, B's peek shows the key as it was.
async fn refused(rig: Rig, algo: Algo) {
    let policy = begin(algo).await;
    let (a, b) = (rig.store(0), rig.store(1));
    let mut failures = Vec::new();
    for op in Op::ALL {
        rig.reset().await;
        let key = format!("refused-{op:?}");
        prepare(b, &key, &policy, op).await;
        // The proxies' calls block until their sockets are closed (or bound
        // again): off the runtime's workers, so that the other algorithms'
        // rigs, timing their own commands on the same two workers, are not
        // held up behind them.
        tokio::task::block_in_place(|| {
            for proxy in rig.all_proxies() {
                proxy.refuse();
            }
        });
        let started = Instant::now();
        let outcome = a.command(&key, &policy, op.command()).await;
        let took = started.elapsed();
        tokio::task::block_in_place(|| {
            for proxy in rig.all_proxies() {
                proxy.accept();
            }
        });
        let case = format!(
            "{op:?}: A's {:?} {} after {took:?}",
            op.command(),
            show(&outcome)
        );
        if outcome.is_ok() {
            failures.push(format!("{case}: answered through a closed port"));
            continue;
        }
        if took > AT_ONCE {
            failures.push(format!(
                "{case}: not at once (< {AT_ONCE:?}; store timeout {TIMEOUT:?})"
            ));
        }
        rig.reset().await;
        let seen = match peek(b, &key, &policy).await {
            Ok(seen) => seen,
            Err(failure) => {
                failures.push(format!("{case}; {failure}"));
                continue;
            }
        };
        // A reset's key keeps its block; every other key its counts.
        let unchanged = if op == Op::Reset {
            !seen.allowed() && seen.retry_after() > WINDOW - Duration::from_secs(60)
        } else {
            holds(&seen, op.used_before())
        };
        if !unchanged {
            failures.push(format!(
                "{case}; then B's peek: {}: the refused command was applied",
                state(&seen)
            ));
        }
    }
    assert!(failures.is_empty(), "\n  {}", failures.join("\n  "));
}

// ---------------------------------------------------------------------------
// The matrix.

/// For each `$test = $scenario`, a module `$test` running `$scenario` for
/// every algorithm (each on a rig of two stores), with one test per source.
macro_rules! on_sources {
    ([$($test:ident = $scenario:path),+ $(,)?] $sources:tt) => {
        $(on_sources!(@one $test = $scenario; $sources);)+
    };
    (@one $test:ident = $scenario:path;
        { $($(#[$attr:meta])* $name:ident: $source:expr),+ $(,)? }) => {
        mod $test {
            use super::*;

            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    each_algorithm($source, 2, TIMEOUT, $scenario).await;
                }
            )+
        }
    };
}

on_sources! {
    [
        a_lost_penalty_or_reward_counts_once = crate::command_faults::lost_penalty_or_reward,
        a_lost_peek_reset_or_block_holds_exactly = crate::command_faults::lost_peek_reset_or_block,
    ]
    {
        pool: Connections::Pool,
        bb8: Connections::Bb8,
        manager: Connections::Manager,
        manager_no_retries: Connections::ManagerNoRetries,
        #[cfg(feature = "cluster")]
        cluster: Connections::Cluster,
        #[cfg(feature = "cluster")]
        cluster_no_retries: Connections::ClusterNoRetries,
    }
}

// The sources that learn of a refusal at once: not a ConnectionManager with
// redis-rs's default retries, which waits for them (as its rustdoc says).
on_sources! {
    [a_refused_command_fails_at_once_and_applies_nothing = crate::command_faults::refused]
    {
        pool: Connections::Pool,
        bb8: Connections::Bb8,
        manager_no_retries: Connections::ManagerNoRetries,
        #[cfg(feature = "cluster")]
        cluster: Connections::Cluster,
    }
}
