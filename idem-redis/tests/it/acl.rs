//! The minimal Redis ACL an idem deployment needs (docs/reliability.md,
//! "Redis ACL"), what a missing permission looks like, and that keys are
//! not logged in clear by default.

use idem_core::store::{Claim, Complete, Store, Token};
use idem_core::{Error, Idempotency, Outcome};
use idem_redis::RedisStore;
use idem_testkit::{LogCapture, RedisServer, Runs};
use std::time::Duration;

const USER: &str = "idem";
const PASSWORD: &str = "s3cret-pw";

/// The ACL of docs/operating.md for namespace `payments`: the commands
/// the client sends (EVALSHA, SCRIPT LOAD after a SCRIPT FLUSH or a
/// restart) and the ones the scripts call, on the namespace's keys only.
static MINIMAL: std::sync::LazyLock<Vec<String>> =
    std::sync::LazyLock::new(|| idem_testkit::store_acl("payments", PASSWORD));

/// The pub/sub grants of MINIMAL: without them idem still works, and
/// waiters poll (`waiters_poll_when_pub_sub_is_denied`).
const PUB_SUB: &[&str] = &["&payments:*", "+spublish", "+ssubscribe", "+sunsubscribe"];

fn set_user(server: &RedisServer, rules: &[impl AsRef<str> + std::fmt::Debug]) {
    let mut args = vec!["ACL", "SETUSER", USER, "reset"];
    args.extend(rules.iter().map(AsRef::as_ref));
    assert_eq!(server.cli(&args), "OK", "ACL SETUSER {rules:?}");
}

/// MINIMAL without `drop`.
fn minimal_without(drop: &str) -> Vec<String> {
    let v: Vec<String> = MINIMAL.iter().filter(|r| *r != drop).cloned().collect();
    assert_eq!(v.len(), MINIMAL.len() - 1, "{drop} is not in MINIMAL");
    v
}

/// The `object` of each ACL LOG entry (as redis-cli prints it): the
/// command or key that was denied.
fn denied_commands(log: &str) -> Vec<String> {
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines
        .windows(2)
        .filter(|w| w[0] == "object")
        .map(|w| w[1].to_owned())
        .collect()
}

fn user_url(server: &RedisServer) -> String {
    format!("redis://{USER}:{PASSWORD}@127.0.0.1:{}/", server.port())
}

fn assert_acl_error(e: &Error, op: &str, case: &str) {
    match e {
        Error::Unavailable { op: o, reason, .. } => {
            assert_eq!(*o, op, "{case}: {e}");
            assert!(
                reason.contains("Redis ACL denied the command"),
                "{case}: {reason}"
            );
            assert!(
                reason.contains("docs/operating.md, section Redis ACL"),
                "{case}: {reason}"
            );
        }
        other => panic!("{case}: expected Unavailable naming the ACL, got {other:?}"),
    }
}

