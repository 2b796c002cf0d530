//! `MemoryStore`, `RedisStore` and `PgStore` are one state machine.
//!
//! A proptest property drives random sequences of claim / complete / release
//! / extend / clock advance against the three stores side by side, through the
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

use idem::{Claim, ClaimReply, Fingerprint, MemoryStore, Store, Token, ValueKind, WriteReply};
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

#[derive(Debug, Clone, Copy)]
enum Op {
    Claim {
        key: usize,
        token: u8,
        fp: Option<u8>,
        long_lease: bool,
        long_ttl: bool,
    },
    Complete {
        key: usize,
        token: u8,
        fp_hint: bool,
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
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS.len();
    let tok = 0u8..3;
    let kind = prop_oneof![
        Just(ValueKind::Json),
        Just(ValueKind::Lz4Json),
        Just(ValueKind::TooLarge),
        Just(ValueKind::Unstorable),
    ];
    prop_oneof![
        5 => (key.clone(), tok.clone(), proptest::option::of(0u8..2), prop::bool::weighted(0.2), any::<bool>())
            .prop_map(|(key, token, fp, long_lease, long_ttl)| Op::Claim { key, token, fp, long_lease, long_ttl }),
        3 => (key.clone(), tok.clone(), any::<bool>(), kind, 0..VALUES.len())
            .prop_map(|(key, token, fp_hint, kind, value)| Op::Complete { key, token, fp_hint, kind, value }),
        2 => (key.clone(), tok.clone()).prop_map(|(key, token)| Op::Release { key, token }),
        2 => (key, tok, any::<bool>())
            .prop_map(|(key, token, long_lease)| Op::Extend { key, token, long_lease }),
        1 => Just(Op::Advance),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 1..12).prop_map(|mut ops| {
        // Keep the number of sleeps bounded (see MAX_ADVANCES).
        let mut seen = 0;
        ops.retain(|o| {
            if matches!(o, Op::Advance) {
                seen += 1;
                seen <= MAX_ADVANCES
            } else {
                true
            }
        });
        ops
    })
}

#[derive(Debug)]
enum Reply {
    Claim(ClaimReply),
    Write(WriteReply),
    Slept,
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
            Reply::Claim(
                store
                    .claim(Claim {
                        key: KEYS[key],
                        token: &t,
                        // A long lease over a short TTL: both stores keep
                        // the record for the lease.
                        lease: if long_lease { LONG_LEASE } else { SHORT },
                        ttl: if long_ttl { LONG_TTL } else { SHORT },
                        fingerprint: f.as_ref(),
                        want_ttl_left: true,
                    })
                    .await?,
            )
        }
        Op::Complete {
            key,
            token: t,
            fp_hint,
            kind,
            value,
        } => Reply::Write(
            store
                .complete(
                    KEYS[key],
                    &token(t),
                    fp_hint.then(|| fingerprint(1)).as_ref(),
                    kind,
                    VALUES[value],
                )
                .await?,
        ),
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
    })
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
        _ => false,
    }
}

async fn run_case(ops: &[Op], redis: &TestContext, pg: &Pg) -> Result<(), TestCaseError> {
    redis.server().flushall();
    pg.0.exec("DELETE FROM idem_keys").await;
    let memory = MemoryStore::new();
    let mut log = Vec::new();
    // Every sequence ends with a probe of each key by an outsider token, so
    // a divergence in state that no reply showed yet still surfaces.
    let probes = (0..KEYS.len()).map(|key| Op::Claim {
        key,
        token: 9,
        fp: None,
        long_lease: false,
        long_ttl: true,
    });
    for op in ops.iter().copied().chain(probes) {
        let started = Instant::now();
        if let Op::Advance = op {
            tokio::time::sleep(ADVANCE).await;
        }
        let mem = step(&memory, op).await;
        let red = step(redis.store(), op).await;
        let sql = step(&pg.1, op).await;
        let (mem, red, sql) = match (mem, red, sql) {
            (Ok(m), Ok(r), Ok(p)) => (m, r, p),
            (m, r, p) => {
                return Err(TestCaseError::fail(format!(
                    "{op:?}: a store failed: memory {m:?}, redis {r:?}, postgres {p:?}\nafter {log:#?}"
                )));
            }
        };
        if !same(&mem, &red) || !same(&mem, &sql) {
            return Err(TestCaseError::fail(format!(
                "stores diverge at {op:?}:\n  memory:   {mem:?}\n  redis:    {red:?}\n  postgres: {sql:?}\nafter {log:#?}"
            )));
        }
        // A step far slower than expected would blur the lease boundaries
        // this model relies on: say so instead of reporting a false bug.
        let took = started
            .elapsed()
            .saturating_sub(if matches!(op, Op::Advance) {
                ADVANCE
            } else {
                Duration::ZERO
            });
        if took > Duration::from_millis(100) {
            return Err(TestCaseError::reject(format!(
                "step {op:?} took {took:?}: machine too loaded"
            )));
        }
        log.push((op, mem));
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
    let result = runner.run(&ops(), |ops| rt.block_on(run_case(&ops, &redis, &pg)));
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
        fp_hint: true,
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
                fp_hint: true,
                kind: ValueKind::Json,
                value: 0,
            },
            claim(0, 0, Some(1), true),
            Complete {
                key: 0,
                token: 0,
                fp_hint: false,
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
                fp_hint: true,
                kind: ValueKind::Unstorable,
                value: 5,
            },
            claim(1, 1, None, true),
        ],
    ];
    for ops in sequences {
        // A case rejected for a slow step (see `run_case`) is run again from
        // clean stores, as proptest does with its own draws; a divergence
        // fails at once.
        let mut tries = 0;
        loop {
            match rt.block_on(run_case(&ops, &redis, &pg)) {
                Ok(()) => break,
                Err(TestCaseError::Reject(why)) if tries < MAX_SLOW_RETRIES => {
                    tries += 1;
                    eprintln!("model: run again ({why})");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

/// How often a fixed sequence is run again when a loaded machine made one
/// of its steps too slow for the model's lease boundaries.
const MAX_SLOW_RETRIES: usize = 5;
