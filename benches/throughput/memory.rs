//! Prefilled keys for the replay phases, and bytes per record.

use crate::keys::{
    FLOOR_PREFIX, FreshKey, PLAIN_PREFIX, ReplayKey, Row, SCOPE, VALUE, big_value, value_json,
};
use crate::ops::{Ctx, TTL_MS, noop_by_hand};
use redis::aio::ConnectionManager;
use std::time::Duration;

async fn memory_usage(conn: &mut ConnectionManager, key: &str) -> i64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .query_async(conn)
        .await
        .expect("MEMORY USAGE")
}

async fn strlen(conn: &mut ConnectionManager, key: &str) -> i64 {
    redis::cmd("STRLEN")
        .arg(key)
        .query_async(conn)
        .await
        .expect("STRLEN")
}

/// Fills the replay key sets: the floor's plain strings and idem's records
/// of the 64-byte value (`small`), the 16 KiB records with and without
/// compression (`big`).
pub(crate) async fn prefill(ctx: &Ctx, small: bool, big: bool) {
    if small {
        prefill_small(ctx).await;
    }
    if big {
        prefill_big(ctx).await;
    }
}

async fn prefill_small(ctx: &Ctx) {
    let mut conn = ctx.conn.clone();
    let mut pipe = redis::pipe();
    for idx in 0..ctx.replay_keys {
        let key = ReplayKey {
            run: ctx.run,
            set: 0,
            idx,
        };
        pipe.cmd("SET")
            .arg(format!("{FLOOR_PREFIX}{key}"))
            .arg(value_json())
            .arg("PX")
            .arg(TTL_MS)
            .ignore();
    }
    let () = pipe
        .query_async(&mut conn)
        .await
        .expect("prefill floor keys");
    for idx in 0..ctx.replay_keys {
        let _: String = ctx
            .replayer
            .call(
                SCOPE,
                ReplayKey {
                    run: ctx.run,
                    set: 0,
                    idx,
                },
            )
            .ttl(Duration::from_secs(3600))
            .run(|| async { Ok::<_, idem::Error>(VALUE.to_owned()) })
            .await
            .expect("prefill idem keys");
    }
}

async fn prefill_big(ctx: &Ctx) {
    // Fewer big records: each is 16 KiB.
    for idx in 0..ctx.big_keys() {
        for (set, idem) in [(1, &ctx.big_plain_r), (2, &ctx.big_lz4_r)] {
            let _: Vec<Row> = idem
                .call(
                    "big",
                    ReplayKey {
                        run: ctx.run,
                        set,
                        idx,
                    },
                )
                .ttl(Duration::from_secs(3600))
                .run(|| async { Ok::<_, idem::Error>(big_value().clone()) })
                .await
                .expect("prefill big keys");
        }
    }
}

pub(crate) struct Memory {
    pub(crate) idem_bytes: i64,
    pub(crate) idem_fp_bytes: i64,
    pub(crate) plain_bytes: i64,
    pub(crate) plain_px_bytes: i64,
    pub(crate) idem_strlen: i64,
    pub(crate) plain_strlen: i64,
    pub(crate) key_len: usize,
    pub(crate) big_plain_bytes: i64,
    pub(crate) big_lz4_bytes: i64,
    pub(crate) big_plain_strlen: i64,
    pub(crate) big_lz4_strlen: i64,
    pub(crate) big_json_len: usize,
}

pub(crate) async fn measure_memory(ctx: &Ctx) -> Memory {
    let mut conn = ctx.fresh_conn.clone();
    let mut conn0 = ctx.conn.clone();
    let key = FreshKey {
        run: ctx.run,
        phase: 0xff,
        task: 0,
        seq: 0,
    };
    assert_eq!(key.to_string().len(), 36);
    let _: String = noop_by_hand(&ctx.idem, key).await.expect("memory record");
    let fp_key = FreshKey { seq: 1, ..key };
    let _: String = ctx
        .idem
        .call(SCOPE, fp_key)
        .ttl(Duration::from_secs(3600))
        .fingerprint(&("charge", 500, "EUR"))
        .run(|| async { Ok::<_, idem::Error>(VALUE.to_owned()) })
        .await
        .expect("memory record with a fingerprint");
    let idem_key = format!("idem:{SCOPE}:{key}");
    let plain_key = format!("{PLAIN_PREFIX}{key}");
    let plain_px_key = format!("plpx:bench:{key}");
    assert_eq!(idem_key.len(), plain_key.len());
    assert_eq!(idem_key.len(), plain_px_key.len());
    let () = redis::cmd("SET")
        .arg(&plain_key)
        .arg(value_json())
        .query_async(&mut conn)
        .await
        .unwrap();
    let () = redis::cmd("SET")
        .arg(&plain_px_key)
        .arg(value_json())
        .arg("PX")
        .arg(TTL_MS)
        .query_async(&mut conn)
        .await
        .unwrap();
    let big_json_len = serde_json::to_vec(big_value()).unwrap().len();
    let big = |set| {
        format!(
            "idem:big:{}",
            ReplayKey {
                run: ctx.run,
                set,
                idx: 0
            }
        )
    };
    Memory {
        idem_bytes: memory_usage(&mut conn, &idem_key).await,
        idem_fp_bytes: memory_usage(&mut conn, &format!("idem:{SCOPE}:{fp_key}")).await,
        plain_bytes: memory_usage(&mut conn, &plain_key).await,
        plain_px_bytes: memory_usage(&mut conn, &plain_px_key).await,
        idem_strlen: strlen(&mut conn, &idem_key).await,
        plain_strlen: strlen(&mut conn, &plain_key).await,
        key_len: idem_key.len(),
        big_plain_bytes: memory_usage(&mut conn0, &big(1)).await,
        big_lz4_bytes: memory_usage(&mut conn0, &big(2)).await,
        big_plain_strlen: strlen(&mut conn0, &big(1)).await,
        big_lz4_strlen: strlen(&mut conn0, &big(2)).await,
        big_json_len,
    }
}
