//! The durability phase (`--only durability`, not run by
//! default): fresh calls/s and replays/s with each `Durability` against
//! `Async`, in the same run on the same servers, interleaved in rounds.
//!
//! Its own servers: a master with one replica, both Valkey 8.1 when it is
//! installed (`WAITAOF`; `cargo xtask setup`), else the suite's
//! redis-server (then only `Replicated` is measured), both with
//! `appendonly yes` and `appendfsync always` so that `Fsynced` has an
//! append-only file to wait for. `Async` is measured on the same master,
//! so it pays `appendfsync always` too: the ratios are the cost of the
//! confirmation alone.

use idem::{Durability, Error, Idempotency, RedisStore};
use idem_testkit::RedisServer;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const ROUNDS: usize = 5;
const SLICE: Duration = Duration::from_secs(1);
const TASKS: usize = 64;
const SERVER_ARGS: [&str; 6] = [
    "--appendonly",
    "yes",
    "--appendfsync",
    "always",
    "--repl-diskless-sync-delay",
    "0",
];

struct Phase {
    name: &'static str,
    durability: Durability,
    /// Replays of prefilled keys rather than fresh calls.
    replay: bool,
}

/// Runs the phase and prints its table.
pub(crate) async fn measure_and_print() {
    let valkey = std::panic::catch_unwind(idem_testkit::valkey_server).ok();
    let start = |extra: &[&str]| {
        let mut args: Vec<&str> = SERVER_ARGS.to_vec();
        args.extend_from_slice(extra);
        match &valkey {
            Some(_) => RedisServer::start_valkey_with(&args),
            None => RedisServer::start_with(&args),
        }
    };
    let master = start(&[]);
    let port = master.port().to_string();
    let replica = start(&["--replicaof", "127.0.0.1", &port]);
    while !replica
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let store = RedisStore::connect(&master.url())
        .await
        .expect("connect to the durability bench's master");
    let second = Duration::from_secs(1);
    let mut phases = vec![
        Phase {
            name: "fresh Async",
            durability: Durability::Async,
            replay: false,
        },
        Phase {
            name: "fresh Replicated{1}",
            durability: Durability::replicated(1, second),
            replay: false,
        },
        Phase {
            name: "replay Async",
            durability: Durability::Async,
            replay: true,
        },
        Phase {
            name: "replay Replicated{1}",
            durability: Durability::replicated(1, second),
            replay: true,
        },
    ];
    if valkey.is_some() {
        phases.push(Phase {
            name: "fresh Fsynced{local}",
            durability: Durability::fsynced(true, 0, second),
            replay: false,
        });
        phases.push(Phase {
            name: "fresh Fsynced{local,1}",
            durability: Durability::fsynced(true, 1, second),
            replay: false,
        });
        phases.push(Phase {
            name: "replay Fsynced{local}",
            durability: Durability::fsynced(true, 0, second),
            replay: true,
        });
    }
    let idem = Idempotency::builder(store)
        .namespace("bench-durable")
        .result_ttl(Duration::from_secs(3600))
        .build();
    const REPLAY_KEYS: u64 = 1000;
    for k in 0..REPLAY_KEYS {
        let _: Result<u64, Error> = idem.call("replay", k).run(|| async move { Ok(k) }).await;
    }
    let errors = Arc::new(AtomicU64::new(0));
    let mut totals = vec![(0u64, Duration::ZERO); phases.len()];
    let mut seq = 0u64;
    for round in 0..ROUNDS {
        for i in 0..phases.len() {
            // Rotate which phase goes first, so drift hits them alike.
            let p = (i + round) % phases.len();
            let phase = &phases[p];
            let started = Instant::now();
            let end = started + SLICE;
            let done = Arc::new(AtomicU64::new(0));
            let tasks: Vec<_> = (0..TASKS)
                .map(|t| {
                    let (idem, done, errors) = (idem.clone(), done.clone(), errors.clone());
                    let (durability, replay) = (phase.durability, phase.replay);
                    let base = seq + ((t as u64) << 32);
                    tokio::spawn(async move {
                        let mut n = 0u64;
                        while Instant::now() < end {
                            n += 1;
                            let r: Result<u64, Error> = if replay {
                                let k = (base + n) % REPLAY_KEYS;
                                idem.call("replay", k)
                                    .durability(durability)
                                    .run(|| async move { Ok(k) })
                                    .await
                            } else {
                                idem.call("fresh", base + n)
                                    .durability(durability)
                                    .run(|| async move { Ok(n) })
                                    .await
                            };
                            match r {
                                Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                                Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                            };
                        }
                    })
                })
                .collect();
            for t in tasks {
                let _ = t.await;
            }
            seq += 1 << 48;
            totals[p].0 += done.load(Ordering::Relaxed);
            totals[p].1 += started.elapsed();
        }
    }
    println!(
        "\ndurability ({}, master + 1 replica, appendfsync always, {TASKS} tasks, {ROUNDS} × {SLICE:?} per phase)",
        if valkey.is_some() {
            "valkey"
        } else {
            "redis-server"
        }
    );
    println!("{:<26} {:>10} {:>9}", "phase", "calls/s", "vs Async");
    let rate = |(n, t): (u64, Duration)| n as f64 / t.as_secs_f64();
    let fresh_async = rate(totals[0]);
    let replay_async = rate(totals[2]);
    for (phase, total) in phases.iter().zip(&totals) {
        let base = if phase.replay {
            replay_async
        } else {
            fresh_async
        };
        println!(
            "{:<26} {:>10.0} {:>8.2}×",
            phase.name,
            rate(*total),
            rate(*total) / base
        );
    }
    println!("errors: {}", errors.load(Ordering::Relaxed));
    drop(replica);
    drop(master);
}
