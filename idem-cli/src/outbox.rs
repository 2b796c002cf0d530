//! `idem outbox status|list|retry|drop`: the operator's side of the
//! outbox, PostgreSQL's (`--postgres`) or a Redis store's.

use crate::args::{OutboxCommand, Target};
use crate::exit;
use idem_core::Error;
use idem_core::outbox::{Backlog, Parked};
use idem_postgres::PgStoreConfig;
use idem_postgres::outbox::Outbox;
use idem_redis::outbox::RedisOutbox;
use serde_json::json;
use std::time::{Duration, SystemTime};

/// Either store's outbox: the same operations on both.
enum AnyOutbox {
    Postgres(Outbox),
    Redis(RedisOutbox),
}

impl AnyOutbox {
    async fn backlog(&self) -> Result<Backlog, Error> {
        match self {
            AnyOutbox::Postgres(o) => o.backlog().await,
            AnyOutbox::Redis(o) => o.backlog().await,
        }
    }
    async fn parked(&self, limit: usize) -> Result<Vec<Parked>, Error> {
        match self {
            AnyOutbox::Postgres(o) => o.parked(limit).await,
            AnyOutbox::Redis(o) => o.parked(limit).await,
        }
    }
    async fn retry(&self, id: &str) -> Result<bool, Error> {
        match self {
            AnyOutbox::Postgres(o) => o.retry(id).await,
            AnyOutbox::Redis(o) => o.retry(id).await,
        }
    }
    async fn retry_all(&self) -> Result<u64, Error> {
        match self {
            AnyOutbox::Postgres(o) => o.retry_all().await,
            AnyOutbox::Redis(o) => o.retry_all().await,
        }
    }
    async fn drop_parked(&self, id: &str) -> Result<Option<Parked>, Error> {
        match self {
            AnyOutbox::Postgres(o) => o.drop_parked(id).await,
            AnyOutbox::Redis(o) => o.drop_parked(id).await,
        }
    }
}

pub(crate) async fn run(target: &Target, command: &OutboxCommand) -> Result<u8, Error> {
    if target.dynamodb.is_some() {
        return Err(Error::Unsupported {
            op: "outbox (DynamoStore keeps no outbox; use --postgres or --redis)",
        });
    }
    let outbox = match &target.postgres {
        Some(url) => {
            let config = PgStoreConfig::table(target.table.as_str());
            AnyOutbox::Postgres(
                idem_postgres::PgStore::connect_with(url, config)
                    .await?
                    .outbox(),
            )
        }
        None => {
            let store = crate::connect_redis(target)
                .await?
                .with_outbox_prefix(&target.outbox_prefix)?;
            AnyOutbox::Redis(store.outbox())
        }
    };
    let json = target.json;
    match command {
        OutboxCommand::Status => {
            let b = outbox.backlog().await?;
            let oldest = b
                .oldest
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            if json {
                println!(
                    "{}",
                    json!({"pending": b.pending, "parked": b.parked, "oldest_pending_ms": oldest})
                );
            } else {
                let age = b.oldest.map_or("-".to_owned(), |d| {
                    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
                });
                println!(
                    "pending {}\tparked {}\toldest pending {age}",
                    b.pending, b.parked
                );
            }
            Ok(0)
        }
        OutboxCommand::List { limit } => {
            let parked = outbox.parked(*limit).await?;
            for m in &parked {
                if json {
                    println!("{}", render(m));
                } else {
                    println!(
                        "{}\t{}\tkey {}\t{} bytes\t{} attempt(s)\t{}",
                        m.id,
                        m.topic,
                        m.key,
                        m.size,
                        m.attempts,
                        m.reason.as_deref().unwrap_or("-")
                    );
                }
            }
            if !json {
                eprintln!("{} parked message(s)", parked.len());
            }
            Ok(0)
        }
        OutboxCommand::Retry { id, all } => {
            let n = match (id, all) {
                (_, true) => outbox.retry_all().await?,
                (Some(id), false) => u64::from(outbox.retry(id).await?),
                (None, false) => 0,
            };
            if json {
                println!("{}", json!({"retried": n}));
            } else {
                println!("{n} message(s) will be sent again at the relay's next pass");
            }
            Ok(if n == 0 && !all { exit::NOT_FOUND } else { 0 })
        }
        OutboxCommand::Drop { id } => match outbox.drop_parked(id).await? {
            Some(m) => {
                if json {
                    println!("{}", render(&m));
                } else {
                    println!(
                        "dropped {} ({} bytes to {}, key {})",
                        m.id, m.size, m.topic, m.key
                    );
                }
                Ok(0)
            }
            None => {
                eprintln!(
                    "idem: no parked message {id:?} (a message that is not parked may be on its way, \
                     and is never dropped); see `idem outbox list`"
                );
                Ok(exit::NOT_FOUND)
            }
        },
    }
}

fn render(m: &Parked) -> serde_json::Value {
    let ms = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    };
    json!({
        "id": m.id, "topic": m.topic, "key": m.key, "size": m.size, "attempts": m.attempts,
        "reason": m.reason, "created_at_ms": ms(m.created_at), "parked_at_ms": m.parked_at.map(ms),
    })
}
