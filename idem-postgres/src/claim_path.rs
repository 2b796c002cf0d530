//! Which claim statement a call sends first: a forecast of whether its key
//! is new, learnt from the store's recent claims.
//!
//! Every claim can be answered by the one statement that reads the row and
//! writes only when it may (`Statements::claim`). That statement pays for
//! both halves on every call: PostgreSQL initialises the call to the claim
//! function even when it is not made, and a claim it does make starts a
//! second executor for the function's `INSERT`. When a store's recent
//! claims were nearly all new keys, a bare `INSERT … ON CONFLICT DO
//! NOTHING` wins the key in one executor start; when they were nearly all
//! existing records (replays, duplicates in flight), a bare read answers.
//! A call the forecast gets wrong costs one more statement, the combined
//! one, which answers every case; between the two bands (a mixed load),
//! the combined statement goes first, as it always did.

use std::sync::atomic::{AtomicU32, Ordering};

/// The share of recent claims that found a record they could not take, in
/// 1/65536ths.
const ONE: u32 = 1 << 16;
/// At or below this share, claims try the bare insert first: at most about
/// one call in five pays a second statement.
const INSERT_BELOW: u32 = ONE / 5;
/// At or above this share, claims try the bare read first.
const READ_ABOVE: u32 = ONE - ONE / 5;
/// Each claim moves the share by 1/16 of the way to its own outcome, so a
/// change of load turns the forecast in a dozen or so calls.
const SHIFT: u32 = 4;

/// The statement a claim sends first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClaimPath {
    /// `Statements::claim_insert`: wins an absent key, or answers nothing.
    Insert,
    /// `Statements::claim_read`: answers a record that is kept (completed,
    /// in progress elsewhere, another fingerprint), or nothing.
    Read,
    /// `Statements::claim`: answers every case.
    Combined,
}

/// The forecast. Updates race between calls and may be lost; it is a
/// heuristic that only chooses which correct statement goes first.
#[derive(Debug)]
pub(crate) struct Forecast {
    kept_share: AtomicU32,
    /// Tests send each statement on purpose.
    #[cfg(test)]
    pinned: std::sync::OnceLock<ClaimPath>,
}

impl Default for Forecast {
    fn default() -> Forecast {
        Forecast {
            kept_share: AtomicU32::new(ONE / 2),
            #[cfg(test)]
            pinned: std::sync::OnceLock::new(),
        }
    }
}

impl Forecast {
    pub(crate) fn path(&self) -> ClaimPath {
        #[cfg(test)]
        if let Some(path) = self.pinned.get() {
            return *path;
        }
        match self.kept_share.load(Ordering::Relaxed) {
            s if s <= INSERT_BELOW => ClaimPath::Insert,
            s if s >= READ_ABOVE => ClaimPath::Read,
            _ => ClaimPath::Combined,
        }
    }

