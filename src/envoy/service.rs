//! [`RateLimitService`]: `envoy.service.ratelimit.v3.RateLimitService`
//! answered by a rule set's descriptor rules.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
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

use super::decide::{Outcome, Outcomes, decide};
use super::plan::{DescriptorPlan, Refusal};
use super::unit;
use crate::decision::Decision;
use crate::http::{
    HeaderStyle, Rendering, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
use crate::limiter::Limiter;
use crate::rules::{self, Rules};

/// The most descriptors one request may carry (Envoy sends one per rate
/// limit action of a route, a handful).
pub const MAX_DESCRIPTORS: usize = 64;
/// The most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 16;
/// The largest request message, in bytes: descriptors far past any
/// route's are refused before they are decoded.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// Limits a descriptor sets itself (`limit` in Envoy's descriptor) count
/// under this name, by the domain and each entry's key and value.
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
/// rule `replaces` others matched by the same request (by the name its
/// status reports). A descriptor's own `limit` is a fixed window of its
/// own, in a domain the rules know. Each status says the rule's rate
/// that decided and its name, the units left and the time to its reset, and the
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

    /// The limiter of a descriptor's own `limit` of `requests` (at least
    /// one) per `unit`.
    fn override_limiter(&self, requests: u32, unit: Unit) -> Result<Limiter, String> {
        let mut overrides = self
            .overrides
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(limiter) = overrides.get(&(unit as i32, requests)) {
            return Ok(limiter.clone());
        }
        let limiter = self
            .rules
            .limiter_for(OVERRIDE_NAME, unit::policy(requests, unit)?);
        if overrides.len() >= MAX_OVERRIDES {
            overrides.clear();
        }
        overrides.insert((unit as i32, requests), limiter.clone());
        Ok(limiter)
    }

    /// The plan of a descriptor carrying its own `limit`, in a domain the
    /// rules know.
    fn own_plan<'a>(
        &self,
        domain: &str,
        descriptor: &RateLimitDescriptor,
        cost: u64,
        limit: &RateLimitOverride,
    ) -> Result<DescriptorPlan<'a>, tonic::Status> {
        let refuse = |e: String| tonic::Status::invalid_argument(format!("descriptor limit: {e}"));
        let unit = Unit::try_from(limit.unit)
            .map_err(|_| refuse(format!("unknown unit {}", limit.unit)))?;
        if limit.requests_per_unit == 0 {
            let rate = rules::rate_of_unit(unit.as_str_name()).ok_or_else(|| {
                refuse(format!("unit {} is not a unit of time", unit.as_str_name()))
            })?;
            return Ok(DescriptorPlan::own_refusal(descriptor, rate));
        }
        let limiter = self
            .override_limiter(limit.requests_per_unit, unit)
            .map_err(refuse)?;
        Ok(DescriptorPlan::own_limit(domain, descriptor, cost, limiter))
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
            let plan = match &descriptor.limit {
                // The reference server looks the domain up first: a
                // descriptor's own limit in a domain it does not know
                // is no limit.
                Some(_) if !active.knows_domain(&request.domain) => DescriptorPlan::new(descriptor),
                Some(limit) => self.own_plan(&request.domain, descriptor, cost, limit)?,
                None => DescriptorPlan::of_rules(
                    &active,
                    &request.domain,
                    descriptor,
                    cost,
                    &mut replaced,
                ),
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
            let decided = decided(outcomes.of(i));
            statuses.push(descriptor_status(plan, decided));
            if let Some(outcome) = decided
                && outcome.decision.is_some()
                && shown.is_none_or(|s| outcome.rank() > s.rank())
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
/// check, else the one with the fewest units left.
fn decided<'o>(mine: impl Iterator<Item = &'o Outcome>) -> Option<&'o Outcome> {
    mine.max_by_key(|o| o.rank())
}

