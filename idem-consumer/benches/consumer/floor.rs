//! The dedup floor: the least any deduplication that writes twice per
//! message must do, written here without idem's code. Per batch, one
//! pipeline of `SET key pending NX PX ttl` (a claim per message) and one
//! pipeline of `SET key result PX ttl` (a stored result per message), on
//! the same Redis as idem's store; on PostgreSQL, one multi-row `INSERT …
//! ON CONFLICT DO NOTHING` and one multi-row `UPDATE`. A broker's floor
//! loop is its bare loop with this between consume and ack, so idem is
//! measured against what its job costs, not against doing nothing.

use idem_consumer::redis_streams::redis;
use idem_postgres::sqlx::{self, PgPool};

/// Roughly the sizes of idem's records: a pending record (owner token,
/// lease, fingerprint) and a completed one holding `null`.
const PENDING: &str = "1P16:0123456789abcdef0123456789abcdef:30000";
const RESULT: &str = "1C16:0123456789abcdef0123456789abcdef:null";
const TTL_MS: u64 = 86_400_000;

/// The two Redis writes per message, one pipeline each per batch.
#[derive(Clone)]
pub(crate) struct RedisFloor {
    conn: redis::aio::MultiplexedConnection,
    prefix: String,
}

impl RedisFloor {
    pub(crate) async fn connect(url: &str, run: usize) -> RedisFloor {
        let conn = redis::Client::open(url)
            .expect("floor: redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("floor: connect to redis");
        RedisFloor {
            conn,
            prefix: format!("floor{run}:"),
        }
    }

    /// Claims then stores one batch; returns how many claims were won.
    pub(crate) async fn dedup<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        let mut conn = self.conn.clone();
        let key = |k: &K| [self.prefix.as_bytes(), k.as_ref()].concat();
        let mut claims = redis::pipe();
        for k in keys {
            claims
                .cmd("SET")
                .arg(key(k))
                .arg(PENDING)
                .arg("NX")
                .arg("PX")
                .arg(TTL_MS);
        }
        let won: Vec<Option<String>> = claims.query_async(&mut conn).await.expect("floor: SET NX");
        let mut stores = redis::pipe();
        for k in keys {
            stores
                .cmd("SET")
                .arg(key(k))
                .arg(RESULT)
                .arg("PX")
                .arg(TTL_MS)
                .ignore();
        }
        let _: () = stores.query_async(&mut conn).await.expect("floor: SET");
        won.iter().filter(|w| w.is_some()).count()
    }
}

/// The two PostgreSQL writes per message, one statement each per batch.
pub(crate) struct PgFloor {
    pool: PgPool,
}

impl PgFloor {
    pub(crate) async fn new(pool: PgPool) -> PgFloor {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS floor_records \
             (key text PRIMARY KEY, value text NOT NULL, expires_at timestamptz NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("floor: create table");
        PgFloor { pool }
    }

    pub(crate) async fn dedup_owned(&self, keys: Vec<String>) -> usize {
        self.dedup(&keys).await
    }

    pub(crate) async fn dedup(&self, keys: &[String]) -> usize {
        let won = sqlx::query(
            "INSERT INTO floor_records (key, value, expires_at) \
             SELECT k, $2, now() + interval '1 day' FROM unnest($1::text[]) AS k \
             ON CONFLICT (key) DO NOTHING",
        )
        .bind(keys)
        .bind(PENDING)
        .execute(&self.pool)
        .await
        .expect("floor: INSERT")
        .rows_affected();
        sqlx::query("UPDATE floor_records SET value = $2 WHERE key = ANY($1::text[])")
            .bind(keys)
            .bind(RESULT)
            .execute(&self.pool)
            .await
            .expect("floor: UPDATE");
        won as usize
    }
}
