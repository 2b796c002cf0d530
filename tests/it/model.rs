//! `MemoryStore`, `RedisStore` and `PgStore` are one state machine.
//!
//! A proptest property drives random sequences of claim / complete / release
//! / extend / clock advance, and the durable steps' save_step / steps /
//! suspend, against the three stores side by side, through the
//! public [`Store`] trait, and asserts that they give identical replies.
//! Only the two clock-derived durations (`InProgress.retry_after` and
//! `Completed.ttl_left`) are compared coarsely: Redis counts with its own
//! `TIME`, memory with `tokio::time::Instant`.
//!
//! Redis uses server time, so a clock advance is a real sleep. Leases are
//! coarse (300 ms) and an advance is 450 ms, well clear of every deadline:
//! a deadline set at `t` is either still ~300 ms away (no sleep since) or
//! ≥ 150 ms in the past (a sleep since). Long durations (5 s leases, 60 s
//! TTLs) outlive a whole sequence.

use idem::store::Finish;
use idem::store::{Claim, ClaimReply, Complete, StepRecord, Store, Token, ValueKind, WriteReply};
use idem::{Fingerprint, MemoryStore};
use idem_postgres::PgStore;
use idem_testkit::{PgTestDb, TestContext};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use std::time::{Duration, Instant};

const KEYS: [&str; 3] = ["idem:model:a", "idem:model:{b}", "idem:model:c%3Ax"];
const SHORT: Duration = Duration::from_millis(300);
const LONG_LEASE: Duration = Duration::from_secs(5);
const LONG_TTL: Duration = Duration::from_secs(60);
const ADVANCE: Duration = Duration::from_millis(450);
/// How far the two stores' clock-derived durations may differ: the time
/// between the two stores' steps (one round trip), with a wide margin.
const CLOCK_SLACK: Duration = Duration::from_millis(150);
/// At most this many advances per sequence, so 60 s TTLs and 5 s leases
/// never expire inside one and each case stays short.
const MAX_ADVANCES: usize = 4;

fn token(i: u8) -> Token {
    Token::from_u128(0x1d3e_0000_0000_0000_0000_0000_0000_0000 | u128::from(i))
}

fn fingerprint(i: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[b'f', i])
}

const VALUES: [&[u8]; 6] = [
    b"",
    b"0",
    b"null",
    b"{\"receipt\":\"r-1\",\"amount\":500}",
    &[0xff, 0x00, 0x80, b'\n', b':'],
    &[b'z'; 3000],
];

/// Step values (serde_json text, as `Steps::step` records), some of them
/// with the Redis step tail's own separators inside.
const STEP_VALUES: [&[u8]; 4] = [b"0", b"\"|3:abc1:x\"", b"{\"hold\":\"h-1\"}", b"\"\""];
const STEP_NAMES: [&str; 3] = ["reserve", "charge", "e|1:x"];

