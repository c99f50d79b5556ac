//! [`RateLimitService`]: `envoy.service.ratelimit.v3.RateLimitService`
//! answered by a rule set's descriptor rules.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService as Protocol, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use http::HeaderMap;

use super::plan::{DescriptorPlan, Limit};
use super::unit;
use crate::decision::Decision;
use crate::http::{HeaderStyle, Rendering};
use crate::limiter::{DecidedBy, Limiter};
use crate::rules::{Planned, Rule, Rules, RulesCheck};

/// The most descriptors one request may carry (Envoy sends one per rate
/// limit action of a route, a handful).
pub const MAX_DESCRIPTORS: usize = 64;
/// The most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 16;
/// The largest request message, in bytes: descriptors far past any
/// route's are refused before they are decoded.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// Limits a descriptor sets itself (`limit` in Envoy's descriptor) count
/// under this name, by domain and entries.
pub const OVERRIDE_NAME: &str = "envoy-override";
/// The most distinct `limit`s of descriptors held at once.
const MAX_OVERRIDES: usize = 256;

/// Envoy's global rate limit service (`envoy.service.ratelimit.v3`),
/// answered by the descriptor rules of a rule set ([`Rules`]): the same
/// engine, stores and rules as the HTTP layers, for Envoy and every
/// gateway built on it (Istio, Envoy Gateway, Contour, Envoy AI Gateway).
///
/// Each descriptor of a request is checked against the rules its domain
/// and entries match (as Envoy's reference server walks its
/// configuration), under a key made of the entries' values, at a cost of
/// the descriptor's `hits_addend`, else the request's, else 1 (a
/// descriptor's own `hits_addend` of 0 asks without spending). Every
/// descriptor's checks are all-or-nothing: a request is `OVER_LIMIT` if
/// any rule denies it, and then counts nowhere. A `shadow` rule is counted
/// and reported but never refuses; an `unlimited` rule is never counted; a
/// rule `replaces` others matched by the same request. A descriptor's own
/// `limit` is a fixed window of its own. Each status says the rule's rate
/// that decided, the units left and the time to its reset, and the
/// response carries the rate-limit header fields for Envoy to add (by
/// default `X-RateLimit-*`, as [`RateLimitLayer`](crate::RateLimitLayer)
/// writes them; a denial adds `Retry-After`).
///
/// ```
/// use tower_redis_ratelimit::envoy::RateLimitService;
/// use tower_redis_ratelimit::rules::{RuleSet, Rules};
/// use tower_redis_ratelimit::MemoryStore;
///
/// let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml(r#"
///     [[rules]]
///     name = "per-client"
///     domain = "edge"
///     descriptor = ["remote_address"]
///     policy = "10/s, 1000/1d"
///     algorithm = "gcra"
/// "#)?);
/// let service = RateLimitService::new(rules);
/// // tonic::transport::Server::builder().add_service(service.into_server())
/// # let _ = service.into_server();
/// # Ok::<(), tower_redis_ratelimit::rules::RulesError>(())
/// ```
#[derive(Clone)]
pub struct RateLimitService {
    rules: Rules,
    headers: Option<HeaderStyle>,
    overrides: Arc<Mutex<HashMap<(i32, u32), Limiter>>>,
}

impl fmt::Debug for RateLimitService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("rules", &self.rules)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl RateLimitService {
    /// Answer from `rules` (replaced at runtime as they are).
    pub fn new(rules: Rules) -> Self {
        Self {
            rules,
            headers: Some(HeaderStyle::default()),
            overrides: Arc::default(),
        }
    }

    /// Which rate-limit fields the responses ask Envoy to add (default
    /// `X-RateLimit-*`).
    #[must_use]
    pub fn with_headers(mut self, style: HeaderStyle) -> Self {
        self.headers = Some(style);
        self
    }

    /// No rate-limit fields in the responses (as the reference server by
    /// default; Envoy's `enable_x_ratelimit_headers` can write its own
    /// from the statuses).
    #[must_use]
    pub fn without_headers(mut self) -> Self {
        self.headers = None;
        self
    }

