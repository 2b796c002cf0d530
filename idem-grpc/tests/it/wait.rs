//! `idem-wait: N` over real sockets, on the in-process MemoryStore, a
//! private Redis (both notify waiters) and PostgreSQL (waiters poll):
//! duplicates of a call whose handler is held on a gate
//! wait for its answer and get it replayed byte for byte; the handler runs
//! once; the wait is capped (`max_wait`, the call's deadline), reported in
//! `idem-wait-applied-ms`, and its end or a failed first call answered as
//! documented.

use crate::support::pb::payments_server::{Payments, PaymentsServer};
use crate::support::pb::{CreateOrderRequest, CreatePaymentRequest, Order, Payment};
use crate::support::{CREATE_PAYMENT, RawAnswer, RawClient, payment};
use http::HeaderMap;
use idem_core::Idempotency;
use idem_grpc::IdempotencyLayer;
use idem_testkit::{TestContext, eventually};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// A `Payments` whose first `CreatePayment` run is held on a gate; a
/// request with `fail_code` set fails its first run with `UNAVAILABLE`
/// (which releases the key).
#[derive(Clone)]
struct Gated {
    runs: Arc<AtomicUsize>,
    arrived: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

#[tonic::async_trait]
impl Payments for Gated {
    async fn create_payment(
        &self,
        req: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let n = self.runs.fetch_add(1, SeqCst) as u64 + 1;
        let r = req.into_inner();
        if n == 1 {
            self.gate.acquire().await.expect("gate open").forget();
            if r.fail_code != 0 {
                return Err(Status::unavailable("the first run fails (test)"));
            }
        }
        let mut response = Response::new(Payment {
            id: format!("pay-{n}"),
            amount_cents: r.amount_cents,
            run: n,
        });
        response
            .metadata_mut()
            .insert("x-run", n.to_string().parse().unwrap());
        Ok(response)
    }