    /// Records one claim's outcome: `kept` when it found a record it could
    /// not take (a replay, a duplicate in flight, a fingerprint mismatch).
    pub(crate) fn observe(&self, kept: bool) {
        let share = self.kept_share.load(Ordering::Relaxed);
        let next = if kept {
            share + ((ONE - share) >> SHIFT)
        } else {
            share - (share >> SHIFT)
        };
        self.kept_share.store(next, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PgStore, RunInTx};
    use idem_core::store::{ClaimReply, Complete, Store, Token, ValueKind};
    use idem_core::{Error, Fingerprint, Idempotency, Outcome};
    use idem_testkit::{PgTestDb, claim};
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// Every claim transition, with each statement sent first: whatever a
    /// one-sided statement cannot answer, the combined one must.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn every_first_statement_answers_every_transition() {
        for path in [ClaimPath::Insert, ClaimPath::Read, ClaimPath::Combined] {
            let db = PgTestDb::new().await;
            let s = PgStore::from_pool(db.pool.clone());
            s.migrate().await.unwrap();
            s.inner.forecast.pinned.set(path).unwrap();
            let (a, b, c) = (Token::random(), Token::random(), Token::random());
            let (x, y) = (Fingerprint::of_bytes(b"x"), Fingerprint::of_bytes(b"y"));
            let at = |attempt| ClaimReply::Acquired { attempt };

            // fresh, then re-sent by its owner; in progress; another request
            for _ in 0..2 {
                let mine = s.claim(claim("k", &a, 5_000, 60_000, Some(&x))).await;
                assert_eq!(mine.unwrap(), at(1), "{path:?}");
            }
            match s.claim(claim("k", &b, 5_000, 60_000, Some(&x))).await {
                Ok(ClaimReply::InProgress { retry_after }) => {
                    assert!(
                        retry_after <= Duration::from_secs(5),
                        "{path:?} {retry_after:?}"
                    )
                }
                other => panic!("{path:?}: {other:?}"),
            }
            let other = s.claim(claim("k", &b, 5_000, 60_000, Some(&y))).await;
            assert!(
                matches!(other, Ok(ClaimReply::Mismatch)),
                "{path:?}: {other:?}"
            );

            // completed: replayed with its value, refused to another request
            s.complete(Complete::new("k", &a, ValueKind::Json, b"7"))
                .await
                .unwrap();
            match s.claim(claim("k", &c, 5_000, 60_000, Some(&x))).await {
                Ok(ClaimReply::Completed(done)) => {
                    assert_eq!(
                        (done.kind, &done.value[..]),
                        (ValueKind::Json, &b"7"[..]),
                        "{path:?}"
                    );
                    assert_eq!(done.fingerprint, Some(x), "{path:?}");
                }
                other => panic!("{path:?}: {other:?}"),
            }
            let other = s.claim(claim("k", &c, 5_000, 60_000, Some(&y))).await;
            assert!(
                matches!(other, Ok(ClaimReply::Mismatch)),
                "{path:?}: {other:?}"
            );

            // a lapsed lease is taken over; an expired record starts afresh
            assert_eq!(
                s.claim(claim("lapsed", &a, 100, 60_000, None))
                    .await
                    .unwrap(),
                at(1)
            );
            assert_eq!(
                s.claim(claim("gone", &a, 50, 150, None)).await.unwrap(),
                at(1)
            );
            s.complete(Complete::new("gone", &a, ValueKind::Json, b"1"))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert_eq!(
                s.claim(claim("lapsed", &b, 100, 60_000, None))
                    .await
                    .unwrap(),
                at(2),
                "{path:?}"
            );
            assert_eq!(
                s.claim(claim("gone", &b, 50, 150, None)).await.unwrap(),
                at(1),
                "{path:?}"
            );

            // a row nobody could have written: typed error, left as it was
            db.exec("INSERT INTO idem_keys (expires_at, state, key) VALUES (clock_timestamp() + interval '1 hour', 'X', 'odd')")
                .await;
            let odd = s.claim(claim("odd", &a, 5_000, 60_000, None)).await;
            assert!(
                matches!(odd, Err(Error::Corrupt { .. })),
                "{path:?}: {odd:?}"
            );
            assert_eq!(
                db.count("SELECT count(*) FROM idem_keys WHERE key = 'odd' AND state = 'X'")
                    .await,
                1
            );

            // many claimers of one new key: exactly one wins
            let tasks: Vec<_> = (0..32)
                .map(|_| {
                    let s = s.clone();
                    tokio::spawn(async move {
                        let t = Token::random();
                        s.claim(claim("race", &t, 5_000, 60_000, None)).await
                    })
                })
                .collect();
            let mut won = 0;
            for task in tasks {
                match task.await.unwrap() {
                    Ok(ClaimReply::Acquired { attempt: 1 }) => won += 1,
                    Ok(ClaimReply::InProgress { .. }) => {}
                    other => panic!("{path:?}: {other:?}"),
                }
            }
            assert_eq!(won, 1, "{path:?}");

            // run_in_tx: its own insert (in_tx, asynchronous commit); the
            // row and the result commit together, a retry replays both
            db.exec("CREATE TABLE orders (req text NOT NULL)").await;
            let idem = Idempotency::builder(s.clone()).build();
            let runs = AtomicUsize::new(0);
            for _ in 0..2 {
                let (n, outcome) = idem
                    .call("orders", "tx-1")
                    .run_in_tx_outcome(&db.pool, async |tx| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        let marked =
                            "SELECT count(*) FROM idem_keys WHERE key LIKE '%tx-1' AND in_tx";
                        assert_eq!(db.count(marked).await, 1, "{path:?}: the claim marks in_tx");
                        sqlx::query("INSERT INTO orders VALUES ('tx-1')")
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| Error::codec(e.to_string()))?;
                        Ok::<_, Error>(5u8)
                    })
                    .await
                    .unwrap();
                assert_eq!(n, 5, "{path:?}");
                assert!(
                    matches!(outcome, Outcome::Executed | Outcome::Replayed),
                    "{outcome:?}"
                );
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "{path:?}");
            assert_eq!(db.count("SELECT count(*) FROM orders").await, 1, "{path:?}");
        }
    }

    #[test]
    fn a_homogeneous_load_turns_the_forecast_and_a_mixed_one_keeps_the_combined_statement() {
        let f = Forecast::default();
        assert_eq!(f.path(), ClaimPath::Combined);
        let turns = (1..100).find(|_| {
            f.observe(false);
            f.path() == ClaimPath::Insert
        });
        assert_eq!(turns, Some(15), "new keys turn it to the insert");
        let turns = (1..100).find(|_| {
            f.observe(true);
            f.path() == ClaimPath::Read
        });
        assert!(turns.is_some_and(|n| n < 40), "{turns:?}");
        let f = Forecast::default();
        for i in 0..1000 {
            f.observe(i % 2 == 0);
            assert_eq!(f.path(), ClaimPath::Combined, "a 50/50 load, call {i}");
        }
        // The share saturates without overflow.
        for _ in 0..10_000 {
            f.observe(true);
        }
        assert!(f.kept_share.load(Ordering::Relaxed) <= ONE);
        for _ in 0..10_000 {
            f.observe(false);
        }
        assert_eq!(f.path(), ClaimPath::Insert);
    }
}
