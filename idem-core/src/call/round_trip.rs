//! A batch's own finish round trip, in place of the store's: the typed
//! hook a caller that shares the store's connection (idem-consumer's Redis
//! Streams adapter) sends its results through.

use crate::error::Error;
use crate::store::{Finish, WriteReply};
use futures_util::future::BoxFuture;

/// One round trip that stores a batch's results, in place of the store's
/// [`finish_batch`](crate::store::Store::finish_batch): given the ops, the future of
/// their replies, one per op, in order. Owned (`'static`): a batch dropped
/// while its results are on their way still sends them. Made with
/// [`finish_round_trip`]; see [`Batch::finish_with`](super::Batch::finish_with).
pub type FinishRoundTrip = Box<
    dyn for<'x> FnOnce(&'x [Finish<'x>]) -> BoxFuture<'x, Vec<Result<WriteReply, Error>>> + Send,
>;

/// Makes the round trip of one set of results: see [`Batch::finish_with`](super::Batch::finish_with).
pub(super) type MakeRoundTrip<'a> =
    Box<dyn Fn(&[usize]) -> Option<FinishRoundTrip> + Send + Sync + 'a>;

/// `send` as a [`FinishRoundTrip`]: the bound lets a closure be written
/// in place (`|ops| Box::pin(async move { … })`).
pub fn finish_round_trip<F>(send: F) -> FinishRoundTrip
where
    F: for<'x> FnOnce(&'x [Finish<'x>]) -> BoxFuture<'x, Vec<Result<WriteReply, Error>>>
        + Send
        + 'static,
{
    Box::new(send)
}