    /// The rules answering.
    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    /// The tonic service to add to a server, refusing messages over
    /// [`MAX_MESSAGE`] bytes.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self).max_decoding_message_size(MAX_MESSAGE)
    }

    /// The limiter of a descriptor's own `limit`.
    fn override_limiter(&self, requests: u32, unit_code: i32) -> Result<Limiter, String> {
        let mut overrides = self
            .overrides
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(limiter) = overrides.get(&(unit_code, requests)) {
            return Ok(limiter.clone());
        }
        let unit = Unit::try_from(unit_code).map_err(|_| format!("unknown unit {unit_code}"))?;
        let limiter = self
            .rules
            .limiter_for(OVERRIDE_NAME, unit::policy(requests, unit)?);
        if overrides.len() >= MAX_OVERRIDES {
            overrides.clear();
        }
        overrides.insert((unit_code, requests), limiter.clone());
        Ok(limiter)
    }

    /// The answer to `request`.
    async fn answer(&self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        check_shape(&request)?;
        let active = self.rules.current();
        let request_cost = match request.hits_addend {
            0 => 1,
            n => u64::from(n),
        };
        // What each descriptor is checked against.
        let mut plans: Vec<DescriptorPlan> = Vec::with_capacity(request.descriptors.len());
        let mut replaced: HashSet<&str> = HashSet::new();
        for descriptor in &request.descriptors {
            let cost = descriptor
                .hits_addend
                .as_ref()
                .map_or(request_cost, |hits| hits.value);
            let plan = if let Some(limit) = &descriptor.limit {
                let limiter = self
                    .override_limiter(limit.requests_per_unit, limit.unit)
                    .map_err(|e| {
                        tonic::Status::invalid_argument(format!("descriptor limit: {e}"))
                    })?;
                DescriptorPlan::own_limit(&request.domain, descriptor, cost, limiter)
            } else {
                DescriptorPlan::of_rules(&active, &request.domain, descriptor, cost, &mut replaced)
            };
            plans.push(plan);
        }
        for plan in &mut plans {
            plan.drop_replaced(&replaced);
        }
        let outcomes = decide(&plans).await?;
        Ok(self.respond(&plans, &outcomes))
    }

    /// The response: each descriptor's status, the overall code, and the
    /// header fields of the status that decided.
    fn respond(&self, plans: &[DescriptorPlan<'_>], outcomes: &Outcomes) -> RateLimitResponse {
        let mut statuses = Vec::with_capacity(plans.len());
        let mut shown: Option<&Outcome> = None;
        for (i, plan) in plans.iter().enumerate() {
            let decided = decided(&outcomes.of(i));
            statuses.push(descriptor_status(plan, decided));
            if let Some(outcome) = decided
                && outcome.decision.is_some()
                && shown.is_none_or(|s| outcome.shows_before(s))
            {
                shown = Some(outcome);
            }
        }
        let over = outcomes.denied;
        let mut response = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..RateLimitResponse::default()
        };
        if let (Some(style), Some(outcome)) = (self.headers, shown) {
            response.response_headers_to_add = header_fields(style, outcome, over);
        }
        response
    }
}

/// The outcome deciding a descriptor of outcomes `mine`: the denying
/// check waiting longest, else the one with the fewest units left.
fn decided<'o>(mine: &[&'o Outcome]) -> Option<&'o Outcome> {
    mine.iter().copied().max_by_key(|o| {
        let denied = o.denies();
        let remaining = o.decision.as_ref().map_or(u64::MAX, Decision::remaining);
        (denied, std::cmp::Reverse(remaining))
    })
}

/// The status of the descriptor of `plan`, decided by `decided`.
fn descriptor_status(plan: &DescriptorPlan<'_>, decided: Option<&Outcome>) -> DescriptorStatus {
    match decided {
        Some(outcome) if !outcome.denies() && !plan.refused.is_empty() => refused(),
        None if !plan.refused.is_empty() => refused(),
        Some(outcome) => status_of(outcome),
        None if plan.unlimited => DescriptorStatus {
            code: Code::Ok as i32,
            limit_remaining: u32::MAX,
            ..DescriptorStatus::default()
        },
        None => DescriptorStatus {
            code: Code::Ok as i32,
            ..DescriptorStatus::default()
        },
    }
}

/// The header fields in `style` for Envoy to add, of the outcome shown
/// (with `Retry-After` when the request is `over` and it denied); none
/// when it holds no decision.
fn header_fields(style: HeaderStyle, outcome: &Outcome, over: bool) -> Vec<HeaderValue> {
    let Some(decision) = &outcome.decision else {
        return Vec::new();
    };
    let rendering = Rendering {
        headers: style,
        ..Rendering::default()
    };
    let mut headers = HeaderMap::new();
    rendering.set_headers(&mut headers, &outcome.limiter, decision, outcome.decided_by);
    if over && !decision.allowed() {
        let seconds = decision.retry_after().as_secs_f64().ceil() as u64;
        headers.insert(http::header::RETRY_AFTER, seconds.max(1).into());
    }
    headers
        .iter()
        .filter_map(|(name, value)| {
            Some(HeaderValue {
                key: name.as_str().to_owned(),
                value: value.to_str().ok()?.to_owned(),
                ..HeaderValue::default()
            })
        })
        .collect()
}