#[derive(Debug, Clone, Copy)]
enum Op {
    Claim {
        key: usize,
        token: u8,
        fp: Option<u8>,
        long_lease: bool,
        long_ttl: bool,
    },
    /// `complete` told the claim `token` may have made (`Complete::of_claim`)
    /// (on Valkey, a plain `SET … IFEQ` when they are the record's).
    Complete {
        key: usize,
        token: u8,
        fp: Option<u8>,
        long_lease: bool,
        long_ttl: bool,
        kind: ValueKind,
        value: usize,
    },
    Release {
        key: usize,
        token: u8,
    },
    Extend {
        key: usize,
        token: u8,
        long_lease: bool,
    },
    Advance,
    SaveStep {
        key: usize,
        token: u8,
        name: usize,
        value: usize,
    },
    Steps {
        key: usize,
        token: u8,
    },
    Suspend {
        key: usize,
        token: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS.len();
    let tok = 0u8..3;
    prop_oneof![
        5 => claim_op(),
        5 => finish_op(),
        2 => (key, tok, any::<bool>())
            .prop_map(|(key, token, long_lease)| Op::Extend { key, token, long_lease }),
        1 => Just(Op::Advance),
        3 => (0..KEYS.len(), 0u8..3, 0..STEP_NAMES.len(), 0..STEP_VALUES.len())
            .prop_map(|(key, token, name, value)| Op::SaveStep { key, token, name, value }),
        1 => (0..KEYS.len(), 0u8..3).prop_map(|(key, token)| Op::Steps { key, token }),
        1 => (0..KEYS.len(), 0u8..3).prop_map(|(key, token)| Op::Suspend { key, token }),
    ]
}

fn claim_op() -> impl Strategy<Value = Op> {
    (
        0..KEYS.len(),
        0u8..3,
        proptest::option::of(0u8..2),
        prop::bool::weighted(0.2),
        any::<bool>(),
    )
        .prop_map(|(key, token, fp, long_lease, long_ttl)| Op::Claim {
            key,
            token,
            fp,
            long_lease,
            long_ttl,
        })
}

/// A complete (3 in 5) or a release (2 in 5): the items of `finish_batch`.
fn finish_op() -> impl Strategy<Value = Op> {
    let kind = prop_oneof![
        Just(ValueKind::Json),
        Just(ValueKind::Lz4Json),
        Just(ValueKind::TooLarge),
        Just(ValueKind::Unstorable),
    ];
    prop_oneof![
        3 => (
            (0..KEYS.len(), 0u8..3, proptest::option::of(0u8..2)),
            (prop::bool::weighted(0.2), any::<bool>(), kind, 0..VALUES.len()),
        )
            .prop_map(|((key, token, fp), (long_lease, long_ttl, kind, value))| {
                Op::Complete { key, token, fp, long_lease, long_ttl, kind, value }
            }),
        2 => (0..KEYS.len(), 0u8..3).prop_map(|(key, token)| Op::Release { key, token }),
    ]
}

/// One step of a sequence: a single call, or a batch (`claim_batch` of
/// claims, `finish_batch` of completes and releases) that the reference
/// memory store runs one call at a time and the others as one batch. With
/// three keys, a batch often holds a key twice.
#[derive(Debug, Clone)]
enum Step {
    One(Op),
    Batch(Vec<Op>),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        8 => op().prop_map(Step::One),
        1 => proptest::collection::vec(claim_op(), 1..5).prop_map(Step::Batch),
        1 => proptest::collection::vec(finish_op(), 1..5).prop_map(Step::Batch),
    ];
    proptest::collection::vec(step, 1..12).prop_map(|mut steps| {
        // Keep the number of sleeps bounded (see MAX_ADVANCES).
        let mut seen = 0;
        steps.retain(|s| {
            if matches!(s, Step::One(Op::Advance)) {
                seen += 1;
                seen <= MAX_ADVANCES
            } else {
                true
            }
        });
        steps
    })
}

#[derive(Debug)]
enum Reply {
    Claim(ClaimReply),
    Write(WriteReply),
    Slept,
    Steps(Option<Vec<StepRecord>>),
}

async fn step(store: &dyn Store, op: Op) -> Result<Reply, idem::Error> {
    Ok(match op {
        Op::Claim {
            key,
            token: t,
            fp,
            long_lease,
            long_ttl,
        } => {
            let (t, f) = (token(t), fp.map(fingerprint));
            let claim = claim_of(key, &t, f.as_ref(), long_lease, long_ttl);
            Reply::Claim(store.claim(claim).await?)
        }
        Op::Complete {
            key,
            token: t,
            fp,
            long_lease,
            long_ttl,
            kind,
            value,
        } => {
            let (t, f) = (token(t), fp.map(fingerprint));
            let claim = claim_of(key, &t, f.as_ref(), long_lease, long_ttl);
            let done = store.complete(Complete::of_claim(&claim, kind, VALUES[value]));
            Reply::Write(done.await?)
        }
        Op::Release { key, token: t } => Reply::Write(store.release(KEYS[key], &token(t)).await?),
        Op::Extend {
            key,
            token: t,
            long_lease,
        } => Reply::Write(
            store
                .extend(
                    KEYS[key],
                    &token(t),
                    if long_lease { LONG_LEASE } else { SHORT },
                )
                .await?,
        ),
        Op::Advance => Reply::Slept,
        Op::SaveStep {
            key,
            token: t,
            name,
            value,
        } => Reply::Write(
            store
                .save_step(KEYS[key], &token(t), STEP_NAMES[name], STEP_VALUES[value])
                .await?,
        ),
        Op::Steps { key, token: t } => Reply::Steps(store.steps(KEYS[key], &token(t)).await?),
        Op::Suspend { key, token: t } => Reply::Write(store.suspend(KEYS[key], &token(t)).await?),
    })
}

