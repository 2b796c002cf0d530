//! A real Redis cluster of three masters.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::server::connect;
use crate::{RedisServer, redis_binaries};

/// Number of hash slots in a Redis cluster.
pub const CLUSTER_SLOTS: u16 = 16384;
const NODES: usize = 3;
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(30);
const NODE_ARGS: &[&str] = &[
    "--cluster-enabled",
    "yes",
    // Relative to the node's temporary directory (its working directory).
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "2000",
];

/// The hash slot of `key`, as `CLUSTER KEYSLOT` computes it: CRC16 (XMODEM)
/// of the key, or of its hash tag (the part between the first `{` and the
/// next `}`, when not empty), modulo 16384.
///
/// ```
/// assert_eq!(idem_testkit::key_slot("foo"), 12182);
/// assert_eq!(idem_testkit::key_slot("{user1000}.following"), idem_testkit::key_slot("user1000"));
/// ```
pub fn key_slot(key: impl AsRef<[u8]>) -> u16 {
    let key = key.as_ref();
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % CLUSTER_SLOTS
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// A real Redis cluster: three masters, no replicas, each a [`RedisServer`]
/// started with `--cluster-enabled yes --cluster-node-timeout 2000` and its
/// `nodes.conf` in its temporary directory.
///
/// Dropping it kills every node.
///
/// ```no_run
/// use idem_testkit::RedisCluster;
///
/// let cluster = RedisCluster::start();
/// let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
/// let owner = cluster.slot_owner("some-key");
/// cluster.migrate_slot(idem_testkit::key_slot("some-key"), (owner + 1) % 3);
/// # let _ = client;
/// ```
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes, joins them with `redis-cli --cluster create
    /// ... --cluster-replicas 0 --cluster-yes`, and waits until every node
    /// reports `cluster_state:ok` and sees the same three healthy masters
    /// (at most about 30 s).
    ///
    /// # Panics
    ///
    /// When a node does not start, `redis-cli --cluster create` fails, or
    /// the cluster is not healthy in time; the message says why.
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..NODES)
            .map(|_| RedisServer::start_with(NODE_ARGS))
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| n.addr().to_string()).collect();
        let output = Command::new(&redis_binaries().cli)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot run redis-cli --cluster create: {e}"));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if !output.status.success() || text.contains("[ERR]") {
            panic!(
                "idem-testkit: `redis-cli --cluster create {}` failed ({}):\n{text}",
                addrs.join(" "),
                output.status
            );
        }
        let cluster = RedisCluster { nodes };
        cluster.wait_healthy();
        cluster
    }

    /// The URLs of the three nodes (`redis://127.0.0.1:PORT/`), e.g. for
    /// [`redis::cluster::ClusterClient::new`].
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The three nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Node `i`, mutably (to [`RedisServer::kill`] it, for instance).
    ///
    /// # Panics
    ///
    /// When `i >= 3`.
    pub fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// Kills node `i` and starts it again on the same port with the same
    /// `nodes.conf`, so it rejoins with its slots (but without its keys: there
    /// is no persistence), then waits until the cluster is healthy again
    /// (see [`RedisCluster::wait_healthy`]).
    ///
    /// # Panics
    ///
    /// When the node does not come back or the cluster does not heal in time.
    pub fn restart_node(&mut self, i: usize) {
        self.nodes[i].restart();
        self.wait_healthy();
    }

    /// Waits (at most about 30 s) until every node reports
    /// `cluster_state:ok` with all 16384 slots served, knows exactly the
    /// three nodes, sees them all as connected masters without any `fail`
    /// flag, and agrees with the others on which master owns which slots.
    ///
    /// # Panics
    ///
    /// When that does not happen in time; the message gives the last reason
    /// and the end of each node's log.
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + HEALTHY_TIMEOUT;
        loop {
            let reason = match self.health() {
                Ok(()) => return,
                Err(reason) => reason,
            };
            if Instant::now() >= deadline {
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| format!("--- node {} log ---\n{}", n.port(), n.log_tail(15)))
                    .collect();
                panic!(
                    "idem-testkit: cluster not healthy after {HEALTHY_TIMEOUT:?}: {reason}\n{}",
                    logs.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The index (into [`RedisCluster::nodes`]) of the node serving the slot
    /// of `key` (see [`key_slot`]), according to the first running node.
    ///
    /// # Panics
    ///
    /// When no node is running or no node serves the slot.
    pub fn slot_owner(&self, key: &str) -> usize {
        self.slot_owner_of(key_slot(key))
    }

    /// The index of the node serving `slot`, according to the first running
    /// node.
    ///
    /// # Panics
    ///
    /// When no node is running or no node serves the slot.
    pub fn slot_owner_of(&self, slot: u16) -> usize {
        let viewer = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .expect("idem-testkit: no cluster node is running");
        let view = parse_nodes(&query_string(viewer.port(), &["CLUSTER", "NODES"]));
        view.iter()
            .find(|line| line.slots.iter().any(|&(lo, hi)| lo <= slot && slot <= hi))
            .and_then(|line| self.index_of_port(line.port))
            .unwrap_or_else(|| panic!("idem-testkit: no node serves slot {slot}"))
    }

    /// Moves `slot` and its keys to node `to`, the way resharding does:
    /// `CLUSTER SETSLOT slot IMPORTING` on the target, `MIGRATING` on the
    /// source, `MIGRATE` of the keys in batches until none is left, then
    /// `CLUSTER SETSLOT slot NODE` on the target, the source and the other
    /// node. Does nothing when `to` already owns the slot.
    ///
    /// It takes `&self`, so it can run on a blocking thread while other tasks
    /// keep using the cluster (clients then see `ASK` and `MOVED`
    /// redirections).
    ///
    /// # Panics
    ///
    /// When `to >= 3`, `slot >= 16384`, or a step fails.
    pub fn migrate_slot(&self, slot: u16, to: usize) {
        assert!(to < NODES, "idem-testkit: no cluster node {to}");
        assert!(slot < CLUSTER_SLOTS, "idem-testkit: no slot {slot}");
        let from = self.slot_owner_of(slot);
        if from == to {
            return;
        }
        let id = |i: usize| query_string(self.nodes[i].port(), &["CLUSTER", "MYID"]);
        let (from_id, to_id) = (id(from), id(to));
        let slot_arg = slot.to_string();
        let (from_port, to_port) = (self.nodes[from].port(), self.nodes[to].port());
        query_ok(
            to_port,
            &["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &from_id],
        );
        query_ok(
            from_port,
            &["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &to_id],
        );
        let mut source = connect_or_panic(from_port);
        loop {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut source)
                .unwrap_or_else(|e| panic!("idem-testkit: GETKEYSINSLOT {slot}: {e}"));
            if keys.is_empty() {
                break;
            }
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to_port)
                .arg("")
                .arg(0)
                .arg(10_000)
                .arg("KEYS")
                .arg(&keys)
                .query::<String>(&mut source)
                .unwrap_or_else(|e| panic!("idem-testkit: MIGRATE of slot {slot}: {e}"));
        }
        let others = (0..NODES).filter(|&i| i != from && i != to);
        for i in [to, from].into_iter().chain(others) {
            query_ok(
                self.nodes[i].port(),
                &["CLUSTER", "SETSLOT", &slot_arg, "NODE", &to_id],
            );
        }
    }

    fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|n| n.port() == port)
    }

    /// `Ok` when the cluster is healthy (see `wait_healthy`), else why not.
    fn health(&self) -> Result<(), String> {
        let mut first_map: Option<BTreeMap<u16, Vec<(u16, u16)>>> = None;
        for node in &self.nodes {
            let port = node.port();
            let mut con = connect(port).map_err(|e| format!("node {port}: {e}"))?;
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut con)
                .map_err(|e| format!("node {port}: CLUSTER INFO: {e}"))?;
            for wanted in [
                "cluster_state:ok",
                "cluster_slots_ok:16384",
                "cluster_known_nodes:3",
                "cluster_size:3",
            ] {
                if !info.lines().any(|l| l.trim() == wanted) {
                    return Err(format!("node {port}: no {wanted} in CLUSTER INFO:\n{info}"));
                }
            }
            let nodes: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query(&mut con)
                .map_err(|e| format!("node {port}: CLUSTER NODES: {e}"))?;
            let view = parse_nodes(&nodes);
            let bad = |line: &NodeLine| {
                self.index_of_port(line.port).is_none()
                    || !line.flags.iter().any(|f| f == "master")
                    || line
                        .flags
                        .iter()
                        .any(|f| matches!(f.as_str(), "fail" | "fail?" | "handshake" | "noaddr"))
                    || line.link != "connected"
            };
            if view.len() != NODES || view.iter().any(bad) {
                return Err(format!(
                    "node {port}: CLUSTER NODES not 3 healthy masters:\n{nodes}"
                ));
            }
            let map: BTreeMap<u16, Vec<(u16, u16)>> =
                view.into_iter().map(|l| (l.port, l.slots)).collect();
            match &first_map {
                None => first_map = Some(map),
                Some(first) if *first != map => {
                    return Err(format!("node {port}: disagrees on slot owners:\n{nodes}"));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// One line of `CLUSTER NODES`.
struct NodeLine {
    port: u16,
    flags: Vec<String>,
    link: String,
    /// Inclusive slot ranges; migrating/importing markers are left out.
    slots: Vec<(u16, u16)>,
}

/// Parses `CLUSTER NODES` output:
/// `<id> <ip:port@cport[,host]> <flags> <master> <ping> <pong> <epoch> <link> <slot>...`
fn parse_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let addr = fields[1].split(['@', ',']).next()?;
            let port = addr.rsplit(':').next()?.parse().ok()?;
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
                    None => s.parse().ok().map(|one| (one, one)),
                })
                .collect();
            Some(NodeLine {
                port,
                flags: fields[2].split(',').map(str::to_string).collect(),
                link: fields[7].to_string(),
                slots,
            })
        })
        .collect()
}

