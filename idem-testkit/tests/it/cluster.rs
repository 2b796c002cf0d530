//! `RedisCluster` against real redis-server processes.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_testkit::{RedisCluster, key_slot};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

async fn cluster_connection(cluster: &RedisCluster) -> ClusterConnection {
    ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
}

/// The reply of `GET key` sent to node `i` directly (no redirection).
fn direct_get(cluster: &RedisCluster, i: usize, key: &str) -> Result<Option<String>, String> {
    let mut con = cluster.nodes()[i].connection();
    redis::cmd("GET")
        .arg(key)
        .query(&mut con)
        .map_err(|e| e.to_string())
}

fn myself_slots(cluster: &RedisCluster, i: usize) -> String {
    let nodes = cluster.nodes()[i].cli(&["CLUSTER", "NODES"]);
    let line = nodes.lines().find(|l| l.contains("myself")).unwrap();
    line.split_whitespace()
        .skip(8)
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_forms_and_spreads_keys_over_three_masters() {
    let cluster = RedisCluster::start();
    assert_eq!(cluster.urls().len(), 3);
    assert_eq!(cluster.nodes().len(), 3);
    for node in cluster.nodes() {
        let info = node.cli(&["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_size:3"), "{info}");
        assert!(node.dir().join("nodes.conf").exists());
    }

    let keys: Vec<String> = (0..300).map(|i| format!("key:{i}")).collect();
    let owners: HashSet<usize> = keys.iter().map(|k| cluster.slot_owner(k)).collect();
    assert_eq!(owners, HashSet::from([0, 1, 2]));

    // key_slot agrees with the server, hash tags included.
    for key in [
        "a",
        "key:1",
        "{user}:1",
        "x{user}y",
        "foo{}{bar}",
        "foo{{bar}}zap",
    ] {
        let server_slot = cluster.nodes()[0].cli(&["CLUSTER", "KEYSLOT", key]);
        assert_eq!(server_slot, key_slot(key).to_string(), "slot of {key}");
    }

    let mut con = cluster_connection(&cluster).await;
    for key in keys.iter().take(60) {
        let () = redis::cmd("SET")
            .arg(key)
            .arg(key)
            .query_async(&mut con)
            .await
            .unwrap();
    }
    for key in keys.iter().take(60) {
        let owner = cluster.slot_owner(key);
        assert_eq!(direct_get(&cluster, owner, key), Ok(Some(key.clone())));
        let other = direct_get(&cluster, (owner + 1) % 3, key).unwrap_err();
        assert!(
            other.contains("Moved") || other.contains("MOVED"),
            "{other}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_node_rejoins_with_its_slots() {
    let mut cluster = RedisCluster::start();
    let key = (0..)
        .map(|i| format!("restart:{i}"))
        .find(|k| cluster.slot_owner(k) == 1)
        .unwrap();
    let mut con = cluster_connection(&cluster).await;
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("before")
        .query_async(&mut con)
        .await
        .unwrap();
    let slots_before = myself_slots(&cluster, 1);
    let port = cluster.nodes()[1].port();

    cluster.restart_node(1);

    assert_eq!(cluster.nodes()[1].port(), port);
    assert_eq!(myself_slots(&cluster, 1), slots_before);
    assert_eq!(cluster.slot_owner(&key), 1);
    for node in cluster.nodes() {
        assert!(node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
    }
    assert_eq!(direct_get(&cluster, 1, &key), Ok(None), "no persistence");
    // A fresh cluster client writes to the restarted node again.
    let mut con = cluster_connection(&cluster).await;
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("after")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(direct_get(&cluster, 1, &key), Ok(Some("after".into())));

    // A node killed by hand comes back through restart_node as well.
    cluster.node_mut(2).kill();
    assert!(!cluster.nodes()[2].is_running());
    cluster.restart_node(2);
    assert!(cluster.nodes()[2].is_running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_slot_moves_keys_under_load() {
    let cluster = Arc::new(RedisCluster::start());
    let key = "{moving}:value";
    let counter = "{moving}:counter";
    let slot = key_slot(key);
    let from = cluster.slot_owner(key);
    let to = (from + 1) % 3;

    let mut con = cluster_connection(&cluster).await;
    let () = redis::cmd("SET")
        .arg(key)
        .arg("payload")
        .query_async(&mut con)
        .await
        .unwrap();
    // Many keys in the slot, so the migration takes several MIGRATE batches.
    for i in 0..250 {
        let () = redis::cmd("SET")
            .arg(format!("{{moving}}:{i}"))
            .arg(i)
            .query_async(&mut con)
            .await
            .unwrap();
    }

    // Keep incrementing a key of the slot while it moves.
    let load = {
        let mut con = con.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let mut done = 0u64;
            while started.elapsed() < Duration::from_millis(1500) || done < 200 {
                let _: u64 = redis::cmd("INCR")
                    .arg(counter)
                    .query_async(&mut con)
                    .await
                    .unwrap();
                done += 1;
            }
            done
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let migrating = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || migrating.migrate_slot(slot, to))
        .await
        .unwrap();
    let increments = load.await.unwrap();

    assert_eq!(cluster.slot_owner(key), to);
    assert_eq!(cluster.slot_owner_of(slot), to);
    assert_eq!(direct_get(&cluster, to, key), Ok(Some("payload".into())));
    let moved = direct_get(&cluster, from, key).unwrap_err();
    assert!(
        moved.contains("Moved") || moved.contains("MOVED"),
        "{moved}"
    );
    assert_eq!(
        direct_get(&cluster, to, counter),
        Ok(Some(increments.to_string())),
        "no increment lost or doubled"
    );
    assert_eq!(
        cluster.nodes()[from].cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()]),
        "0"
    );
    assert_eq!(
        cluster.nodes()[to].cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()]),
        "252"
    );
    let value: String = redis::cmd("GET")
        .arg(key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(value, "payload");

    // Every node agrees, and the cluster is still healthy.
    cluster.wait_healthy();
    // Moving to the current owner does nothing.
    cluster.migrate_slot(slot, to);
    assert_eq!(cluster.slot_owner_of(slot), to);
}
