//! The bad-input catalogue (docs/reliability.md): every bad key, value,
//! stored record and configuration gives a typed error that names the
//! problem and the fix; the body never runs when refused; other keys are
//! not affected; nothing panics. Each case runs against `MemoryStore` and
//! `RedisStore` wherever it applies (raw records exist only in Redis).

use idem::store::{Complete, Store, Token, WriteReply};
use idem::{
    Error, FailMode, Idempotency, IdempotencyBuilder, KeyError, KeyPart, MemoryStore, Outcome,
    RedisStore,
};
use idem_testkit::{Runs, TestContext};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

const SENTINEL: u32 = 41;

/// Fresh builders over an empty `MemoryStore` and over the context's Redis
/// (one Redis per test: tests run in parallel).
fn builders(ctx: &TestContext) -> Vec<(&'static str, IdempotencyBuilder)> {
    ["memory", "redis"]
        .into_iter()
        .map(|store| (store, builder_clone(store, ctx)))
        .collect()
}

/// Stores the sentinel result another key keeps through every bad input.
async fn plant_sentinel(idem: &Idempotency) {
    let (v, o) = idem
        .call("sentinel", "keep-me")
        .run_outcome(|| async { Ok::<_, Error>(SENTINEL) })
        .await
        .expect("the sentinel call works");
    assert_eq!((v, o), (SENTINEL, Outcome::Executed));
}

/// The sentinel still replays: the bad input cost nothing else.
async fn assert_sentinel(idem: &Idempotency, case: &str) {
    let (v, o) = idem
        .call("sentinel", "keep-me")
        .run_outcome(|| async { Ok::<_, Error>(0u32) })
        .await
        .unwrap_or_else(|e| panic!("{case}: the sentinel key was affected: {e}"));
    assert_eq!((v, o), (SENTINEL, Outcome::Replayed), "{case}: sentinel");
}

/// A `Display` that fails: renders as an empty key, which is refused.
struct FailingDisplay;

impl fmt::Display for FailingDisplay {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        Err(fmt::Error)
    }
}

// ---------------------------------------------------------------- keys ---

#[tokio::test]
async fn refused_keys_never_reach_the_store() {
    let ctx = TestContext::redis().await;
    let long_unicode = "é".repeat(128); // 128 chars, 256 bytes: the limit is in bytes
    let keys: Vec<(&str, String, &str)> = vec![
        ("empty", String::new(), "is empty"),
        (
            "256 bytes",
            "k".repeat(256),
            "256 bytes, over the 255-byte limit",
        ),
        (
            "256 bytes of unicode",
            long_unicode,
            "over the 255-byte limit",
        ),
        ("newline", "order-1\n".into(), "control character at byte 7"),
        ("tab", "a\tb".into(), "control character at byte 1"),
        (
            "ANSI escape",
            "\x1b[31mred".into(),
            "control character at byte 0",
        ),
        ("NUL", "a\0b".into(), "control character at byte 1"),
        ("C1 control U+0085", "a\u{85}b".into(), "control character"),
        ("DEL", "a\x7fb".into(), "control character"),
    ];
    for (store, builder) in builders(&ctx) {
        let idem = builder.build();
        plant_sentinel(&idem).await;
        let before = ctx.dbsize();
        let runs = Runs::default();
        for (case, key, says) in &keys {
            let r: Result<u32, Error> = idem.call("charge", key).run(|| runs.body(1)).await;
            match r {
                Err(Error::InvalidKey(ref e)) => {
                    let msg = r.as_ref().unwrap_err().to_string();
                    assert!(msg.contains(says), "{store}/{case}: {msg}");
                    assert!(
                        msg.starts_with("invalid idempotency key: the key"),
                        "{store}/{case}: {msg}"
                    );
                    match e {
                        KeyError::Empty { part }
                        | KeyError::TooLong { part, .. }
                        | KeyError::ControlChar { part, .. } => {
                            assert_eq!(*part, KeyPart::Key)
                        }
                        other => panic!("{store}/{case}: {other:?}"),
                    }
                }
                other => panic!("{store}/{case}: expected InvalidKey, got {other:?}"),
            }
        }
        // The fixes the messages name.
        let too_long = idem
            .call("charge", "k".repeat(256))
            .run(|| runs.body(1))
            .await;
        assert!(
            too_long
                .unwrap_err()
                .to_string()
                .contains("hash long inputs (e.g. SHA-256 hex)")
        );
        let empty = idem.call("charge", "").run(|| runs.body(1)).await;
        assert!(
            empty
                .unwrap_err()
                .to_string()
                .contains("pass a non-empty value")
        );
        // A key whose Display fails is an empty key, not a panic.
        let failing = idem
            .call("charge", FailingDisplay)
            .run(|| runs.body(1))
            .await;
        assert!(
            matches!(
                failing,
                Err(Error::InvalidKey(KeyError::Empty { part: KeyPart::Key }))
            ),
            "{store}: {failing:?}"
        );
        // Scopes are checked the same way.
        let scopes: Vec<(String, &str)> = vec![
            (String::new(), "the scope is empty"),
            ("payments.".repeat(40), "the scope is 360 bytes"),
            (
                "charge\nv2".into(),
                "the scope contains a control character at byte 6",
            ),
        ];
        for (scope, says) in &scopes {
            let r: Result<u32, Error> = idem.call(scope, "order-1").run(|| runs.body(1)).await;
            let msg = r.as_ref().unwrap_err().to_string();
            assert!(
                matches!(r, Err(Error::InvalidKey(ref e)) if matches!(e, KeyError::Empty { part: KeyPart::Scope } | KeyError::TooLong { part: KeyPart::Scope, .. } | KeyError::ControlChar { part: KeyPart::Scope, .. })),
                "{store}/{scope:?}: {r:?}"
            );
            assert!(msg.contains(says), "{store}/{scope:?}: {msg}");
        }
        assert_eq!(runs.get(), 0, "{store}: a refused key ran the body");
        if store == "redis" {
            assert_eq!(ctx.dbsize(), before, "a refused key wrote to Redis");
        }
        assert_sentinel(&idem, store).await;
    }
}

