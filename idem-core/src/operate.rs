//! Operating idem: look at one key (`inspect`), evict it (`forget`), list a
//! scope's keys (`scan`). For operators and tools (the `idem` CLI); calls
//! never need these.

use crate::codec::{decompress, split_frame, stored_version};
use crate::error::{Error, KeyPart};
use crate::idempotency::Idempotency;
use crate::key::{push_escaped, storage_key, validate_key_part};
use crate::store::{RecordInfo, Store, ValueKind};
use bytes::Bytes;
use futures_util::Stream;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use std::collections::VecDeque;
use std::fmt;
use std::future::IntoFuture;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

impl Idempotency {
    /// The record of `(scope, key)` as it is in the store now, without its
    /// value (which is read for its [`RecordInfo::result_version`], then
    /// dropped); `None` when there is none. Writes nothing.
    ///
    /// ```
    /// use idem_core::{Idempotency, KeyState, MemoryStore};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// assert!(idem.inspect("charge", "order-1").await?.is_none());
    /// let _: u32 = idem.call("charge", "order-1").run(|| async { Ok::<_, idem_core::Error>(7) }).await?;
    /// let info = idem.inspect("charge", "order-1").await?.unwrap();
    /// assert_eq!((info.state, info.value_size, info.value), (KeyState::Completed, Some(1), None));
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    pub async fn inspect<K: fmt::Display>(
        &self,
        scope: &str,
        key: K,
    ) -> Result<Option<RecordInfo>, Error> {
        let key = storage_key(&self.inner.prefix, scope, key)?;
        let info = self.inner.store.inspect(&key, true).await?;
        Ok(info.map(|mut info| {
            if info.result_version.is_none()
                && let (Some(kind), Some(value)) = (info.kind, &info.value)
            {
                info.result_version = stored_version(kind, value);
            }
            info.value = None;
            info
        }))
    }

    /// As [`inspect`](Idempotency::inspect), with the stored value in
    /// [`RecordInfo::value`]: the result's JSON (decompressed, without its
    /// result version frame: the version is in
    /// [`RecordInfo::result_version`]), or the text of a too-large or
    /// unserializable marker.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let _: u32 = idem.call("charge", "order-1").run(|| async { Ok::<_, idem_core::Error>(7) }).await?;
    /// let info = idem.inspect_with_value("charge", "order-1").await?.unwrap();
    /// assert_eq!(info.value.as_deref(), Some(&b"7"[..]));
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    pub async fn inspect_with_value<K: fmt::Display>(
        &self,
        scope: &str,
        key: K,
    ) -> Result<Option<RecordInfo>, Error> {
        let key = storage_key(&self.inner.prefix, scope, key)?;
        let Some(mut info) = self.inner.store.inspect(&key, true).await? else {
            return Ok(None);
        };
        if info.kind == Some(ValueKind::Lz4Json)
            && let Some(packed) = &info.value
        {
            info.value = Some(Bytes::from(decompress(packed, self.inner.max_value_size)?));
        }
        if matches!(info.kind, Some(ValueKind::Json | ValueKind::Lz4Json))
            && let Some(doc) = &info.value
        {
            let (version, json) = split_frame(doc)?;
            info.result_version = Some(version);
            info.value = Some(doc.slice_ref(json));
        }
        Ok(Some(info))
    }

