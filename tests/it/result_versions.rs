//! Result versions across two builds of one service, on every store.
//!
//! `build_v1` and `build_v2` are two builds of one charging service, each
//! with its own `Receipt` type: v2 renamed v1's `cents` into a structured
//! `amount` (and keeps writing `cents` so that v1 processes can still
//! read its records). Both run on one store (one Redis, one PostgreSQL
//! database, one MemoryStore per test), as the two halves of a rolling
//! deploy do. Every body run is counted in the context's ledger: no test
//! here may run a body a second time for a key, whatever it reads.

use idem::store::{Claim, ClaimReply, Complete, Token, ValueKind, WriteReply};
use idem::{Error, Idempotency, Outcome, VersionRule};
use idem_testkit::{Ledger, TestContext};
use std::time::Duration;

idem_testkit::every_store!(
    namespace = "versions", stores = [redis, postgres, dynamodb, memory];
    stored_bytes_match_the_golden_fixtures,
    golden_records_read_through_each_rule,
    the_newer_build_reads_older_records_through_each_rule,
    the_older_build_reads_newer_records_through_each_rule,
    a_rolling_deploy_runs_each_body_once,
    an_unreadable_result_is_never_released_nor_rewritten,
);

/// Build 1 of the service: `Receipt` version 1, declared per call site.
mod build_v1 {
    use idem::{Error, Idempotency, Outcome, VersionRule};
    use idem_testkit::Ledger;
    use serde::{Deserialize, Serialize};
    use std::time::Duration;

    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    pub(super) struct Receipt {
        pub(super) id: String,
        pub(super) cents: u64,
    }

    /// Charges `cents` once per key: the body runs only when idem says so,
    /// and records its run in `ledger`.
    pub(super) async fn charge(
        idem: &Idempotency,
        ledger: &Ledger,
        key: &str,
        cents: u64,
        rule: VersionRule<Receipt>,
    ) -> Result<(Receipt, Outcome), Error> {
        idem.call("charge", key)
            .result_version(1)
            .on_other_version(rule)
            .wait(Duration::from_secs(10))
            .run_outcome(|| async {
                ledger.record(key);
                Ok(Receipt {
                    id: format!("r-{key}"),
                    cents,
                })
            })
            .await
    }
}

/// Build 2 of the service: `Receipt` version 2, declared once on the type
/// (`Versioned`), its rule overridable per call site.
mod build_v2 {
    use idem::{Error, Idempotency, Outcome, VersionRule, Versioned};
    use idem_testkit::Ledger;
    use serde::{Deserialize, Serialize};
    use std::time::Duration;

    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    pub(super) struct Amount {
        pub(super) minor: u64,
        pub(super) currency: String,
    }

    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    pub(super) struct Receipt {
        pub(super) id: String,
        pub(super) amount: Amount,
        /// Still written for build 1's processes, which read only this.
        pub(super) cents: u64,
    }

    impl Versioned for Receipt {
        const VERSION: u32 = 2;
        fn on_other_version() -> VersionRule<Self> {
            VersionRule::upgrade(upgrade)
        }
    }

    /// A version-1 (or version-0) receipt as a version-2 one.
    pub(super) fn upgrade(json: serde_json::Value, stored: u32) -> Result<Receipt, Error> {
        let v1: super::build_v1::Receipt = serde_json::from_value(json).map_err(|e| {
            Error::codec(format!("a version-{stored} receipt that is not one: {e}"))
        })?;
        Ok(Receipt {
            id: v1.id,
            amount: Amount {
                minor: v1.cents,
                currency: "EUR".into(),
            },
            cents: v1.cents,
        })
    }

    /// Charges `cents` once per key; `rule` overrides the type's own.
    pub(super) async fn charge(
        idem: &Idempotency,
        ledger: &Ledger,
        key: &str,
        cents: u64,
        rule: Option<VersionRule<Receipt>>,
    ) -> Result<(Receipt, Outcome), Error> {
        let call = idem.call("charge", key).versioned::<Receipt>();
        let call = match rule {
            Some(rule) => call.on_other_version(rule),
            None => call,
        };
        call.wait(Duration::from_secs(10))
            .run_outcome(|| async {
                ledger.record(key);
                Ok(Receipt {
                    id: format!("r-{key}"),
                    amount: Amount {
                        minor: cents,
                        currency: "EUR".into(),
                    },
                    cents,
                })
            })
            .await
    }
}

