//! The operations: idem's calls and the floor's hand-written equivalents.

use crate::keys::{FLOOR_PREFIX, FreshKey, ReplayKey, Row, SCOPE, VALUE, big_value, value_json};
use idem::{Idempotency, idempotent};
use redis::aio::ConnectionManager;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The floor's claim: take a fresh key, nothing else.
pub(crate) const FLOOR_CLAIM: &str =
    "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])";
/// The floor's complete: store the value over it.
pub(crate) const FLOOR_COMPLETE: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])";
pub(crate) const TTL_MS: u64 = 3_600_000;
/// The floor's stand-in for an owner token (same size as idem's).
const FLOOR_TOKEN: &[u8; 32] = b"0123456789abcdef0123456789abcdef";

pub(crate) struct Ctx {
    pub(crate) run: u32,
    /// Database 0: the replay keys (kept for the whole run).
    pub(crate) conn: ConnectionManager,
    /// Database 1 of our own server (emptied before each slice, so every
    /// slice of a fresh phase starts from the same small key space), or the
    /// `--redis` URL's database.
    pub(crate) fresh_conn: ConnectionManager,
    pub(crate) flush_fresh: bool,
    pub(crate) claim: redis::Script,
    pub(crate) complete: redis::Script,
    /// No cache, no compression: what `#[idempotent]` (installed globally)
    /// and the hand-written calls use.
    pub(crate) idem: Idempotency,
    /// Over database 0, no cache.
    pub(crate) replayer: Idempotency,
    /// Over database 0, `local_cache(100_000)`.
    pub(crate) cached: Idempotency,
    /// Over the fresh database, without and with compression.
    pub(crate) big_plain: Idempotency,
    pub(crate) big_lz4: Idempotency,
    /// The same two over database 0, for the big replays.
    pub(crate) big_plain_r: Idempotency,
    pub(crate) big_lz4_r: Idempotency,
    pub(crate) replay_keys: u64,
    pub(crate) errors: AtomicU64,
}

/// The `#[idempotent]` form of the no-op body (uses the installed default).
#[idempotent(key = key, scope = "bench", ttl = "1h")]
async fn noop(key: FreshKey) -> Result<String, idem::Error> {
    Ok(VALUE.to_owned())
}

/// The same call written by hand.
pub(crate) async fn noop_by_hand(idem: &Idempotency, key: FreshKey) -> Result<String, idem::Error> {
    idem.call(SCOPE, key)
        .ttl(Duration::from_secs(3600))
        .run(|| async { Ok(VALUE.to_owned()) })
        .await
}