fn claim_of<'a>(
    key: usize,
    token: &'a Token,
    fingerprint: Option<&'a Fingerprint>,
    long_lease: bool,
    long_ttl: bool,
) -> Claim<'a> {
    // A long lease over a short TTL: both stores keep the record for the
    // lease.
    let lease = if long_lease { LONG_LEASE } else { SHORT };
    let ttl = if long_ttl { LONG_TTL } else { SHORT };
    Claim::new(KEYS[key], token, lease, ttl)
        .fingerprint(fingerprint)
        .want_ttl_left(true)
}

/// Runs `ops` as one batch: `claim_batch` when they are claims, else
/// `finish_batch` (`steps` makes batches of one sort only).
async fn batch(store: &dyn Store, ops: &[Op]) -> Vec<Result<Reply, idem::Error>> {
    let owned: Vec<(Token, Option<Fingerprint>)> = ops
        .iter()
        .map(|op| match *op {
            Op::Claim { token: t, fp, .. } => (token(t), fp.map(fingerprint)),
            Op::Complete { token: t, fp, .. } => (token(t), fp.map(fingerprint)),
            Op::Release { token: t, .. }
            | Op::Extend { token: t, .. }
            | Op::SaveStep { token: t, .. }
            | Op::Steps { token: t, .. }
            | Op::Suspend { token: t, .. } => (token(t), None),
            Op::Advance => (token(0), None),
        })
        .collect();
    if ops.iter().all(|op| matches!(op, Op::Claim { .. })) {
        let claims: Vec<Claim<'_>> = ops
            .iter()
            .zip(&owned)
            .filter_map(|(op, (t, f))| match *op {
                Op::Claim {
                    key,
                    long_lease,
                    long_ttl,
                    ..
                } => Some(claim_of(key, t, f.as_ref(), long_lease, long_ttl)),
                _ => None,
            })
            .collect();
        let replies = store.claim_batch(&claims).await;
        return replies.into_iter().map(|r| r.map(Reply::Claim)).collect();
    }
    let finishes: Vec<Finish<'_>> = ops
        .iter()
        .zip(&owned)
        .filter_map(|(op, (t, f))| match *op {
            Op::Complete {
                key,
                long_lease,
                long_ttl,
                kind,
                value,
                ..
            } => Some(Finish::Complete(Complete::of_claim(
                &claim_of(key, t, f.as_ref(), long_lease, long_ttl),
                kind,
                VALUES[value],
            ))),
            Op::Release { key, .. } => Some(Finish::Release {
                key: KEYS[key],
                token: t,
            }),
            _ => None,
        })
        .collect();
    let replies = store.finish_batch(&finishes).await;
    replies.into_iter().map(|r| r.map(Reply::Write)).collect()
}

fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) <= CLOCK_SLACK
}

/// Equal replies, comparing the two clock-derived durations coarsely.
fn same(mem: &Reply, red: &Reply) -> bool {
    use ClaimReply::*;
    match (mem, red) {
        (
            Reply::Claim(InProgress { retry_after: a }),
            Reply::Claim(InProgress { retry_after: b }),
        ) => close(*a, *b),
        (Reply::Claim(Completed(a)), Reply::Claim(Completed(b))) => {
            a.kind == b.kind
                && a.value == b.value
                && a.fingerprint == b.fingerprint
                && match (a.ttl_left, b.ttl_left) {
                    (Some(x), Some(y)) => close(x, y),
                    _ => false,
                }
        }
        (Reply::Claim(a), Reply::Claim(b)) => a == b,
        (Reply::Write(a), Reply::Write(b)) => a == b,
        (Reply::Slept, Reply::Slept) => true,
        (Reply::Steps(a), Reply::Steps(b)) => a == b,
        _ => false,
    }
}