    /// Deletes the record of `(scope, key)`, so that the next call runs the
    /// body again. Await it; it returns what it removed (`None`: nothing
    /// there). A key in flight with a live lease is refused with
    /// [`Error::LeaseHeld`] unless [`Forget::force`]; an unreadable record
    /// (another program's key) is refused with [`Error::Corrupt`], and
    /// nothing is deleted.
    ///
    /// The key's failure count ([`Idempotency::count_failure`]) is reset
    /// with it (Redis: one more `DEL`, best effort; PostgreSQL: in the same
    /// transaction), also when there was no record.
    ///
    /// This process's local replay cache forgets the key at once; other
    /// processes' caches hear it from the store (see
    /// [`IdempotencyBuilder::local_cache`](crate::IdempotencyBuilder::local_cache)).
    /// Only where the publish of the forget is refused (the operator's user
    /// may not `SPUBLISH`) may another process keep replaying its copy, for
    /// as long as the record had left when it was forgotten (the returned
    /// [`RecordInfo::ttl_left`]; at most the result TTL).
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore, Outcome};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let _: u32 = idem.call("charge", "order-1").run(|| async { Ok::<_, Error>(7) }).await?;
    /// let removed = idem.forget("charge", "order-1").await?;
    /// assert!(removed.is_some());
    /// let (_, o) = idem.call("charge", "order-1").run_outcome(|| async { Ok::<_, Error>(8) }).await?;
    /// assert_eq!(o, Outcome::Executed); // runs again
    /// # Ok::<(), Error>(()) }).unwrap();
    /// ```
    pub fn forget<K: fmt::Display>(&self, scope: &str, key: K) -> Forget<'_> {
        Forget {
            idem: self,
            key: storage_key(&self.inner.prefix, scope, key).map_err(Error::from),
            force: false,
        }
    }

    /// The keys of `scope` with their records, page by page (Redis: `SCAN`
    /// on every master, never `KEYS`), as a [`Stream`]. It holds one page
    /// at a time; [`Scan::limit`] bounds how many keys it yields. Keys
    /// created or deleted during the scan may or may not appear; none
    /// appears twice on one standalone Redis.
    ///
    /// ```
    /// use idem_core::{Idempotency, KeyState, MemoryStore};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// for k in ["a", "b"] {
    ///     let _: u32 = idem.call("charge", k).run(|| async { Ok::<_, idem_core::Error>(1) }).await?;
    /// }
    /// let mut keys = Vec::new();
    /// let mut scan = idem.scan("charge").limit(10);
    /// while let Some(entry) = scan.next().await {
    ///     let entry = entry?;
    ///     keys.push((entry.key, entry.record?.state));
    /// }
    /// assert_eq!(keys, [("a".to_owned(), KeyState::Completed), ("b".to_owned(), KeyState::Completed)]);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    pub fn scan(&self, scope: &str) -> Scan {
        let prefix = validate_key_part(KeyPart::Scope, scope)
            .map(|()| {
                let mut prefix = self.inner.prefix.clone();
                push_escaped(&mut prefix, scope);
                prefix.push(':');
                prefix
            })
            .map_err(Error::from);
        Scan {
            store: Arc::clone(&self.inner.store),
            prefix: Some(prefix),
            page_size: 100,
            limit: None,
            stream: None,
        }
    }
}

/// A pending [`Idempotency::forget`]: await it, or [`force`](Forget::force) it first.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
/// assert!(idem.forget("charge", "never-seen").force().await?.is_none());
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
#[must_use = "a Forget does nothing until it is awaited"]
pub struct Forget<'a> {
    idem: &'a Idempotency,
    key: Result<String, Error>,
    force: bool,
}

impl Forget<'_> {
    /// Deletes a pending record even while its holder's lease is live.
    /// Only for a holder known to be dead (its process gone): a live one
    /// keeps running its body, and the next call runs the body beside it.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let f = idem.forget("charge", "order-1").force();
    /// ```
    pub fn force(mut self) -> Self {
        self.force = true;
        self
    }
}

impl<'a> IntoFuture for Forget<'a> {
    type Output = Result<Option<RecordInfo>, Error>;
    type IntoFuture = BoxFuture<'a, Self::Output>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let key = self.key?;
            let inner = &self.idem.inner;
            let removed = inner.store.forget(&key, self.force).await;
            // Dropped whatever the answer: a stale copy must never outlive
            // an operator's forget in the process that issued it.
            if let Some(cache) = &inner.cache {
                cache.remove(&key);
            }
            if let Ok(Some(info)) = &removed {
                tracing::info!(
                    key = %crate::call::shown_key(inner, &key),
                    state = %info.state,
                    forced = self.force,
                    "idempotency record forgotten"
                );
            }
            removed
        })
    }
}