/// The status of the descriptor of `plan`, decided by `decided`.
fn descriptor_status(plan: &DescriptorPlan<'_>, decided: Option<&Outcome>) -> DescriptorStatus {
    let refusal = plan
        .refused
        .iter()
        .find(|r| !r.shadow)
        .or(plan.refused.first());
    match (decided, refusal) {
        (Some(outcome), Some(refusal)) if !outcome.denies && !refusal.shadow => refused(refusal),
        (None, Some(refusal)) => refused(refusal),
        (Some(outcome), _) => status_of(outcome),
        (None, None) if plan.unlimited => DescriptorStatus {
            code: Code::Ok as i32,
            limit_remaining: u32::MAX,
            ..DescriptorStatus::default()
        },
        (None, None) => DescriptorStatus {
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
    let retry_after = (over && !decision.allowed())
        .then(|| (decision.retry_after().as_secs_f64().ceil() as u64).max(1));
    if style == HeaderStyle::XRateLimit {
        return x_ratelimit_fields(decision, retry_after);
    }
    let rendering = Rendering {
        headers: style,
        ..Rendering::default()
    };
    let mut headers = HeaderMap::new();
    rendering.set_headers(&mut headers, &outcome.limiter, decision, outcome.decided_by);
    if let Some(seconds) = retry_after {
        headers.insert(http::header::RETRY_AFTER, seconds.into());
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

/// The `X-RateLimit-*` fields of `decision` (and `Retry-After`), as
/// [`Rendering`] writes them in that style, written straight into the
/// message: the default style, on every call, where a `HeaderMap` and the
/// copies out of it were most of the work of an answer. A test holds the
/// two to the same fields.
fn x_ratelimit_fields(decision: &Decision, retry_after: Option<u64>) -> Vec<HeaderValue> {
    let reset = decision.reset();
    // Whole seconds, rounded up.
    let reset = reset.as_secs() + u64::from(reset.subsec_nanos() > 0);
    let field = |name: &http::HeaderName, n: u64| HeaderValue {
        key: name.as_str().to_owned(),
        value: itoa::Buffer::new().format(n).to_owned(),
        ..HeaderValue::default()
    };
    let mut fields = Vec::with_capacity(4);
    fields.push(field(&X_RATELIMIT_LIMIT, decision.limit()));
    fields.push(field(&X_RATELIMIT_REMAINING, decision.remaining()));
    fields.push(field(&X_RATELIMIT_RESET, reset));
    if let Some(seconds) = retry_after {
        fields.push(field(&http::header::RETRY_AFTER, seconds));
    }
    fields
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
        // A descriptor of no entries matches nothing, as in the reference.
        if descriptor.entries.len() > MAX_ENTRIES {
            return refuse(format!(
                "a descriptor of {} entries: at most {MAX_ENTRIES}",
                descriptor.entries.len()
            ));
        }
    }
    Ok(())
}

/// The status of a descriptor a limit of 0 refuses: its name, the unit
/// and reset of its rate, nothing left (`OK` for a shadow's). A usage the
/// catalog cannot price reports its rule's rate, and no reset: waiting
/// cures nothing.
fn refused(refusal: &Refusal) -> DescriptorStatus {
    let max = match refusal.rate {
        Some(rate) if refusal.unpriced => u32::try_from(rate.max()).unwrap_or(u32::MAX),
        _ => 0,
    };
    DescriptorStatus {
        code: if refusal.shadow {
            Code::Ok
        } else {
            Code::OverLimit
        } as i32,
        current_limit: Some(RateLimit {
            name: refusal.name.as_deref().unwrap_or_default().to_owned(),
            requests_per_unit: max,
            unit: refusal.rate.as_ref().map_or(Unit::Unknown, unit::of_rate) as i32,
        }),
        limit_remaining: 0,
        duration_until_reset: refusal
            .rate
            .as_ref()
            .filter(|_| !refusal.unpriced)
            .map(|rate| proto_duration(unit::reset(rate))),
        ..DescriptorStatus::default()
    }
}

/// A descriptor's status from the outcome that decided it.
fn status_of(outcome: &Outcome) -> DescriptorStatus {
    let code = if outcome.denies {
        Code::OverLimit
    } else {
        Code::Ok
    } as i32;
    // Refused with the store's state unknown: the policy's rate. Admitted
    // uncounted (the store failed, failing open): no limit.
    let rate = match &outcome.decision {
        Some(decision) => Some(decision.rate()),
        None if outcome.denies => outcome.limiter.policy().rates().first().copied(),
        None => None,
    };
    let Some(rate) = rate else {
        return DescriptorStatus {
            code,
            ..DescriptorStatus::default()
        };
    };
    DescriptorStatus {
        code,
        current_limit: Some(RateLimit {
            name: outcome.name.as_deref().unwrap_or_default().to_owned(),
            requests_per_unit: u32::try_from(rate.max()).unwrap_or(u32::MAX),
            unit: unit::of_rate(&rate) as i32,
        }),
        limit_remaining: u32::try_from(outcome.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(proto_duration(
            outcome
                .decision
                .as_ref()
                .map_or_else(|| unit::reset(&rate), Decision::reset),
        )),
        ..DescriptorStatus::default()
    }
}

fn proto_duration(d: std::time::Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use crate::limiter::DecidedBy;

    /// The `X-RateLimit-*` fields written straight into the message are
    /// those `Rendering` writes in that style, admitted and denied, with
    /// and without `Retry-After`, for every algorithm's resets.
    #[tokio::test]
    async fn x_ratelimit_fields_are_those_the_rendering_writes() {
        for policy in ["3/s", "2/1500ms", "5/1h", "1/7s"] {
            for algorithm in ["sliding-log", "fixed-window", "sliding-window", "gcra"] {
                let policy = policy
                    .parse::<crate::Policy>()
                    .unwrap()
                    .with_algorithm(algorithm.parse().unwrap())
                    .unwrap();
                let limiter = Limiter::new(MemoryStore::new(), policy);
                for _ in 0..4 {
                    let verdict = limiter.check("k").await.unwrap();
                    let (Some(decision), ..) = verdict.into_parts() else {
                        panic!("no decision");
                    };
                    for over in [false, true] {
                        let retry_after = (over && !decision.allowed())
                            .then(|| (decision.retry_after().as_secs_f64().ceil() as u64).max(1));
                        let rendering = Rendering {
                            headers: HeaderStyle::XRateLimit,
                            ..Rendering::default()
                        };
                        let mut headers = HeaderMap::new();
                        rendering.set_headers(&mut headers, &limiter, &decision, DecidedBy::Store);
                        if let Some(seconds) = retry_after {
                            headers.insert(http::header::RETRY_AFTER, seconds.into());
                        }
                        let rendered: Vec<(String, String)> = headers
                            .iter()
                            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                            .collect();
                        let written: Vec<(String, String)> =
                            x_ratelimit_fields(&decision, retry_after)
                                .into_iter()
                                .map(|f| (f.key, f.value))
                                .collect();
                        assert_eq!(written, rendered, "{algorithm} {decision:?}");
                    }
                }
            }
        }
    }
}