/// Today's bytes of a receipt stored without a version (and by build 1
/// at version 0): no frame.
const GOLDEN_V0: &[u8] = br#"{"id":"r-g","cents":500}"#;
/// Build 1's bytes: the `#v1` frame, then the same JSON.
const GOLDEN_V1: &[u8] = b"#v1\n{\"id\":\"r-g\",\"cents\":500}";
/// Build 2's bytes.
const GOLDEN_V2: &[u8] =
    b"#v2\n{\"id\":\"r-g\",\"amount\":{\"minor\":500,\"currency\":\"EUR\"},\"cents\":500}";

/// The stored key of `("charge", key)` in the tests' namespace.
fn stored_key(key: &str) -> String {
    format!("versions:charge:{key}")
}

/// The record under `key` as the store keeps it: a claim of a completed
/// key answers its bytes and changes nothing.
async fn raw(ctx: &TestContext, key: &str) -> (ValueKind, Vec<u8>) {
    let key = stored_key(key);
    let token = Token::random();
    let claim = Claim::new(
        &key,
        &token,
        Duration::from_secs(10),
        Duration::from_secs(3600),
    );
    match ctx.store().claim(claim).await.unwrap() {
        ClaimReply::Completed(c) => (c.kind, c.value.to_vec()),
        other => panic!("{}: {key} is not completed: {other:?}", ctx.name()),
    }
}

/// Writes `bytes` under `key` as a completed record, as an earlier build
/// (or an earlier release of idem) did.
async fn write_raw(ctx: &TestContext, key: &str, bytes: &[u8]) {
    let key = stored_key(key);
    let token = Token::random();
    let claim = Claim::new(
        &key,
        &token,
        Duration::from_secs(10),
        Duration::from_secs(3600),
    );
    assert!(matches!(
        ctx.store().claim(claim).await.unwrap(),
        ClaimReply::Acquired { .. }
    ));
    let done = ctx
        .store()
        .complete(Complete::of_claim(&claim, ValueKind::Json, bytes))
        .await
        .unwrap();
    assert_eq!(done, WriteReply::Done, "{}", ctx.name());
}

fn version_of(r: Result<impl std::fmt::Debug, Error>) -> (u32, u32, String) {
    match r {
        Err(Error::ResultVersion {
            stored,
            current,
            raw_json,
            ..
        }) => (stored, current, raw_json),
        other => panic!("expected Error::ResultVersion, got {other:?}"),
    }
}

/// Invariant: a result of version 0 is stored with exactly the bytes a
/// call without versions stored (no frame), and a result of version N
/// with the `#vN` frame before the same JSON; every store keeps them
/// as given, and `inspect` reports the version.
async fn stored_bytes_match_the_golden_fixtures(ctx: TestContext) {
    let idem = ctx.idem();
    let receipt = build_v1::Receipt {
        id: "r-g".into(),
        cents: 500,
    };
    let plain: build_v1::Receipt = idem
        .call("charge", "plain")
        .run(|| async { Ok::<_, Error>(receipt.clone()) })
        .await
        .unwrap();
    assert_eq!(plain, receipt);
    let _: build_v1::Receipt = idem
        .call("charge", "zero")
        .result_version(0)
        .run(|| async { Ok::<_, Error>(receipt.clone()) })
        .await
        .unwrap();
    let _: build_v1::Receipt = idem
        .call("charge", "one")
        .result_version(1)
        .run(|| async { Ok::<_, Error>(receipt.clone()) })
        .await
        .unwrap();
    let v2 = build_v2::upgrade(serde_json::to_value(&receipt).unwrap(), 1).unwrap();
    let _: build_v2::Receipt = idem
        .call("charge", "two")
        .versioned::<build_v2::Receipt>()
        .run(|| async { Ok::<_, Error>(v2.clone()) })
        .await
        .unwrap();
    for (key, golden, version) in [
        ("plain", GOLDEN_V0, 0),
        ("zero", GOLDEN_V0, 0),
        ("one", GOLDEN_V1, 1),
        ("two", GOLDEN_V2, 2),
    ] {
        assert_eq!(
            raw(&ctx, key).await,
            (ValueKind::Json, golden.to_vec()),
            "{}: {key}",
            ctx.name()
        );
        let info = idem.inspect("charge", key).await.unwrap().unwrap();
        assert_eq!(info.result_version, Some(version), "{key}");
        let info = idem
            .inspect_with_value("charge", key)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.result_version, Some(version), "{key}");
        // The value shown is the JSON, without the frame.
        let json: serde_json::Value = serde_json::from_slice(&info.value.unwrap()).unwrap();
        assert_eq!(json["id"], "r-g", "{key}");
    }
}

