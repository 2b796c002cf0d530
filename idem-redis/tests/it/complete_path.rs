//! How `complete` runs on the server under test: one plain `SET … IFEQ`
//! where the server has it (Valkey 8.1+, Redis 8.4+), the Lua script on
//! Redis 7; and that a plain complete that does not match answers exactly
//! as the script would. Run on Redis 7 by `cargo test`, and on Valkey by
//! `cargo xtask test`'s second pass (`IDEM_REDIS_SERVER=…/valkey-server`).

use idem_core::store::{
    Claim, ClaimReply, Complete, Store, Token, ValueKind, WatchStore, WriteReply,
};
use idem_core::{Error, Fingerprint};
use idem_redis::RedisStore;
use idem_testkit::RedisServer;
use std::time::Duration;

const TTL: Duration = Duration::from_secs(60);

fn claim<'a>(key: &'a str, token: &'a Token, fp: Option<&'a Fingerprint>) -> Claim<'a> {
    Claim::new(key, token, Duration::from_millis(100), TTL).fingerprint(fp)
}

/// `field:value` of `INFO <section>`.
fn info_field(server: &RedisServer, section: &str, field: &str) -> Option<String> {
    let info = server.cli(&["INFO", section]);
    info.lines().find_map(|l| {
        l.trim()
            .strip_prefix(&format!("{field}:"))
            .map(str::to_owned)
    })
}

/// The path a server of this name and version must take.
fn expected_path(server: &RedisServer) -> &'static str {
    let (name, version) = match info_field(server, "server", "valkey_version") {
        Some(v) => ("valkey", v),
        None => (
            "redis",
            info_field(server, "server", "redis_version").unwrap_or_default(),
        ),
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let at = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let min = if name == "valkey" { (8, 1) } else { (8, 4) };
    if at >= min { "set-ifeq" } else { "script" }
}

/// How many `EVALSHA` calls the server has run since its last reset.
fn evalsha_calls(server: &RedisServer) -> u64 {
    calls(server, "evalsha")
}