async fn run_case(steps: &[Step], redis: &TestContext, pg: &Pg) -> Result<(), TestCaseError> {
    redis.server().flushall();
    pg.0.exec("DELETE FROM idem_keys").await;
    // The reference runs every operation as a single call; `batched`, Redis
    // and PostgreSQL run a batch step as one batch.
    let memory = MemoryStore::new();
    let batched = MemoryStore::new();
    let mut log = Vec::new();
    // Every sequence ends with a probe of each key by an outsider token, so
    // a divergence in state that no reply showed yet still surfaces.
    let probes = (0..KEYS.len()).map(|key| {
        Step::One(Op::Claim {
            key,
            token: 9,
            fp: None,
            long_lease: false,
            long_ttl: true,
        })
    });
    for step_ in steps.iter().cloned().chain(probes) {
        let started = Instant::now();
        if let Step::One(Op::Advance) = step_ {
            tokio::time::sleep(ADVANCE).await;
        }
        let ops = match &step_ {
            Step::One(op) => vec![*op],
            Step::Batch(ops) => ops.clone(),
        };
        let mut mem = Vec::with_capacity(ops.len());
        for op in &ops {
            mem.push(step(&memory, *op).await);
        }
        let (bat, red, sql) = match &step_ {
            Step::One(op) => (
                vec![step(&batched, *op).await],
                vec![step(redis.store(), *op).await],
                vec![step(&pg.1, *op).await],
            ),
            Step::Batch(ops) => (
                batch(&batched, ops).await,
                batch(redis.store(), ops).await,
                batch(&pg.1, ops).await,
            ),
        };
        let lens = [bat.len(), red.len(), sql.len()];
        if lens != [ops.len(); 3] {
            return Err(TestCaseError::fail(format!(
                "{step_:?}: {lens:?} replies for {} operations",
                ops.len()
            )));
        }
        // A step far slower than expected blurs the lease boundaries this
        // model relies on (a store that answered 200 ms after another sees a
        // lease 200 ms shorter): reject the case before comparing, instead
        // of reporting a false divergence.
        let took = started
            .elapsed()
            .saturating_sub(if matches!(step_, Step::One(Op::Advance)) {
                ADVANCE
            } else {
                Duration::ZERO
            });
        if took > Duration::from_millis(100) {
            return Err(TestCaseError::reject(format!(
                "step {step_:?} took {took:?}: machine too loaded"
            )));
        }
        let all = mem.into_iter().zip(bat).zip(red).zip(sql);
        for (op, (((mem, bat), red), sql)) in ops.iter().zip(all) {
            let (mem, bat, red, sql) = match (mem, bat, red, sql) {
                (Ok(m), Ok(b), Ok(r), Ok(p)) => (m, b, r, p),
                (m, b, r, p) => {
                    return Err(TestCaseError::fail(format!(
                        "{op:?} in {step_:?}: a store failed: memory {m:?}, batched memory {b:?}, redis {r:?}, postgres {p:?}\nafter {log:#?}"
                    )));
                }
            };
            if !same(&mem, &bat) || !same(&mem, &red) || !same(&mem, &sql) {
                return Err(TestCaseError::fail(format!(
                    "stores diverge at {op:?} in {step_:?}:\n  memory:   {mem:?}\n  batched:  {bat:?}\n  redis:    {red:?}\n  postgres: {sql:?}\nafter {log:#?}"
                )));
            }
            log.push((*op, mem));
        }
    }
    Ok(())
}

/// A database of its own on the local PostgreSQL, and a store on it.
type Pg = (PgTestDb, PgStore);

