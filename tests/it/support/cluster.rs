//! A Redis Cluster of three masters, each a [`RedisServer`] of its own.

use std::time::{Duration, Instant};

use super::RedisServer;

/// The arguments of a `redis-server` that is a cluster node.
pub const CLUSTER_NODE_ARGS: [&str; 8] = [
    "--cluster-enabled",
    "yes",
    // In the server's own directory: one file per node.
    "--cluster-config-file",
    "nodes.conf",
    // Redis's default. No test waits for a failure to be detected, and a
    // node a loaded machine leaves unscheduled for a shorter time must not
    // be marked failed (the cluster would answer CLUSTERDOWN).
    "--cluster-node-timeout",
    "15000",
    // A dead master's slots go unserved, the others' keep counting (a
    // test kills one).
    "--cluster-require-full-coverage",
    "no",
];

/// A Redis Cluster of three masters (no replicas), each a `redis-server` on
/// a free loopback port, all killed on drop.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Start three cluster-enabled servers, join them ([`create_cluster`])
    /// and wait until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_with(&CLUSTER_NODE_ARGS))
            .collect();
        let ports: Vec<u16> = nodes.iter().map(RedisServer::port).collect();
        create_cluster(&ports, "Redis Cluster", &nodes, |_| true);
        Self { nodes }
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Kill node `i` (a master: its slots go unserved).
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// The master that owns `key`'s slot (`CLUSTER KEYSLOT`, then the slot
    /// ranges in `CLUSTER NODES`).
    pub fn node_of(&self, key: &str) -> &RedisServer {
        let slot = key_slot(&self.nodes[0], key);
        let nodes = self.nodes[0].command(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.len() < 9 || !fields[2].contains("master") {
                continue;
            }
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap();
            if in_slot_ranges(&fields[8..], slot) {
                return self.nodes.iter().find(|n| n.port() == port).unwrap();
            }
        }
        panic!("no master owns slot {slot} of {key}:\n{nodes}");
    }
}

/// Join the cluster-enabled servers `nodes` (reached by clients on `ports`:
/// their own, their TLS ports or their proxies') into one cluster of
/// masters, as `redis-cli --cluster create` does but without its
/// one-second waits: distinct config epochs, a third of the slots each,
/// and a `CLUSTER MEET` of every node at the address it announces. Then
/// wait until every node reports `cluster_state:ok`, all 16384 slots
/// assigned, 3 nodes known, and `ready` holds for it. `name` says which
/// cluster in the panic message.
pub fn create_cluster(
    ports: &[u16],
    name: &str,
    nodes: &[RedisServer],
    ready: impl Fn(&RedisServer) -> bool,
) {
    let addresses: Vec<String> = ports
        .iter()
        .map(|port| format!("127.0.0.1:{port}"))
        .collect();
    let expect_ok = |node: &RedisServer, args: &[&str]| {
        let reply = node.command(args);
        assert!(
            reply.starts_with("+OK"),
            "{args:?} on the {name} node {} answered {reply:?}",
            node.port()
        );
    };
    let count = nodes.len();
    for (i, node) in nodes.iter().enumerate() {
        let epoch = (i + 1).to_string();
        expect_ok(node, &["CLUSTER", "SET-CONFIG-EPOCH", &epoch]);
        let (first, last) = (16384 * i / count, 16384 * (i + 1) / count - 1);
        expect_ok(
            node,
            &[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &first.to_string(),
                &last.to_string(),
            ],
        );
    }
    for node in &nodes[1..] {
        let (ip, port, bus) = announced_address(node);
        expect_ok(&nodes[0], &["CLUSTER", "MEET", &ip, &port, &bus]);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let all_ready = nodes.iter().all(|node| {
            let info = node.command(&["CLUSTER", "INFO"]);
            info.contains("cluster_state:ok")
                && info.contains("cluster_slots_assigned:16384")
                && info.contains("cluster_known_nodes:3")
                && ready(node)
        });
        if all_ready {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the {name} on {addresses:?} did not reach cluster_state:ok within 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The address `node` gives the cluster for itself (`ip`, client port, bus
/// port), from the `myself` line of `CLUSTER NODES`: the one its peers must
/// meet (an announced proxy, or its TLS port). A node that has met no peer
/// yet does not know its IP: it is on loopback.
fn announced_address(node: &RedisServer) -> (String, String, String) {
    let nodes = node.command(&["CLUSTER", "NODES"]);
    let myself = nodes
        .lines()
        .find(|line| line.contains("myself"))
        .unwrap_or_else(|| panic!("no myself line in CLUSTER NODES: {nodes:?}"));
    let address = myself.split(' ').nth(1).unwrap_or_default();
    let address = address.split(',').next().unwrap_or_default();
    let (host, bus) = address
        .split_once('@')
        .unwrap_or_else(|| panic!("no bus port in {myself:?}"));
    let (ip, port) = host
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("no port in {myself:?}"));
    let ip = if ip.is_empty() { "127.0.0.1" } else { ip };
    (ip.to_owned(), port.to_owned(), bus.to_owned())
}

/// The hash slot of `key` (`CLUSTER KEYSLOT` on `node`).
pub(crate) fn key_slot(node: &RedisServer, key: &str) -> u16 {
    let reply = node.command(&["CLUSTER", "KEYSLOT", key]);
    reply.trim().trim_start_matches(':').parse().unwrap()
}

/// Whether `slot` lies in one of `ranges`, the slot fields of a `CLUSTER
/// NODES` line (`0-5460`, or a single slot `5461`).
pub(crate) fn in_slot_ranges(ranges: &[&str], slot: u16) -> bool {
    ranges.iter().any(|range| {
        let mut ends = range.split('-').map(|n| n.trim().parse::<u16>());
        match (ends.next(), ends.next()) {
            (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
            (Some(Ok(a)), None) => a == slot,
            _ => false,
        }
    })
}