#[tokio::test]
async fn unusual_but_valid_keys_work() {
    let ctx = TestContext::redis().await;
    let keys: Vec<(&str, String)> = vec![
        ("exactly 255 bytes", "k".repeat(255)),
        ("hash tag braces", "{user:1000}:order-7".into()),
        ("empty hash tag", "{}".into()),
        ("unicode", "ключ-🔑-キー-ünï".into()),
        ("spaces", "  order 7  ".into()),
        ("colons and percent", "a:b%3Ac%".into()),
        ("quotes and JSON", "{\"id\":\"o'7\"}".into()),
        ("glob characters", "order-*?[x]".into()),
        (
            "bidi override (format char, not control)",
            "\u{202e}7-redro".into(),
        ),
    ];
    for (store, builder) in builders(&ctx) {
        let idem = builder.build();
        for (case, key) in &keys {
            let runs = Runs::default();
            let first = idem
                .call("charge", key)
                .run_outcome(|| runs.body(case.len()))
                .await;
            let again = idem.call("charge", key).run_outcome(|| runs.body(0)).await;
            assert_eq!(
                first.unwrap(),
                (case.len(), Outcome::Executed),
                "{store}/{case}"
            );
            assert_eq!(
                again.unwrap(),
                (case.len(), Outcome::Replayed),
                "{store}/{case}"
            );
            assert_eq!(runs.get(), 1, "{store}/{case}");
        }
        // A 255-byte scope is accepted too, and the stored key is still fine.
        let scope = "s".repeat(255);
        let r: Result<u8, Error> = idem.call(&scope, "k").run(|| async { Ok(1) }).await;
        assert_eq!(r.unwrap(), 1, "{store}: 255-byte scope");
        // `:` is escaped in scopes, so scope/key boundaries never blur.
        let a: u8 = idem
            .call("a:b", "c")
            .run(|| async { Ok::<_, Error>(1) })
            .await
            .unwrap();
        let b: u8 = idem
            .call("a", "b:c")
            .run(|| async { Ok::<_, Error>(2) })
            .await
            .unwrap();
        assert_eq!(
            (a, b),
            (1, 2),
            "{store}: (\"a:b\",\"c\") and (\"a\",\"b:c\") collided"
        );
    }
    // The exact stored key: namespace:scope:key, the key verbatim.
    let mut con = ctx.server().connection();
    let exists = |con: &mut redis::Connection, k: &str| -> bool {
        redis::cmd("EXISTS").arg(k).query::<i64>(con).unwrap() == 1
    };
    assert!(exists(&mut con, "idem:charge:{user:1000}:order-7"));
    assert!(exists(&mut con, "idem:charge:ключ-🔑-キー-ünï"));
    assert!(exists(&mut con, "idem:a%3Ab:c"));
    assert!(exists(&mut con, "idem:a:b:c"));
}