#[tokio::test]
async fn minimal_acl_user_runs_the_core_semantics() {
    let server = RedisServer::start();
    set_user(&server, &MINIMAL);
    server.cli(&["ACL", "LOG", "RESET"]);
    let store = RedisStore::connect(&user_url(&server))
        .await
        .expect("connect as the ACL user");
    let idem = Idempotency::builder(store.clone())
        .namespace("payments")
        .lease(Duration::from_millis(300))
        .build();
    let runs = Runs::default();

    // claim, run, replay
    let first = idem
        .call("charge", "order-1")
        .fingerprint(&500)
        .run_outcome(|| runs.body(500u64))
        .await;
    assert_eq!(first.unwrap(), (500, Outcome::Executed));
    let again = idem
        .call("charge", "order-1")
        .fingerprint(&500)
        .run_outcome(|| runs.body(0u64))
        .await;
    assert_eq!(again.unwrap(), (500, Outcome::Replayed));
    let other = idem
        .call("charge", "order-1")
        .fingerprint(&501)
        .run(|| runs.body(0u64))
        .await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch)),
        "{other:?}"
    );
    assert_eq!(runs.get(), 1);

    // release: an error from the body frees the key
    let failed: Result<u64, Error> = idem
        .call("charge", "order-2")
        .run(|| async { Err(Error::codec("provider said no")) })
        .await;
    assert!(failed.is_err());
    let retried = idem
        .call("charge", "order-2")
        .run_outcome(|| runs.body(2u64))
        .await;
    assert_eq!(retried.unwrap(), (2, Outcome::Executed));

    // extend: a 1.2 s body under a 300 ms lease keeps its key; a duplicate
    // arriving after the first lease would have run out is still refused.
    let long = idem.call("charge", "order-3").run_outcome(|| async {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        Ok::<_, Error>(3u64)
    });
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        idem.call("charge", "order-3")
            .run(|| runs.body(33u64))
            .await
    };
    let (long, duplicate) = tokio::join!(long, duplicate);
    assert_eq!(long.unwrap(), (3, Outcome::Executed));
    assert!(
        matches!(duplicate, Err(Error::InProgress { .. })),
        "extend did not keep the lease: {duplicate:?}"
    );

    // takeover of a lease nobody renews
    let stale = Token::from_u128(7);
    let claim = Claim::new(
        "payments:charge:order-4",
        &stale,
        Duration::from_millis(100),
        Duration::from_secs(60),
    );
    store.claim(claim).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let recovered = idem
        .call("charge", "order-4")
        .run_outcome(|| runs.body(4u64))
        .await;
    assert_eq!(recovered.unwrap(), (4, Outcome::Recovered));

    // failure counts (idem-consumer's max_failures): a key of their own
    // under the namespace, written by a script with GET and SET only.
    let day = Duration::from_secs(86_400);
    for expected in 1..=3 {
        let n = idem.count_failure("charge", "order-2", day).await.unwrap();
        assert_eq!(n, expected);
    }

    // SCRIPT FLUSH (or a restart, or a fail-over): the client reloads the
    // scripts with SCRIPT LOAD and carries on.
    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
    let n = idem.count_failure("charge", "order-2", day).await.unwrap();
    assert_eq!(n, 4, "the failure script is reloaded after a flush");
    let after_flush = idem
        .call("charge", "order-5")
        .run_outcome(|| runs.body(5u64))
        .await;
    assert_eq!(after_flush.unwrap(), (5, Outcome::Executed));
    let replay_after_flush = idem.call("charge", "order-1").run(|| runs.body(0u64)).await;
    assert_eq!(replay_after_flush.unwrap(), 500);

    // A batch's claims and completes (one `complete_batch` call on Redis 7,
    // which reads the keys with MGET).
    let tokens = [
        Token::from_u128(11),
        Token::from_u128(12),
        Token::from_u128(13),
    ];
    let batch_keys = ["payments:b:1", "payments:b:2", "payments:b:3"];
    let done = batch_round(&store, &batch_keys, &tokens).await;
    assert_eq!(done, 3, "every key of the batch completed");

    // Nothing the client or the scripts sent was denied (CLIENT SETINFO on
    // connect is the one exception, see below).
    let log = server.cli(&["ACL", "LOG"]);
    eprintln!("ACL LOG after the run:\n{log}");
    let denied = denied_commands(&log);
    assert!(
        denied.iter().all(|d| d.starts_with("client|setinfo")),
        "the minimal ACL denied something idem needs: {denied:?}\n{log}"
    );

    // The user can do nothing else: no other command, no other key.
    let mut con = redis::Client::open(user_url(&server))
        .unwrap()
        .get_connection()
        .unwrap();
    for cmd in [
        redis::cmd("FLUSHALL"),
        redis::cmd("KEYS").arg("*").to_owned(),
        redis::cmd("EVAL").arg("return 1").arg(0).to_owned(),
    ] {
        let e = cmd.query::<redis::Value>(&mut con).unwrap_err();
        assert!(
            e.to_string().to_lowercase().contains("no permissions"),
            "{e}"
        );
    }
    let e = redis::cmd("GET")
        .arg("other:key")
        .query::<redis::Value>(&mut con)
        .unwrap_err();
    assert!(
        e.to_string().to_lowercase().contains("no permissions"),
        "{e}"
    );
}

