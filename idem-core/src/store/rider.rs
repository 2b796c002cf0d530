//! Another system's commands carried in a batch's finish round trip.

use crate::error::Error;
use std::any::Any;
use std::fmt;

/// What a store answered for a [`Rider`] it carried: `Ok`, the server's
/// reply to its commands in the store's own type, an error reply included
/// (`redis::Value` for idem-redis); `Err`, the round trip failed (they may
/// or may not have run).
pub type RiderReply = Result<Box<dyn Any + Send>, Error>;

/// Commands that a store may send in the round trip that stores a batch's
/// results, after them: a Redis Streams consumer whose stream lives in
/// the store's own Redis acks its entries in the round trip that stores
/// their results, not in one more.
///
/// The commands are opaque to idem-core. A store carries the kind it
/// knows (idem-redis's `RedisStore`, on one Redis server rather than a
/// cluster: a `redis::Cmd`) and calls [`land`](Rider::land) with the
/// reply; any other store, or a store that cannot carry this one, drops
/// it, and its maker then sends the commands itself. Carried commands go
/// after every write of the round trip, so a server that executes them
/// has executed those writes first; and they run only if every complete
/// of the round trip is stored by then: a complete that is not (stored
/// alone after the round trip, or refused) withholds them, and the reply
/// is an error reply (idem-redis: `UNSTORED`, or `NOSCRIPT`), after which
/// the maker sends them itself.
///
/// ```
/// use idem_core::store::Rider;
/// use std::sync::{Arc, Mutex};
/// let heard = Arc::new(Mutex::new(None));
/// let h = Arc::clone(&heard);
/// let rider = Rider::new("XACK orders g 1-0", move |reply| {
///     *h.lock().unwrap() = Some(reply.is_ok());
/// });
/// assert_eq!(rider.commands::<&str>(), Some(&"XACK orders g 1-0"));
/// rider.land(Ok(Box::new(1_i64)));
/// assert_eq!(*heard.lock().unwrap(), Some(true));
/// ```
pub struct Rider {
    commands: Box<dyn Any + Send>,
    landed: Box<dyn FnOnce(RiderReply) + Send>,
}

impl Rider {
    /// `commands` to carry; `landed` hears the reply if a store carried
    /// them, and is never called if none did.
    pub fn new<C: Any + Send>(
        commands: C,
        landed: impl FnOnce(RiderReply) + Send + 'static,
    ) -> Rider {
        Rider {
            commands: Box::new(commands),
            landed: Box::new(landed),
        }
    }

    /// The commands, if they are a `C`.
    pub fn commands<C: Any>(&self) -> Option<&C> {
        self.commands.downcast_ref()
    }

    /// Tells the rider's maker what the store answered for its commands:
    /// `Err` when the round trip failed (they may or may not have run).
    pub fn land(self, reply: RiderReply) {
        (self.landed)(reply);
    }
}

impl fmt::Debug for Rider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rider").finish_non_exhaustive()
    }
}
