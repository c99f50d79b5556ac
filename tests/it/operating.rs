//! The example server operated through its admin router, as an operator
//! on call would: two servers sharing Redis under load, steered from
//! either one's admin API, and the console page in a real browser.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_parse::{Scrape, Value as Metric};
use serde_json::{Value, json};

use crate::example_server::Server;
use crate::support::RedisServer;
use crate::support::browser::Browser;

const TOKEN: &str = "an-operators-token-0123456789abcdef";

fn rules(policy: &str) -> String {
    format!(
        "[[rules]]\nname = \"api\"\nkey = \"header:x-client\"\npolicy = \"{policy}\"\nalgorithm = \"fixed-window\"\n"
    )
}

/// One request to an admin router: the status and the body (JSON when it
/// parses).
fn call(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    // The admin server answers with a content length: the body is whole.
    let body = serde_json::from_str(body).unwrap_or(Value::String(body.to_owned()));
    (status, body)
}

fn until<T>(within: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two servers on one Redis, each with an admin router.
struct Deployment {
    _redis: RedisServer,
    servers: [Server; 2],
    admins: [String; 2],
}

impl Deployment {
    fn start(redis: RedisServer) -> Self {
        let url = redis.url();
        let vars = [
            ("REDIS_URL", url.as_str()),
            ("RULES", "redis"),
            ("ADMIN_BIND", "127.0.0.1:0"),
            ("ADMIN_TOKEN", TOKEN),
        ];
        let servers = [Server::start(&vars), Server::start(&vars)];
        let admins = [servers[0].admin_addr(), servers[1].admin_addr()];
        Self {
            _redis: redis,
            servers,
            admins,
        }
    }
}

async fn publish(redis: &RedisServer, text: &str) {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    tower_redis_ratelimit::rules::publish(&mut connection, "rl:rules", text)
        .await
        .unwrap();
}

/// Sets its flag when dropped: load threads stop even when the test fails
/// (a scope would otherwise wait for them forever).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Load on both servers until `stop`: the flooder, 20 requests a second
/// to each.
fn load<'s>(scope: &'s std::thread::Scope<'s, '_>, servers: &'s [Server; 2], stop: &'s AtomicBool) {
    scope.spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            for server in servers {
                server.status(&[("x-client", "flooder")]);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

#[test]
fn two_servers_are_operated_from_either_admin_router_under_load() {
    let redis = RedisServer::start();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            // A fixed window of an hour that the test does not cross (a
            // new window would admit the flooder again: CI once saw 12
            // admissions in one process under "10/min").
            let hour = Duration::from_secs(3_600);
            crate::support::harness::away_from_a_boundary(hour, Duration::from_secs(120)).await;
            publish(&redis, &rules("10/h")).await;
        });
    let deployment = Deployment::start(redis);
    let [one, other] = &deployment.admins;
    let servers = &deployment.servers;
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        load(scope, servers, &stop);
        let _stop = StopOnDrop(&stop);

        // The top keys show the flooding client, across both processes.
        let top = until(Duration::from_secs(10), "the flooder on top", || {
            let (status, top) = call(one, "GET", "/api/limits/api/top", None);
            assert_eq!(status, 200, "{top}");
            (top["keys"][0]["denials"].as_u64().unwrap_or(0) > 20).then_some(top)
        });
        let flooder = top["keys"][0]["key"].as_str().unwrap().to_owned();
        assert!(flooder.contains("flooder"), "{top}");

        // A block from one server's admin API denies on both.
        let calm = flooder.replace("flooder", "calm");
        let (status, blocked) = call(
            one,
            "POST",
            &format!("/api/limits/api/keys/{calm}/block"),
            Some(&json!({ "seconds": 60 })),
        );
        assert_eq!(status, 200, "{blocked}");
        for server in servers {
            assert_eq!(server.status(&[("x-client", "calm")]), 429);
        }
        // A reset from the other's admits on both (each process's deny
        // cache holds a denial at most a second).
        let (status, reset) = call(
            other,
            "POST",
            &format!("/api/limits/api/keys/{calm}/reset"),
            None,
        );
        assert_eq!(status, 200, "{reset}");
        std::thread::sleep(Duration::from_millis(1_100));
        for server in servers {
            assert_eq!(server.status(&[("x-client", "calm")]), 200);
        }

        // A rule set published through one's API reaches both.
        let (status, published) = call(
            one,
            "PUT",
            "/api/rules",
            Some(&json!({ "text": rules("3/h") })),
        );
        assert_eq!(status, 200, "{published}");
        assert_eq!(published["version"], 2);
        for admin in [one, other] {
            until(Duration::from_secs(5), "the new set on both", || {
                let (_, shown) = call(admin, "GET", "/api/rules", None);
                (shown["rules"]["rules"][0]["policy"] == "3/h" && shown["watch"]["version"] == 2)
                    .then_some(())
            });
        }

        // /metrics, parsed as Prometheus parses it: the series with
        // plausible values.
        let (status, text) = call(one, "GET", "/metrics", None);
        assert_eq!(status, 200);
        let text = text.as_str().unwrap().to_owned();
        let samples = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .unwrap()
            .samples;
        let counter = |outcome: &str, source: &str| -> f64 {
            samples
                .iter()
                .filter(|s| {
                    s.metric == "ratelimit_decisions_total"
                        && s.labels.get("rule") == Some("api")
                        && s.labels.get("outcome") == Some(outcome)
                        && s.labels.get("source") == Some(source)
                })
                .map(|s| match s.value {
                    Metric::Counter(n) => n,
                    _ => panic!("{s:?}"),
                })
                .sum()
        };
        // This process's share of 10 an hour (and calm's admission after
        // its reset); its flooder's denials mostly from the deny cache.
        let admitted = counter("admitted", "store");
        assert!((1.0..=11.0).contains(&admitted), "{text}");
        assert!(counter("denied", "store") >= 1.0, "{text}");
        assert!(counter("denied", "deny_cache") >= 10.0, "{text}");
        assert!(counter("blocked", "store") >= 1.0, "{text}");
        let breaker = samples
            .iter()
            .find(|s| {
                s.metric == "ratelimit_circuit_breaker_open" && s.labels.get("rule") == Some("api")
            })
            .expect("the breaker gauge");
        assert!(matches!(breaker.value, Metric::Gauge(v) if v == 0.0));
        let latency = samples
            .iter()
            .find(|s| {
                s.metric == "ratelimit_store_duration_seconds"
                    && s.labels.get("rule") == Some("api")
            })
            .expect("the store latency histogram");
        let Metric::Histogram(buckets) = &latency.value else {
            panic!("{latency:?}")
        };
        let observed = buckets.iter().map(|b| b.count).fold(0.0, f64::max);
        let under_a_second = buckets
            .iter()
            .find(|b| b.less_than == 1.0)
            .map_or(0.0, |b| b.count);
        assert!(
            observed >= admitted && under_a_second == observed,
            "{buckets:?}"
        );
        assert!(
            text.contains("ratelimit_rule_sets_total{result=\"loaded\"}"),
            "{text}"
        );

        // The Grafana dashboard in docs/ queries only series the server
        // exports.
        let dashboard = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/grafana-dashboard.json"),
        )
        .unwrap();
        let dashboard: Value = serde_json::from_str(&dashboard).unwrap();
        let mut queried = 0;
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"].as_str().unwrap();
                for (at, _) in expr.match_indices("ratelimit_") {
                    let name: String = expr[at..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    assert!(
                        samples
                            .iter()
                            .any(|s| s.metric == name || format!("{}_bucket", s.metric) == name),
                        "the dashboard queries {name}, which /metrics does not export"
                    );
                    queried += 1;
                }
            }
        }
        assert!(queried >= 7);
    });
}