/// Claims `keys` in one batch, completes them in one batch, and counts the
/// completes that answered `Done`.
async fn batch_round(store: &RedisStore, keys: &[&str], tokens: &[Token]) -> usize {
    use idem_core::store::{ClaimReply, Finish, ValueKind, WriteReply};
    let claims: Vec<Claim<'_>> = keys
        .iter()
        .zip(tokens)
        .map(|(key, token)| {
            Claim::new(key, token, Duration::from_secs(30), Duration::from_secs(60))
        })
        .collect();
    for reply in store.claim_batch(&claims).await {
        assert_eq!(reply.unwrap(), ClaimReply::Acquired { attempt: 1 });
    }
    let ops: Vec<Finish<'_>> = claims
        .iter()
        .map(|claim| Finish::Complete(Complete::of_claim(claim, ValueKind::Json, b"1")))
        .collect();
    store
        .finish_batch(&ops)
        .await
        .into_iter()
        .filter(|r| matches!(r, Ok(WriteReply::Done)))
        .count()
}

/// A user whose ACL predates `+mget` (added for the batch completes on
/// Redis 7) still completes every key of a batch: the script reads each
/// key with `GET` when `MGET` is refused, and `ACL LOG` names `mget`.
#[tokio::test]
async fn a_user_without_mget_still_completes_batches() {
    let server = RedisServer::start();
    set_user(&server, &minimal_without("+mget"));
    server.cli(&["ACL", "LOG", "RESET"]);
    let store = RedisStore::connect(&user_url(&server))
        .await
        .expect("connect as the ACL user");
    let tokens = [
        Token::from_u128(1),
        Token::from_u128(2),
        Token::from_u128(3),
    ];
    let keys = ["payments:m:1", "payments:m:2", "payments:m:3"];
    assert_eq!(batch_round(&store, &keys, &tokens).await, 3);
    let log = server.cli(&["ACL", "LOG"]);
    let denied = denied_commands(&log);
    assert!(
        denied
            .iter()
            .all(|d| d == "mget" || d.starts_with("client|setinfo")),
        "only MGET may be denied: {denied:?}\n{log}"
    );
    // Redis 7 (no `SET … IFEQ`) completes the batch with the script, whose
    // MGET was refused; Valkey 8.1 completes it with plain `SET`s.
    let info = server.cli(&["INFO", "server"]);
    if !info.contains("valkey_version") && info.contains("redis_version:7.") {
        assert!(denied.iter().any(|d| d == "mget"), "{denied:?}\n{log}");
    }
    let mut admin = server.connection();
    for key in keys {
        let record: Vec<u8> = redis::cmd("GET").arg(key).query(&mut admin).unwrap();
        assert!(record.starts_with(b"1C"), "{key} holds {record:?}");
    }
}

/// redis-rs sends CLIENT SETINFO on connect and ignores a refusal: the
/// minimal ACL need not grant it. Redis 7.0/7.1 do not know the command at
/// all; on 7.2 and later it is refused (and noted in ACL LOG) unless
/// `+client|setinfo` is granted, and idem works either way.
#[tokio::test]
async fn client_setinfo_is_optional() {
    let server = RedisServer::start();
    let known = server.cli(&["ACL", "SETUSER", "probe", "+client|setinfo"]) == "OK";
    for grant in [false, true] {
        if grant && !known {
            eprintln!("this Redis has no CLIENT SETINFO (before 7.2): nothing to grant");
            break;
        }
        let mut rules = MINIMAL.to_vec();
        if grant {
            rules.push("+client|setinfo".to_owned());
        }
        set_user(&server, &rules);
        server.cli(&["ACL", "LOG", "RESET"]);
        let idem = Idempotency::builder(RedisStore::connect(&user_url(&server)).await.unwrap())
            .namespace("payments")
            .build();
        let v: u8 = idem
            .call("charge", "k")
            .run(|| async { Ok::<_, Error>(1) })
            .await
            .unwrap();
        assert_eq!(v, 1);
        let log = server.cli(&["ACL", "LOG"]);
        if grant || !known {
            assert!(log.trim().is_empty(), "nothing should be denied: {log}");
        } else {
            assert!(
                log.contains("client|setinfo"),
                "expected the SETINFO refusal in ACL LOG: {log}"
            );
        }
    }
}

