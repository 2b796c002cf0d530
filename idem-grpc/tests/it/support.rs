//! The test service (idem.test.v1.Payments), a server for it on a free
//! port behind the layer, and two clients: tonic's generated one, and a
//! raw HTTP/2 one that sees answers byte for byte.

#![allow(dead_code)]

pub(crate) mod pb {
    #![allow(clippy::all, unreachable_pub, missing_docs)]
    include!("pb/idem.test.v1.rs");
}

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use idem_grpc::IdempotencyLayer;
use idem_testkit::{FileLedger, Ledger};
use pb::payments_client::PaymentsClient;
use pb::payments_server::{Payments, PaymentsServer};
use pb::{CreateOrderRequest, CreatePaymentRequest, Order, Payment};
use prost::Message as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

pub(crate) const CREATE_PAYMENT: &str = "/idem.test.v1.Payments/CreatePayment";
pub(crate) const CREATE_ORDER: &str = "/idem.test.v1.Payments/CreateOrder";
pub(crate) const WATCH: &str = "/idem.test.v1.Payments/Watch";

/// The handlers: each run records its key in the ledger first (the side
/// effect), then sleeps, fails or panics as the request asks.
#[derive(Clone)]
pub(crate) struct Svc {
    pub(crate) ledger: Ledger,
    /// Set in worker processes: runs are recorded in this file too, across
    /// processes, and the reply's run number counts them there.
    pub(crate) file: Option<FileLedger>,
    /// Set in a worker that is to be killed mid-call: after recording its
    /// run the handler never returns.
    pub(crate) hang: bool,
}

impl Svc {
    fn record(&self, key: &str) -> u64 {
        let n = self.ledger.record(key) as u64;
        match &self.file {
            Some(file) => {
                file.record(key);
                file.runs().iter().filter(|r| r.key == key).count() as u64
            }
            None => n,
        }
    }
}

fn ledger_key<T>(req: &GrpcRequest<T>, fallback: &str) -> String {
    req.metadata()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| fallback.to_owned())
}

#[tonic::async_trait]
impl Payments for Svc {
    async fn create_payment(
        &self,
        req: GrpcRequest<CreatePaymentRequest>,
    ) -> Result<GrpcResponse<Payment>, Status> {
        let key = ledger_key(&req, &req.get_ref().request_id);
        let r = req.into_inner();
        let run = self.record(&key);
        if self.hang {
            std::future::pending::<()>().await;
        }
        if r.sleep_ms > 0 {
            tokio::time::sleep(Duration::from_millis(r.sleep_ms.into())).await;
        }
        if r.panic {
            panic!("the handler panics, as the request asked");
        }
        if r.fail_code != 0 {
            let mut md = tonic::metadata::MetadataMap::new();
            md.insert("x-run", run.to_string().parse().unwrap());
            return Err(Status::with_metadata(
                tonic::Code::from_i32(r.fail_code),
                format!("declined (run {run})"),
                md,
            ));
        }
        // `currency: "pad:<n>"` asks for a reply `n` bytes longer.
        let pad = r
            .currency
            .strip_prefix("pad:")
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        let mut response = GrpcResponse::new(Payment {
            id: format!("pay-{key}{}", "x".repeat(pad)),
            amount_cents: r.amount_cents,
            run,
        });
        response
            .metadata_mut()
            .insert("x-run", run.to_string().parse().unwrap());
        if r.currency == "trailing" {
            let mut trailing = tonic::metadata::MetadataMap::new();
            trailing.insert("x-trailing-run", run.to_string().parse().unwrap());
            response.extensions_mut().insert(Trailing(trailing));
        }
        Ok(response)
    }

    async fn create_order(
        &self,
        req: GrpcRequest<CreateOrderRequest>,
    ) -> Result<GrpcResponse<Order>, Status> {
        let r = req.into_inner();
        let key = r
            .idempotency_key
            .as_ref()
            .map(|k| k.key.clone())
            .unwrap_or_default();
        let run = self.record(&key);
        Ok(GrpcResponse::new(Order {
            id: format!("order-{key}"),
            item: r.item,
            run,
        }))
    }

    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<Payment, Status>> + Send + 'static>>;

    async fn watch(
        &self,
        req: GrpcRequest<CreatePaymentRequest>,
    ) -> Result<GrpcResponse<Self::WatchStream>, Status> {
        let key = ledger_key(&req, &req.get_ref().request_id);
        self.record(&key);
        let items = (1..=3).map(|run| {
            Ok(Payment {
                id: format!("watch-{run}"),
                amount_cents: 0,
                run,
            })
        });
        Ok(GrpcResponse::new(Box::pin(tokio_stream::iter(items))))
    }
}

/// Trailing metadata for an `OK` reply: a handler puts it in its
/// response's extensions (tonic 0.14 has no other way), and
/// [`move_trailing`] sends it in the trailers.
#[derive(Clone)]
pub(crate) struct Trailing(pub(crate) tonic::metadata::MetadataMap);