/// Invariant: records written with the golden bytes of each version (as
/// an earlier build or an earlier idem release left them) replay through
/// each rule as the table in docs/semantics.md says, and no body runs.
async fn golden_records_read_through_each_rule(ctx: TestContext) {
    let (idem, ledger) = (ctx.idem(), ctx.ledger());
    for (key, bytes) in [("g0", GOLDEN_V0), ("g1", GOLDEN_V1), ("g2", GOLDEN_V2)] {
        write_raw(&ctx, key, bytes).await;
    }
    // Build 1 reads version 0 (older) and 2 (newer) as it is: both JSON
    // documents carry `id` and `cents`.
    for key in ["g0", "g1", "g2"] {
        let (r, o) = build_v1::charge(&idem, ledger, key, 1, VersionRule::Decode)
            .await
            .unwrap();
        assert_eq!((r.cents, o), (500, Outcome::Replayed), "{key}");
    }
    // Build 2 upgrades versions 0 and 1, decodes its own.
    for key in ["g0", "g1", "g2"] {
        let (r, o) = build_v2::charge(&idem, ledger, key, 1, None).await.unwrap();
        assert_eq!((r.amount.minor, o), (500, Outcome::Replayed), "{key}");
        assert_eq!(r.amount.currency, "EUR");
    }
    // Build 2 with Reject: the typed error for versions 0 and 1.
    for (key, stored, json) in [("g0", 0, GOLDEN_V0), ("g1", 1, &GOLDEN_V1[4..])] {
        let r = build_v2::charge(&idem, ledger, key, 1, Some(VersionRule::Reject)).await;
        let (s, c, raw_json) = version_of(r);
        assert_eq!((s, c, raw_json.as_bytes()), (stored, 2, json), "{key}");
    }
    assert_eq!(ledger.total(), 0, "{}: a replay ran a body", ctx.name());
    // Nothing was rewritten.
    for (key, bytes) in [("g0", GOLDEN_V0), ("g1", GOLDEN_V1), ("g2", GOLDEN_V2)] {
        assert_eq!(raw(&ctx, key).await.1, bytes, "{key}");
    }
}

/// Invariant: after a deploy, the new build (v2) reads the old build's
/// (v1) records through its rule: Decode answers `Error::Codec` (the
/// renamed field does not decode), Upgrade answers the converted receipt,
/// Reject answers `Error::ResultVersion` with the stored JSON. No body
/// runs again, and every record stays as v1 wrote it: v1 still replays it.
async fn the_newer_build_reads_older_records_through_each_rule(ctx: TestContext) {
    let ledger = ctx.ledger();
    // Two processes: one of each build, on one store. Build 2 compresses
    // (its records then carry the frame inside the LZ4).
    let (v1, v2) = (ctx.idem(), ctx.idem_with(|b| b.compress_above(16)));
    for key in ["decode", "upgrade", "reject", "type"] {
        let (r, o) = build_v1::charge(&v1, ledger, key, 700, VersionRule::Decode)
            .await
            .unwrap();
        assert_eq!((r.cents, o), (700, Outcome::Executed));
    }

    let e = build_v2::charge(&v2, ledger, "decode", 1, Some(VersionRule::Decode))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Codec { .. }), "{e}");
    assert!(e.to_string().contains("result version 1"), "{e}");

    let (r, o) = build_v2::charge(&v2, ledger, "upgrade", 1, None)
        .await
        .unwrap();
    assert_eq!(o, Outcome::Replayed);
    assert_eq!(
        r.amount,
        build_v2::Amount {
            minor: 700,
            currency: "EUR".into()
        }
    );

    let r = build_v2::charge(&v2, ledger, "reject", 1, Some(VersionRule::Reject)).await;
    let (stored, current, raw_json) = version_of(r);
    assert_eq!((stored, current), (1, 2));
    let json: serde_json::Value = serde_json::from_str(&raw_json).unwrap();
    assert_eq!(json["cents"], 700);

    // Read as a type that fits no version: Codec, kept.
    let e = v2
        .call("charge", "type")
        .result_version(2)
        .run(|| async {
            ledger.record("type");
            Ok::<_, Error>(String::new())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Codec { .. }), "{e}");

    assert!(ledger.duplicates().is_empty(), "{:?}", ledger.duplicates());
    assert_eq!(ledger.total(), 4, "{}", ctx.name());
    for key in ["decode", "upgrade", "reject", "type"] {
        let info = v1.inspect("charge", key).await.unwrap().unwrap();
        assert_eq!(info.result_version, Some(1), "{key}");
        let (r, o) = build_v1::charge(&v1, ledger, key, 1, VersionRule::Reject)
            .await
            .unwrap();
        assert_eq!((r.cents, o), (700, Outcome::Replayed), "{key}");
    }
    assert_eq!(ledger.total(), 4);
}