// -------------------------------------------------------------- values ---

#[tokio::test]
async fn oversized_result_is_returned_once_then_too_large() {
    let ctx = TestContext::redis().await;
    let big = "x".repeat(100); // 102 bytes of JSON
    let fits = "y".repeat(62); // exactly 64 bytes of JSON
    for store in ["memory", "redis"] {
        for cache in [false, true] {
            let b = if cache {
                builder_clone(store, &ctx).local_cache(100)
            } else {
                builder_clone(store, &ctx)
            };
            let idem = b
                .max_value_size(64)
                .namespace(format!("big{cache}"))
                .build();
            let runs = Runs::default();
            let first = idem
                .call("report", "r-1")
                .run_outcome(|| runs.body(big.clone()))
                .await;
            assert_eq!(
                first.unwrap(),
                (big.clone(), Outcome::Executed),
                "{store}: first caller gets its value"
            );
            for _ in 0..2 {
                let again: Result<String, Error> = idem
                    .call("report", "r-1")
                    .run(|| runs.body("ran again".into()))
                    .await;
                match again {
                    Err(
                        ref e @ Error::TooLarge {
                            size: 102,
                            limit: 64,
                        },
                    ) => {
                        let msg = e.to_string();
                        assert!(msg.contains("102 bytes, over the 64-byte limit"), "{msg}");
                        assert!(msg.contains("max_value_size"), "{msg}");
                    }
                    other => panic!("{store} cache={cache}: expected TooLarge, got {other:?}"),
                }
            }
            assert_eq!(runs.get(), 1, "{store}: the body ran again after TooLarge");
            // At the limit exactly: stored and replayed.
            let at_limit = idem
                .call("report", "r-2")
                .run(|| runs.body(fits.clone()))
                .await;
            let replay: Result<String, Error> = idem
                .call("report", "r-2")
                .run(|| runs.body(String::new()))
                .await;
            assert_eq!(
                (at_limit.unwrap(), replay.unwrap()),
                (fits.clone(), fits.clone())
            );
            assert_eq!(runs.get(), 2);
        }
    }
}

/// A builder over the same store `store` names (memory: a fresh one).
fn builder_clone(store: &str, ctx: &TestContext) -> IdempotencyBuilder {
    match store {
        "memory" => Idempotency::builder(MemoryStore::new()),
        _ => ctx.builder(),
    }
}

#[tokio::test]
async fn unserializable_result_is_returned_once_then_codec() {
    let ctx = TestContext::redis().await;
    // serde_json cannot write a map whose keys are not strings or numbers.
    let value: HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    for (store, builder) in builders(&ctx) {
        let idem = builder.build();
        plant_sentinel(&idem).await;
        let runs = Runs::default();
        let first = idem
            .call("grid", "g-1")
            .run_outcome(|| runs.body(value.clone()))
            .await;
        assert_eq!(
            first.unwrap(),
            (value.clone(), Outcome::Executed),
            "{store}"
        );
        let again: Result<HashMap<(u8, u8), u8>, Error> = idem
            .call("grid", "g-1")
            .run(|| runs.body(HashMap::new()))
            .await;
        match again {
            Err(Error::Codec { reason: msg, .. }) => {
                assert!(msg.contains("could not be serialized"), "{msg}");
                assert!(msg.contains("key must be a string"), "{msg}");
                assert!(msg.contains("fix the type's Serialize impl"), "{msg}");
            }
            other => panic!("{store}: expected Codec, got {other:?}"),
        }
        assert_eq!(runs.get(), 1, "{store}: the body ran again");
        assert_sentinel(&idem, store).await;
    }
}