/// One key found by [`Idempotency::scan`].
///
/// ```
/// # use idem_core::{KeyState, RecordInfo, ScannedKey};
/// let k = ScannedKey { key: "order-1".into(), record: Ok(RecordInfo::pending(1, None, Default::default(), None)) };
/// assert_eq!(k.record.unwrap().state, KeyState::Pending);
/// ```
#[derive(Debug)]
pub struct ScannedKey {
    /// The key as the calls gave it (namespace and scope removed).
    pub key: String,
    /// Its record, or why it cannot be read ([`Error::Corrupt`]: garbage
    /// bytes, or another Redis type under idem's prefix).
    pub record: Result<RecordInfo, Error>,
}

/// The stream of [`Idempotency::scan`]. An `Err` item (store unreachable)
/// ends it.
///
/// ```
/// use futures_util::TryStreamExt;
/// use idem_core::{Error, Idempotency, MemoryStore, ScannedKey};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// for k in ["o-1", "o-2", "o-3"] {
///     let _: u32 = idem.call("charge", k).run(|| async { Ok::<_, Error>(1) }).await?;
/// }
/// // A `Stream`: any stream combinator applies.
/// let found: Vec<ScannedKey> = idem.scan("charge").limit(2).try_collect().await?;
/// assert_eq!(found.len(), 2);
/// # Ok::<(), Error>(()) }).unwrap();
/// ```
pub struct Scan {
    store: Arc<dyn Store>,
    prefix: Option<Result<String, Error>>,
    page_size: usize,
    limit: Option<usize>,
    stream: Option<BoxStream<'static, Result<ScannedKey, Error>>>,
}

impl fmt::Debug for Scan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scan")
            .field("page_size", &self.page_size)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl Scan {
    /// Yields at most `n` keys.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let scan = idem.scan("charge").limit(1000);
    /// ```
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = Some(n);
        self
    }

    /// About how many keys each round trip asks for (default 100; Redis's
    /// `SCAN … COUNT`).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let scan = idem.scan("charge").page_size(500);
    /// ```
    pub fn page_size(mut self, n: usize) -> Self {
        self.page_size = n.max(1);
        self
    }

    /// The next key, or `None` when the scan is done (a shorthand for
    /// `StreamExt::next`).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// assert!(idem.scan("charge").next().await.is_none());
    /// # });
    /// ```
    pub async fn next(&mut self) -> Option<Result<ScannedKey, Error>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    fn start(&mut self) -> BoxStream<'static, Result<ScannedKey, Error>> {
        struct State {
            store: Arc<dyn Store>,
            prefix: String,
            page_size: usize,
            left: usize,
            cursor: Option<String>,
            buffered: VecDeque<ScannedKey>,
            done: bool,
        }
        let prefix = match self.prefix.take() {
            Some(Ok(prefix)) => prefix,
            Some(Err(e)) => return Box::pin(futures_util::stream::once(async { Err(e) })),
            None => return Box::pin(futures_util::stream::empty()),
        };
        let state = State {
            store: Arc::clone(&self.store),
            prefix,
            page_size: self.page_size,
            left: self.limit.unwrap_or(usize::MAX),
            cursor: None,
            buffered: VecDeque::new(),
            done: false,
        };
        Box::pin(futures_util::stream::unfold(state, |mut s| async move {
            loop {
                if s.left == 0 {
                    return None;
                }
                if let Some(next) = s.buffered.pop_front() {
                    s.left -= 1;
                    return Some((Ok(next), s));
                }
                if s.done {
                    return None;
                }
                let page = match s
                    .store
                    .scan(&s.prefix, s.cursor.as_deref(), s.page_size)
                    .await
                {
                    Ok(page) => page,
                    Err(e) => {
                        s.done = true;
                        return Some((Err(e), s));
                    }
                };
                s.done = page.cursor.is_none();
                s.cursor = page.cursor;
                let strip = s.prefix.len();
                s.buffered
                    .extend(page.records.into_iter().map(|(key, record)| ScannedKey {
                        key: key.get(strip..).unwrap_or(&key).to_owned(),
                        record,
                    }));
            }
        }))
    }
}

impl Stream for Scan {
    type Item = Result<ScannedKey, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.stream.is_none() {
            let stream = self.start();
            self.stream = Some(stream);
        }
        match self.stream.as_mut() {
            Some(stream) => stream.as_mut().poll_next(cx),
            None => Poll::Ready(None),
        }
    }
}