    async fn create_order(
        &self,
        _req: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<Payment, Status>> + Send + 'static>>;

    async fn watch(
        &self,
        _req: Request<CreatePaymentRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

/// A tonic server of [`Gated`] behind the layer, calls counted as they
/// arrive (outside the layer); stopped on drop.
struct GatedServer {
    svc: Gated,
    raw: RawClient,
    _ctx: TestContext,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for GatedServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl GatedServer {
    async fn start(
        ctx: TestContext,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> GatedServer {
        let idem: Idempotency = ctx.idem();
        let layer = configure(IdempotencyLayer::new(idem).unary(CREATE_PAYMENT));
        let svc = Gated {
            runs: Arc::default(),
            arrived: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        };
        let arrived = svc.arrived.clone();
        let count =
            tower::util::MapRequestLayer::new(move |r: http::Request<tonic::body::Body>| {
                arrived.fetch_add(1, SeqCst);
                r
            });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let service = PaymentsServer::new(svc.clone());
        tokio::spawn(async move {
            Server::builder()
                .layer(count)
                .layer(layer)
                .add_service(service)
                .serve_with_incoming_shutdown(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        GatedServer {
            svc,
            raw: RawClient::new(addr),
            _ctx: ctx,
            stop: Some(stop),
        }
    }

    fn runs(&self) -> usize {
        self.svc.runs.load(SeqCst)
    }

    fn open(&self) {
        self.svc.gate.add_permits(1);
    }

    fn call(
        &self,
        key: &'static str,
        metadata: &[(&'static str, &'static str)],
        message: CreatePaymentRequest,
    ) -> tokio::task::JoinHandle<RawAnswer> {
        let raw = self.raw.clone();
        let mut md = vec![("idempotency-key", key)];
        md.extend_from_slice(metadata);
        tokio::spawn(async move { raw.call(CREATE_PAYMENT, &md, &message).await })
    }

    /// Sends the first call, and waits until its handler runs (held).
    async fn first(
        &self,
        key: &'static str,
        message: CreatePaymentRequest,
    ) -> tokio::task::JoinHandle<RawAnswer> {
        let first = self.call(key, &[], message);
        eventually(
            "the first call's handler runs",
            Duration::from_secs(30),
            || std::future::ready((self.runs() >= 1).then_some(())),
        )
        .await;
        first
    }

    /// Waits until `n` calls reached the server, then gives their claims a
    /// moment to reach the store (a duplicate that claims only after the
    /// gate opens gets a plain replay, which the assertions accept too).
    async fn until_arrived(&self, n: usize) {
        eventually(
            "every call reached the server",
            Duration::from_secs(30),
            || std::future::ready((self.svc.arrived.load(SeqCst) >= n).then_some(())),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The headers a replay repeats: all but `date` and what the layer adds.
fn original_headers(a: &RawAnswer) -> HeaderMap {
    let mut h = a.comparable_headers();
    h.remove("idem-wait-applied-ms");
    h
}

fn status(a: &RawAnswer) -> String {
    a.grpc_status().unwrap_or_default()
}

/// 64 concurrent duplicates with `idem-wait: 5`, sent while the first
/// call's handler is held: none is answered while it is held (each
/// waits), and once it finishes every one gets the first call's answer
/// byte for byte (initial metadata, message, trailers) marked as a replay
/// with `idem-wait-applied-ms: 5000`; the handler ran once.
async fn sixty_four_waiting_duplicates(ctx: TestContext) {
    let server = GatedServer::start(ctx, |l| l).await;
    let first = server.first("dup", payment(500)).await;
    let duplicates: Vec<_> = (0..64)
        .map(|_| server.call("dup", &[("idem-wait", "5")], payment(500)))
        .collect();
    server.until_arrived(65).await;
    assert!(
        duplicates.iter().all(|d| !d.is_finished()),
        "a duplicate was answered while the first call still ran: it did not wait"
    );
    server.open();
    let first = first.await.unwrap();
    assert_eq!(status(&first), "0", "{first:?}");
    assert!(!first.replayed());
    assert_eq!(first.payment().run, 1);
    for d in duplicates {
        let d = d.await.unwrap();
        assert_eq!(d.body, first.body, "same message bytes: {d:?}");
        assert_eq!(d.trailers, first.trailers, "same trailers");
        assert_eq!(original_headers(&d), original_headers(&first));
        assert!(d.replayed());
        assert_eq!(d.headers["idem-wait-applied-ms"], "5000");
    }
    assert_eq!(server.runs(), 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_duplicates_with_idem_wait_get_the_original_reply_memory_store() {
    sixty_four_waiting_duplicates(TestContext::memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_duplicates_with_idem_wait_get_the_original_reply_redis() {
    sixty_four_waiting_duplicates(TestContext::redis().await.with_namespace("grpc-wait")).await;
}

/// The same on PostgreSQL, a store without notifications: the waiters
/// fall back to reading the key again (idem-core's polling), with the same
/// outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_duplicates_with_idem_wait_get_the_original_reply_postgres_polling() {
    sixty_four_waiting_duplicates(TestContext::postgres().await.with_namespace("grpc-wait")).await;
}

/// Without `idem-wait` (and without the layer's `wait`) a duplicate is
/// `ABORTED` at once; with a wait shorter than the handler it is
/// `ABORTED` once the wait ends, with the wait it was granted; an entry
/// that is not whole seconds is ignored. The handler is not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_is_aborted_without_a_wait_and_after_one_that_ends_first() {
    let server = GatedServer::start(TestContext::memory(), |l| l).await;
    let first = server.first("short", payment(500)).await;
    for (metadata, applied) in [
        (&[][..], None),
        (&[("idem-wait", "1")][..], Some("1000")),
        (&[("idem-wait", "soon")][..], None),
        (&[("idem-wait", "1.5")][..], None),
    ] {
        let dup = server.call("short", metadata, payment(500)).await.unwrap();
        assert_eq!(status(&dup), "10", "ABORTED: {dup:?}");
        assert_eq!(dup.headers["idem-error"], "key-in-use");
        assert_eq!(
            dup.headers
                .get("idem-wait-applied-ms")
                .map(|v| v.to_str().unwrap()),
            applied,
            "{metadata:?}"
        );
    }
    server.open();
    assert_eq!(status(&first.await.unwrap()), "0");
    assert_eq!(server.runs(), 1);
}

/// A wait over `max_wait` is cut to it, and so is one past the call's
/// deadline (`grpc-timeout`); `idem-wait-applied-ms` says what was
/// granted. `max_wait(0)` ignores the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_is_capped_by_max_wait_and_the_deadline() {
    let server = GatedServer::start(TestContext::memory(), |l| {
        l.max_wait(Duration::from_secs(1))
    })
    .await;
    let first = server.first("capped", payment(500)).await;
    let dup = server
        .call("capped", &[("idem-wait", "3600")], payment(500))
        .await
        .unwrap();
    assert_eq!(status(&dup), "10", "ABORTED: {dup:?}");
    assert_eq!(dup.headers["idem-wait-applied-ms"], "1000");
    server.open();
    let first = first.await.unwrap();
    let replay = server
        .call("capped", &[("idem-wait", "3600")], payment(500))
        .await
        .unwrap();
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["idem-wait-applied-ms"], "1000");

    let server = GatedServer::start(TestContext::memory(), |l| l).await;
    let first = server.first("deadline", payment(500)).await;
    server.open();
    let first = first.await.unwrap();
    let replay = server
        .call(
            "deadline",
            &[("idem-wait", "3600"), ("grpc-timeout", "2S")],
            payment(500),
        )
        .await
        .unwrap();
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["idem-wait-applied-ms"], "2000");
    let replay = server
        .call("deadline", &[("idem-wait", "3600")], payment(500))
        .await
        .unwrap();
    assert_eq!(
        replay.headers["idem-wait-applied-ms"], "10000",
        "the default cap"
    );

    let server = GatedServer::start(TestContext::memory(), |l| l.max_wait(Duration::ZERO)).await;
    let first = server.first("off", payment(500)).await;
    let dup = server
        .call("off", &[("idem-wait", "5")], payment(500))
        .await
        .unwrap();
    assert_eq!(status(&dup), "10", "ABORTED: {dup:?}");
    assert!(!dup.headers.contains_key("idem-wait-applied-ms"));
    server.open();
    first.await.unwrap();
    assert_eq!(server.runs(), 1);
}

/// When the first call fails (`UNAVAILABLE` releases its key) while
/// duplicates wait, the key is free again and the waiters are retries of
/// it: one of them runs the handler (its own answer, not a replay), the
/// others wait on and get that answer replayed. Two runs in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_first_call_is_run_by_one_waiter() {
    let server = GatedServer::start(
        TestContext::redis().await.with_namespace("grpc-wait-fail"),
        |l| l,
    )
    .await;
    let mut failing = payment(500);
    failing.fail_code = tonic::Code::Unavailable as i32;
    let first = server.first("failed", failing.clone()).await;
    let waiters: Vec<_> = (0..8)
        .map(|_| server.call("failed", &[("idem-wait", "5")], failing.clone()))
        .collect();
    server.until_arrived(9).await;
    server.open();
    assert_eq!(status(&first.await.unwrap()), "14", "UNAVAILABLE");
    let mut answers = Vec::new();
    for w in waiters {
        answers.push(w.await.unwrap());
    }
    assert!(answers.iter().all(|a| status(a) == "0"), "{answers:?}");
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    let ran: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(ran.len(), 1, "one waiter ran the handler");
    assert!(!ran[0].headers.contains_key("idem-wait-applied-ms"));
    assert_eq!(ran[0].payment().run, 2);
    for a in answers.iter().filter(|a| a.replayed()) {
        assert_eq!(a.headers["idem-wait-applied-ms"], "5000");
    }
    assert_eq!(server.runs(), 2, "the failed run and one waiter's");
}