/// A private Redis, a PostgreSQL database, and the runtime that drives the stores.
fn runtime_and_redis() -> (tokio::runtime::Runtime, TestContext, Pg) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = rt.block_on(TestContext::redis());
    let pg = rt.block_on(async {
        let db = PgTestDb::new().await;
        let store = PgStore::from_pool(db.pool.clone());
        store.migrate().await.unwrap();
        // A connection's first claim compiles idem's functions and plans its
        // statements: pay for that here, not inside a timed step.
        for op in [
            Op::Claim {
                key: 0,
                token: 0,
                fp: None,
                long_lease: false,
                long_ttl: true,
            },
            Op::Release { key: 0, token: 0 },
        ] {
            step(&store, op).await.unwrap();
        }
        (db, store)
    });
    (rt, redis, pg)
}

#[test]
fn memory_and_redis_stores_are_one_state_machine() {
    let (rt, redis, pg) = runtime_and_redis();
    // IDEM_MODEL_CASES=500 for a longer hunt; 24 keeps CI under a minute.
    let cases = std::env::var("IDEM_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    let started = Instant::now();
    let result = runner.run(&steps(), |steps| rt.block_on(run_case(&steps, &redis, &pg)));
    if let Err(e) = result {
        panic!("MemoryStore and RedisStore diverge: {e}");
    }
    eprintln!("model: {cases} cases in {:?}", started.elapsed());
}

/// The fixed sequences that exercise each transition at least once, so a
/// regression shows up even on an unlucky random draw.
#[test]
fn memory_and_redis_agree_on_every_transition() {
    use Op::*;
    let (rt, redis, pg) = runtime_and_redis();
    let claim = |key, token, fp, long_ttl| Claim {
        key,
        token,
        fp,
        long_lease: false,
        long_ttl,
    };
    let json = |key, token| Complete {
        key,
        token,
        fp: Some(1),
        long_lease: false,
        long_ttl: false,
        kind: ValueKind::Json,
        value: 3,
    };
    let sequences: Vec<Vec<Op>> = vec![
        // fresh, re-sent, busy, complete, replay, late writes by others
        vec![
            claim(0, 0, Some(0), true),
            claim(0, 0, Some(0), true),
            claim(0, 1, None, true),
            claim(0, 1, Some(1), true),
            json(0, 0),
            claim(0, 1, None, true),
            claim(0, 1, Some(1), true),
            json(0, 1),
            Release { key: 0, token: 0 },
            Extend {
                key: 0,
                token: 0,
                long_lease: false,
            },
        ],
        // takeover after the lease: attempt 2, fingerprint kept / replaced, old holder refused
        vec![
            claim(1, 0, None, true),
            Advance,
            claim(1, 1, Some(1), true),
            json(1, 0),
            Release { key: 1, token: 0 },
            Extend {
                key: 1,
                token: 0,
                long_lease: true,
            },
            claim(1, 2, Some(0), true),
            Advance,
            claim(1, 2, Some(0), true),
            claim(1, 2, None, true),
        ],
        // extend keeps a lease alive past its first deadline and the record past its TTL
        vec![
            claim(2, 0, None, false),
            Extend {
                key: 2,
                token: 0,
                long_lease: true,
            },
            Advance,
            claim(2, 1, None, false),
            Extend {
                key: 2,
                token: 0,
                long_lease: false,
            },
            Advance,
            claim(2, 1, None, false),
            Advance,
            Release { key: 2, token: 1 },
        ],
        // records expire: pending with a short TTL, completed with a short TTL
        vec![
            claim(0, 0, Some(0), false),
            Advance,
            Complete {
                key: 0,
                token: 0,
                fp: Some(1),
                long_lease: false,
                long_ttl: false,
                kind: ValueKind::Json,
                value: 0,
            },
            claim(0, 0, Some(1), true),
            Complete {
                key: 0,
                token: 0,
                fp: None,
                long_lease: false,
                long_ttl: false,
                kind: ValueKind::TooLarge,
                value: 4,
            },
            claim(0, 1, None, true),
            Advance,
            claim(0, 1, Some(1), true),
        ],
        // a long lease over a short TTL: the record lives as long as the lease
        vec![
            Op::Claim {
                key: 2,
                token: 0,
                fp: Some(1),
                long_lease: true,
                long_ttl: false,
            },
            Advance,
            claim(2, 1, Some(1), false),
            Extend {
                key: 2,
                token: 0,
                long_lease: false,
            },
            Advance,
            claim(2, 1, None, false),
            Advance,
            claim(2, 1, Some(0), true),
        ],
        // a lease that ran out but nobody took over: the holder may still finish
        vec![
            claim(1, 0, None, true),
            Advance,
            Extend {
                key: 1,
                token: 0,
                long_lease: false,
            },
            claim(1, 1, None, true),
            Advance,
            Complete {
                key: 1,
                token: 0,
                fp: Some(1),
                long_lease: false,
                long_ttl: false,
                kind: ValueKind::Unstorable,
                value: 5,
            },
            claim(1, 1, None, true),
        ],
    ];
    for ops in sequences {
        run_fixed(&rt, &redis, &pg, ops.into_iter().map(Step::One).collect());
    }
}

/// Runs one fixed sequence. A case rejected for a slow step (see
/// `run_case`) is run again from clean stores, as proptest does with its
/// own draws; a divergence fails at once.
fn run_fixed(rt: &tokio::runtime::Runtime, redis: &TestContext, pg: &Pg, steps: Vec<Step>) {
    let mut tries = 0;
    loop {
        match rt.block_on(run_case(&steps, redis, pg)) {
            Ok(()) => break,
            Err(TestCaseError::Reject(why)) if tries < MAX_SLOW_RETRIES => {
                tries += 1;
                eprintln!("model: run again ({why})");
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Batches that hold a key more than once, beside other keys, through
/// each transition: every store answers each item as the reference
/// answers the same calls one by one, in batch order.
#[test]
fn memory_and_redis_batches_answer_as_the_single_calls_in_order() {
    use Op::*;
    let (rt, redis, pg) = runtime_and_redis();
    let claim = |key, token, fp| Claim {
        key,
        token,
        fp,
        long_lease: false,
        long_ttl: true,
    };
    let json = |key, token, value| Complete {
        key,
        token,
        fp: Some(1),
        long_lease: false,
        long_ttl: false,
        kind: ValueKind::Json,
        value,
    };
    let sequences: Vec<Vec<Step>> = vec![
        vec![
            // fresh, busy, re-sent, mismatch; another key beside it
            Step::Batch(vec![
                claim(0, 0, Some(1)),
                claim(0, 1, Some(1)),
                claim(1, 2, None),
                claim(0, 0, Some(1)),
                claim(0, 1, Some(0)),
            ]),
            // complete, then the same again, a release and another owner
            Step::Batch(vec![
                json(0, 0, 3),
                json(0, 0, 3),
                Release { key: 0, token: 0 },
                json(0, 1, 2),
                Release { key: 1, token: 2 },
                json(1, 2, 1),
            ]),
            // replays, a fresh key after its release
            Step::Batch(vec![
                claim(0, 1, None),
                claim(1, 0, None),
                claim(0, 2, Some(0)),
            ]),
        ],
        vec![
            Step::Batch(vec![claim(2, 0, None), claim(1, 0, None)]),
            Step::One(Advance),
            // takeover (attempt 2), then busy for the next one in the batch
            Step::Batch(vec![
                claim(2, 1, Some(1)),
                claim(2, 2, None),
                claim(2, 1, Some(1)),
                claim(1, 0, None),
            ]),
            // the old holder is refused; release then complete of one key
            Step::Batch(vec![
                json(2, 0, 4),
                Release { key: 2, token: 1 },
                json(2, 1, 4),
                Release { key: 1, token: 0 },
            ]),
        ],
    ];
    for steps in sequences {
        run_fixed(&rt, &redis, &pg, steps);
    }
}

/// How often a fixed sequence is run again when a loaded machine made one
/// of its steps too slow for the model's lease boundaries.
const MAX_SLOW_RETRIES: usize = 5;