#[tonic::async_trait]
impl Protocol for RateLimitService {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.answer(request.into_inner())
            .await
            .map(tonic::Response::new)
    }
}

/// A request Envoy would never send is refused, naming what is wrong.
fn check_shape(request: &RateLimitRequest) -> Result<(), tonic::Status> {
    let refuse = |what: String| Err(tonic::Status::invalid_argument(what));
    if request.domain.is_empty() {
        return refuse("rate limit domain must not be empty".to_owned());
    }
    if request.descriptors.is_empty() {
        return refuse("rate limit descriptor list must not be empty".to_owned());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return refuse(format!(
            "{} descriptors: at most {MAX_DESCRIPTORS} in one request",
            request.descriptors.len()
        ));
    }
    for descriptor in &request.descriptors {
        if descriptor.entries.is_empty() || descriptor.entries.len() > MAX_ENTRIES {
            return refuse(format!(
                "a descriptor of {} entries: from 1 to {MAX_ENTRIES}",
                descriptor.entries.len()
            ));
        }
    }
    Ok(())
}

/// One check's outcome.
struct Outcome {
    descriptor: usize,
    limiter: Limiter,
    decision: Option<Decision>,
    decided_by: DecidedBy,
    shadow: bool,
    /// A peek (a cost of 0): its decision says what a check of the
    /// policy's cost would leave, and the status the units left now.
    peek: bool,
    /// Refused whatever the count (a cost no window can hold).
    refused: bool,
}

impl Outcome {
    fn denies(&self) -> bool {
        self.refused || !self.shadow && self.decision.as_ref().is_some_and(|d| !d.allowed())
    }

    /// Whether this outcome's fields are shown rather than `other`'s: a
    /// denial before an admission, then the fewest units left.
    fn shows_before(&self, other: &Outcome) -> bool {
        let remaining = |o: &Outcome| o.decision.as_ref().map_or(u64::MAX, Decision::remaining);
        (self.denies(), std::cmp::Reverse(remaining(self)))
            > (other.denies(), std::cmp::Reverse(remaining(other)))
    }
}

struct Outcomes {
    all: Vec<Outcome>,
    /// Whether the request is refused.
    denied: bool,
}

impl Outcomes {
    fn of(&self, descriptor: usize) -> Vec<&Outcome> {
        self.all
            .iter()
            .filter(|o| o.descriptor == descriptor)
            .collect()
    }
}