/// Fresh claims and replays are plain commands, but every write of a
/// running call is a script: without EVALSHA a body would run and then
/// fail to store. `connect` refuses instead, naming the ACL.
#[tokio::test]
async fn missing_evalsha_fails_at_connect_naming_the_acl() {
    let server = RedisServer::start();
    set_user(&server, &minimal_without("+evalsha"));
    let e = RedisStore::connect(&user_url(&server)).await.unwrap_err();
    assert_acl_error(&e, "connect", "no EVALSHA");
}

#[tokio::test]
async fn missing_script_load_fails_at_connect() {
    let server = RedisServer::start();
    set_user(&server, &minimal_without("+script|load"));
    let e = RedisStore::connect(&user_url(&server)).await.unwrap_err();
    assert_acl_error(&e, "connect", "no SCRIPT LOAD");
}

/// A command the scripts call but the user may not run is reported as an
/// ACL problem too, never as a corrupt record.
#[tokio::test]
async fn missing_script_commands_are_unavailable_naming_the_acl() {
    let server = RedisServer::start();
    // Claim writes with SET (its GET option included); PTTL measures a
    // pending record's lease when another owner holds it.
    for cmd in ["+set", "+pttl"] {
        set_user(&server, &minimal_without(cmd));
        let store = RedisStore::connect(&user_url(&server))
            .await
            .expect("connect");
        let idem = Idempotency::builder(store.clone())
            .namespace("payments")
            .build();
        let runs = Runs::default();
        // +pttl is used only on a record held by someone else: plant one as the admin.
        let mut held = b"1P\x00".to_vec();
        held.extend_from_slice(Token::from_u128(9).as_bytes());
        held.extend_from_slice(b"0:1");
        let _: () = redis::cmd("SET")
            .arg("payments:charge:held")
            .arg(held)
            .arg("PX")
            .arg(60_000)
            .query(&mut server.connection())
            .unwrap();
        let key = if cmd == "+pttl" { "held" } else { "order-1" };
        let r: Result<String, Error> = idem
            .call("charge", key)
            .run(|| runs.body("x".to_owned()))
            .await;
        assert_acl_error(&r.unwrap_err(), "claim", cmd);
        assert_eq!(runs.get(), 0, "{cmd}");
        server.flushall();
    }
    // GET, DEL and PEXPIRE are used by release and extend.
    for cmd in ["+get", "+del", "+pexpire"] {
        set_user(&server, &minimal_without(cmd));
        let store = RedisStore::connect(&user_url(&server))
            .await
            .expect("connect");
        let token = Token::from_u128(1);
        let claim = Claim::new(
            "payments:charge:order-2",
            &token,
            Duration::from_millis(100),
            Duration::from_millis(100),
        );
        store.claim(claim).await.unwrap();
        let e = if cmd != "+pexpire" {
            store.release(claim.key, &token).await.unwrap_err()
        } else {
            store
                .extend(claim.key, &token, Duration::from_secs(1))
                .await
                .unwrap_err()
        };
        assert_acl_error(
            &e,
            if cmd != "+pexpire" {
                "release"
            } else {
                "extend"
            },
            cmd,
        );
    }
}

#[tokio::test]
async fn key_outside_the_pattern_is_refused() {
    let server = RedisServer::start();
    set_user(&server, &MINIMAL);
    let store = RedisStore::connect(&user_url(&server)).await.unwrap();
    let payments = Idempotency::builder(store.clone())
        .namespace("payments")
        .build();
    let orders = Idempotency::builder(store.clone())
        .namespace("orders")
        .build();
    let runs = Runs::default();
    let ok: u8 = payments
        .call("charge", "k")
        .run(|| runs.body(1))
        .await
        .unwrap();
    assert_eq!(ok, 1);
    let refused: Result<u8, Error> = orders.call("create", "k").run(|| runs.body(2)).await;
    assert_acl_error(
        &refused.unwrap_err(),
        "claim",
        "namespace outside ~payments:*",
    );
    assert_eq!(runs.get(), 1);
    // The permitted namespace is unaffected.
    let again: u8 = payments
        .call("charge", "k")
        .run(|| runs.body(0))
        .await
        .unwrap();
    assert_eq!((again, runs.get()), (1, 1));
    assert_eq!(server.cli(&["EXISTS", "orders:create:k"]), "0");
}