#[tokio::test]
async fn unserializable_fingerprint_is_refused_before_the_body() {
    let ctx = TestContext::redis().await;
    let payload: HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    for (store, builder) in builders(&ctx) {
        let idem = builder.build();
        let before = ctx.dbsize();
        let runs = Runs::default();
        let r: Result<u8, Error> = idem
            .call("charge", "order-1")
            .fingerprint(&payload)
            .run(|| runs.body(1))
            .await;
        match r {
            Err(Error::Codec { reason: msg, .. }) => assert!(
                msg.contains("fingerprint value cannot be serialized"),
                "{msg}"
            ),
            other => panic!("{store}: expected Codec, got {other:?}"),
        }
        assert_eq!(runs.get(), 0, "{store}");
        if store == "redis" {
            assert_eq!(ctx.dbsize(), before);
        }
        // The key is free: the same call with a usable fingerprint runs.
        let ok: u8 = idem
            .call("charge", "order-1")
            .fingerprint(&[1, 2, 3])
            .run(|| runs.body(7))
            .await
            .unwrap();
        assert_eq!((ok, runs.get()), (7, 1));
    }
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct ReceiptV2 {
    id: String,
    amount: u64,
}

#[tokio::test]
async fn changed_result_type_is_codec_naming_the_type() {
    let ctx = TestContext::redis().await;
    for (store, builder) in builders(&ctx) {
        let idem = builder.build();
        let runs = Runs::default();
        // Deployment 1 stored a u32 ...
        let v1: u32 = idem
            .call("charge", "order-1")
            .run(|| runs.body(500u32))
            .await
            .unwrap();
        assert_eq!(v1, 500);
        // ... deployment 2 reads the same key as a struct.
        let v2: Result<ReceiptV2, Error> = idem
            .call("charge", "order-1")
            .run(|| {
                runs.body(ReceiptV2 {
                    id: "r".into(),
                    amount: 1,
                })
            })
            .await;
        match v2 {
            Err(Error::Codec { reason: msg, .. }) => {
                assert!(
                    // The type's path: `it::bad_input::ReceiptV2` in the
                    // one test binary.
                    msg.contains("does not deserialize as `")
                        && msg.contains("bad_input::ReceiptV2`"),
                    "{msg}"
                );
                assert!(msg.contains("change the scope"), "{msg}");
            }
            other => panic!("{store}: expected Codec, got {other:?}"),
        }
        assert_eq!(runs.get(), 1, "{store}: the body ran for a type mismatch");
        // The record is intact: the old type still reads it (rollback works),
        // and a versioned scope runs the new type cleanly.
        let old: u32 = idem
            .call("charge", "order-1")
            .run(|| runs.body(0u32))
            .await
            .unwrap();
        assert_eq!(old, 500);
        let new: ReceiptV2 = idem
            .call("charge.v2", "order-1")
            .run(|| {
                runs.body(ReceiptV2 {
                    id: "r".into(),
                    amount: 1,
                })
            })
            .await
            .unwrap();
        assert_eq!(new.amount, 1);
    }
}

// ------------------------------------------------ stored records (Redis) ---

const KEY: &str = "idem:charge:order-1";

/// Writes `setup` under the key a call for ("charge", "order-1") uses,
/// then checks the call refuses with `Error::Corrupt` saying `says`, runs
/// no body, leaves the record untouched, answers the same again, and that
/// the sentinel survived. Then deleting the key (the advice) frees it.
async fn assert_corrupt(
    ctx: &TestContext,
    case: &str,
    setup: &dyn Fn(&mut redis::Connection),
    says: &[&str],
) {
    for fail_mode in [FailMode::Closed, FailMode::Open] {
        let idem = ctx.builder().fail_mode(fail_mode).build();
        plant_sentinel_once(&idem).await;
        let mut con = ctx.server().connection();
        let _: () = redis::cmd("DEL").arg(KEY).query(&mut con).unwrap();
        setup(&mut con);
        let dump = |con: &mut redis::Connection| -> Vec<u8> {
            redis::cmd("DUMP").arg(KEY).query(con).unwrap()
        };
        let before = dump(&mut con);
        let runs = Runs::default();
        for wait in [None, Some(Duration::from_secs(2))] {
            let mut call = idem.call("charge", "order-1");
            if let Some(w) = wait {
                call = call.wait(w);
            }
            let started = std::time::Instant::now();
            let r: Result<u32, Error> = call.run(|| runs.body(1)).await;
            match r {
                Err(Error::Corrupt {
                    reason: ref msg, ..
                }) => {
                    for s in says {
                        assert!(msg.contains(s), "{case}: {msg:?} lacks {s:?}");
                    }
                    let full = r.as_ref().unwrap_err().to_string();
                    assert!(
                        full.starts_with("stored idempotency record is unreadable"),
                        "{full}"
                    );
                }
                other => {
                    panic!("{case} ({fail_mode:?}, wait {wait:?}): expected Corrupt, got {other:?}")
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "{case}: waited on a corrupt record"
            );
        }
        // Store-level writes by a token that does not own the record never
        // change it (they answer Corrupt, or AlreadyCompleted / OtherOwner
        // for a readable envelope around a bad value).
        let t = Token::from_u128(1);
        let store = ctx.store();
        let writes = [
            store.release(KEY, &t).await,
            store.extend(KEY, &t, Duration::from_secs(1)).await,
            store
                .complete(Complete::new(KEY, &t, idem::store::ValueKind::Json, b"1"))
                .await,
        ];
        for w in writes {
            if let Err(Error::Corrupt { reason: msg, .. }) = &w {
                assert!(
                    msg.contains("delete the key") && !msg.contains("0 bytes"),
                    "{case}: {msg}"
                );
            }
            assert!(
                matches!(
                    w,
                    Err(Error::Corrupt { .. })
                        | Ok(WriteReply::AlreadyCompleted | WriteReply::OtherOwner)
                ),
                "{case}: {w:?}"
            );
        }
        assert_eq!(runs.get(), 0, "{case}: the body ran over a corrupt record");
        assert_eq!(dump(&mut con), before, "{case}: the record was changed");
        assert_sentinel(&idem, case).await;
        // Deleting the key, as the message advises, frees it.
        let _: () = redis::cmd("DEL").arg(KEY).query(&mut con).unwrap();
        let fixed: u32 = idem
            .call("charge", "order-1")
            .run(|| runs.body(9))
            .await
            .unwrap();
        assert_eq!((fixed, runs.get()), (9, 1), "{case}");
    }
}

async fn plant_sentinel_once(idem: &Idempotency) {
    let _: u32 = idem
        .call("sentinel", "keep-me")
        .run(|| async { Ok::<_, Error>(SENTINEL) })
        .await
        .unwrap();
}

fn set_raw(bytes: &'static [u8]) -> impl Fn(&mut redis::Connection) {
    move |con| {
        let _: () = redis::cmd("SET").arg(KEY).arg(bytes).query(con).unwrap();
    }
}

const NOT_OURS: [&str; 2] = [
    "not an idem record",
    "use a distinct namespace, or delete the key",
];

#[tokio::test]
async fn truncated_records_are_corrupt() {
    let ctx = TestContext::redis().await;
    let cases: [(&str, &'static [u8]); 7] = [
        ("empty string", b""),
        ("version byte only", b"1"),
        ("no fingerprint length", b"1C"),
        ("fingerprint cut short", b"1C\x10abc"),
        ("pending, owner cut short", b"1P\x000123456789abcdef"),
        (
            "pending, no deadline",
            b"1P\x000123456789abcdef0123456789abcdef",
        ),
        (
            "pending, deadline without attempt",
            b"1P\x000123456789abcdef0123456789abcdef1700000000000",
        ),
    ];
    for (case, bytes) in cases {
        assert_corrupt(&ctx, case, &set_raw(bytes), &NOT_OURS).await;
    }
}

#[tokio::test]
async fn garbage_records_are_corrupt() {
    let ctx = TestContext::redis().await;
    let cases: [(&str, &'static [u8], &[&str]); 5] = [
        ("text", b"hello world", &NOT_OURS),
        ("binary", &[0xde, 0xad, 0xbe, 0xef, 0x00, 0x01], &NOT_OURS),
        ("unknown state byte", b"1Q\x00{}", &NOT_OURS),
        ("another program's JSON", b"{\"id\":1}", &NOT_OURS),
        // A well-formed envelope around a value that is not JSON at all.
        (
            "completed, value not JSON",
            b"1C\x00\xff\xfenot json",
            &["not JSON"],
        ),
    ];
    for (case, bytes, says) in cases {
        assert_corrupt(&ctx, case, &set_raw(bytes), says).await;
    }
    // A compressed value whose length prefix lies: refused before lz4
    // allocates anything.
    assert_corrupt(
        &ctx,
        "lz4 with a huge length prefix",
        &set_raw(b"1Z\x00\xff\xff\xff\x7f\x01\x02"),
        &["compressed record"],
    )
    .await;
    assert_corrupt(
        &ctx,
        "lz4 garbage",
        &set_raw(b"1Z\x00\x05\x00\x00\x00\xff\xff"),
        &["does not decompress"],
    )
    .await;
}

#[tokio::test]
async fn wrong_redis_type_is_corrupt() {
    let ctx = TestContext::redis().await;
    let says = [
        "a Redis type other than string",
        "use a distinct namespace, or delete the key",
    ];
    let hash = |con: &mut redis::Connection| {
        let _: () = redis::cmd("HSET")
            .arg(KEY)
            .arg("state")
            .arg("C")
            .query(con)
            .unwrap();
    };
    let list = |con: &mut redis::Connection| {
        let _: () = redis::cmd("RPUSH")
            .arg(KEY)
            .arg("1C\x00{}")
            .query(con)
            .unwrap();
    };
    let set = |con: &mut redis::Connection| {
        let _: () = redis::cmd("SADD").arg(KEY).arg("x").query(con).unwrap();
    };
    assert_corrupt(&ctx, "hash", &hash, &says).await;
    assert_corrupt(&ctx, "list", &list, &says).await;
    assert_corrupt(&ctx, "set", &set, &says).await;
}

#[tokio::test]
async fn newer_format_version_is_corrupt_and_says_newer() {
    let ctx = TestContext::redis().await;
    let says = [
        "written by a newer idem (format version 2)",
        "upgrade this service",
    ];
    assert_corrupt(&ctx, "2C", &set_raw(b"2C\x00{\"amount\":500}"), &says).await;
    assert_corrupt(
        &ctx,
        "2P",
        &set_raw(b"2P\x000123456789abcdef0123456789abcdef99:1"),
        &says,
    )
    .await;
    assert_corrupt(&ctx, "2 only", &set_raw(b"2"), &says).await;
    assert_corrupt(
        &ctx,
        "9X",
        &set_raw(b"9X\x07future"),
        &["newer idem (format version 9)"],
    )
    .await;
}

// -------------------------------------------------------------- config ---

#[tokio::test]
async fn invalid_builder_config_fails_every_call_without_panicking() {
    let ctx = TestContext::redis().await;
    type Tweak = fn(IdempotencyBuilder) -> IdempotencyBuilder;
    let cases: Vec<(&str, Tweak, &str)> = vec![
        (
            "zero TTL",
            |b| b.result_ttl(Duration::ZERO),
            "result TTL is 0ns; use at least 1 ms",
        ),
        (
            "sub-ms TTL",
            |b| b.result_ttl(Duration::from_micros(500)),
            "use at least 1 ms",
        ),
        (
            "absurd TTL",
            |b| b.result_ttl(Duration::MAX),
            "over the one-year limit",
        ),
        (
            "400-day TTL",
            |b| b.result_ttl(Duration::from_secs(400 * 86_400)),
            "over the one-year limit",
        ),
        (
            "zero lease",
            |b| b.lease(Duration::ZERO),
            "lease is 0ns; use at least 1 ms",
        ),
        (
            "absurd lease",
            |b| b.lease(Duration::MAX),
            "over the one-day limit",
        ),
        (
            "two-day lease",
            |b| b.lease(Duration::from_secs(2 * 86_400)),
            "over the one-day limit",
        ),
        (
            "lease longer than TTL",
            |b| {
                b.result_ttl(Duration::from_secs(10))
                    .lease(Duration::from_secs(60))
            },
            "lease (60s) is longer than the result TTL (10s)",
        ),
        (
            "zero max_value_size",
            |b| b.max_value_size(0),
            "max_value_size is 0",
        ),
        (
            "empty namespace",
            |b| b.namespace(""),
            "the namespace is empty",
        ),
        (
            "namespace with newline",
            |b| b.namespace("pay\nments"),
            "the namespace contains a control character",
        ),
        (
            "300-byte namespace",
            |b| b.namespace("n".repeat(300)),
            "the namespace is 300 bytes",
        ),
    ];
    for store in ["memory", "redis"] {
        for (case, tweak, says) in &cases {
            let idem = tweak(builder_clone(store, &ctx)).build();
            let runs = Runs::default();
            for _ in 0..2 {
                let r: Result<u8, Error> =
                    idem.call("charge", "order-1").run(|| runs.body(1)).await;
                match r {
                    Err(Error::InvalidConfig(msg)) => {
                        assert!(msg.contains(says), "{store}/{case}: {msg}")
                    }
                    other => panic!("{store}/{case}: expected InvalidConfig, got {other:?}"),
                }
            }
            assert_eq!(runs.get(), 0, "{store}/{case}");
        }
    }
    assert_eq!(ctx.dbsize(), 0, "an invalid configuration wrote to Redis");
}

#[tokio::test]
async fn invalid_per_call_ttl_or_lease_fails_that_call() {
    let ctx = TestContext::redis().await;
    type Tweak = for<'a> fn(idem::Call<'a>) -> idem::Call<'a>;
    let cases: Vec<(&str, Tweak, &str)> = vec![
        ("zero TTL", |c| c.ttl(Duration::ZERO), "result TTL is 0ns"),
        (
            "absurd TTL",
            |c| c.ttl(Duration::MAX),
            "over the one-year limit",
        ),
        ("zero lease", |c| c.lease(Duration::ZERO), "lease is 0ns"),
        (
            "absurd lease",
            |c| c.lease(Duration::MAX),
            "over the one-day limit",
        ),
        (
            "lease longer than TTL",
            |c| {
                c.ttl(Duration::from_secs(10))
                    .lease(Duration::from_secs(20))
            },
            "lease (20s) is longer than the result TTL (10s)",
        ),
        // The builder's default lease (30 s) against a shorter per-call TTL.
        (
            "lease set over the TTL",
            |c| {
                c.ttl(Duration::from_secs(10))
                    .lease(Duration::from_secs(30))
            },
            "lease (30s) is longer than the result TTL (10s)",
        ),
    ];
    for (store, builder) in builders(&ctx) {
        let idem = builder.build();
        plant_sentinel(&idem).await;
        let runs = Runs::default();
        for (case, tweak, says) in &cases {
            for _ in 0..2 {
                let r: Result<u8, Error> = tweak(idem.call("charge", "order-1"))
                    .run(|| runs.body(1))
                    .await;
                match r {
                    Err(Error::InvalidConfig(msg)) => {
                        assert!(msg.contains(says), "{store}/{case}: {msg}")
                    }
                    other => panic!("{store}/{case}: expected InvalidConfig, got {other:?}"),
                }
            }
        }
        assert_eq!(runs.get(), 0, "{store}");
        // The same key with sane settings is untouched and free.
        let ok: u8 = idem
            .call("charge", "order-1")
            .run(|| runs.body(3))
            .await
            .unwrap();
        assert_eq!((ok, runs.get()), (3, 1));
        assert_sentinel(&idem, store).await;
    }
}

#[tokio::test]
async fn absurd_wait_does_not_panic() {
    let ctx = TestContext::redis().await;
    for (store, builder) in builders(&ctx) {
        let idem = builder.wait(Duration::MAX).build();
        // No contention: the wait is never used, but must not overflow.
        let v: u8 = idem
            .call("charge", "a")
            .run(|| async { Ok::<_, Error>(1) })
            .await
            .unwrap();
        assert_eq!(v, 1, "{store}");
        let v: u8 = idem
            .call("charge", "b")
            .wait(Duration::MAX)
            .run(|| async { Ok::<_, Error>(2) })
            .await
            .unwrap();
        assert_eq!(v, 2, "{store}");
        // Contention: an absurd wait waits for the holder's result.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let holder = idem.call("charge", "c").run(|| async move {
            let _ = rx.await;
            Ok::<_, Error>(3u8)
        });
        let waiter = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let w = idem
                .call("charge", "c")
                .wait(Duration::MAX)
                .run(|| async { Ok::<_, Error>(99u8) });
            let release = async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = tx.send(());
            };
            let (w, ()) = tokio::join!(w, release);
            w
        };
        let (h, w) = tokio::join!(holder, waiter);
        assert_eq!((h.unwrap(), w.unwrap()), (3, 3), "{store}");
        // A zero wait is no wait.
        let idem2 = builder_clone(store, &ctx).namespace("zero-wait").build();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let holder = idem2.call("charge", "d").run(|| async move {
            let _ = rx.await;
            Ok::<_, Error>(4u8)
        });
        let other = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let r: Result<u8, Error> = idem2
                .call("charge", "d")
                .wait(Duration::ZERO)
                .run(|| async { Ok(0) })
                .await;
            let _ = tx.send(());
            r
        };
        let (h, o) = tokio::join!(holder, other);
        assert_eq!(h.unwrap(), 4);
        assert!(matches!(o, Err(Error::InProgress { .. })), "{store}: {o:?}");
    }
}

