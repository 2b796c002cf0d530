//! The outcome hook: once per call, for every outcome and error, never
//! breaking the call; and (feature `metrics`) the counts a Prometheus
//! exporter renders after a known sequence of calls.

use async_trait::async_trait;
use idem_core::store::{Claim, ClaimReply, Complete, Store, Token, WriteReply};
use idem_core::{CallOutcome, Error, FailMode, Idempotency, MemoryStore, Outcome};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Seen = Arc<Mutex<Vec<(CallOutcome, Option<String>, Option<u32>, bool)>>>;

fn recording(store: impl Store, log_keys: bool) -> (Idempotency, Seen) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let idem = Idempotency::builder(store)
        .namespace("hooked")
        .log_keys(log_keys)
        .on_outcome(move |e| {
            assert_eq!((e.namespace, e.scope), ("hooked", "charge"));
            assert!(e.elapsed >= e.body.unwrap_or_default());
            log.lock().unwrap().push((
                e.outcome,
                e.key.map(str::to_owned),
                e.attempt,
                e.body.is_some(),
            ));
        })
        .build();
    (idem, seen)
}

fn outcomes(seen: &Seen) -> Vec<CallOutcome> {
    seen.lock().unwrap().iter().map(|s| s.0).collect()
}

/// A store that is always down.
struct Down;

#[async_trait]
impl Store for Down {
    async fn claim(&self, _: Claim<'_>) -> Result<ClaimReply, Error> {
        Err(Error::unavailable("claim", "down"))
    }
    async fn complete(&self, _: Complete<'_>) -> Result<WriteReply, Error> {
        Ok(WriteReply::Missing)
    }
    async fn release(&self, _: &str, _: &Token) -> Result<WriteReply, Error> {
        Ok(WriteReply::Missing)
    }
    async fn extend(&self, _: &str, _: &Token, _: Duration) -> Result<WriteReply, Error> {
        Ok(WriteReply::Missing)
    }
}

#[tokio::test]
async fn one_event_per_call_for_every_outcome() {
    let (idem, seen) = recording(MemoryStore::new(), false);
    let ok = |v: u32| async move { Ok::<_, Error>(v) };

    let _: u32 = idem
        .call("charge", "k1")
        .fingerprint(&1)
        .run(|| ok(1))
        .await
        .unwrap();
    let _: u32 = idem
        .call("charge", "k1")
        .fingerprint(&1)
        .run(|| ok(1))
        .await
        .unwrap();
    let e = idem
        .call("charge", "k1")
        .fingerprint(&2)
        .run(|| ok(1))
        .await;
    assert!(matches!(e, Err(Error::FingerprintMismatch)));
    let e: Result<u32, Error> = idem
        .call("charge", "k2")
        .run(|| async { Err(Error::codec("the body's own error")) })
        .await;
    assert!(e.is_err());
    let e = idem.call("charge", "").run(|| ok(1)).await;
    assert!(matches!(e, Err(Error::InvalidKey(_))));

    // In progress: a holder that does not finish while a second call tries.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.call("charge", "k3")
                .run(|| async {
                    let _ = rx.await;
                    Ok::<_, Error>(3u32)
                })
                .await
        })
    };
    claimed(&idem, "k3").await;
    let e = idem.call("charge", "k3").run(|| ok(1)).await;
    assert!(matches!(e, Err(Error::InProgress { .. })));
    tx.send(()).unwrap();
    holder.await.unwrap().unwrap();

    assert_eq!(
        outcomes(&seen),
        [
            CallOutcome::Executed,
            CallOutcome::Replayed,
            CallOutcome::FingerprintMismatch,
            CallOutcome::BodyError,
            CallOutcome::Invalid,
            CallOutcome::InProgress,
            CallOutcome::Executed,
        ]
    );
    let seen = seen.lock().unwrap();
    // Executed: attempt 1, body timed; the key hashed, never in clear.
    let (_, key, attempt, timed) = &seen[0];
    assert_eq!((attempt, timed), (&Some(1), &true));
    let key = key.as_deref().unwrap();
    assert!(
        key.starts_with('#') && key.len() == 13 && !key.contains("k1"),
        "{key}"
    );
    assert_eq!(
        (seen[1].2, seen[1].3),
        (None, false),
        "a replay ran no body"
    );
    assert_eq!(seen[4].1, None, "a refused key is not shown");
}

/// Waits until the spawned holder has claimed `key`.
async fn claimed(idem: &Idempotency, key: &str) {
    for _ in 0..200 {
        if idem.inspect("charge", key).await.unwrap().is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the holder never claimed");
}

#[tokio::test]
async fn unavailable_and_unprotected_and_clear_keys() {
    let (idem, seen) = recording(Down, true);
    let e = idem
        .call("charge", "k")
        .run(|| async { Ok::<_, Error>(1u8) })
        .await;
    assert!(matches!(e, Err(Error::Unavailable { .. })));
    let open = {
        let log = seen.clone();
        Idempotency::builder(Down)
            .namespace("hooked")
            .fail_mode(FailMode::Open)
            .store_retries(0)
            .on_outcome(move |e| log.lock().unwrap().push((e.outcome, None, None, false)))
            .build()
    };
    let (_, o) = open
        .call("charge", "k")
        .run_outcome(|| async { Ok::<_, Error>(1u8) })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Unprotected);
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0].0, CallOutcome::Unavailable);
    assert_eq!(
        seen[0].1.as_deref(),
        Some("hooked:charge:k"),
        "log_keys shows it"
    );
    assert_eq!(seen[1].0, CallOutcome::Unprotected);
}

