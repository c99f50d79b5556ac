//! The app: its routes, the limiter and the layer on them, built from the
//! settings (one policy, or rules as data).

use axum::Router;
use axum::routing::get;
use tower_redis_ratelimit::rules::RulesLayer;
use tower_redis_ratelimit::rules::{RuleSet, Rules, Watch};
use tower_redis_ratelimit::{Limiter, Policy, RateLimitLayer, Store, key};

use crate::bodies::{self, Bodies};
use crate::settings::{BadSetting, ClientKey, RulesSource, Settings};
use crate::store::rules_client;

/// What the app limits with, for the admin router. (Without the `admin`
/// feature only the watch is used: held, it keeps following the rules.)
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) enum Operated {
    /// `RATE_LIMIT=off`.
    Nothing,
    Limiter(Limiter),
    /// The rules, and the watch that follows their source (it stops when
    /// dropped).
    Rules(Rules, Watch),
}

/// The app, with its limited routes counted in `store` as the settings say.
pub(crate) fn router<St: Store>(
    store: St,
    settings: &Settings,
) -> Result<(Router, Operated), BadSetting> {
    let Some(policy) = settings.policy.clone() else {
        // `RATE_LIMIT=off`: the same routes with no layer, the baseline of
        // the benchmarks.
        return Ok((
            with_health(Router::new().route("/", get(hello))),
            Operated::Nothing,
        ));
    };
    let limiter = limiter(store, policy, settings)?;
    let operated = Operated::Limiter(limiter.clone());
    // The client's address: the peer's, or behind trusted proxies the one
    // they forwarded (never a header the client wrote itself).
    let app = match (&settings.key, &settings.client_ip) {
        (ClientKey::PeerIp, None) => routes(
            RateLimitLayer::from_limiter(limiter, key::peer_ip()),
            settings,
        ),
        (ClientKey::PeerIp, Some(client_ip)) => routes(
            RateLimitLayer::from_limiter(limiter, client_ip.clone()),
            settings,
        ),
        // A request without the header is limited by its address, so
        // leaving the header out does not get around the limit.
        (ClientKey::Header(header), None) => routes(
            RateLimitLayer::from_limiter(limiter, header.clone().or(key::peer_ip())),
            settings,
        ),
        (ClientKey::Header(header), Some(client_ip)) => routes(
            RateLimitLayer::from_limiter(limiter, header.clone().or(client_ip.clone())),
            settings,
        ),
    }?;
    Ok((app, operated))
}

/// The engine of the limited routes: `policy` in `store`, with the fail
/// mode, deny cache and local quota the settings say.
pub(crate) fn limiter<St: Store>(
    store: St,
    policy: Policy,
    settings: &Settings,
) -> Result<Limiter, BadSetting> {
    // Named: a server restarted with another RATE_LIMIT keeps counting the
    // same count (a tightened limit bites at once, and a rollout never
    // adds two quotas). Counts belong to the name, so it is no rule's
    // name in `examples/rules.toml`: a server limiting with the rules
    // would count into this limit (and this one into the rule's). The
    // admin router addresses it as `/api/limits/server/…`.
    let limiter = Limiter::new(store, policy)
        .with_name("server")
        .with_fail_mode(settings.fail_mode.clone());
    // The deny cache is on by default.
    let limiter = if settings.deny_cache {
        limiter
    } else {
        limiter.without_deny_cache()
    };
    match settings.local_quota {
        Some(quota) => limiter
            .with_local_quota(quota)
            .map_err(|error| BadSetting::new("LOCAL_QUOTA", error)),
        None => Ok(limiter),
    }
}

/// Every path limited by the rules from `source`, which are followed as
/// they change for as long as the returned watch lives, and `GET /health`.
pub(crate) async fn rules_router<St: Store>(
    store: St,
    source: &RulesSource,
    settings: &Settings,
) -> Result<(Router, Operated), BadSetting> {
    let empty = RuleSet::from_toml("").map_err(|error| BadSetting::new("RULES", error))?;
    let mut rules = Rules::new(store, empty).with_fail_mode(settings.fail_mode.clone());
    if !settings.deny_cache {
        rules = rules.without_deny_cache();
    }
    let watch = match source {
        RulesSource::File(path) => {
            let set = RuleSet::from_file(path).map_err(|error| BadSetting::new("RULES", error))?;
            rules.replace(set);
            rules.watch_file(path, std::time::Duration::from_secs(1))
        }
        RulesSource::Redis(key) => {
            let Some(url) = &settings.redis_url else {
                return Err(BadSetting::new("RULES", "`redis` needs REDIS_URL"));
            };
            let client = rules_client(url)?;
            // The pub/sub message brings a change at once; the version
            // check every second is the backstop.
            rules
                .follow_redis(client, key.clone(), std::time::Duration::from_secs(1))
                .await
                .map_err(|error| BadSetting::new("RULES", error))?
        }
    };
    let mut layer = RulesLayer::new(rules.clone()).with_headers(settings.headers);
    if let Some(client_ip) = &settings.client_ip {
        layer = layer.with_client_ip(client_ip.clone());
    }
    let limited = Router::new()
        .route("/login", axum::routing::post(login))
        // The one route that reads a body: read whole under the bounds
        // (once the request is admitted: a denied one is never read).
        .route(
            "/completions",
            axum::routing::post(completion)
                // The bounds are BODY_LIMIT's, not the extractor's 2 MiB.
                .layer(axum::extract::DefaultBodyLimit::disable())
                .layer(axum::middleware::from_fn_with_state(
                    Bodies::new(settings.bodies),
                    bodies::bounded,
                )),
        )
        .fallback(hello)
        .layer(layer);
    Ok((with_health(limited), Operated::Rules(rules, watch)))
}

/// A demonstration login: `x-password: demo` succeeds, anything else fails.
pub(crate) async fn login(headers: http::HeaderMap) -> http::StatusCode {
    if headers.get("x-password").is_some_and(|p| p == "demo") {
        http::StatusCode::OK
    } else {
        http::StatusCode::UNAUTHORIZED
    }
}

/// A demonstration upstream of a metered API: it answers the prompt back
/// and reports its words as the tokens it used, in `x-usage-tokens` (the
/// header the rules' `tokens` rule settles from).
pub(crate) async fn completion(prompt: String) -> impl axum::response::IntoResponse {
    let tokens = prompt.split_whitespace().count();
    ([("x-usage-tokens", tokens.to_string())], prompt)
}

/// `GET /`, limited by `limiter`, and `GET /health`, never limited.
pub(crate) fn routes<K>(
    limiter: RateLimitLayer<K>,
    settings: &Settings,
) -> Result<Router, BadSetting>
where
    K: key::KeyExtractor<axum::body::Body>,
{
    let limiter = limiter.with_headers(settings.headers);
    // `route_layer` limits only the routes of this router...
    Ok(with_health(
        Router::new().route("/", get(hello)).route_layer(limiter),
    ))
}

/// ...and `/health` is added beside them, outside the limit.
pub(crate) fn with_health(limited: Router) -> Router {
    Router::new().route("/health", get(health)).merge(limited)
}

pub(crate) async fn hello() -> &'static str {
    "hello"
}

pub(crate) async fn health() -> &'static str {
    "ok"
}
