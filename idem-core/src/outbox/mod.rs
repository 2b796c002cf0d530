//! The outbox's contract: what an outgoing message is, how its id is made,
//! and what a [`Sink`] (a broker) promises the relay that drains it.
//!
//! A body that must tell the next system about its work writes the message
//! in the same transaction as its stored result (idem-postgres's
//! `outbox::publish`); a relay later publishes it through a `Sink` and
//! deletes it only once the broker confirmed it. The relay publishes at
//! least once, so every message carries a deterministic id
//! ([`message_id`]) in the broker's own id field, and an idem consumer on
//! the other side runs its effect once however often the relay re-sends.
//!
//! The relay itself is here once ([`OutboxRelay`]), over a [`RelaySource`]
//! that each store implements beside itself (idem-redis's `RedisRelay`,
//! idem-postgres's `PgRelay`); sinks live beside the consumer adapters
//! (idem-consumer, feature `outbox`). This module is the one definition
//! both sides share.

pub(crate) mod message;
mod relay;
mod relaying;
mod sink;
mod stage;

pub use self::message::{MAX_OUTBOX_FIELD, OutboxMessage, TRACE_HEADERS, message_id};
pub use self::relay::{OutboxRelay, RelaySource};
pub use self::relaying::{Backlog, Failed, Parked, RelayReport, SendPolicy, Waves, send_in_waves};
pub use self::sink::{Sink, SinkError};
pub use self::stage::{check_field, encode_payload, stage};
/// `#[async_trait]`, for implementing [`Sink`] (the same as [`crate::async_trait`]).
pub use async_trait::async_trait;