/// A durable call needs `+wait` (docs/operating.md): without it the call is
/// refused as a configuration error naming the grant (not a retryable
/// outage a worker would retry forever), its body does not run and its
/// claim is released.
#[tokio::test]
async fn durable_calls_without_wait_are_refused_with_the_grant_to_add() {
    let server = RedisServer::start();
    set_user(&server, &MINIMAL);
    let store = RedisStore::connect(&user_url(&server)).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("payments")
        .durability(idem_core::Durability::replicated(
            1,
            Duration::from_millis(300),
        ))
        .build();
    let runs = Runs::default();
    let refused: Result<u8, Error> = idem.call("charge", "k").run(|| runs.body(1)).await;
    match refused {
        Err(ref e @ Error::DurabilityUnsupported { ref reason, .. }) => {
            assert!(!e.is_retryable(), "{e}");
            assert!(reason.contains("+wait"), "{reason}");
            assert!(reason.contains("Redis ACL"), "{reason}");
        }
        other => panic!("expected DurabilityUnsupported naming +wait, got {other:?}"),
    }
    assert_eq!(runs.get(), 0, "the body of a refused durable call ran");
    assert_eq!(
        server.cli(&["EXISTS", "payments:charge:k"]),
        "0",
        "the refused claim was not released"
    );
    // The same user without durability is unaffected.
    let ok: u8 = idem
        .call("charge", "k")
        .durability(idem_core::Durability::Async)
        .run(|| runs.body(2))
        .await
        .unwrap();
    assert_eq!((ok, runs.get()), (2, 1));
}

// ------------------------------------------------------------- logging ---

/// Runs every logging path once (executed, replayed, in progress,
/// fingerprint mismatch, body error, refused key) with a subscriber that
/// records spans and events at TRACE, and returns what it wrote.
async fn captured_logs(idem: &Idempotency, key: &str) -> String {
    let out = LogCapture::new();
    let _guard = tracing::subscriber::set_default(out.trace_subscriber());
    let _: u8 = idem
        .call("charge", key)
        .fingerprint(&1)
        .run(|| async { Ok::<_, Error>(1) })
        .await
        .unwrap();
    let _: u8 = idem
        .call("charge", key)
        .fingerprint(&1)
        .run(|| async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    let mismatch: Result<u8, Error> = idem
        .call("charge", key)
        .fingerprint(&2)
        .run(|| async { Ok(3) })
        .await;
    assert!(matches!(mismatch, Err(Error::FingerprintMismatch)));
    let failing = format!("{key}/failing");
    let _: Result<u8, Error> = idem
        .call("charge", &failing)
        .run(|| async { Err(Error::codec("no")) })
        .await;
    let busy = format!("{key}/busy");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let holder = idem.call("charge", &busy).run(|| async move {
        let _ = rx.await;
        Ok::<_, Error>(4u8)
    });
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let r: Result<u8, Error> = idem.call("charge", &busy).run(|| async { Ok(5) }).await;
        let _ = tx.send(());
        r
    };
    let (h, d) = tokio::join!(holder, duplicate);
    assert_eq!(h.unwrap(), 4);
    assert!(matches!(d, Err(Error::InProgress { .. })));
    out.contents()
}

#[tokio::test]
async fn keys_are_not_logged_in_clear_by_default() {
    let server = RedisServer::start();
    let redis = RedisStore::connect(&server.url()).await.unwrap();
    let key = "alice@example.com-order-4242";
    for store in ["memory", "redis"] {
        let builder = |ns: &str| {
            let b = match store {
                "memory" => Idempotency::builder(idem_core::MemoryStore::new()),
                _ => Idempotency::builder(redis.clone()),
            };
            b.namespace(ns)
        };
        let hidden = captured_logs(&builder("hidden").build(), key).await;
        assert!(
            hidden.contains("idem.call"),
            "{store}: no span captured:\n{hidden}"
        );
        assert!(
            hidden.contains("key=\"#"),
            "{store}: the key digest is missing:\n{hidden}"
        );
        assert!(
            hidden.contains("WARN"),
            "{store}: the warning paths did not log:\n{hidden}"
        );
        assert!(
            !hidden.contains("alice"),
            "{store}: the key leaked into the logs:\n{hidden}"
        );

        let shown = captured_logs(&builder("shown").log_keys(true).build(), key).await;
        assert!(
            shown.contains(key),
            "{store}: log_keys(true) should show the key:\n{shown}"
        );
    }
}