fn connect_or_panic(port: u16) -> redis::Connection {
    connect(port).unwrap_or_else(|e| panic!("idem-testkit: cannot connect to node {port}: {e}"))
}

fn query_string(port: u16, args: &[&str]) -> String {
    let mut con = connect_or_panic(port);
    redis::cmd(args[0])
        .arg(&args[1..])
        .query(&mut con)
        .unwrap_or_else(|e| panic!("idem-testkit: `{}` on node {port}: {e}", args.join(" ")))
}

fn query_ok(port: u16, args: &[&str]) {
    let reply = query_string(port, args);
    assert_eq!(
        reply,
        "OK",
        "idem-testkit: `{}` on node {port}",
        args.join(" ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_slot_matches_known_values() {
        // Values from the Redis cluster specification and CLUSTER KEYSLOT.
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("bar"), 5061);
        assert_eq!(key_slot(""), 0);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("foo{}{bar}"), key_slot("foo{}{bar}"));
        assert_ne!(key_slot("foo{}{bar}"), key_slot("bar"));
        assert_eq!(key_slot("foo{{bar}}zap"), key_slot("{bar"));
        assert_eq!(key_slot("foo{bar}{zap}"), key_slot("bar"));
        assert_eq!(crc16(b"123456789"), 0x31C3);
    }

    #[test]
    fn parse_nodes_reads_slots_and_flags() {
        let text = "07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host \
                    myself,master - 0 1426238317239 4 connected 0-5460 5462 \
                    [5461->-e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca]\n\
                    e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 \
                    master,fail? - 0 0 1 disconnected\n";
        let lines = parse_nodes(text);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].port, 30004);
        assert_eq!(lines[0].slots, vec![(0, 5460), (5462, 5462)]);
        assert_eq!(lines[0].link, "connected");
        assert_eq!(lines[1].port, 30001);
        assert!(lines[1].flags.iter().any(|f| f == "fail?"));
        assert!(lines[1].slots.is_empty());
    }
}