impl Ctx {
    fn error(&self, what: &str, e: &dyn fmt::Display) {
        if self.errors.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("error in {what}: {e}");
        }
    }

    pub(crate) async fn floor_fresh(&self, key: FreshKey) {
        let mut conn = self.fresh_conn.clone();
        let full = format!("{FLOOR_PREFIX}{key}");
        let claimed: redis::RedisResult<redis::Value> = self
            .claim
            .key(&full)
            .arg(&FLOOR_TOKEN[..])
            .arg(TTL_MS)
            .invoke_async(&mut conn)
            .await;
        match claimed {
            Ok(redis::Value::Okay) => {}
            Ok(other) => return self.error("floor claim", &format!("{other:?}")),
            Err(e) => return self.error("floor claim", &e),
        }
        let done: redis::RedisResult<redis::Value> = self
            .complete
            .key(&full)
            .arg(value_json())
            .arg(TTL_MS)
            .invoke_async(&mut conn)
            .await;
        if let Err(e) = done {
            self.error("floor complete", &e);
        }
    }

    /// The limit of any two-command design: claim and complete as two plain
    /// `SET`s, no script, no ownership check.
    pub(crate) async fn floor_sets(&self, key: FreshKey) {
        let mut conn = self.fresh_conn.clone();
        let full = format!("{FLOOR_PREFIX}{key}");
        let claimed: redis::RedisResult<redis::Value> = redis::cmd("SET")
            .arg(&full)
            .arg(&FLOOR_TOKEN[..])
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .arg("GET")
            .query_async(&mut conn)
            .await;
        match claimed {
            Ok(redis::Value::Nil) => {}
            Ok(other) => return self.error("floor SET claim", &format!("{other:?}")),
            Err(e) => return self.error("floor SET claim", &e),
        }
        let done: redis::RedisResult<redis::Value> = redis::cmd("SET")
            .arg(&full)
            .arg(value_json())
            .arg("XX")
            .arg("KEEPTTL")
            .arg("GET")
            .query_async(&mut conn)
            .await;
        if let Err(e) = done {
            self.error("floor SET complete", &e);
        }
    }

    pub(crate) async fn idem_fresh(&self, key: FreshKey) {
        if let Err(e) = noop(key).await {
            self.error("idem fresh (macro)", &e);
        }
    }

    pub(crate) async fn hand_fresh(&self, key: FreshKey) {
        if let Err(e) = noop_by_hand(&self.idem, key).await {
            self.error("idem fresh (by hand)", &e);
        }
    }

    /// `run_steps` of `steps` no-op steps, then the complete: each step is
    /// one more round trip (the `step` script) against `hand_fresh`.
    pub(crate) async fn steps_fresh(&self, key: FreshKey, steps: usize) {
        const NAMES: [&str; 3] = ["reserve", "charge", "email"];
        let r: Result<String, idem::Error> = self
            .idem
            .call(SCOPE, key)
            .ttl(Duration::from_secs(3600))
            .run_steps(async |s| {
                for name in &NAMES[..steps] {
                    s.step(name, async || Ok::<_, idem::Error>("r-1".to_owned()))
                        .await?;
                }
                Ok(VALUE.to_owned())
            })
            .await;
        if let Err(e) = r {
            self.error("idem run_steps", &e);
        }
    }

    /// The big records are fewer: each is 16 KiB.
    pub(crate) fn big_keys(&self) -> u64 {
        self.replay_keys.min(100)
    }

    pub(crate) fn replay_key(&self, set: u8, task: u16, seq: u64) -> ReplayKey {
        ReplayKey {
            run: self.run,
            set,
            idx: (u64::from(task) * 7919 + seq)
                % if set == 0 {
                    self.replay_keys
                } else {
                    self.big_keys()
                },
        }
    }

    pub(crate) async fn floor_replay(&self, key: ReplayKey) {
        let mut conn = self.conn.clone();
        let got: redis::RedisResult<Vec<u8>> = redis::cmd("GET")
            .arg(format!("{FLOOR_PREFIX}{key}"))
            .query_async(&mut conn)
            .await;
        match got {
            Ok(v) if v.len() == 64 => {}
            Ok(v) => self.error("floor replay", &format!("{} bytes", v.len())),
            Err(e) => self.error("floor replay", &e),
        }
    }

    pub(crate) async fn idem_replay(&self, idem: &Idempotency, key: ReplayKey, what: &str) {
        let r: Result<(String, idem::Outcome), idem::Error> = idem
            .call(SCOPE, key)
            .ttl(Duration::from_secs(3600))
            .run_outcome(|| async { Ok(String::new()) })
            .await;
        match r {
            Ok((_, idem::Outcome::Replayed)) => {}
            Ok((_, o)) => self.error(what, &format!("outcome {o}, expected replayed")),
            Err(e) => self.error(what, &e),
        }
    }

    pub(crate) async fn big_fresh(&self, idem: &Idempotency, key: FreshKey) {
        let r: Result<Vec<Row>, idem::Error> = idem
            .call("big", key)
            .ttl(Duration::from_secs(3600))
            .run(|| async { Ok(big_value().clone()) })
            .await;
        if let Err(e) = r {
            self.error("big fresh", &e);
        }
    }

    pub(crate) async fn big_replay(&self, idem: &Idempotency, key: ReplayKey) {
        let r: Result<(Vec<Row>, idem::Outcome), idem::Error> = idem
            .call("big", key)
            .ttl(Duration::from_secs(3600))
            .run_outcome(|| async { Ok(Vec::new()) })
            .await;
        match r {
            Ok((v, idem::Outcome::Replayed)) if v.len() == 170 => {}
            Ok((_, o)) => self.error("big replay", &format!("outcome {o}")),
            Err(e) => self.error("big replay", &e),
        }
    }
}
