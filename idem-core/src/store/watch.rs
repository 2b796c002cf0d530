//! Waiting without polling: a store tells this process when a key it waits
//! on may have changed (completed, released, forgotten), and when a key
//! cached by a local replay cache was forgotten.
//!
//! [`Hub`] keeps, per watched key, a generation counter on a
//! `tokio::sync::watch` channel: a waiter takes a receiver *before* it
//! re-reads the record, so a change that lands between its read and its
//! wait is never missed (the receiver sees the newer generation at once).
//! The last receiver of a key to go asks the store to unsubscribe.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;

/// A subscription to changes of one stored key, from [`WatchStore::watch`].
///
/// Take it *before* reading the record again: every change after it was
/// taken is seen by [`changed`](KeyWatch::changed). Dropping the last watch
/// of a key unsubscribes.
///
/// [`WatchStore::watch`]: crate::store::WatchStore::watch
///
/// ```
/// use idem_core::store::{Claim, MemoryStore, Store, Token, WatchStore};
/// use std::time::Duration;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let holder = Token::random();
/// let claim = Claim::new("k", &holder, Duration::from_secs(5), Duration::from_secs(60));
/// store.claim(claim).await?;
/// let mut watch = store.watch("k").await.expect("memory always notifies");
/// store.release("k", &holder).await?;
/// watch.changed().await; // returns at once: the release came after the watch
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
pub struct KeyWatch {
    rx: Option<watch::Receiver<u64>>,
    hub: Arc<Hub>,
    key: String,
}

impl std::fmt::Debug for KeyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyWatch")
            .field("key", &self.key)
            .field("live", &self.is_live())
            .finish()
    }
}

