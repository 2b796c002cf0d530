//! The batch phase: `BATCH` claims of fresh keys, then their completes,
//! three ways on the same store and server, rounds interleaved: one call
//! after another (a loop that awaits each), all single calls at once (the
//! multiplexed connection pipelines them, as concurrent handlers do), and
//! one `claim_batch` / `finish_batch`. Stands apart from the interleaved
//! phases, like the wait phase.

use futures_util::future::join_all;
use idem::RedisStore;
use idem::store::{Claim, ClaimReply, Complete, Finish, Store, Token, ValueKind, WriteReply};
use std::time::{Duration, Instant};

/// Items per batch.
const BATCH: usize = 64;
/// Batches per mode per round, and rounds.
const PER_ROUND: usize = 20;
const ROUNDS: usize = 10;
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(120);

#[derive(Clone, Copy)]
enum Mode {
    Sequential,
    Concurrent,
    Batch,
}

const MODES: [(Mode, &str); 3] = [
    (Mode::Sequential, "64 single calls, one after another"),
    (Mode::Concurrent, "64 single calls at once"),
    (Mode::Batch, "one batch of 64"),
];

fn claim<'a>(key: &'a str, token: &'a Token) -> Claim<'a> {
    Claim::new(key, token, LEASE, TTL)
}

/// Claims then completes one batch of fresh keys in `mode`; the time of
/// each half.
async fn one_batch(store: &RedisStore, mode: Mode, keys: &[String]) -> (Duration, Duration) {
    let token = Token::random();
    let claims: Vec<Claim<'_>> = keys.iter().map(|k| claim(k, &token)).collect();
    let done: Vec<Finish<'_>> = keys
        .iter()
        .map(|key| {
            let done = Complete::of_claim(&claim(key, &token), ValueKind::Json, b"{\"ok\":true}");
            Finish::Complete(done)
        })
        .collect();
    let started = Instant::now();
    let claimed: Vec<_> = match mode {
        Mode::Sequential => {
            let mut out = Vec::with_capacity(claims.len());
            for c in &claims {
                out.push(store.claim(*c).await);
            }
            out
        }
        Mode::Concurrent => join_all(claims.iter().map(|c| store.claim(*c))).await,
        Mode::Batch => store.claim_batch(&claims).await,
    };
    let claim_took = started.elapsed();
    for r in claimed {
        assert!(
            matches!(r, Ok(ClaimReply::Acquired { attempt: 1 })),
            "{r:?}"
        );
    }
    let started = Instant::now();
    let written: Vec<_> = match mode {
        Mode::Sequential => {
            let mut out = Vec::with_capacity(done.len());
            for op in &done {
                out.push(op.run_on(store).await);
            }
            out
        }
        Mode::Concurrent => join_all(done.iter().map(|op| op.run_on(store))).await,
        Mode::Batch => store.finish_batch(&done).await,
    };
    let complete_took = started.elapsed();
    for r in written {
        assert!(matches!(r, Ok(WriteReply::Done)), "{r:?}");
    }
    (claim_took, complete_took)
}

/// Runs the phase and prints its table: keys per second for claims and
/// completes, and the time of one batch.
pub(crate) async fn measure_and_print(store: &RedisStore, run: u32) {
    let mut totals = [(Duration::ZERO, Duration::ZERO); 3];
    let mut seq = 0u64;
    for round in 0..ROUNDS {
        for m in 0..MODES.len() {
            // Rotate which mode goes first, so drift hits them alike.
            let at = (m + round) % MODES.len();
            let (mode, _) = MODES[at];
            for _ in 0..PER_ROUND {
                let keys: Vec<String> = (0..BATCH)
                    .map(|_| {
                        seq += 1;
                        format!("bench:batch:{run:x}:{seq}")
                    })
                    .collect();
                let (c, w) = one_batch(store, mode, &keys).await;
                totals[at].0 += c;
                totals[at].1 += w;
            }
        }
    }
    let batches = (ROUNDS * PER_ROUND) as f64;
    let keys = batches * BATCH as f64;
    println!(
        "\nbatch ({BATCH} fresh keys per batch, {} batches per mode)",
        ROUNDS * PER_ROUND
    );
    println!(
        "{:<36} {:>14} {:>14} {:>14} {:>14}",
        "mode", "claims/s", "µs per claims", "completes/s", "µs per compl."
    );
    for (i, (_, name)) in MODES.iter().enumerate() {
        let (c, w) = totals[i];
        println!(
            "{name:<36} {:>14.0} {:>14.0} {:>14.0} {:>14.0}",
            keys / c.as_secs_f64(),
            c.as_secs_f64() * 1e6 / batches,
            keys / w.as_secs_f64(),
            w.as_secs_f64() * 1e6 / batches,
        );
    }
}
