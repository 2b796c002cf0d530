//! A scripted HTTP server on 127.0.0.1 that records every request it sees.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;

/// One scripted answer.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
    /// Send `Retry-After` as an HTTP-date this far in the future (computed
    /// when answering).
    retry_after_date: Option<Duration>,
    /// Wait this long before answering.
    delay: Option<Duration>,
}

impl Reply {
    pub(crate) fn status(status: u16) -> Self {
        Reply {
            status,
            headers: Vec::new(),
            body: String::new(),
            retry_after_date: None,
            delay: None,
        }
    }

    pub(crate) fn json(status: u16, body: &str) -> Self {
        Self::status(status)
            .header("content-type", "application/json")
            .body(body)
    }

    pub(crate) fn problem(status: u16, body: &str) -> Self {
        Self::status(status)
            .header("content-type", "application/problem+json")
            .body(body)
    }

    pub(crate) fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub(crate) fn body(mut self, body: &str) -> Self {
        self.body = body.to_owned();
        self
    }

    pub(crate) fn retry_after_date(mut self, from_now: Duration) -> Self {
        self.retry_after_date = Some(from_now);
        self
    }

    pub(crate) fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }
}

/// What the server saw for one request.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub method: Method,
    pub path: String,
    pub key: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
    pub peer: SocketAddr,
}

struct Inner {
    script: Vec<Reply>,
    seen: Mutex<Vec<Seen>>,
}

/// A scripted server: the n-th request gets the n-th reply; the last reply
/// repeats once the script is used up.
#[derive(Clone)]
pub(crate) struct Server {
    inner: Arc<Inner>,
    addr: Arc<Mutex<Option<SocketAddr>>>,
}

impl Server {
    /// A server that is not listening yet; see [`Server::serve`].
    pub(crate) fn new(script: Vec<Reply>) -> Self {
        assert!(!script.is_empty(), "a script needs at least one reply");
        Server {
            inner: Arc::new(Inner {
                script,
                seen: Mutex::new(Vec::new()),
            }),
            addr: Arc::new(Mutex::new(None)),
        }
    }

    /// Binds 127.0.0.1:0 and serves the script.
    pub(crate) async fn start(script: Vec<Reply>) -> Self {
        let server = Self::new(script);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        server.serve(listener);
        server
    }

    /// Serves the script on `listener` in a background task.
    pub(crate) fn serve(&self, listener: TcpListener) {
        *self.addr.lock().unwrap() = Some(listener.local_addr().expect("local addr"));
        let app = Router::new()
            .fallback(handle)
            .with_state(self.inner.clone())
            .into_make_service_with_connect_info::<SocketAddr>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }

    pub(crate) fn url(&self) -> String {
        format!(
            "http://{}",
            self.addr.lock().unwrap().expect("server not serving")
        )
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.inner.seen.lock().unwrap().clone()
    }
}

async fn handle(
    State(inner): State<Arc<Inner>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let reply = {
        let mut seen = inner.seen.lock().unwrap();
        let index = seen.len().min(inner.script.len() - 1);
        seen.push(Seen {
            method,
            path: uri
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            key: headers
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
            headers,
            body,
            at: Instant::now(),
            peer,
        });
        inner.script[index].clone()
    };
    if let Some(delay) = reply.delay {
        tokio::time::sleep(delay).await;
    }
    let mut response = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    let h = response.headers_mut();
    for (name, value) in &reply.headers {
        h.insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    if let Some(from_now) = reply.retry_after_date {
        let date = httpdate::fmt_http_date(SystemTime::now() + from_now);
        h.insert("retry-after", HeaderValue::from_str(&date).unwrap());
    }
    response
}

/// A free port on 127.0.0.1 with nothing listening on it (yet).
pub(crate) fn unused_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("local addr").port()
}