/// A Redis Cluster deployment also needs what the cluster client sends on
/// its own: PING on each node connection, CLUSTER SLOTS for the topology,
/// ASKING for a slot being migrated.
const CLUSTER_EXTRA: &[&str] = &["+ping", "+cluster|slots", "+asking"];

#[tokio::test]
async fn cluster_acl_adds_ping_cluster_slots_and_asking() {
    let cluster = idem_testkit::RedisCluster::start();
    let mut rules = MINIMAL.to_vec();
    rules.extend(CLUSTER_EXTRA.iter().map(|r| (*r).to_owned()));
    for node in cluster.nodes() {
        set_user(node, &rules);
        node.cli(&["ACL", "LOG", "RESET"]);
    }
    let urls: Vec<String> = cluster.nodes().iter().map(user_url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let store = RedisStore::connect_cluster(&urls)
        .await
        .expect("connect to the cluster as the ACL user");
    let idem = Idempotency::builder(store).namespace("payments").build();
    let runs = Runs::default();
    for i in 0..30u32 {
        let key = format!("order-{i}");
        let first = idem.call("charge", &key).run_outcome(|| runs.body(i)).await;
        assert_eq!(first.unwrap(), (i, Outcome::Executed), "{key}");
        let again = idem.call("charge", &key).run_outcome(|| runs.body(0)).await;
        assert_eq!(again.unwrap(), (i, Outcome::Replayed), "{key}");
    }
    // Failure counters live on their own keys' slots, on every master.
    let day = Duration::from_secs(86_400);
    for i in 0..30u32 {
        let n = idem.count_failure("charge", i, day).await.unwrap();
        assert_eq!(n, 1, "failure count of {i}");
    }
    // NOSCRIPT on every node is recovered with SCRIPT LOAD.
    for node in cluster.nodes() {
        assert_eq!(node.cli(&["SCRIPT", "FLUSH"]), "OK");
    }
    for i in 0..30u32 {
        let n = idem.count_failure("charge", i, day).await.unwrap();
        assert_eq!(n, 2, "failure count of {i} after SCRIPT FLUSH");
    }
    let v: u32 = idem
        .call("charge", "after-flush")
        .run(|| runs.body(7))
        .await
        .unwrap();
    assert_eq!(v, 7);
    for node in cluster.nodes() {
        // CLIENT SETINFO, which redis-rs sends and does without, is refused
        // by Redis 7.2+ and Valkey (minimal_acl_user_runs_the_core_semantics).
        let log = node.cli(&["ACL", "LOG"]);
        let denied = denied_commands(&log);
        assert!(
            denied.iter().all(|d| d.starts_with("client|setinfo")),
            "node {}: denied: {log}",
            node.port()
        );
    }
    // Without CLUSTER SLOTS the client cannot learn the topology.
    for node in cluster.nodes() {
        let mut r = rules.clone();
        r.retain(|x| *x != "+cluster|slots");
        set_user(node, &r);
    }
    let e = RedisStore::connect_cluster(&urls).await.unwrap_err();
    assert_acl_error(&e, "connect", "no CLUSTER SLOTS");
    // The PING on each new node connection is sent but its refusal is
    // ignored: without +ping idem works, and ACL LOG notes the refusals.
    for node in cluster.nodes() {
        let mut r = rules.clone();
        r.retain(|x| *x != "+ping");
        set_user(node, &r);
        node.cli(&["ACL", "LOG", "RESET"]);
    }
    let store = RedisStore::connect_cluster(&urls)
        .await
        .expect("connect without +ping");
    let idem = Idempotency::builder(store).namespace("payments").build();
    for i in 0..10u32 {
        let v: u32 = idem
            .call("charge", format!("no-ping-{i}"))
            .run(|| runs.body(i))
            .await
            .unwrap();
        assert_eq!(v, i);
    }
    // Only the PINGs (and, on Redis 7.2+ and Valkey, CLIENT SETINFO) were
    // refused. Keep +ping anyway: the cluster client
    // also PINGs to check a connection when it refreshes the topology,
    // and there a refusal counts as a failure.
    for node in cluster.nodes() {
        let log = node.cli(&["ACL", "LOG"]);
        let denied = denied_commands(&log);
        assert!(
            denied.iter().any(|d| d == "ping")
                && denied
                    .iter()
                    .all(|d| d == "ping" || d.starts_with("client|setinfo")),
            "{denied:?}\n{log}"
        );
    }
}

/// Starts a holder of `key` whose body takes `hold`, then `n` callers that
/// wait for it; returns their outcomes and how many bodies ran.
async fn wait_round(
    idem: &Idempotency,
    key: &str,
    n: usize,
    hold: Duration,
) -> (Vec<Outcome>, usize) {
    let runs = std::sync::Arc::new(Runs::default());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let holder = {
        let idem = idem.clone();
        let key = key.to_owned();
        let runs = runs.clone();
        tokio::spawn(async move {
            idem.call("charge", &key)
                .run_outcome(|| async move {
                    runs.record();
                    let _ = started_tx.send(());
                    tokio::time::sleep(hold).await;
                    Ok::<_, Error>(1u8)
                })
                .await
        })
    };
    started_rx.await.unwrap();
    let waiters: Vec<_> = (0..n)
        .map(|_| {
            let idem = idem.clone();
            let key = key.to_owned();
            let runs = runs.clone();
            tokio::spawn(async move {
                idem.call("charge", &key)
                    .wait(Duration::from_secs(30))
                    .run_outcome(|| runs.body(2u8))
                    .await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for w in waiters {
        let (v, o) = w.await.unwrap().unwrap();
        assert_eq!(v, 1);
        outcomes.push(o);
    }
    assert_eq!(holder.await.unwrap().unwrap(), (1, Outcome::Executed));
    (outcomes, runs.get())
}

/// With the documented ACL, waiters are notified (a shard channel is
/// subscribed while they wait) and nothing is denied; without the pub/sub
/// grants (the ACL of earlier releases), the subscriber's SSUBSCRIBE is
/// refused, and waiters fall back to polling: the same results, the body
/// run once. (The scripts' SPUBLISH is refused too when it is sent, but a
/// complete publishes only for a record a subscribed waiter marked, and
/// here none can subscribe: it is sent at most when a claim marks the
/// record in the moment before the refusal comes back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_poll_when_pub_sub_is_denied() {
    let server = RedisServer::start();
    for granted in [true, false] {
        let rules: Vec<String> = if granted {
            MINIMAL.to_vec()
        } else {
            MINIMAL
                .iter()
                .filter(|r| !PUB_SUB.contains(&r.as_str()))
                .cloned()
                .collect()
        };
        set_user(&server, &rules);
        server.cli(&["ACL", "LOG", "RESET"]);
        let store = RedisStore::connect(&user_url(&server)).await.unwrap();
        let idem = Idempotency::builder(store).namespace("payments").build();
        let key = format!("waited-{granted}");
        let watcher = {
            let server_url = server.url();
            tokio::spawn(async move {
                // The most shard channels seen while the call runs.
                let mut con = redis::Client::open(server_url)
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap();
                let mut most = 0;
                for _ in 0..40 {
                    let chans: Vec<String> = redis::cmd("PUBSUB")
                        .arg("SHARDCHANNELS")
                        .query_async(&mut con)
                        .await
                        .unwrap();
                    most = most.max(chans.len());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                most
            })
        };
        let (outcomes, ran) = wait_round(&idem, &key, 10, Duration::from_millis(300)).await;
        assert!(
            outcomes.iter().all(|o| *o == Outcome::Replayed),
            "{outcomes:?}"
        );
        assert_eq!(ran, 1, "granted={granted}: the body ran once");
        let subscribed = watcher.await.unwrap();
        let denied = denied_commands(&server.cli(&["ACL", "LOG"]));
        if granted {
            assert_eq!(
                subscribed, 1,
                "waiters did not subscribe to the key's channel"
            );
            assert!(
                denied.iter().all(|d| d.starts_with("client|setinfo")),
                "denied with the documented ACL: {denied:?}"
            );
        } else {
            assert_eq!(subscribed, 0);
            assert!(
                denied.iter().any(|d| d == "ssubscribe"),
                "expected SSUBSCRIBE refusals: {denied:?}"
            );
        }
    }
}