#[tokio::test]
async fn a_panicking_hook_never_breaks_the_call() {
    let idem = Idempotency::builder(MemoryStore::new())
        .on_outcome(|_| panic!("a broken hook"))
        .build();
    for expected in [Outcome::Executed, Outcome::Replayed] {
        let (v, o) = idem
            .call("charge", "k")
            .run_outcome(|| async { Ok::<_, Error>(5u8) })
            .await
            .unwrap();
        assert_eq!((v, o), (5, expected));
    }
}

#[tokio::test]
async fn a_panicking_body_is_reported_then_unwinds() {
    let (idem, seen) = recording(MemoryStore::new(), false);
    let call = tokio::spawn(async move {
        idem.call("charge", "k")
            .run(|| async {
                if true {
                    panic!("the body's panic");
                }
                Ok::<_, Error>(1u8)
            })
            .await
    });
    assert!(call.await.unwrap_err().is_panic());
    assert_eq!(outcomes(&seen), [CallOutcome::BodyError]);
}

/// Counts as a Prometheus exporter renders them, after a known sequence.
#[cfg(feature = "metrics")]
#[test]
fn metrics_count_each_outcome() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let idem = Idempotency::builder(MemoryStore::new())
                .namespace("m")
                .build();
            let call = |key: &'static str, fp: u8| {
                let idem = idem.clone();
                async move {
                    idem.call("charge", key)
                        .fingerprint(&fp)
                        .run(|| async { Ok::<_, Error>(1u8) })
                        .await
                }
            };
            for _ in 0..3 {
                call("a", 1).await.unwrap(); // executed, replayed, replayed
            }
            call("b", 1).await.unwrap(); // executed
            assert!(call("b", 2).await.is_err()); // fingerprint_mismatch
            call("c", 1).await.unwrap(); // executed
        });
    });
    let text = handle.render();
    let count = |outcome: &str| {
        let line = format!(
            "idem_calls_total{{namespace=\"m\",scope=\"charge\",outcome=\"{outcome}\",store=\"memory\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map(|n| n.trim().parse::<u64>().unwrap())
            .unwrap_or(0)
    };
    assert_eq!(
        (
            count("executed"),
            count("replayed"),
            count("fingerprint_mismatch")
        ),
        (3, 2, 1),
        "{text}"
    );
    assert!(
        text.contains("idem_store_seconds_count{op=\"claim\",store=\"memory\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("idem_store_seconds_count{op=\"replay\",store=\"memory\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("idem_store_seconds_count{op=\"complete\",store=\"memory\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("idem_body_seconds_count{scope=\"charge\"} 3"),
        "{text}"
    );
    assert!(text.contains("idem_bodies_in_flight 0"), "{text}");
}

/// idem keeps the handles it registers, per recorder: calls made while
/// another recorder is in effect land in that one.
#[cfg(feature = "metrics")]
#[test]
fn metrics_follow_the_recorder_in_effect() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("m")
        .build();
    // Both alive at once: recorders are told apart by address.
    let recorders = [
        metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
        metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
    ];
    let calls = |recorder: &metrics_exporter_prometheus::PrometheusRecorder,
                 keys: &'static [&'static str]| {
        let handle = recorder.handle();
        metrics::with_local_recorder(recorder, || {
            rt.block_on(async {
                for key in keys {
                    idem.call("charge", *key)
                        .run(|| async { Ok::<_, Error>(1u8) })
                        .await
                        .unwrap();
                }
            })
        });
        handle.render()
    };
    let first = calls(&recorders[0], &["a", "b"]);
    let second = calls(&recorders[1], &["c", "a", "a"]);
    let executed =
        "idem_calls_total{namespace=\"m\",scope=\"charge\",outcome=\"executed\",store=\"memory\"}";
    assert!(first.contains(&format!("{executed} 2")), "{first}");
    assert!(second.contains(&format!("{executed} 1")), "{second}");
    assert!(
        second.contains("outcome=\"replayed\",store=\"memory\"} 2"),
        "{second}"
    );
    assert!(
        second.contains("idem_store_seconds_count{op=\"replay\",store=\"memory\"} 2"),
        "{second}"
    );
    assert!(
        second.contains("idem_body_seconds_count{scope=\"charge\"} 1"),
        "{second}"
    );
}

/// PgStore's calls land under the same names, labelled `store="postgres"`.
#[cfg(feature = "metrics")]
#[test]
fn metrics_label_the_postgres_store() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let ctx = idem_testkit::TestContext::postgres()
                .await
                .with_namespace("m");
            let idem = ctx.idem();
            for _ in 0..2 {
                let _: u8 = idem
                    .call("charge", "a")
                    .run(|| async { Ok::<_, Error>(1u8) })
                    .await
                    .unwrap(); // executed, replayed
            }
        });
    });
    let text = handle.render();
    for line in [
        "idem_calls_total{namespace=\"m\",scope=\"charge\",outcome=\"executed\",store=\"postgres\"} 1",
        "idem_calls_total{namespace=\"m\",scope=\"charge\",outcome=\"replayed\",store=\"postgres\"} 1",
        "idem_store_seconds_count{op=\"claim\",store=\"postgres\"} 1",
        "idem_store_seconds_count{op=\"replay\",store=\"postgres\"} 1",
        "idem_store_seconds_count{op=\"complete\",store=\"postgres\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
}