/// Moves a reply's [`Trailing`] extension into its trailers frame (after
/// `grpc-status`), as docs/grpc.md shows.
pub(crate) fn move_trailing(
    response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    use http_body_util::BodyExt as _;
    let (mut parts, body) = response.into_parts();
    let Some(Trailing(trailing)) = parts.extensions.remove::<Trailing>() else {
        return http::Response::from_parts(parts, body);
    };
    let mut trailing = Some(trailing.into_headers());
    let body = body.map_frame(move |frame| match frame.into_trailers() {
        Ok(mut trailers) => {
            trailers.extend(trailing.take().unwrap_or_default());
            http_body::Frame::trailers(trailers)
        }
        Err(frame) => frame,
    });
    http::Response::from_parts(parts, tonic::body::Body::new(body))
}

/// A tonic server with the layer on a free port of 127.0.0.1; stopped on drop.
pub(crate) struct TestServer {
    pub(crate) addr: SocketAddr,
    pub(crate) ledger: Ledger,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl TestServer {
    pub(crate) async fn start(layer: IdempotencyLayer, ledger: Ledger) -> TestServer {
        let svc = Svc {
            ledger: ledger.clone(),
            file: None,
            hang: false,
        };
        TestServer::start_with(layer, svc).await
    }

    pub(crate) async fn start_with(layer: IdempotencyLayer, svc: Svc) -> TestServer {
        let ledger = svc.ledger.clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let svc = PaymentsServer::new(svc);
        tokio::spawn(async move {
            Server::builder()
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        TestServer {
            addr,
            ledger,
            stop: Some(stop),
        }
    }

    /// [`start`](Self::start) with [`move_trailing`] as a layer inside
    /// the idempotency layer (added after it), so trailing metadata is in
    /// the reply the idempotency layer stores.
    pub(crate) async fn start_with_trailing(layer: IdempotencyLayer, ledger: Ledger) -> TestServer {
        let svc = PaymentsServer::new(Svc {
            ledger: ledger.clone(),
            file: None,
            hang: false,
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            Server::builder()
                .layer(layer)
                .layer(tower::util::MapResponseLayer::new(move_trailing))
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        TestServer {
            addr,
            ledger,
            stop: Some(stop),
        }
    }

    pub(crate) async fn client(&self) -> PaymentsClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        PaymentsClient::new(channel)
    }

    pub(crate) fn raw(&self) -> RawClient {
        RawClient::new(self.addr)
    }
}

/// A payment request whose reply is `pad` bytes longer than usual.
pub(crate) fn padded_payment(amount_cents: i64, pad: usize) -> CreatePaymentRequest {
    CreatePaymentRequest {
        amount_cents,
        currency: format!("pad:{pad}"),
        ..Default::default()
    }
}

/// A payment request with a key in the metadata.
pub(crate) fn with_key<T>(message: T, key: &str) -> GrpcRequest<T> {
    let mut req = GrpcRequest::new(message);
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    req
}

pub(crate) fn payment(amount_cents: i64) -> CreatePaymentRequest {
    CreatePaymentRequest {
        amount_cents,
        currency: "EUR".into(),
        ..Default::default()
    }
}

/// What idem wrote in a refusal's metadata.
pub(crate) fn slug(status: &Status) -> Option<String> {
    status
        .metadata()
        .get("idem-error")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// An answer as it came off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawAnswer {
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: HeaderMap,
}

impl RawAnswer {
    /// The headers a replay must repeat: all but `date` and the replay mark.
    pub(crate) fn comparable_headers(&self) -> HeaderMap {
        let mut h = self.headers.clone();
        h.remove("date");
        h.remove("idempotent-replayed");
        h
    }

    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The status: from the trailers, or the headers of a trailers-only answer.
    pub(crate) fn grpc_status(&self) -> Option<String> {
        self.trailers
            .get("grpc-status")
            .or_else(|| self.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    pub(crate) fn payment(&self) -> Payment {
        Payment::decode(self.body.get(5..).unwrap()).unwrap()
    }
}

/// Unary calls over plain HTTP/2, the message framed by hand.
#[derive(Clone)]
pub(crate) struct RawClient {
    addr: SocketAddr,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
}

impl RawClient {
    pub(crate) fn new(addr: SocketAddr) -> RawClient {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(true)
                .build_http();
        RawClient { addr, client }
    }

    pub(crate) async fn call(
        &self,
        path: &str,
        metadata: &[(&str, &str)],
        message: &impl prost::Message,
    ) -> RawAnswer {
        let metadata: Vec<(&str, &[u8])> =
            metadata.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        self.call_bytes(path, &metadata, message).await
    }

    /// [`call`](Self::call) with metadata values as bytes (not UTF-8, say).
    pub(crate) async fn call_bytes(
        &self,
        path: &str,
        metadata: &[(&str, &[u8])],
        message: &impl prost::Message,
    ) -> RawAnswer {
        let bytes = message.encode_to_vec();
        let mut framed = Vec::with_capacity(5 + bytes.len());
        framed.push(0);
        framed.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        framed.extend_from_slice(&bytes);
        let mut req = Request::post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (k, v) in metadata {
            req = req.header(*k, http::HeaderValue::from_bytes(v).unwrap());
        }
        let req = req.body(Full::new(Bytes::from(framed))).unwrap();
        let response = self.client.request(req).await.unwrap();
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap_or_default();
        RawAnswer {
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
        }
    }
}