/// How many times the server ran `command` since its last reset, scripts'
/// calls included (`INFO commandstats`).
fn calls(server: &RedisServer, command: &str) -> u64 {
    info_field(server, "commandstats", &format!("cmdstat_{command}"))
        .and_then(|s| {
            s.split(',')
                .find_map(|kv| kv.strip_prefix("calls=").map(str::to_owned))
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The raw record under `key`.
fn raw(server: &RedisServer, key: &str) -> Vec<u8> {
    redis::cmd("GET")
        .arg(key)
        .query(&mut server.connection())
        .expect("GET the record")
}

/// Publish only when someone waits: a caller subscribed
/// to the key marks the pending record with its claim (the record's bytes
/// change, its TTL and fields stay, the holder's `extend` keeps the mark);
/// the holder's complete then does not match its `SET … IFEQ` (Valkey
/// 8.1+) and the script, which publishes for a marked record, wakes the
/// waiter. Exactly one `SPUBLISH`, on either path.
#[tokio::test]
async fn a_waiter_marks_the_record_and_the_complete_publishes_once() {
    let server = RedisServer::start();
    let holder = connect(&server).await;
    let waiter = connect(&server).await;
    let path = expected_path(&server);
    let (mine, theirs) = (Token::random(), Token::random());
    let long = |key, token| {
        let mut long = claim(key, token, None);
        long.lease = Duration::from_secs(30);
        long
    };
    assert_eq!(
        holder.claim(long("k:w", &mine)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    let written = raw(&server, "k:w");
    // A claim before subscribing marks nothing.
    assert!(matches!(
        waiter.claim(long("k:w", &theirs)).await.unwrap(),
        ClaimReply::InProgress { .. }
    ));
    assert_eq!(
        raw(&server, "k:w"),
        written,
        "an unsubscribed claim marked the record"
    );
    let mut watch = waiter
        .watch("k:w")
        .await
        .expect("a store from a URL watches keys");
    for _ in 0..2 {
        // Marked once: the second claim finds the mark and writes nothing.
        assert!(matches!(
            waiter.claim(long("k:w", &theirs)).await.unwrap(),
            ClaimReply::InProgress { .. }
        ));
        assert_eq!(raw(&server, "k:w"), [&written[..], b"|0:0:"].concat());
    }
    let left: i64 = server.cli(&["PTTL", "k:w"]).parse().unwrap();
    assert!(
        left > 50_000 && left <= 60_000,
        "PTTL {left}: the mark kept the TTL"
    );
    // The holder renews its lease: the mark stays.
    assert_eq!(
        holder
            .extend("k:w", &mine, Duration::from_secs(30))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert!(
        raw(&server, "k:w").ends_with(b"|0:0:"),
        "extend dropped the mark"
    );
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    assert_eq!(
        holder
            .complete(Complete::of_claim(
                &long("k:w", &mine),
                ValueKind::Json,
                b"5"
            ))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        calls(&server, "spublish"),
        1,
        "{path}: the marked record's complete"
    );
    assert_eq!(evalsha_calls(&server), 1, "{path}: the script completed it");
    tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("no notification for the completed key");
    assert_eq!(raw(&server, "k:w"), b"1C\x005");

    // Without the extend, on the plain SET path: the IFEQ does not match
    // the marked record, the script completes and publishes.
    let (mine, theirs) = (Token::random(), Token::random());
    holder.claim(long("k:w2", &mine)).await.unwrap();
    assert!(matches!(
        waiter.claim(long("k:w2", &theirs)).await.unwrap(),
        ClaimReply::InProgress { .. }
    ));
    let mut watch = waiter.watch("k:w2").await.expect("watches");
    waiter.claim(long("k:w2", &theirs)).await.unwrap();
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    assert_eq!(
        holder
            .complete(Complete::of_claim(
                &long("k:w2", &mine),
                ValueKind::Json,
                b"6"
            ))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(calls(&server, "spublish"), 1, "{path}");
    tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("no notification for the completed key");
}

/// Claims each of `keys` with its token in one batch: all fresh.
async fn claim_fresh(store: &RedisStore, keys: &[String], tokens: &[Token]) {
    let claims: Vec<Claim<'_>> = keys
        .iter()
        .zip(tokens)
        .map(|(k, t)| claim(k, t, None))
        .collect();
    for reply in store.claim_batch(&claims).await {
        assert_eq!(reply.unwrap(), ClaimReply::Acquired { attempt: 1 });
    }
}

async fn connect(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the test server {}: {e}", server.url()))
}

#[tokio::test]
async fn complete_takes_the_servers_path_and_keeps_ttl_and_fingerprint() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let path = expected_path(&server);
    assert_eq!(store.complete_path(), path, "server {}", store.server());

    let (token, fp) = (Token::random(), Fingerprint::of_bytes(b"payload"));
    assert_eq!(
        store.claim(claim("k:1", &token, Some(&fp))).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let mine = claim("k:1", &token, Some(&fp));
    let reply = store.complete(Complete::of_claim(&mine, ValueKind::Json, b"42"));
    assert_eq!(reply.await.unwrap(), WriteReply::Done);
    let scripts = evalsha_calls(&server);
    match path {
        "set-ifeq" => assert_eq!(scripts, 0, "the plain SET path ran a script"),
        _ => {
            assert_eq!(scripts, 1, "the script path ran {scripts} scripts");
            // complete_batch for one key, on its common path: the record
            // read once and compared whole, not complete's read and parse.
            assert_eq!(
                (calls(&server, "mget"), calls(&server, "get")),
                (1, 0),
                "the script path did not compare the claim's record"
            );
        }
    }
    // No one waited: nothing published, on either path.
    assert_eq!(
        calls(&server, "spublish"),
        0,
        "{path}: a complete no one waits on published"
    );

    // The claim's fingerprint and the claim's TTL stay.
    let left: i64 = server.cli(&["PTTL", "k:1"]).parse().unwrap();
    assert!(left > 0 && left <= 60_000, "PTTL {left}");
    match store
        .claim(claim("k:1", &Token::random(), Some(&fp)))
        .await
        .unwrap()
    {
        ClaimReply::Completed(c) => {
            assert_eq!(&c.value[..], b"42");
            assert_eq!(c.fingerprint, Some(fp));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_plain_complete_that_does_not_match_answers_as_the_script() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let (old, new) = (Token::random(), Token::random());

    // Lease lost, taken over: OtherOwner; then completed by the new owner:
    // AlreadyCompleted.
    store.claim(claim("k:late", &old, None)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.claim(claim("k:late", &new, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    let s = &store;
    let complete = |token| {
        let mine = claim("k:late", token, None);
        async move {
            s.complete(Complete::of_claim(&mine, ValueKind::Json, b"1"))
                .await
        }
    };
    assert_eq!(complete(&old).await.unwrap(), WriteReply::OtherOwner);
    store.claim(claim("k:late2", &old, None)).await.unwrap();
    assert_eq!(complete(&new).await.unwrap(), WriteReply::Done);
    // Re-sent after its reply was lost: the same result, done.
    assert_eq!(complete(&new).await.unwrap(), WriteReply::Done);
    let complete2 = |token, value: &'static [u8]| {
        let mine = claim("k:late2", token, None);
        async move {
            s.complete(Complete::of_claim(&mine, ValueKind::Json, value))
                .await
        }
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.claim(claim("k:late2", &new, None)).await.unwrap();
    assert_eq!(complete2(&new, b"1").await.unwrap(), WriteReply::Done);
    assert_eq!(
        complete2(&old, b"2").await.unwrap(),
        WriteReply::AlreadyCompleted
    );

    // The record vanished (expired, deleted): Missing.
    let t = Token::random();
    store.claim(claim("k:gone", &t, None)).await.unwrap();
    assert_eq!(server.cli(&["DEL", "k:gone"]), "1");
    assert_eq!(
        store
            .complete(Complete::of_claim(
                &claim("k:gone", &t, None),
                ValueKind::Json,
                b"1"
            ))
            .await
            .unwrap(),
        WriteReply::Missing
    );

    // Another Redis type under the key: the typed error, nothing written.
    store.claim(claim("k:list", &t, None)).await.unwrap();
    assert_eq!(server.cli(&["DEL", "k:list"]), "1");
    assert_eq!(server.cli(&["RPUSH", "k:list", "x"]), "1");
    match store
        .complete(Complete::of_claim(
            &claim("k:list", &t, None),
            ValueKind::Json,
            b"1",
        ))
        .await
    {
        Err(Error::Corrupt { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(server.cli(&["LLEN", "k:list"]), "1");

    // Extended: the record's lease end changed; still done.
    let t = Token::random();
    store.claim(claim("k:ext", &t, None)).await.unwrap();
    assert_eq!(
        store
            .extend("k:ext", &t, Duration::from_secs(5))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        store
            .complete(Complete::of_claim(
                &claim("k:ext", &t, None),
                ValueKind::Json,
                b"7"
            ))
            .await
            .unwrap(),
        WriteReply::Done
    );
}

#[tokio::test]
async fn a_store_from_a_connection_learns_the_server_at_its_first_complete() {
    let server = RedisServer::start();
    let manager = redis::aio::ConnectionManager::new(server.client())
        .await
        .expect("connect to the test server");
    let store = RedisStore::from_manager(manager);
    assert_eq!(store.complete_path(), "script");
    assert_eq!(store.server(), "unknown");
    let first = Token::random();
    store.claim(claim("k:first", &first, None)).await.unwrap();
    assert_eq!(
        store
            .complete(Complete::of_claim(
                &claim("k:first", &first, None),
                ValueKind::Json,
                b"1"
            ))
            .await
            .unwrap(),
        WriteReply::Done
    );
    let path = expected_path(&server);
    assert_eq!(store.complete_path(), path, "server {}", store.server());

    let next = Token::random();
    store.claim(claim("k:next", &next, None)).await.unwrap();
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    assert_eq!(
        store
            .complete(Complete::of_claim(
                &claim("k:next", &next, None),
                ValueKind::Json,
                b"2"
            ))
            .await
            .unwrap(),
        WriteReply::Done
    );
    let scripts = evalsha_calls(&server);
    assert_eq!(
        scripts,
        u64::from(path == "script"),
        "{path}: {scripts} scripts"
    );
}

/// A batch takes the same path as single calls: claims made fresh in a
/// batch are completed in a batch with plain `SET … IFEQ`s (no script on
/// Valkey 8.1+) or with one `complete_batch` script call for all (Redis
/// 7), and an item whose record was taken over meanwhile is answered as
/// the script answers it.
#[tokio::test]
async fn a_batch_completes_on_the_servers_path() {
    use idem_core::store::Finish;
    let server = RedisServer::start();
    let store = connect(&server).await;
    let path = expected_path(&server);
    let tokens: Vec<Token> = (0..8).map(|_| Token::random()).collect();
    let keys: Vec<String> = (0..8).map(|i| format!("b:{i}")).collect();
    claim_fresh(&store, &keys, &tokens).await;
    // b:7 is taken over by another owner after its lease (100 ms).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let thief = Token::random();
    assert_eq!(
        store.claim(claim("b:7", &thief, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let ops: Vec<Finish<'_>> = keys
        .iter()
        .zip(&tokens)
        .map(|(key, token)| {
            Finish::Complete(Complete::of_claim(
                &claim(key, token, None),
                ValueKind::Json,
                b"1",
            ))
        })
        .collect();
    let replies: Vec<WriteReply> = store
        .finish_batch(&ops)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // The first seven completed. The lease of 100 ms has run out for all
    // of them, but a record no one took over is still its owner's.
    assert_eq!(&replies[..7], &[WriteReply::Done; 7]);
    assert_eq!(replies[7], WriteReply::OtherOwner);
    let scripts = evalsha_calls(&server);
    match path {
        // Only the one that did not match asks the script.
        "set-ifeq" => assert_eq!(scripts, 1, "the plain SET path ran {scripts} scripts"),
        // One `complete_batch` call for the eight (Redis 7: a script
        // call's own cost is most of a complete's).
        _ => assert_eq!(scripts, 1, "the script path ran {scripts} scripts"),
    }
}

/// A batch of more keys than the script reads at once (`complete_batch`
/// reads them with one `MGET` per 1,000 on Redis 7) answers each key as
/// its own: keys taken over on either side of each chunk's edge are
/// `OtherOwner`, a key turned into a list mid-chunk gets its typed error,
/// and every other key is completed with its own value.
#[tokio::test]
async fn a_batch_of_several_read_chunks_answers_each_key_as_its_own() {
    use idem_core::store::Finish;
    let server = RedisServer::start();
    let store = connect(&server).await;
    const N: usize = 2_100;
    let tokens: Vec<Token> = (0..N).map(|_| Token::random()).collect();
    let keys: Vec<String> = (0..N).map(|i| format!("chunk:{i}")).collect();
    claim_fresh(&store, &keys, &tokens).await;
    let taken = [0, 999, 1_000, 1_999, 2_000, N - 1];
    let listed = 1_500;
    // Their leases (100 ms) run out, and another owner takes these over.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let thief = Token::random();
    for &i in &taken {
        assert_eq!(
            store.claim(claim(&keys[i], &thief, None)).await.unwrap(),
            ClaimReply::Acquired { attempt: 2 }
        );
    }
    server.cli(&["DEL", &keys[listed]]);
    server.cli(&["LPUSH", &keys[listed], "x"]);
    let values: Vec<String> = (0..N).map(|i| format!("{i}")).collect();
    let ops: Vec<Finish<'_>> = (0..N)
        .map(|i| {
            Finish::Complete(Complete::of_claim(
                &claim(&keys[i], &tokens[i], None),
                ValueKind::Json,
                values[i].as_bytes(),
            ))
        })
        .collect();
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let replies = store.finish_batch(&ops).await;
    assert_eq!(replies.len(), N);
    if expected_path(&server) == "script" {
        // Three reads for the batch; only the keys that were not as their
        // claim left them are read again, by the complete step (the list
        // twice: MGET reads it as nil, so its compare reads it alone).
        assert_eq!(calls(&server, "mget"), 3);
        assert_eq!(calls(&server, "get"), taken.len() as u64 + 2);
    }
    for (i, reply) in replies.into_iter().enumerate() {
        if taken.contains(&i) {
            assert_eq!(reply.unwrap(), WriteReply::OtherOwner, "key {i}");
        } else if i == listed {
            assert!(
                matches!(reply, Err(Error::Corrupt { .. })),
                "key {i}: {reply:?}"
            );
        } else {
            assert_eq!(reply.unwrap(), WriteReply::Done, "key {i}");
            let record = raw(&server, &keys[i]);
            assert!(
                record.ends_with(values[i].as_bytes()) && record[1] == b'C',
                "key {i} holds {record:?}"
            );
        }
    }
}

/// Nothing is kept per call between a claim and its complete: the
/// complete rebuilds the pending record from the claim's
/// terms, so a store that never saw the claim (another connection, as
/// after a process restart with the same owner token) completes it with
/// one plain `SET … IFEQ` on Valkey 8.1+, and terms that are not the
/// record's (another lease) fall back to the script and still complete.
#[tokio::test]
async fn a_complete_needs_nothing_kept_since_its_claim() {
    let server = RedisServer::start();
    let (claimer, completer) = (connect(&server).await, connect(&server).await);
    let path = expected_path(&server);
    let (token, fp) = (Token::random(), Fingerprint::of_bytes(b"order-7"));
    let mine = claim("k:far", &token, Some(&fp));
    assert_eq!(
        claimer.claim(mine).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let done = completer.complete(Complete::of_claim(&mine, ValueKind::Json, b"9"));
    assert_eq!(done.await.unwrap(), WriteReply::Done);
    let scripts = evalsha_calls(&server);
    assert_eq!(
        scripts,
        u64::from(path == "script"),
        "{path}: {scripts} scripts"
    );
    assert_eq!(
        raw(&server, "k:far"),
        [&b"1C\x10"[..], fp.as_bytes(), b"9"].concat()
    );

    let other = Token::random();
    let theirs = claim("k:terms", &other, None);
    claimer.claim(theirs).await.unwrap();
    let mut longer = theirs;
    longer.lease = Duration::from_secs(5);
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let done = completer.complete(Complete::of_claim(&longer, ValueKind::Json, b"3"));
    assert_eq!(done.await.unwrap(), WriteReply::Done);
    assert_eq!(evalsha_calls(&server), 1, "{path}: the script answered");
    assert_eq!(raw(&server, "k:terms"), b"1C\x003");
}

/// A call whose lease was renewed (its record's lease end moved) completes
/// through the script at once: no plain `SET … IFEQ` is sent that could
/// not match. `INFO commandstats` counts the scripts' own commands: each
/// script here (the renewals, the complete) writes with one `SET`, and the
/// claim is one more.
#[tokio::test]
async fn a_renewed_call_completes_through_the_script_at_once() {
    let server = RedisServer::start();
    let idem = short_lease(&server).await;
    assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let v: u32 = idem
        .call("renewed", "k")
        .run(|| async {
            // Past a third of the lease, twice: renewed.
            tokio::time::sleep(Duration::from_millis(250)).await;
            Ok::<_, Error>(5)
        })
        .await
        .unwrap();
    assert_eq!(v, 5);
    only_claims_and_scripts_set(&server, 1, 2, "a single call");
}

/// A runtime on `server` whose calls renew their lease after 100 ms.
async fn short_lease(server: &RedisServer) -> idem_core::Idempotency {
    idem_core::Idempotency::builder(connect(server).await)
        .lease(Duration::from_millis(300))
        .build()
}

/// Every `SET` since the last reset was one of `claims` claims' or a
/// script's own (at least `scripts` scripts ran: renewals and completes),
/// so no plain `SET … IFEQ` was sent.
fn only_claims_and_scripts_set(server: &RedisServer, claims: u64, scripts: u64, what: &str) {
    let ran = evalsha_calls(server);
    let stats = server.cli(&["INFO", "commandstats"]);
    assert!(ran >= scripts, "{what}: no renewals and completes: {stats}");
    assert_eq!(
        calls(server, "set"),
        claims + ran,
        "{what}: a SET besides the claims' and the scripts': {stats}"
    );
}

/// As [`a_renewed_call_completes_through_the_script_at_once`], for calls
/// of a [`Batch`](idem_core::Batch) and of a [`CallGroup`](idem_core::CallGroup):
/// each renewed call leaves the shared finish round trip (which completes
/// with the claim's bytes) and completes through the script on its own.
/// Every `SET` is a claim's or a script's: none is a plain complete that
/// could not match, and on Redis 7 no batch script covers them.
#[tokio::test]
async fn renewed_calls_of_a_batch_or_a_group_complete_through_the_script_at_once() {
    let server = RedisServer::start();
    let idem = short_lease(&server).await;
    // Several thirds of the lease: renewed.
    let slow = |i: usize| async move {
        tokio::time::sleep(Duration::from_millis(450)).await;
        Ok::<_, Error>(i)
    };
    for grouped in [false, true] {
        assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
        let scope = if grouped { "group" } else { "batch" };
        let values: Vec<usize> = if grouped {
            let group = idem.group(2);
            let calls = (0..2).map(|i| idem.call(scope, i).in_group(&group).run(move || slow(i)));
            futures_util::future::join_all(calls).await
        } else {
            idem_core::Batch::from(vec![idem.call(scope, 0), idem.call(scope, 1)])
                .run(slow)
                .await
        }
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap();
        assert_eq!(values, [0, 1]);
        only_claims_and_scripts_set(&server, 2, 4, scope);
        for i in 0..2 {
            let record = raw(&server, &format!("idem:{scope}:{i}"));
            assert!(record.starts_with(b"1C"), "{scope} {i}: completed");
        }
    }
}
