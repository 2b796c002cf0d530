//! Notifications from Redis: one subscriber connection per store (RESP3,
//! sharded pub/sub) multiplexing every key this process waits on, and the
//! forget invalidations of its local caches.
//!
//! The scripts `complete` (for a record a waiter marked), `release` and
//! `forget` `SPUBLISH` on a channel
//! named exactly as the key, so it hashes to the key's slot: on a cluster
//! the message is published by the key's primary and heard by a
//! subscription routed to that node (redis-rs's cluster `ssubscribe`).
//! `forget` also publishes the key on its namespace's channel
//! (`<namespace>::forgotten`, never a stored key: scopes are not empty),
//! which processes with a local cache subscribe to, one channel per
//! namespace.
//!
//! Pub/sub is at most once. Every lost message is covered: waiters keep
//! polling (slowly while notifications flow, as before while they do not);
//! when the connection drops every waiter is woken to read again and every
//! local cache stops serving (a forget would go unheard), and when it is
//! back every local cache starts again empty.

use idem_core::store::{Hub, Invalidation, InvalidationSink, KeyWatch};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{PushInfo, PushKind, RedisError, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// The suffix of a namespace's invalidation channel (`idem::forgotten`).
pub(super) const FORGOTTEN: &str = ":forgotten";

/// How long a store that was refused subscriptions (ACL, a server without
/// sharded pub/sub) polls before it asks again.
const RETRY_REFUSED: Duration = Duration::from_secs(60);
/// How long after a failed attempt to open the subscriber connection (an
/// unreachable server) a waiter tries again.
const RETRY_FAILED: Duration = Duration::from_secs(5);

/// How to open the subscriber connection.
#[derive(Clone)]
pub(super) enum Source {
    /// A client of the store's URL, speaking RESP3 (pushes).
    Single(redis::Client),
    Cluster(Vec<String>),
}

enum Sub {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

enum Command {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe(String),
}

type Sender = mpsc::UnboundedSender<Command>;

pub(super) struct Notifier {
    hub: Arc<Hub>,
    source: Source,
    config: super::RedisStoreConfig,
    /// The running subscriber task's inbox; `None` before the first watch.
    cmds: Arc<Mutex<Option<Sender>>>,
    /// Serializes starting the task; true once one has started.
    start: tokio::sync::Mutex<bool>,
    refused_until: Mutex<Option<Instant>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Notifier {
    pub(super) fn new(source: Source, config: super::RedisStoreConfig) -> Notifier {
        let cmds: Arc<Mutex<Option<Sender>>> = Arc::default();
        // Weak: the task holds the hub, so a strong inbox here would keep
        // the task (and its connection) alive after the last store clone.
        let inbox = Arc::downgrade(&cmds);
        // Called under the hub's lock, so an unsubscribe is queued before
        // any later subscribe of the same key.
        let on_last = Box::new(move |key: &str| {
            let Some(inbox) = inbox.upgrade() else {
                return;
            };
            if let Some(tx) = lock(&inbox).as_ref() {
                let _ = tx.send(Command::Unsubscribe(key.to_owned()));
            }
        });
        Notifier {
            hub: Arc::new(Hub::new(false, Some(on_last))),
            source,
            config,
            cmds,
            start: tokio::sync::Mutex::new(false),
            refused_until: Mutex::new(None),
        }
    }

    /// A watch of `key` whose subscription is confirmed, or `None`
    /// (refused, or the subscriber connection cannot be opened).
    pub(super) async fn watch(&self, key: &str) -> Option<KeyWatch> {
        let (watch, _) = self.hub.join(key);
        self.subscribe(key).await.then_some(watch)
    }

    /// Whether a caller in this process watches `key` (see `watch`): its
    /// claims then mark the record, so the holder's complete publishes.
    pub(super) fn watches(&self, key: &str) -> bool {
        self.hub.is_watched(key)
    }

    /// Registers a cache's sink for keys forgotten under `prefix`.
    pub(super) async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        self.hub.add_feed(prefix, &sink);
        self.subscribe(&format!("{prefix}{FORGOTTEN}")).await
    }

    async fn subscribe(&self, channel: &str) -> bool {
        if lock(&self.refused_until).is_some_and(|t| Instant::now() < t) {
            return false;
        }
        let Some(tx) = self.running().await else {
            return false;
        };
        let (ack, answer) = oneshot::channel();
        if tx
            .send(Command::Subscribe(channel.to_owned(), ack))
            .is_err()
        {
            return false;
        }
        match answer.await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                self.refused(&e);
                false
            }
            Err(_) => false,
        }
    }

    fn refused(&self, e: &RedisError) {
        let refused = matches!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
        ) || e.code() == Some("ERR")
            || e.code() == Some("NOPERM");
        let retry = if refused {
            tracing::warn!(error = %e, "Redis refused SSUBSCRIBE: waiters poll instead of being notified (grant SSUBSCRIBE and the key channels, see docs/operating.md, section Redis ACL)");
            RETRY_REFUSED
        } else {
            tracing::debug!(error = %e, "no subscriber connection; waiters poll");
            RETRY_FAILED
        };
        // Not asked again by every waiter meanwhile.
        *lock(&self.refused_until) = Some(Instant::now() + retry);
    }

    /// The task's inbox, starting the task (and its connection) if there
    /// is none or it stopped (its runtime shut down).
    async fn running(&self) -> Option<Sender> {
        if let Some(tx) = lock(&self.cmds).as_ref().filter(|tx| !tx.is_closed()) {
            return Some(tx.clone());
        }
        let mut started = self.start.lock().await;
        if let Some(tx) = lock(&self.cmds).as_ref().filter(|tx| !tx.is_closed()) {
            return Some(tx.clone());
        }
        let (push_tx, push_rx) = mpsc::unbounded_channel::<PushInfo>();
        let sub = match self.open(push_tx).await {
            Ok(sub) => sub,
            Err(e) => {
                self.refused(&e);
                return None;
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        *lock(&self.cmds) = Some(tx.clone());
        self.hub.set_live(true);
        let task = Task {
            hub: Arc::clone(&self.hub),
            sub,
            confirmed: std::collections::HashSet::new(),
            resubscribing: std::collections::HashSet::new(),
        };
        tokio::spawn(task.run(rx, push_rx));
        let restarted = std::mem::replace(&mut *started, true);
        self.resubscribe_feeds(&tx, restarted).await;
        Some(tx)
    }

    /// A new task (the first, or one after the last stopped with its
    /// runtime) subscribes every cache's invalidation channel again; one
    /// after a stopped task then tells each cache its deliveries resumed
    /// (a forget published while no task listened is lost), or, where the
    /// subscription failed, that they stay paused. (Before the first task
    /// no cache is live: the registration that first succeeds makes it so.)
    async fn resubscribe_feeds(&self, tx: &Sender, restarted: bool) {
        let prefixes = self.hub.feed_prefixes();
        for prefix in prefixes {
            let (ack, answer) = oneshot::channel();
            let channel = format!("{prefix}{FORGOTTEN}");
            if tx.send(Command::Subscribe(channel, ack)).is_err() {
                return;
            }
            match answer.await {
                Ok(Ok(())) if restarted => self.hub.invalidate(&prefix, Invalidation::Resumed),
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, %prefix, "could not subscribe a local cache's forget invalidations again: it caches nothing until a later registration is heard");
                    self.hub.invalidate(&prefix, Invalidation::Paused);
                }
                Err(_) => return,
            }
        }
    }

    async fn open(&self, push: mpsc::UnboundedSender<PushInfo>) -> Result<Sub, RedisError> {
        let cfg = &self.config;
        match &self.source {
            Source::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(cfg.connection_timeout))
                    .set_response_timeout(Some(cfg.response_timeout))
                    .set_number_of_retries(cfg.reconnect_retries)
                    .set_max_delay(Duration::from_millis(500))
                    .set_push_sender(push)
                    .set_automatic_resubscription();
                let manager = ConnectionManager::new_with_config(client.clone(), config).await?;
                Ok(Sub::Single(manager))
            }
            Source::Cluster(urls) => {
                let client = ClusterClient::builder(urls.iter().map(String::as_str))
                    .connection_timeout(cfg.connection_timeout)
                    .response_timeout(cfg.response_timeout)
                    .retries(u32::try_from(cfg.reconnect_retries).unwrap_or(u32::MAX))
                    .max_retry_wait(500)
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .push_sender(push)
                    .build()?;
                Ok(Sub::Cluster(client.get_async_connection().await?))
            }
        }
    }
}

