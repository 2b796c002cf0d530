//! The payments story over gRPC: `CreatePayment` charges a card at most
//! once per `request_id` (Google's AIP-155), however often clients retry.
//!
//! * `idem::grpc::IdempotencyLayer` on the tonic server reads the key from
//!   the request message's own `request_id` (required): a retry gets the
//!   first reply byte for byte (`idempotent-replayed: true` in its
//!   metadata), a duplicate still in flight waits for it (`.wait`), the
//!   same `request_id` with another payment is `FAILED_PRECONDITION`.
//! * `idem::grpc::client::Operation` on the client side: one key per
//!   payment, sent on every retry, with backoff.
//!
//! ```text
//! cargo run --example payments_grpc --features grpc            # server + a demo client, in one process
//! cargo run --example payments_grpc --features grpc -- serve   # the server only, on $ADDR (127.0.0.1:50051)
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example payments_grpc --features grpc -- serve
//! ```
//!
//! The service is `examples/proto/payments.proto`; its Rust code is
//! committed in `examples/pb/` (no build script, no protoc). Without
//! `REDIS_URL` the in-process `MemoryStore` is used: the same semantics,
//! within this one process. Each charge prints one `charged` line.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "an example program: it fails loudly and prints what it does"
)]

/// The generated messages, client and server (`include!`, so that rustfmt
/// leaves the generated file as the generator wrote it).
#[allow(clippy::all, missing_docs, unreachable_pub)]
pub(crate) mod pb {
    include!("pb/payments.v1.rs");
}

use idem::grpc::client::{Operation, RetryPolicy};
use idem::grpc::{IdempotencyLayer, UnaryMethod};
use idem::{Idempotency, MemoryStore, RedisStore};
use pb::payments_client::PaymentsClient;
use pb::payments_server::{Payments, PaymentsServer};
use pb::{CreatePaymentRequest, Payment};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// The full path of the protected method.
pub(crate) const CREATE_PAYMENT: &str = "/payments.v1.Payments/CreatePayment";

/// The card processor: counts charges (your side effect goes here).
#[derive(Clone, Default)]
pub(crate) struct PaymentsService {
    charges: Arc<AtomicU64>,
}

impl PaymentsService {
    /// How many charges were made (clones share the count).
    pub(crate) fn charges(&self) -> u64 {
        self.charges.load(Ordering::SeqCst)
    }
}

#[tonic::async_trait]
impl Payments for PaymentsService {
    async fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let r = request.into_inner();
        if r.amount_cents <= 0 {
            return Err(Status::invalid_argument("amount_cents must be positive"));
        }
        // Slow enough that concurrent retries meet the charge in flight.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        println!(
            "charged order {} {} {} (charge #{n}, request_id {})",
            r.order_id, r.amount_cents, r.currency, r.request_id
        );
        Ok(Response::new(Payment {
            payment_id: format!("pay_{n}"),
            order_id: r.order_id,
            amount_cents: r.amount_cents,
            currency: r.currency,
            charge_number: n,
        }))
    }
}

/// The layer: the key is the request's own `request_id`, required; a
/// duplicate in flight waits up to 10 s for the first reply.
pub(crate) fn layer(idem: Idempotency) -> IdempotencyLayer {
    IdempotencyLayer::new(idem)
        .method(
            UnaryMethod::new(CREATE_PAYMENT)
                .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone())),
        )
        .require_key(true)
        .wait(Duration::from_secs(10))
}

/// Serves `service` behind the layer on `listener` until the process ends.
pub(crate) async fn serve(
    idem: Idempotency,
    service: PaymentsService,
    listener: TcpListener,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .layer(layer(idem))
        .add_service(PaymentsServer::new(service))
        // A listener of our own (bound before, so the address is known):
        // `serve_with_incoming` leaves the sockets as it gets them, so ask
        // for `TCP_NODELAY` as `serve(addr)` does, or small replies wait
        // for the client's ACKs.
        .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
        .await
}

/// The runtime: Redis when `REDIS_URL` is set, else memory.
async fn runtime() -> Result<Idempotency, Box<dyn std::error::Error>> {
    let idem = match std::env::var("REDIS_URL") {
        Ok(url) => Idempotency::builder(RedisStore::connect(&url).await?),
        Err(_) => Idempotency::builder(MemoryStore::new()),
    };
    Ok(idem.namespace("payments").build())
}

/// Six clients retrying one payment at once, sharing its key: one charge.
async fn demo(addr: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let op = Operation::new().retry(
        RetryPolicy::default()
            .max_retries(5)
            .initial_backoff(Duration::from_millis(100)),
    );
    let message = CreatePaymentRequest {
        request_id: op.key().to_owned(),
        order_id: "order-1".into(),
        amount_cents: 1999,
        currency: "EUR".into(),
    };
    let mut tasks = Vec::new();
    for client_no in 1..=6 {
        let (op, message, channel) = (op.clone(), message.clone(), channel.clone());
        tasks.push(tokio::spawn(async move {
            let reply = op
                .call(|| {
                    let mut client = PaymentsClient::new(channel.clone());
                    let request = op.request(message.clone());
                    async move { client.create_payment(request).await }
                })
                .await?;
            let p = reply.response.get_ref();
            println!(
                "client {client_no}: {} for {} (charge #{}, {} attempt(s), replayed: {})",
                p.payment_id, p.order_id, p.charge_number, reply.attempts, reply.replayed
            );
            Ok::<_, idem::grpc::client::CallError>(p.charge_number)
        }));
    }
    for task in tasks {
        let charge = task.await??;
        assert_eq!(charge, 1, "every client got the one charge");
    }
    println!("six clients, one payment, one charge");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let idem = runtime().await?;
    if std::env::args().nth(1).as_deref() == Some("serve") {
        let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:50051".into());
        let listener = TcpListener::bind(&addr).await?;
        println!("payments_grpc listening on {}", listener.local_addr()?);
        serve(idem, PaymentsService::default(), listener).await?;
        return Ok(());
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let service = PaymentsService::default();
    tokio::spawn(serve(idem, service.clone(), listener));
    demo(addr).await?;
    assert_eq!(service.charges(), 1, "the card was charged once");
    Ok(())
}
