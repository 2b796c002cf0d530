//! Response bodies the layer hands to hyper: one fed by the idempotent run's
//! task (so that hyper dropping it cannot cancel the run), and one that turns
//! a panic of the wrapped body into an error instead of unwinding through
//! the connection.

use axum::body::Body;
use bytes::Bytes;
use futures_util::FutureExt;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use idem_layer::task::panic_message;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

pub(crate) type FrameResult = Result<Frame<Bytes>, axum::Error>;

/// How many frames may wait between the run's task and hyper. Small: the
/// task should not read far ahead of a slow client.
pub(crate) const CHANNEL_FRAMES: usize = 4;

/// A body whose frames come from the run's task.
pub(crate) struct ChannelBody {
    rx: mpsc::Receiver<FrameResult>,
}

impl ChannelBody {
    pub(crate) fn pair() -> (mpsc::Sender<FrameResult>, ChannelBody) {
        let (tx, rx) = mpsc::channel(CHANNEL_FRAMES);
        (tx, ChannelBody { rx })
    }
}

impl HttpBody for ChannelBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.rx.poll_recv(cx)
    }
}

/// Wraps a body so that a panic while it is polled ends it with an error
/// (hyper then aborts the response) rather than unwinding through hyper.
pub(crate) struct CatchPanic {
    inner: Option<Body>,
}

impl CatchPanic {
    pub(crate) fn wrap(body: Body) -> Body {
        Body::new(CatchPanic { inner: Some(body) })
    }
}

impl HttpBody for CatchPanic {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(inner).poll_frame(cx))) {
            Ok(poll) => poll,
            Err(panic) => {
                self.inner = None;
                tracing::error!(
                    panic = panic_message(panic.as_ref()),
                    "the response body panicked while streaming: the response is cut short"
                );
                Poll::Ready(Some(Err(panicked())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

pub(crate) fn panicked() -> axum::Error {
    axum::Error::new("the response body panicked")
}

/// The next frame of `body`, with a panic while polling it caught.
pub(crate) enum Next {
    Frame(Frame<Bytes>),
    End,
    Failed(axum::Error),
    Panicked(String),
}

pub(crate) async fn next_frame(body: &mut Body) -> Next {
    match AssertUnwindSafe(body.frame()).catch_unwind().await {
        Ok(Some(Ok(frame))) => Next::Frame(frame),
        Ok(None) => Next::End,
        Ok(Some(Err(e))) => Next::Failed(e),
        Err(panic) => Next::Panicked(panic_message(panic.as_ref()).to_owned()),
    }
}

/// The rest of a response to pump from the inner body to the client after
/// the run has stored what it stores, and the sender whose drop ends the
/// client's body (held until then, so that the client never sees the end of
/// a response before it is stored).
pub(crate) struct Forward {
    pub(crate) body: Option<Body>,
    pub(crate) tx: mpsc::Sender<FrameResult>,
}

impl Forward {
    pub(crate) async fn finish(self) {
        let Forward { body, tx } = self;
        let Some(mut body) = body else {
            return;
        };
        loop {
            let item = match next_frame(&mut body).await {
                Next::End => return,
                Next::Frame(frame) => Ok(frame),
                Next::Failed(e) => {
                    tracing::warn!(error = %e, "the response body failed after its response was stored as not kept; the response is cut short");
                    Err(e)
                }
                Next::Panicked(why) => {
                    tracing::error!(panic = %why, "the response body panicked after its response was stored as not kept; the response is cut short");
                    Err(panicked())
                }
            };
            let last = item.is_err();
            if tx.send(item).await.is_err() {
                // The client went away: stop reading a body nobody reads.
                tracing::debug!("client gone: the rest of the response is dropped");
                return;
            }
            if last {
                return;
            }
        }
    }
}