/// The subscriber: one task owning the connection, so subscribes and
/// unsubscribes reach Redis in the order they were asked for.
struct Task {
    hub: Arc<Hub>,
    sub: Sub,
    confirmed: std::collections::HashSet<String>,
    /// Cluster: the channels confirmed before the last disconnection whose
    /// resubscription has not been confirmed yet.
    resubscribing: std::collections::HashSet<String>,
}

/// When the task ends (its runtime shut down), nothing is delivered any
/// more: say so, and wake everyone to poll.
struct Stopped(Arc<Hub>);

impl Drop for Stopped {
    fn drop(&mut self) {
        self.0.set_live(false);
        self.0.notify_all();
        self.0.invalidate_all(Invalidation::Paused);
    }
}

impl Task {
    async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Command>,
        mut pushes: mpsc::UnboundedReceiver<PushInfo>,
    ) {
        let _stopped = Stopped(Arc::clone(&self.hub));
        let mut heal = tokio::time::interval(Duration::from_millis(250));
        heal.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        let _ = ack.send(self.subscribe(channel).await);
                    }
                    Some(Command::Unsubscribe(channel)) => self.unsubscribe(channel).await,
                },
                push = pushes.recv() => match push {
                    None => return,
                    Some(push) => self.on_push(push),
                },
                _ = heal.tick(), if !self.hub.is_live() => self.heal().await,
            }
        }
    }

    async fn subscribe(&mut self, channel: String) -> Result<(), RedisError> {
        if self.confirmed.contains(&channel) {
            return Ok(());
        }
        let result = match &mut self.sub {
            Sub::Single(c) => c
                .send_packed_command(redis::cmd("SSUBSCRIBE").arg(&channel))
                .await
                .and_then(|v| v.extract_error()),
            Sub::Cluster(c) => c.ssubscribe(&channel).await.map(|()| Value::Nil),
        };
        result.map(|_| {
            self.confirmed.insert(channel);
        })
    }

    async fn unsubscribe(&mut self, channel: String) {
        self.resubscribing.remove(&channel);
        if !self.confirmed.remove(&channel) {
            return;
        }
        let result = match &mut self.sub {
            Sub::Single(c) => c
                .send_packed_command(redis::cmd("SUNSUBSCRIBE").arg(&channel))
                .await
                .map(drop),
            Sub::Cluster(c) => c.sunsubscribe(&channel).await,
        };
        if let Err(e) = result {
            tracing::debug!(error = %e, "SUNSUBSCRIBE failed (the connection is gone, and the subscription with it)");
        }
    }

    fn on_push(&mut self, push: PushInfo) {
        // Cluster: which node was lost is not said, so every channel
        // counts as being resubscribed until its confirmation.
        let text = |v: Option<&Value>| match v {
            Some(Value::BulkString(b)) => std::str::from_utf8(b).ok().map(str::to_owned),
            Some(Value::SimpleString(s)) => Some(s.clone()),
            _ => None,
        };
        match push.kind {
            PushKind::SMessage => {
                let Some(channel) = text(push.data.first()) else {
                    return;
                };
                match channel.strip_suffix(FORGOTTEN) {
                    Some(prefix) => {
                        if let Some(key) = text(push.data.get(1)) {
                            self.hub.invalidate(prefix, Invalidation::Key(&key));
                        }
                    }
                    None => self.hub.notify(&channel),
                }
            }
            PushKind::Disconnection => {
                tracing::debug!("subscriber connection lost: waiters poll until it is back");
                self.resubscribing.clone_from(&self.confirmed);
                self.hub.set_live(false);
                self.hub.notify_all();
                // A forget published now goes unheard: caches stop serving
                // until the connection is back, and start again empty.
                self.hub.invalidate_all(Invalidation::Paused);
            }
            // A resubscription confirmed: on a cluster, redis-rs
            // subscribes again by itself after a reconnection, one
            // confirmation per channel, in no set order. Messages of the
            // gap may be lost on any of them, so at the first: every waiter
            // reads again and every cache is emptied, as on a standalone
            // reconnection. (Our own subscriptions are confirmed while
            // live: nothing to do.)
            PushKind::SSubscribe if matches!(self.sub, Sub::Cluster(_)) => {
                if !self.hub.is_live() {
                    tracing::debug!("subscriber connection back: waiters are notified again");
                    self.hub.set_live(true);
                    self.hub.notify_all();
                    self.hub.invalidate_all(Invalidation::Resumed);
                }
                // Each channel resubscribed later may have lost messages
                // until then too.
                if let Some(channel) = text(push.data.first())
                    && self.resubscribing.remove(&channel)
                {
                    match channel.strip_suffix(FORGOTTEN) {
                        Some(prefix) => self.hub.invalidate(prefix, Invalidation::All),
                        None => self.hub.notify(&channel),
                    }
                }
            }
            _ => {}
        }
    }

    /// After a disconnection: a `PING` (on a cluster, to every primary)
    /// answered means the connection is back, with its subscriptions
    /// (standalone: the manager reconnects and subscribes again on the
    /// next command, this one; cluster: redis-rs reconnects the node and
    /// subscribes again by itself, ahead of the `PING`).
    async fn heal(&mut self) {
        let back = match &mut self.sub {
            Sub::Single(c) => c.send_packed_command(&redis::cmd("PING")).await.is_ok(),
            Sub::Cluster(c) => {
                let every_primary =
                    RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                c.route_command(redis::cmd("PING"), every_primary)
                    .await
                    .is_ok()
            }
        };
        if back {
            tracing::debug!("subscriber connection back: waiters are notified again");
            self.hub.set_live(true);
            // What was published during the gap is lost: read again.
            self.hub.notify_all();
            self.hub.invalidate_all(Invalidation::Resumed);
        }
    }
}
