//! A real Redis cluster of three masters, with or without a replica each.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::server::connect;
use crate::{RedisServer, redis_binaries};

/// Number of hash slots in a Redis cluster.
pub const CLUSTER_SLOTS: u16 = 16384;
/// Masters (shards) of every cluster.
const MASTERS: usize = 3;
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
    /// Replicas per master: 0 ([`RedisCluster::start`]) or 1
    /// ([`RedisCluster::start_with_replicas`]).
    replicas: usize,
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
        Self::create(0)
    }

    /// Starts a cluster of three masters with one replica each: six nodes,
    /// joined with `redis-cli --cluster create ... --cluster-replicas 1`
    /// (nodes 0 to 2 start as the masters, 3 to 5 as their replicas; after
    /// a [`RedisCluster::fail_over`] the roles move), each replica sending
    /// its data at once (`--repl-diskless-sync-delay 0`). Waits until the
    /// cluster is healthy, every replica's link to its master is up and
    /// every master counts its replica online (at most about 30 s).
    ///
    /// # Panics
    ///
    /// As [`RedisCluster::start`].
    pub fn start_with_replicas() -> RedisCluster {
        Self::create(1)
    }

    fn create(replicas: usize) -> RedisCluster {
        let mut args: Vec<&str> = NODE_ARGS.to_vec();
        args.extend(["--repl-diskless-sync-delay", "0"]);
        let nodes: Vec<RedisServer> = (0..MASTERS * (1 + replicas))
            .map(|_| RedisServer::start_with(&args))
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| n.addr().to_string()).collect();
        let output = Command::new(&redis_binaries().cli)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
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
        let cluster = RedisCluster { nodes, replicas };
        cluster.wait_healthy();
        cluster
    }

    /// The indices of the nodes that are masters now, in the order of the
    /// slots they serve (the master of slot 0 first), according to the
    /// first running node.
    ///
    /// # Panics
    ///
    /// When no node is running.
    pub fn primaries(&self) -> Vec<usize> {
        let mut masters: Vec<(u16, usize)> = self
            .view()
            .iter()
            .filter(|l| !l.slots.is_empty())
            .filter_map(|l| Some((l.slots[0].0, self.index_of_port(l.port)?)))
            .collect();
        masters.sort_unstable();
        masters.into_iter().map(|(_, i)| i).collect()
    }

    /// For each of the 16384 slots, the index of the node serving it,
    /// according to the first running node.
    ///
    /// # Panics
    ///
    /// When no node is running or a slot has no master.
    pub fn slot_owners(&self) -> Vec<usize> {
        let mut owners = vec![usize::MAX; usize::from(CLUSTER_SLOTS)];
        for line in self.view() {
            let Some(i) = self.index_of_port(line.port) else {
                continue;
            };
            for (lo, hi) in line.slots {
                owners[usize::from(lo)..=usize::from(hi)].fill(i);
            }
        }
        if let Some(slot) = owners.iter().position(|&o| o == usize::MAX) {
            panic!("idem-testkit: no node serves slot {slot}");
        }
        owners
    }

    /// Fails over the shard of master `i` the hard way, on a cluster
    /// started with [`RedisCluster::start_with_replicas`]: SIGKILLs node
    /// `i`, makes its replica take over at once (`CLUSTER FAILOVER
    /// TAKEOVER`: no agreement of the dead master needed), starts node `i`
    /// again on its port and `nodes.conf` (empty: there is no persistence)
    /// so it rejoins as the new master's replica, and waits until the
    /// cluster is healthy again (see [`RedisCluster::wait_healthy`]: every
    /// slot served by a reachable master, each with its replica in sync).
    /// Returns the index of the new master.
    ///
    /// It takes `&mut self` (the restart): move the cluster into a
    /// blocking task to keep clients running during the failover.
    ///
    /// # Panics
    ///
    /// When node `i` is not a master with a replica, the takeover is
    /// refused, or the cluster does not heal in time.
    pub fn fail_over(&mut self, i: usize) -> usize {
        let view = self.view();
        let port = self.nodes[i].port();
        let master = view
            .iter()
            .find(|l| l.port == port && l.flags.iter().any(|f| f == "master"))
            .unwrap_or_else(|| panic!("idem-testkit: node {i} is not a master"));
        let replica = view
            .iter()
            .find(|l| l.master == master.id)
            .and_then(|l| self.index_of_port(l.port))
            .unwrap_or_else(|| panic!("idem-testkit: master {i} has no replica"));
        let master_id = master.id.clone();
        self.nodes[i].kill();
        query_ok(
            self.nodes[replica].port(),
            &["CLUSTER", "FAILOVER", "TAKEOVER"],
        );
        // The replica has bumped its epoch and claims the slots: wait until
        // it calls itself a master before the old one comes back, so the
        // old one learns at once that it lost its slots.
        let deadline = Instant::now() + HEALTHY_TIMEOUT;
        let replica_port = self.nodes[replica].port();
        while !query_string(replica_port, &["INFO", "replication"]).contains("role:master") {
            assert!(
                Instant::now() < deadline,
                "idem-testkit: node {replica} did not take over from node {i}:\n{}",
                self.nodes[replica].log_tail(15)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.nodes[i].restart();
        let new_id = query_string(replica_port, &["CLUSTER", "MYID"]);
        let nudge_at = Instant::now() + Duration::from_secs(10);
        let mut nudged = false;
        loop {
            if self.health().is_ok() {
                return replica;
            }
            // The old master turns into a replica of the owner of its
            // slots by itself (gossip); if it is still an empty master
            // after a while, tell it, once (each REPLICATE starts the
            // synchronisation over).
            if !nudged && Instant::now() >= nudge_at && self.is_empty_master(i, &master_id) {
                nudged = true;
                let _ = try_query(self.nodes[i].port(), &["CLUSTER", "REPLICATE", &new_id]);
            }
            if Instant::now() >= deadline {
                // Panics with the reason and the logs, or returns if the
                // cluster heals after all.
                self.wait_healthy();
                return replica;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether node `i`, still with id `id`, calls itself a master of no slot.
    fn is_empty_master(&self, i: usize, id: &str) -> bool {
        let Ok(nodes) = try_query(self.nodes[i].port(), &["CLUSTER", "NODES"]) else {
            return false;
        };
        parse_nodes(&nodes).iter().any(|l| {
            l.id == id
                && l.slots.is_empty()
                && l.flags.iter().any(|f| f == "myself")
                && l.flags.iter().any(|f| f == "master")
        })
    }

    /// `CLUSTER NODES` of the first running node, parsed.
    fn view(&self) -> Vec<NodeLine> {
        let viewer = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .expect("idem-testkit: no cluster node is running");
        parse_nodes(&query_string(viewer.port(), &["CLUSTER", "NODES"]))
    }

    /// The URLs of the nodes (`redis://127.0.0.1:PORT/`), e.g. for
    /// [`redis::cluster::ClusterClient::new`].
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes (three, or six with [`RedisCluster::start_with_replicas`]).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Node `i`, mutably (to [`RedisServer::kill`] it, for instance).
    ///
    /// # Panics
    ///
    /// When `i` is not a node's index.
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
    /// cluster's nodes, sees them all connected without any `fail` flag,
    /// sees three masters serving slots (every other node the replica of
    /// one, each master with as many as the cluster was started with), and
    /// agrees with the others on which master owns which slots; and, with
    /// replicas, every replica's link to its master is up and every master
    /// counts its replicas online (so `WAIT` can be satisfied).
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
    /// When `to` is not a master, `slot >= 16384`, or a step fails.
    pub fn migrate_slot(&self, slot: u16, to: usize) {
        let masters = self.primaries();
        assert!(
            masters.contains(&to),
            "idem-testkit: node {to} is not a master"
        );
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
        let others = masters.into_iter().filter(|&i| i != from && i != to);
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
        let known = format!("cluster_known_nodes:{}", self.nodes.len());
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
                &known,
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
            let is = |line: &NodeLine, flag: &str| line.flags.iter().any(|f| f == flag);
            let masters: Vec<&NodeLine> = view.iter().filter(|l| is(l, "master")).collect();
            let replicas_of = |m: &NodeLine| {
                view.iter()
                    .filter(|l| is(l, "slave") && l.master == m.id)
                    .count()
            };
            let bad = |line: &NodeLine| {
                self.index_of_port(line.port).is_none()
                    || line
                        .flags
                        .iter()
                        .any(|f| matches!(f.as_str(), "fail" | "fail?" | "handshake" | "noaddr"))
                    || line.link != "connected"
                    || (is(line, "master") && line.slots.is_empty())
                    || (is(line, "slave") && !masters.iter().any(|m| m.id == line.master))
            };
            if view.len() != self.nodes.len()
                || view.iter().any(bad)
                || masters.len() != MASTERS
                || masters.iter().any(|m| replicas_of(m) != self.replicas)
            {
                return Err(format!(
                    "node {port}: CLUSTER NODES not {MASTERS} healthy masters with {} replica(s) each:\n{nodes}",
                    self.replicas
                ));
            }
            if self.replicas > 0 {
                let replication: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut con)
                    .map_err(|e| format!("node {port}: INFO replication: {e}"))?;
                let me = view.iter().find(|l| is(l, "myself"));
                let synced = if me.is_some_and(|me| is(me, "master")) {
                    replication.matches("state=online").count() == self.replicas
                } else {
                    replication.contains("master_link_status:up")
                };
                if !synced {
                    return Err(format!(
                        "node {port}: replication not in sync:\n{replication}"
                    ));
                }
            }
            let map: BTreeMap<u16, Vec<(u16, u16)>> = masters
                .into_iter()
                .map(|l| (l.port, l.slots.clone()))
                .collect();
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
    id: String,
    port: u16,
    /// The id of its master, for a replica; `-` for a master.
    master: String,
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
                id: fields[0].to_string(),
                port,
                master: fields[3].to_string(),
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

fn try_query(port: u16, args: &[&str]) -> Result<String, String> {
    let mut con = connect(port).map_err(|e| e.to_string())?;
    redis::cmd(args[0])
        .arg(&args[1..])
        .query(&mut con)
        .map_err(|e| e.to_string())
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
        assert_eq!(lines[0].id, "07c37dfeb235213a872192d90877d0cd55635b91");
        assert_eq!(lines[0].master, "-");
        assert!(lines[1].flags.iter().any(|f| f == "fail?"));
        assert!(lines[1].slots.is_empty());
    }
}
