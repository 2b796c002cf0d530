//! A fetched batch: bounded concurrency, one decision per message, and
//! copies of one message inside the batch run once.

use crate::consumer::{Consumer, Handled};
use crate::decision::{Classify, Decision};
use crate::message::Message;
use futures_util::StreamExt;
use futures_util::stream;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::time::Duration;

impl<C> Consumer<C> {
    /// Handles a batch with at most [`concurrency`](Consumer::concurrency)
    /// handlers at once and returns one [`Handled`] per message, in order.
    /// One message failing does not affect the others (partial batch
    /// failure).
    ///
    /// A message whose key and payload equal those of an earlier one in the
    /// batch is not run: it gets the first copy's decision, with
    /// `duplicate_of` set. Never a plain ack: the copy may be the same
    /// broker message as the first (a JetStream redelivery in the same
    /// fetch), and acking it would remove a message whose first copy was
    /// nacked or dead-lettered. A copy of a nacked message comes back and
    /// replays then.
    ///
    /// ```
    /// use idem_consumer::{Consumer, Message};
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let consumer = Consumer::new(idem, "orders");
    /// let runs = AtomicU32::new(0);
    /// let handler = |_: Message| async { runs.fetch_add(1, Ordering::SeqCst); Ok::<_, String>(()) };
    /// let batch = [Message::new("1").with_id("a"), Message::new("2").with_id("b"), Message::new("1").with_id("a")];
    /// let out = consumer.handle_batch(&batch, &handler).await;
    /// assert!(out.iter().all(|h| h.decision.is_ack()));
    /// assert_eq!(out[2].duplicate_of, Some(0));
    /// assert_eq!(runs.load(Ordering::SeqCst), 2);
    /// # });
    /// ```
    pub async fn handle_batch<T, E, H, Fut>(&self, msgs: &[Message], handler: &H) -> Vec<Handled<T>>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let mut first_of: HashMap<(String, [u8; 16]), usize> = HashMap::new();
        let mut duplicate_of: Vec<Option<usize>> = vec![None; msgs.len()];
        let mut keys = Vec::with_capacity(msgs.len());
        let mut fps = Vec::with_capacity(msgs.len());
        for (i, msg) in msgs.iter().enumerate() {
            let key = self.key_of(msg);
            let fingerprint = self.fingerprint_of(msg);
            fps.push(fingerprint);
            if let Ok(k) = &key {
                let fp = *fingerprint.as_bytes();
                match first_of.get(&(k.clone(), fp)) {
                    Some(&first) => duplicate_of[i] = Some(first),
                    None => {
                        first_of.insert((k.clone(), fp), i);
                    }
                }
            }
            keys.push(key);
        }
        // Collected first: iterator adapters with closures over references
        // inside a future make it lose `Send` (higher-ranked lifetimes).
        let todo: Vec<(usize, &Message, Result<String, crate::ConsumerError>)> = msgs
            .iter()
            .zip(keys)
            .enumerate()
            .filter_map(|(i, (msg, key))| duplicate_of[i].is_none().then_some((i, msg, key)))
            .collect();
        let mut work = Vec::with_capacity(todo.len());
        for (i, msg, key) in todo {
            let fp = fps.get(i).copied();
            work.push(async move { (i, self.handle_keyed(msg, key, fp, handler).await) });
        }
        let mut done: Vec<Option<Handled<T>>> = (0..msgs.len()).map(|_| None).collect();
        let mut results = stream::iter(work).buffer_unordered(self.batch_concurrency());
        while let Some((i, handled)) = results.next().await {
            done[i] = Some(handled);
        }
        // A copy's first copy comes earlier in the batch, so its decision
        // is known when the copy is reached.
        let mut out: Vec<Handled<T>> = Vec::with_capacity(msgs.len());
        for (i, h) in done.into_iter().enumerate() {
            let h = match h {
                Some(h) => h,
                None => {
                    let first = duplicate_of[i];
                    let decision = first
                        .and_then(|f| out.get(f))
                        .map(|h| h.decision.clone())
                        // Unreachable (every message runs or copies an
                        // earlier one); a nack loses nothing.
                        .unwrap_or(Decision::Nack {
                            delay: Duration::ZERO,
                        });
                    tracing::debug!(
                        id = msgs[i].id(),
                        first_id = first.and_then(|f| msgs.get(f)).and_then(Message::id),
                        decision = decision.as_str(),
                        "copy of an earlier message in the same batch: not run, settled as the first copy"
                    );
                    Handled {
                        decision,
                        outcome: None,
                        value: None,
                        key: self.key_of(&msgs[i]).ok(),
                        duplicate_of: first,
                    }
                }
            };
            out.push(h);
        }
        out
    }
}
