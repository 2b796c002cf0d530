//! Response bodies the layer builds: a complete answer (messages, then
//! trailers), and a stream's already-read prefix followed by the rest.

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A complete answer: its messages in one data frame, then its trailers.
/// What a replay sends, and what the call that ran the handler sends once
/// the answer is stored.
#[derive(Debug)]
pub(crate) struct Complete {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Complete {
    pub(crate) fn new(data: Bytes, trailers: Option<HeaderMap>) -> Complete {
        Complete {
            data: Some(data).filter(|d| !d.is_empty()),
            trailers,
        }
    }
}

impl Body for Complete {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let len = self.data.as_ref().map_or(0, |d| d.len() as u64);
        SizeHint::with_exact(len)
    }
}

/// What was read of a reply before the layer saw it streams (or is too
/// large to keep), then the rest of it as the handler produces it.
pub(crate) struct Chain {
    prefix: Option<Bytes>,
    rest: tonic::body::Body,
}

impl Chain {
    pub(crate) fn new(prefix: Bytes, rest: tonic::body::Body) -> Chain {
        Chain {
            prefix: Some(prefix).filter(|p| !p.is_empty()),
            rest,
        }
    }
}

impl Body for Chain {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest)
            .poll_frame(cx)
            .map_err(|status| Box::new(status) as BoxError)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }
}