#[tokio::test]
async fn smallest_valid_durations_work() {
    let ctx = TestContext::redis().await;
    for (store, builder) in builders(&ctx) {
        // 1 ms lease and TTL: valid, the body outlives its lease many times
        // over (renewed every ~0.3 ms), and the result expires at once.
        let idem = builder
            .result_ttl(Duration::from_millis(1))
            .lease(Duration::from_millis(1))
            .build();
        let runs = Runs::default();
        let r: u8 = idem
            .call("charge", "order-1")
            .run(|| async {
                runs.record();
                tokio::time::sleep(Duration::from_millis(30)).await;
                Ok::<_, Error>(5)
            })
            .await
            .unwrap();
        assert_eq!(r, 5, "{store}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let r: u8 = idem
            .call("charge", "order-1")
            .run(|| runs.body(6))
            .await
            .unwrap();
        assert_eq!(
            (r, runs.get()),
            (6, 2),
            "{store}: a 1 ms result should have expired"
        );
    }
}

// ------------------------------------------------------------- connect ---

#[tokio::test]
async fn bad_redis_urls_and_unreachable_redis() {
    for url in [
        "not a url",
        "http://127.0.0.1:1/",
        "redis://user:hunter2@127.0.0.1:notaport/",
    ] {
        match RedisStore::connect(url).await {
            Err(Error::InvalidConfig(msg)) => {
                assert!(
                    msg.contains("expected redis://[user:password@]host:port/[db]"),
                    "{url}: {msg}"
                );
                assert!(
                    !msg.contains("hunter2"),
                    "{url}: the message leaks the password: {msg}"
                );
            }
            other => panic!("{url}: expected InvalidConfig, got {other:?}"),
        }
    }
    assert!(matches!(
        RedisStore::connect_cluster(&[]).await,
        Err(Error::InvalidConfig(_))
    ));
    // Nothing listens on this port.
    let port = idem_testkit::free_port();
    let url = format!("redis://user:hunter2@127.0.0.1:{port}/");
    match RedisStore::connect(&url).await {
        Err(e @ Error::Unavailable { op: "connect", .. }) => {
            let msg = e.to_string();
            assert!(!msg.contains("hunter2"), "{msg}");
            assert!(e.is_retryable());
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// The `Store` trait is public: absurd durations given to it directly
/// (bypassing the builder's checks) neither panic nor make the two stores
/// disagree.
#[tokio::test]
async fn absurd_durations_at_the_store_level_do_not_panic() {
    let ctx = TestContext::redis().await;
    let memory = MemoryStore::new();
    let stores: [(&str, &dyn Store); 2] = [("redis", ctx.store()), ("memory", &memory)];
    for (name, store) in stores {
        let (a, b) = (Token::from_u128(0xa), Token::from_u128(0xb));
        for (case, lease, ttl) in [
            ("MAX lease and TTL", Duration::MAX, Duration::MAX),
            ("MAX TTL", Duration::from_secs(1), Duration::MAX),
            ("zero lease and TTL", Duration::ZERO, Duration::ZERO),
        ] {
            let key = format!("idem:store:{case}");
            let claim = |token| idem::store::Claim::new(&key, token, lease, ttl);
            let first = store.claim(claim(&a)).await;
            assert_eq!(
                first.unwrap(),
                idem::store::ClaimReply::Acquired { attempt: 1 },
                "{name}/{case}"
            );
            let extended = store.extend(&key, &a, lease).await;
            assert!(
                matches!(extended, Ok(WriteReply::Done | WriteReply::Missing)),
                "{name}/{case}: {extended:?}"
            );
            let done = store
                .complete(Complete::new(&key, &a, idem::store::ValueKind::Json, b"1"))
                .await;
            assert!(
                matches!(done, Ok(WriteReply::Done | WriteReply::Missing)),
                "{name}/{case}: {done:?}"
            );
            let again = store.claim(claim(&b)).await;
            assert!(again.is_ok(), "{name}/{case}: {again:?}");
        }
    }
}