/// Invariant: an old build (v1) that reads a record of a newer build (v2:
/// a rolling deploy, a rollback) neither runs the body again nor releases
/// or rewrites the record: Decode reads it (v2 keeps v1's fields), Upgrade
/// decodes it too (an upgrade knows only older versions), Reject answers
/// `Error::ResultVersion { stored: 2, current: 1 }`. v2 then replays its
/// records unchanged.
async fn the_older_build_reads_newer_records_through_each_rule(ctx: TestContext) {
    let ledger = ctx.ledger();
    let (v1, v2) = (ctx.idem(), ctx.idem_with(|b| b.compress_above(16)));
    // Long, repetitive keys: the receipts (whose ids hold them) compress.
    let long = |name: &str| format!("{}-{name}", "x".repeat(96));
    let (decode, upgrade, reject) = (long("decode"), long("upgrade"), long("reject"));
    for key in [&decode, &upgrade, &reject] {
        let (_, o) = build_v2::charge(&v2, ledger, key, 900, None).await.unwrap();
        assert_eq!(o, Outcome::Executed);
    }
    let before: Vec<_> = [
        raw(&ctx, &decode).await,
        raw(&ctx, &upgrade).await,
        raw(&ctx, &reject).await,
    ]
    .into();
    assert_eq!(before[0].0, ValueKind::Lz4Json, "compressed, frame inside");

    let (r, o) = build_v1::charge(&v1, ledger, &decode, 1, VersionRule::Decode)
        .await
        .unwrap();
    assert_eq!((r.cents, o), (900, Outcome::Replayed));
    let rule = VersionRule::upgrade(|_, stored| {
        Err(Error::codec(format!("build 1 knows no version {stored}")))
    });
    let (r, o) = build_v1::charge(&v1, ledger, &upgrade, 1, rule)
        .await
        .unwrap();
    assert_eq!((r.cents, o), (900, Outcome::Replayed));
    for _ in 0..3 {
        let r = build_v1::charge(&v1, ledger, &reject, 1, VersionRule::Reject).await;
        let (stored, current, raw_json) = version_of(r);
        assert_eq!((stored, current), (2, 1));
        assert!(raw_json.contains(r#""minor":900"#), "{raw_json}");
    }

    assert_eq!(ledger.total(), 3, "{}", ctx.name());
    let after: Vec<_> = [
        raw(&ctx, &decode).await,
        raw(&ctx, &upgrade).await,
        raw(&ctx, &reject).await,
    ]
    .into();
    assert_eq!(before, after, "{}: a reader rewrote a record", ctx.name());
    for key in [&decode, &upgrade, &reject] {
        let (r, o) = build_v2::charge(&v2, ledger, key, 1, Some(VersionRule::Reject))
            .await
            .unwrap();
        assert_eq!((r.amount.minor, o), (900, Outcome::Replayed));
    }
    assert_eq!(ledger.total(), 3);
}

/// Invariant: during a rolling deploy, processes of both builds call the
/// same keys concurrently (each key is first called by either build, then
/// by both, several times): each body runs exactly once per key, build 1
/// answers every key from its `cents` (Decode), build 2 every key from its
/// `amount` (Upgrade of v1 records), and build 2 with Reject answers
/// `Error::ResultVersion` exactly for the keys build 1 stored.
async fn a_rolling_deploy_runs_each_body_once(ctx: TestContext) {
    const KEYS: u64 = 24;
    const ROUNDS: u64 = 3;
    let ledger = ctx.ledger().clone();
    let (v1, v2) = (ctx.idem(), ctx.idem());
    let mut tasks = tokio::task::JoinSet::new();
    for round in 0..ROUNDS {
        for n in 0..KEYS {
            for build in [1, 2] {
                let (v1, v2, ledger) = (v1.clone(), v2.clone(), ledger.clone());
                // Which build gets to a key first varies with the key.
                let delay = Duration::from_millis((n + build + round) % 3);
                tasks.spawn(async move {
                    tokio::time::sleep(delay).await;
                    let key = format!("k{n}");
                    let cents = 100 + n;
                    if build == 1 {
                        let (r, o) =
                            build_v1::charge(&v1, &ledger, &key, cents, VersionRule::Decode)
                                .await
                                .unwrap();
                        assert_eq!(r.cents, cents, "{key}");
                        (key, 1, o)
                    } else {
                        let (r, o) = build_v2::charge(&v2, &ledger, &key, cents, None)
                            .await
                            .unwrap();
                        assert_eq!((r.amount.minor, r.cents), (cents, cents), "{key}");
                        (key, 2, o)
                    }
                });
            }
        }
    }
    let mut executed_by = std::collections::BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        let (key, build, outcome) = joined.unwrap();
        if outcome == Outcome::Executed {
            assert!(
                executed_by.insert(key.clone(), build).is_none(),
                "{key} executed twice"
            );
        } else {
            assert_eq!(outcome, Outcome::Replayed, "{key}");
        }
    }
    assert_eq!(executed_by.len() as u64, KEYS);
    assert!(ledger.duplicates().is_empty(), "{:?}", ledger.duplicates());
    assert_eq!(ledger.total() as u64, KEYS, "{}", ctx.name());

    // Each record carries the version of the build that ran its body, and
    // build 2's Reject refuses exactly build 1's records.
    for (key, build) in &executed_by {
        let info = v1.inspect("charge", key).await.unwrap().unwrap();
        assert_eq!(info.result_version, Some(*build), "{key}");
        let r = build_v2::charge(&v2, &ledger, key, 0, Some(VersionRule::Reject)).await;
        if *build == 1 {
            assert_eq!(version_of(r).0, 1, "{key}");
        } else {
            assert_eq!(r.unwrap().1, Outcome::Replayed, "{key}");
        }
    }
    assert_eq!(ledger.total() as u64, KEYS, "{}", ctx.name());
}

/// Invariant: a stored result that a reader cannot decode (another type,
/// a newer version it cannot read) answers `Error::Codec` on every
/// attempt, waiting callers included, and is never released nor
/// rewritten: the body does not run again, and a reader of the right type
/// still replays it. The same holds with the local replay cache on.
async fn an_unreadable_result_is_never_released_nor_rewritten(ctx: TestContext) {
    let ledger = ctx.ledger();
    for (idem, key) in [
        (ctx.idem(), "plain"),
        (ctx.idem_with(|b| b.local_cache(100)), "cached"),
    ] {
        let (r, _) = build_v2::charge(&idem, ledger, key, 300, None)
            .await
            .unwrap();
        let before = raw(&ctx, key).await;
        for attempt in 0..3 {
            let e = idem
                .call("charge", key)
                .result_version(2)
                .wait(Duration::from_secs(1))
                .run(|| async {
                    ledger.record(key);
                    Ok::<_, Error>(vec![attempt])
                })
                .await
                .unwrap_err();
            assert!(matches!(e, Error::Codec { .. }), "{e}");
            // A build that cannot read the newer record's shape at all.
            let e = old_reader(&idem, ledger, key).await.unwrap_err();
            assert!(matches!(e, Error::Codec { .. }), "{e}");
        }
        assert_eq!(raw(&ctx, key).await, before, "{}: {key}", ctx.name());
        assert_eq!(ledger.count(key), 1, "{}: {key}", ctx.name());
        let (again, o) = build_v2::charge(&idem, ledger, key, 1, None).await.unwrap();
        assert_eq!((again, o), (r, Outcome::Replayed));
    }
}

/// A build whose receipt has no field in common with version 2's.
async fn old_reader(idem: &Idempotency, ledger: &Ledger, key: &str) -> Result<u64, Error> {
    idem.call("charge", key)
        .result_version(1)
        .run(|| async {
            ledger.record(key);
            Ok(0u64)
        })
        .await
}
