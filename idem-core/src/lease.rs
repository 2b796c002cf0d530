//! What a running body can learn about its lease: whether it is lost, so
//! that a body another caller may already be running again can stop early.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

tokio::task_local! {
    /// The lease of the idem body this task is running, if any.
    static CURRENT: Lease;
}

/// The lease of the body now running, as seen from inside it; `None`
/// outside an idem body (and in a body run without protection under
/// `FailMode::Open`, which holds no lease).
///
/// A call's lease is lost when the store answers that the record is no
/// longer its own (taken over, or expired), or when no renewal has been
/// confirmed for a whole lease (the store unreachable for that long: after
/// a lease the store may give the key to another caller, which then runs
/// the body too). A body that learns it should stop its effects where it
/// can: whatever it returns afterwards is not stored
/// ([`Outcome::LeaseLost`](crate::Outcome::LeaseLost)) unless the record is
/// still its own when it finishes.
///
/// Inside a nested idem call the lease is the nested call's.
///
/// ```
/// use idem_core::{Error, Idempotency, MemoryStore};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// assert!(idem_core::lease().is_none()); // not inside a body
/// let v: Result<u32, Error> = idem
///     .call("batch.export", "day-7")
///     .run(|| async {
///         let lease = idem_core::lease().expect("inside a body");
///         let mut done = 0;
///         for _chunk in 0..3 {
///             if lease.is_lost() {
///                 // Another caller may be running this body: stop here.
///                 return Err(Error::LeaseLost);
///             }
///             done += 1; // … write one chunk …
///         }
///         Ok(done)
///     })
///     .await;
/// assert_eq!(v.unwrap(), 3);
/// # });
/// ```
pub fn lease() -> Option<Lease> {
    CURRENT.try_with(Clone::clone).ok()
}

/// Runs `body` with `lease` as the one [`lease()`] returns inside it.
pub(crate) async fn scope<F: Future>(lease: Lease, body: F) -> F::Output {
    CURRENT.scope(lease, body).await
}

/// Calls `f` with `lease` as the one [`lease()`] returns inside it: a
/// body's poll made outside a [`scope`].
pub(crate) fn sync_scope<R>(lease: Lease, f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(lease, f)
}

/// A running body's view of its lease, from [`lease()`]. Cheap to clone;
/// a clone moved into a spawned task still tells it about this lease.
///
/// ```
/// use idem_core::{Error, Idempotency, MemoryStore};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let r: Result<bool, Error> = idem
///     .call("report", "day-7")
///     .run(|| async {
///         let lease = idem_core::lease().expect("inside a body");
///         // The spawned task is outside the body's scope: hand it a clone.
///         let worker = tokio::spawn(async move { lease.is_lost() });
///         Ok(worker.await.unwrap())
///     })
///     .await;
/// assert!(!r.unwrap()); // the lease was held throughout
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct Lease {
    state: Arc<State>,
}

#[derive(Debug, Default)]
struct State {
    lost: AtomicBool,
    /// A renewal was sent: the pending record may no longer be the one the
    /// claim wrote (its lease end moved).
    extended: AtomicBool,
    notify: Notify,
    /// Whether the call's store takes outgoing messages with its result
    /// ([`Capabilities::outbox`](crate::store::Capabilities::outbox)).
    outbox: bool,
    /// What the body staged for the outbox ([`crate::outbox::stage`]), in
    /// order: written with the result, or dropped with a failed body.
    staged: Mutex<Vec<Staged>>,
}

/// One message a body staged: its id is made at completion, from the
/// call's record key and the message's name.
#[derive(Debug)]
pub(crate) struct Staged {
    pub(crate) topic: String,
    pub(crate) key: String,
    pub(crate) payload: bytes::Bytes,
}

impl Lease {
    /// Whether the lease is lost: another caller may take the key over (or
    /// has), and this body's result will not be stored. Once lost, it stays
    /// lost for this call.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let r: Result<bool, idem_core::Error> = idem
    ///     .call("s", "k")
    ///     .run(|| async { Ok(idem_core::lease().is_some_and(|l| l.is_lost())) })
    ///     .await;
    /// assert!(!r.unwrap()); // a short body keeps its lease
    /// # });
    /// ```
    pub fn is_lost(&self) -> bool {
        self.state.lost.load(Ordering::Acquire)
    }

    /// Resolves when the lease is lost; never, if it is not. Race it
    /// against the body's work (`tokio::select!`) to stop at the first
    /// sign that another caller may run the body too.
    ///
    /// ```
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let r: Result<String, idem_core::Error> = idem
    ///     .call("s", "k")
    ///     .run(|| async {
    ///         let lease = idem_core::lease().expect("inside a body");
    ///         tokio::select! {
    ///             () = lease.lost() => Err(idem_core::Error::LeaseLost),
    ///             () = tokio::time::sleep(Duration::from_millis(10)) => Ok("done".to_owned()),
    ///         }
    ///     })
    ///     .await;
    /// assert_eq!(r.unwrap(), "done");
    /// # });
    /// ```
    pub async fn lost(&self) {
        loop {
            let notified = self.state.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check: a loss flagged in between wakes it.
            notified.as_mut().enable();
            if self.is_lost() {
                return;
            }
            notified.await;
        }
    }

    /// The lease of a call whose store does (or does not) take outgoing
    /// messages with its result.
    pub(crate) fn with_outbox(outbox: bool) -> Lease {
        Lease {
            state: Arc::new(State {
                outbox,
                ..State::default()
            }),
        }
    }

    /// A fresh lease like [`with_outbox`](Lease::with_outbox)'s, made in
    /// this one's allocation when nothing else holds it (a clone kept by a
    /// body, or its task, makes a new one): a batch's bodies that end at
    /// once share one.
    pub(crate) fn renewed(mut self, outbox: bool) -> Lease {
        match Arc::get_mut(&mut self.state) {
            Some(state) => {
                *state = State {
                    outbox,
                    ..State::default()
                };
                self
            }
            None => Lease::with_outbox(outbox),
        }
    }

    /// Keeps a message the body staged; `false` when the store has no
    /// outbox.
    pub(crate) fn stage(&self, message: Staged) -> bool {
        if !self.state.outbox {
            return false;
        }
        self.staged().push(message);
        true
    }

    /// Takes what the body staged (the body has finished).
    pub(crate) fn take_staged(&self) -> Vec<Staged> {
        std::mem::take(&mut *self.staged())
    }

    fn staged(&self) -> std::sync::MutexGuard<'_, Vec<Staged>> {
        // A push cannot leave the vector half-written: use it after a panic.
        self.state.staged.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Flags the lease lost and wakes every body waiting on [`Lease::lost`].
    /// A renewal of this lease is on its way to the store.
    pub(crate) fn mark_extended(&self) {
        self.state.extended.store(true, Ordering::Release);
    }

    /// Whether a renewal was ever sent: the record may have changed since
    /// the claim, so the complete does not compare the claim's bytes.
    pub(crate) fn was_extended(&self) -> bool {
        self.state.extended.load(Ordering::Acquire)
    }

    pub(crate) fn mark_lost(&self) {
        if !self.state.lost.swap(true, Ordering::AcqRel) {
            self.state.notify.notify_waiters();
        }
    }
}