impl KeyWatch {
    /// Resolves once the key may have changed since the watch was taken
    /// (or since the last `changed`), or the store's notifications were
    /// interrupted (then nothing can be promised: read the record again).
    /// Never resolves when the store drops the subscription for good; wrap
    /// it in a timeout.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # use idem_core::store::WatchStore;
    /// let store = idem_core::MemoryStore::new();
    /// let mut w = store.watch("k").await.unwrap();
    /// let timed_out = tokio::time::timeout(std::time::Duration::from_millis(1), w.changed()).await;
    /// assert!(timed_out.is_err()); // nothing happened to "k"
    /// # });
    /// ```
    pub async fn changed(&mut self) {
        match self.rx.as_mut() {
            Some(rx) => {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }

    /// Whether notifications are flowing now. While they are not (the
    /// subscriber connection is down), a waiter polls as it would without.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # use idem_core::store::WatchStore;
    /// assert!(idem_core::MemoryStore::new().watch("k").await.unwrap().is_live());
    /// # });
    /// ```
    pub fn is_live(&self) -> bool {
        self.hub.live.load(Ordering::Acquire)
    }
}

impl Drop for KeyWatch {
    fn drop(&mut self) {
        self.hub.leave(&self.key, self.rx.take());
    }
}

/// What a store tells a local replay cache, from
/// [`WatchStore::watch_forgotten`](crate::store::WatchStore::watch_forgotten).
///
/// ```
/// let i = idem_core::store::Invalidation::Key("idem:charge:42");
/// assert_ne!(i, idem_core::store::Invalidation::All);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation<'a> {
    /// This stored key was forgotten: drop its copy.
    Key(&'a str),
    /// Messages may have been lost (a channel was subscribed again after a
    /// gap): drop every copy.
    All,
    /// Deliveries stopped (the subscriber connection dropped, or its task
    /// ended): drop every copy, and cache nothing until
    /// [`Resumed`](Invalidation::Resumed), as a forget now goes unheard.
    Paused,
    /// Deliveries flow again after [`Paused`](Invalidation::Paused);
    /// messages of the gap are lost: drop every copy.
    Resumed,
}

/// What a replay cache gives the store to hear of forgotten keys.
pub type InvalidationSink = Arc<dyn Fn(Invalidation<'_>) + Send + Sync>;

type WeakSink = std::sync::Weak<dyn Fn(Invalidation<'_>) + Send + Sync>;

/// What a [`Hub`] calls with a key whose last [`KeyWatch`] was dropped, so
/// that the store stops listening for it (Redis: `SUNSUBSCRIBE`). Called
/// under the hub's lock: a watch of the same key taken meanwhile asks to
/// subscribe after this returns, never before. Keep it short and
/// non-blocking (send the request to a task).
pub type OnLast = Box<dyn Fn(&str) + Send + Sync>;

/// The watched keys of one store in this process, and the local caches'
/// invalidation sinks: what a store hands out from [`WatchStore::watch`] and
/// [`WatchStore::watch_forgotten`], and wakes when it hears of a change.
///
/// A store that can tell this process when a key changed (a pub/sub
/// channel, a `LISTEN`, its own memory) keeps one `Hub` behind an `Arc`:
///
/// - [`WatchStore::watch`]: [`join`](Hub::join) the key; when it is the key's
///   first watch, subscribe on the backend *before* handing the watch out
///   (the caller re-reads the record after it, so nothing is missed);
/// - on a change of a key (completed, released, forgotten):
///   [`notify`](Hub::notify) it; on a forget, also
///   [`invalidate`](Hub::invalidate) the key's [`namespace_prefix`];
/// - [`WatchStore::watch_forgotten`]: [`add_feed`](Hub::add_feed), subscribing
///   the prefix's channel when it is the first sink;
/// - when deliveries stop or may have been lost (a dropped connection):
///   [`set_live`](Hub::set_live)`(false)`, [`notify_all`](Hub::notify_all)
///   and [`invalidate_all`](Hub::invalidate_all) with
///   [`Invalidation::Paused`]; once they flow again, `set_live(true)`,
///   `notify_all`, [`Invalidation::Resumed`], and subscribe again what
///   [`feed_prefixes`](Hub::feed_prefixes) lists.
///
/// `Hub::default()` is an in-process hub, always live, with nothing to
/// unsubscribe: what [`MemoryStore`](super::MemoryStore) uses.
///
/// [`WatchStore::watch`]: super::WatchStore::watch
/// [`WatchStore::watch_forgotten`]: super::WatchStore::watch_forgotten
///
/// ```
/// use idem_core::store::{Hub, OnLast};
/// use std::sync::{Arc, Mutex};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let unsubscribed = Arc::new(Mutex::new(Vec::new()));
/// let log = Arc::clone(&unsubscribed);
/// let on_last: OnLast = Box::new(move |key: &str| log.lock().unwrap().push(key.to_owned()));
/// let hub = Arc::new(Hub::new(true, Some(on_last)));
///
/// let (mut watch, first) = hub.join("ns:charge:42");
/// assert!(first); // the store subscribes to the key now, then returns the watch
/// hub.notify("ns:charge:42"); // the backend said the key changed
/// watch.changed().await; // the waiter wakes and reads the record again
/// drop(watch);
/// assert_eq!(*unsubscribed.lock().unwrap(), ["ns:charge:42"]);
/// # });
/// ```
pub struct Hub {
    keys: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Invalidation sinks by namespace prefix; weak, so a dropped
    /// `Idempotency` (which holds its sink) stops hearing.
    feeds: Mutex<HashMap<String, Vec<WeakSink>>>,
    live: AtomicBool,
    on_last: Option<OnLast>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("keys", &lock(&self.keys).len())
            .field("live", &self.live.load(Ordering::Relaxed))
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; recover anyway.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Default for Hub {
    /// An in-process hub: always live, nothing to unsubscribe.
    fn default() -> Hub {
        Hub::new(true, None)
    }
}

impl Hub {
    /// A hub with no watches. `live` says whether notifications flow from
    /// the start (a store that must first open a subscriber connection
    /// starts with `false`: its waiters poll until then); `on_last` is
    /// called with each key whose last watch goes.
    pub fn new(live: bool, on_last: Option<OnLast>) -> Hub {
        Hub {
            keys: Mutex::new(HashMap::new()),
            feeds: Mutex::new(HashMap::new()),
            live: AtomicBool::new(live),
            on_last,
        }
    }

    /// A watch of `key`, and whether it is the key's first: then the store
    /// must subscribe to the key before it hands the watch out.
    pub fn join(self: &Arc<Hub>, key: &str) -> (KeyWatch, bool) {
        let mut keys = lock(&self.keys);
        let (rx, first) = match keys.get(key) {
            Some(tx) => (tx.subscribe(), false),
            None => {
                let (tx, rx) = watch::channel(0);
                keys.insert(key.to_owned(), tx);
                (rx, true)
            }
        };
        drop(keys);
        let watch = KeyWatch {
            rx: Some(rx),
            hub: Arc::clone(self),
            key: key.to_owned(),
        };
        (watch, first)
    }

    fn leave(&self, key: &str, rx: Option<watch::Receiver<u64>>) {
        let mut keys = lock(&self.keys);
        // Dropped under the lock, so a `join` racing with us either keeps
        // the entry alive or finds it gone and subscribes again, in order.
        drop(rx);
        if keys.get(key).is_some_and(|tx| tx.receiver_count() == 0) {
            keys.remove(key);
            // Still under the lock: a `join` of the key after this asks to
            // subscribe after our unsubscribe was asked for, never before.
            if let Some(on_last) = &self.on_last {
                on_last(key);
            }
        }
    }

    /// Whether someone in this process watches `key` now (from
    /// [`join`](Hub::join) until its last watch is dropped). A store whose
    /// writes notify only keys someone waits on asks this in a claim: the
    /// claim a waiter makes after subscribing then tells the store it
    /// waits.
    pub fn is_watched(&self, key: &str) -> bool {
        lock(&self.keys).contains_key(key)
    }

    /// Wakes the watchers of `key`, if any: the store heard that it
    /// changed.
    pub fn notify(&self, key: &str) {
        if let Some(tx) = lock(&self.keys).get(key) {
            tx.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// Wakes every watcher: notifications may have been lost (a
    /// subscriber connection dropped or came back), so each reads its
    /// record again.
    pub fn notify_all(&self) {
        for tx in lock(&self.keys).values() {
            tx.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// Says whether notifications flow now ([`KeyWatch::is_live`]): while
    /// they do not, waiters poll as they would without a watch.
    pub fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
    }

    /// Whether notifications flow now, as last [`set_live`](Hub::set_live).
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Adds an invalidation sink for keys under `prefix` (once, however
    /// often it is registered; kept weakly, so it is heard while its owner
    /// holds it); true when it is the prefix's first live sink: then the
    /// store must subscribe to the prefix's forgets.
    pub fn add_feed(&self, prefix: &str, sink: &InvalidationSink) -> bool {
        let mut feeds = lock(&self.feeds);
        let list = feeds.entry(prefix.to_owned()).or_default();
        list.retain(|s| s.strong_count() > 0);
        let sink = Arc::downgrade(sink);
        if !list.iter().any(|s| s.ptr_eq(&sink)) {
            list.push(sink);
        }
        list.len() == 1
    }

    /// The prefixes some live sink listens to, for a subscriber connection
    /// that was opened again and must subscribe them again.
    pub fn feed_prefixes(&self) -> Vec<String> {
        let mut feeds = lock(&self.feeds);
        feeds.retain(|_, list| {
            list.retain(|s| s.strong_count() > 0);
            !list.is_empty()
        });
        feeds.keys().cloned().collect()
    }

    /// Tells the sinks of `prefix` about `what` (a forgotten key, or
    /// [`Invalidation::All`] when that prefix's messages may have been
    /// lost).
    pub fn invalidate(&self, prefix: &str, what: Invalidation<'_>) {
        let sinks: Vec<InvalidationSink> = lock(&self.feeds)
            .get(prefix)
            .map(|l| l.iter().filter_map(|s| s.upgrade()).collect())
            .unwrap_or_default();
        for sink in sinks {
            sink(what);
        }
    }

    /// Tells every sink `what` ([`Invalidation::Paused`] or
    /// [`Invalidation::Resumed`], for a store whose one subscriber
    /// connection carries every feed).
    pub fn invalidate_all(&self, what: Invalidation<'_>) {
        let sinks: Vec<InvalidationSink> = lock(&self.feeds)
            .values()
            .flatten()
            .filter_map(|s| s.upgrade())
            .collect();
        for sink in sinks {
            sink(what);
        }
    }
}

/// The namespace prefix of a stored key (`namespace:`, with its colon):
/// where a store announces a forget of the key to other processes' local
/// caches, and what [`WatchStore::watch_forgotten`](super::WatchStore::watch_forgotten)
/// is given. A stored key is `namespace:scope:key` with a `:` inside a
/// part escaped, so the first `:` ends the namespace.
///
/// ```
/// use idem_core::store::namespace_prefix;
/// assert_eq!(namespace_prefix("payments:charge:42"), "payments:");
/// ```
pub fn namespace_prefix(key: &str) -> &str {
    match key.find(':') {
        Some(at) => &key[..=at],
        None => key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_change_between_watch_and_wait_is_not_missed() {
        let hub = Arc::new(Hub::new(true, None));
        let (mut w, first) = hub.join("k");
        assert!(first);
        hub.notify("k");
        tokio::time::timeout(std::time::Duration::from_secs(5), w.changed())
            .await
            .unwrap();
    }

    #[test]
    fn the_last_watcher_unsubscribes() {
        let gone = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&gone);
        let on_last: OnLast = Box::new(move |k: &str| seen.lock().unwrap().push(k.to_owned()));
        let hub = Arc::new(Hub::new(true, Some(on_last)));
        let (a, first_a) = hub.join("k");
        let (b, first_b) = hub.join("k");
        assert!(first_a && !first_b);
        drop(a);
        assert!(gone.lock().unwrap().is_empty());
        drop(b);
        assert_eq!(*gone.lock().unwrap(), vec!["k".to_owned()]);
        assert!(lock(&hub.keys).is_empty());
    }

    #[test]
    fn prefixes_end_at_the_first_colon() {
        assert_eq!(namespace_prefix("idem:charge:42"), "idem:");
        assert_eq!(namespace_prefix("nocolon"), "nocolon");
    }

    /// A waiter joining while the last one leaves must ask to subscribe
    /// after the leaver's unsubscribe (Redis would otherwise drop the new
    /// waiter's subscription): the join waits for `on_last`.
    #[test]
    fn a_join_racing_the_last_leave_subscribes_after_the_unsubscribe() {
        let events = Arc::new(Mutex::new(Vec::new()));
        let hub_slot: Arc<Mutex<Option<Arc<Hub>>>> = Arc::default();
        let (log, slot) = (Arc::clone(&events), Arc::clone(&hub_slot));
        let on_last: OnLast = Box::new(move |k: &str| {
            // A waiter of the same key arrives now, on another thread.
            let hub = slot.lock().unwrap().clone().unwrap();
            let (log2, key) = (Arc::clone(&log), k.to_owned());
            let joiner = std::thread::spawn(move || {
                let (w, first) = hub.join(&key);
                log2.lock().unwrap().push(format!("join first={first}"));
                std::mem::forget(w);
            });
            // Give it every chance to overtake us before we unsubscribe.
            std::thread::sleep(std::time::Duration::from_millis(200));
            log.lock().unwrap().push("unsubscribe".to_owned());
            drop(joiner);
        });
        let hub = Arc::new(Hub::new(true, Some(on_last)));
        *hub_slot.lock().unwrap() = Some(Arc::clone(&hub));
        let (w, _) = hub.join("k");
        drop(w);
        for _ in 0..100 {
            if events.lock().unwrap().len() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            *events.lock().unwrap(),
            vec!["unsubscribe".to_owned(), "join first=true".to_owned()]
        );
    }
}