/// The console, in headless chromium, against a server under load: it
/// shows the flooding client among the top limited keys, and its reset
/// button admits it again. The screenshot goes to `target/console.png`
/// (`scripts/screenshot` copies it into `docs/`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_the_flooder_and_its_reset_admits_it() {
    let redis = RedisServer::start();
    publish(&redis, &rules("10/h")).await;
    let deployment = Deployment::start(redis);
    let admin = deployment.admins[0].clone();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flooding = std::sync::Arc::new(AtomicBool::new(true));
    let server_addr = deployment.servers[0].addr.clone();
    let loader = {
        let (stop, flooding) = (stop.clone(), flooding.clone());
        std::thread::spawn(move || {
            let get = |client: &str| {
                let Ok(mut stream) = TcpStream::connect(&server_addr) else {
                    return;
                };
                let _ = write!(
                    stream,
                    "GET / HTTP/1.1\r\nHost: t\r\nx-client: {client}\r\nConnection: close\r\n\r\n"
                );
                let _ = stream.read_to_end(&mut Vec::new());
            };
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if flooding.load(Ordering::Relaxed) {
                    get("flooder");
                }
                get(&format!("user-{}", i % 7));
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let _stop = StopOnDrop(&stop);
    let mut browser = Browser::start().await;
    browser.call("Network.enable", json!({})).await;
    browser
        .call(
            "Network.setExtraHTTPHeaders",
            json!({ "headers": { "Authorization": format!("Bearer {TOKEN}") } }),
        )
        .await;
    browser.call("Page.enable", json!({})).await;
    browser
        .call(
            "Page.navigate",
            json!({ "url": format!("http://{admin}/") }),
        )
        .await;
    // The page fills itself: the rule, the flooder among the top keys, a
    // chart with both lines.
    browser
        .wait_for(
            "document.querySelector('#rules code')?.textContent === 'api'",
            Duration::from_secs(15),
        )
        .await;
    let row = "document.querySelector('#top tr[data-key*=\"flooder\"]')";
    browser
        .wait_for(&format!("{row} !== null"), Duration::from_secs(15))
        .await;
    browser
        .wait_for(
            "document.querySelectorAll('#legend span').length >= 2 \
             && Number(document.getElementById('chart').dataset.points) >= 6",
            Duration::from_secs(20),
        )
        .await;
    let png = browser.screenshot().await;
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real screenshot"
    );
    let target = std::env::current_exe()
        .unwrap()
        .ancestors()
        .nth(3)
        .unwrap()
        .join("console.png");
    std::fs::write(&target, &png).unwrap();

    // The flooder stops; an operator clicks its reset; it is admitted.
    flooding.store(false, Ordering::Relaxed);
    assert_eq!(
        deployment.servers[0].status(&[("x-client", "flooder")]),
        429
    );
    browser
        .eval(&format!(
            "{row}.querySelector('button.reset').click(), true"
        ))
        .await;
    browser
        .wait_for(
            "document.getElementById('message').textContent.startsWith('reset api')",
            Duration::from_secs(10),
        )
        .await;
    // This process's deny cache held the denial at most a second.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        deployment.servers[0].status(&[("x-client", "flooder")]),
        200,
        "admitted after the reset"
    );
    drop(_stop);
    loader.join().unwrap();
}