/// Check every descriptor: the enforced limits all-or-nothing, a cost of
/// 0 as a peek, a cost no rate can ever admit denied without counting,
/// shadow limits each on its own.
async fn decide(plans: &[DescriptorPlan<'_>]) -> Result<Outcomes, tonic::Status> {
    let mut all = Vec::new();
    let mut planned = Vec::new();
    let mut planned_at = Vec::new();
    let mut side = Vec::new();
    let mut too_costly = false;
    for (i, plan) in plans.iter().enumerate() {
        for limit in &plan.limits {
            let policy = limit.limiter.policy();
            if plan.negative || plan.cost == 0 || limit.shadow || limit.charge {
                side.push((i, limit));
            } else if plan.cost > policy.max_cost() {
                // More than a whole window holds: never admitted.
                too_costly |= !limit.shadow;
                all.push(Outcome {
                    descriptor: i,
                    limiter: limit.limiter.clone(),
                    decision: limit.limiter.peek(&limit.key).await.ok(),
                    decided_by: DecidedBy::Store,
                    shadow: false,
                    peek: true,
                    refused: true,
                });
            } else {
                let name = limit.rule.map_or(OVERRIDE_NAME, Rule::name);
                planned_at.push((i, name, limit.key.clone()));
                planned.push(match limit.rule {
                    Some(rule) => {
                        Planned::new(rule, limit.limiter.clone(), limit.key.clone(), plan.cost)
                    }
                    None => Planned::anonymous(limit.limiter.clone(), limit.key.clone(), plan.cost),
                });
            }
        }
    }
    let mut denied = too_costly || plans.iter().any(|plan| !plan.refused.is_empty());
    // A request refused already counts nowhere.
    if !denied && !planned.is_empty() {
        denied |= enforced(planned, &planned_at, &mut all).await?;
    }
    for (i, limit) in side {
        let Some(outcome) = on_the_side(&plans[i], limit, i).await else {
            continue;
        };
        // A peek over its limit refuses; a shadow never does.
        denied |= outcome.peek && outcome.denies();
        all.push(outcome);
    }
    Ok(Outcomes { all, denied })
}

/// The enforced limits `planned` (of the descriptors and rules
/// `planned_at`), checked all-or-nothing: their outcomes into `all`, and
/// whether they deny.
async fn enforced(
    planned: Vec<Planned>,
    planned_at: &[(usize, &str, String)],
    all: &mut Vec<Outcome>,
) -> Result<bool, tonic::Status> {
    let admission = RulesCheck::run(planned, Vec::new())
        .await
        .map_err(|error| tonic::Status::unavailable(format!("rate limit store: {error}")))?;
    for (rule, key, decision, decided_by, limiter) in admission.checked() {
        let Some(&(i, _, _)) = planned_at
            .iter()
            .find(|(_, name, k)| *name == rule && k == key)
        else {
            continue;
        };
        all.push(Outcome {
            descriptor: i,
            limiter: limiter.clone(),
            decision: decision.cloned(),
            decided_by,
            shadow: false,
            peek: false,
            refused: false,
        });
    }
    Ok(!admission.allowed())
}

/// A limit of descriptor `i` checked on its own: a give-back, a charge, a
/// peek (a cost of 0) or a shadow's check. `None` when the store failed
/// (logged: reported as admitted).
async fn on_the_side(plan: &DescriptorPlan<'_>, limit: &Limit<'_>, i: usize) -> Option<Outcome> {
    let limiter = &limit.limiter;
    let decided: Result<Option<Decision>, String> = if plan.negative {
        limiter
            .reward(&limit.key, plan.cost)
            .await
            .map(Some)
            .map_err(|e| e.to_string())
    } else if limit.charge {
        limiter
            .penalty(&limit.key, plan.cost)
            .await
            .map(Some)
            .map_err(|e| e.to_string())
    } else if plan.cost == 0 {
        limiter
            .peek(&limit.key)
            .await
            .map(Some)
            .map_err(|e| e.to_string())
    } else {
        limiter
            .check_n(&limit.key, plan.cost)
            .await
            .map(|verdict| verdict.into_parts().0)
            .map_err(|e| e.to_string())
    };
    let decision = match decided {
        Ok(decision) => decision,
        Err(error) => {
            tracing::warn!(%error, "envoy: a shadow check, a peek or a give-back failed; reported as admitted");
            return None;
        }
    };
    if limit.shadow && decision.as_ref().is_some_and(|d| !d.allowed()) {
        tracing::info!(
            rule = limit.rule.map_or(OVERRIDE_NAME, Rule::name),
            "envoy: a shadow rule would deny; not refused"
        );
    }
    Some(Outcome {
        descriptor: i,
        limiter: limit.limiter.clone(),
        decision,
        decided_by: DecidedBy::Store,
        // A charge never refuses: it is reported as a shadow's is.
        shadow: limit.shadow || limit.charge,
        peek: plan.cost == 0 && !plan.negative && !limit.charge,
        refused: false,
    })
}

/// The status of a descriptor a rule refuses whatever its count (the
/// reference server's `requests_per_unit: 0`).
fn refused() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::OverLimit as i32,
        current_limit: Some(RateLimit {
            requests_per_unit: 0,
            ..RateLimit::default()
        }),
        ..DescriptorStatus::default()
    }
}

/// A descriptor's status from the outcome that decided it.
fn status_of(outcome: &Outcome) -> DescriptorStatus {
    let Some(decision) = &outcome.decision else {
        // Admitted uncounted (the store failed, failing open).
        return DescriptorStatus {
            code: Code::Ok as i32,
            ..DescriptorStatus::default()
        };
    };
    let rate = decision.rate();
    let mut remaining = decision.remaining();
    if outcome.peek && decision.allowed() {
        remaining += outcome.limiter.policy().cost();
    }
    DescriptorStatus {
        code: if outcome.denies() {
            Code::OverLimit
        } else {
            Code::Ok
        } as i32,
        current_limit: Some(RateLimit {
            name: outcome.limiter.name().to_owned(),
            requests_per_unit: u32::try_from(rate.max()).unwrap_or(u32::MAX),
            unit: unit::of_rate(&rate) as i32,
        }),
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(proto_duration(decision.reset())),
        ..DescriptorStatus::default()
    }
}

fn proto_duration(d: std::time::Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}
