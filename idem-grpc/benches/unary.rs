//! Unary RPCs per second through the idempotency layer against the bare
//! tonic service, in the same run: the same service, the same request (the
//! bare server ignores the key), one HTTP/2 connection per server, many
//! calls in flight. Phases, alternated over rounds:
//!
//! * `bare`: the service without the layer;
//! * `fresh`: through the layer, a new key per call (claim, run, store);
//! * `fresh-shared`: the same with `share_round_trips(true)`, the claims
//!   (then the completes) of calls that reach the store in one scheduler
//!   turn sent as one batch;
//! * `replay`: through the layer, keys already completed (one read);
//! * `replay-shared`: the same with `share_round_trips(true)`;
//! * `cached`: the same replays, the runtime keeping completed results in
//!   process (`IdempotencyBuilder::local_cache`): no store round trip;
//! * `floor-fresh`, `floor-replay`: the floor, the least any idempotency
//!   layer must add, written by hand in the service without idem: per
//!   new key `SET key pending NX PX ttl GET`, the handler, `SET key reply
//!   PX ttl` (the encoded message); per completed key the same first
//!   `SET`, which finds the reply, decoded and answered.
//!
//! A private `redis-server` on 127.0.0.1 is the store. Prints each round,
//! then the median per phase, `fresh / bare`, `replay / bare`, and idem
//! against the floor.
//!
//! On a 2-core machine 32 calls in flight already saturate the CPU (the
//! servers' sockets have `TCP_NODELAY`, as `Server::serve` sets it): the
//! ratios say what a call costs in CPU, the Redis server's included as it
//! shares the cores (docs/performance.md, "gRPC unary RPCs").
//!
//! `IDEM_BENCH_PIN=1` puts Redis on the last CPU and the bench (client and
//! servers) on the others, so the store does not share the service's
//! cores.
//!
//! ```text
//! cargo bench -p idem-grpc --bench unary
//! IDEM_BENCH_SECS=3 IDEM_BENCH_ROUNDS=7 IDEM_BENCH_CONCURRENCY=64 cargo bench -p idem-grpc --bench unary
//! IDEM_BENCH_PIN=1 cargo bench -p idem-grpc --bench unary
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]

#[allow(clippy::all, missing_docs, unreachable_pub, dead_code)]
mod pb {
    include!("../tests/it/pb/idem.test.v1.rs");
}

use idem_core::Idempotency;
use idem_grpc::IdempotencyLayer;
use idem_testkit::RedisServer;
use pb::payments_client::PaymentsClient;
use pb::payments_server::{Payments, PaymentsServer};
use pb::{CreateOrderRequest, CreatePaymentRequest, Order, Payment};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

const CREATE_PAYMENT: &str = "/idem.test.v1.Payments/CreatePayment";

#[derive(Clone, Default)]
struct Svc;

#[tonic::async_trait]
impl Payments for Svc {
    async fn create_payment(
        &self,
        req: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let r = req.into_inner();
        Ok(Response::new(Payment {
            id: "pay_1".into(),
            amount_cents: r.amount_cents,
            run: 1,
        }))
    }

    async fn create_order(
        &self,
        _req: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        Err(Status::unimplemented("not benchmarked"))
    }

    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<Payment, Status>> + Send + 'static>>;

    async fn watch(
        &self,
        _req: Request<CreatePaymentRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not benchmarked"))
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The floor: the bare service's handler between a claim and a store,
/// both plain commands on the layer's Redis (no owner token, no record
/// format, no fingerprint: less than any correct layer can do).
#[derive(Clone)]
struct FloorSvc {
    redis: redis::aio::ConnectionManager,
}

const FLOOR_TTL_MS: u64 = 3_600_000;

#[tonic::async_trait]
impl Payments for FloorSvc {
    async fn create_payment(
        &self,
        req: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        use prost::Message as _;
        let key = match req.metadata().get("idempotency-key") {
            Some(v) => format!("floor:{}", v.to_str().unwrap_or_default()),
            None => return Err(Status::invalid_argument("no key")),
        };
        let mut redis = self.redis.clone();
        let found: Option<Vec<u8>> = redis::cmd("SET")
            .arg(&key)
            .arg("pending")
            .arg("NX")
            .arg("PX")
            .arg(FLOOR_TTL_MS)
            .arg("GET")
            .query_async(&mut redis)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        if let Some(stored) = found {
            let reply =
                Payment::decode(&stored[..]).map_err(|e| Status::internal(e.to_string()))?;
            return Ok(Response::new(reply));
        }
        let reply = Svc.create_payment(req).await?.into_inner();
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(reply.encode_to_vec())
            .arg("PX")
            .arg(FLOOR_TTL_MS)
            .query_async(&mut redis)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(reply))
    }

    async fn create_order(
        &self,
        req: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        Svc.create_order(req).await
    }

    type WatchStream = <Svc as Payments>::WatchStream;

    async fn watch(
        &self,
        req: Request<CreatePaymentRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Svc.watch(req).await
    }
}

/// What a server runs.
enum Served {
    Bare,
    Layered(Box<IdempotencyLayer>),
    Floor(FloorSvc),
}

/// Serves `what` on a port of its own; a channel to it.
async fn serve(what: Served) -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // As `Server::serve(addr)` binds it: without `TCP_NODELAY` the
    // server's small response frames wait for the client's ACKs (Nagle).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    match what {
        Served::Layered(layer) => tokio::spawn(
            Server::builder()
                .layer(*layer)
                .add_service(PaymentsServer::new(Svc))
                .serve_with_incoming(incoming),
        ),
        Served::Bare => tokio::spawn(
            Server::builder()
                .add_service(PaymentsServer::new(Svc))
                .serve_with_incoming(incoming),
        ),
        Served::Floor(floor) => tokio::spawn(
            Server::builder()
                .add_service(PaymentsServer::new(floor))
                .serve_with_incoming(incoming),
        ),
    };
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// The bench's one request, under `key`.
fn request(key: &str) -> Request<CreatePaymentRequest> {
    let mut req = Request::new(CreatePaymentRequest {
        amount_cents: 500,
        currency: "EUR".into(),
        ..Default::default()
    });
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    req
}

/// Calls per second over `secs`, `concurrency` calls in flight; `key(i)`
/// names the i-th call's key.
async fn phase(
    channel: &Channel,
    concurrency: u64,
    secs: u64,
    key: Arc<dyn Fn(u64) -> String + Send + Sync>,
) -> f64 {
    let counter = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let mut client = PaymentsClient::new(channel.clone());
            let (counter, key) = (counter.clone(), key.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < end {
                    let i = counter.fetch_add(1, Ordering::Relaxed);
                    client.create_payment(request(&key(i))).await.unwrap();
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// With `IDEM_BENCH_PIN` set: Redis's main thread on the last CPU, this
/// process (its runtime's threads are made after this) on the others, so
/// that the store does not take the service's cores, as in production.
/// False (and nothing pinned) on a single CPU.
fn pin_apart(redis: &RedisServer) -> bool {
    use rustix::thread::{CpuSet, Pid, sched_getaffinity, sched_setaffinity};
    let ours = sched_getaffinity(None).unwrap();
    let cpus: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| ours.is_set(c)).collect();
    let (Some((&last, rest)), Some(pid)) = (cpus.split_last(), redis.pid()) else {
        return false;
    };
    if rest.is_empty() {
        return false;
    }
    let mut store = CpuSet::new();
    store.set(last);
    let mut service = CpuSet::new();
    for &c in rest {
        service.set(c);
    }
    let redis_pid = Pid::from_raw(i32::try_from(pid).unwrap());
    sched_setaffinity(redis_pid, &store).unwrap();
    sched_setaffinity(None, &service).unwrap();
    true
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let secs = env("IDEM_BENCH_SECS", 2);
    let rounds = env("IDEM_BENCH_ROUNDS", 5);
    let concurrency = env("IDEM_BENCH_CONCURRENCY", 32);
    let redis = RedisServer::start();
    let pinned = std::env::var_os("IDEM_BENCH_PIN").is_some() && pin_apart(&redis);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = idem_redis::RedisStore::connect(&redis.url()).await.unwrap();
        let idem = Idempotency::builder(store.clone())
            .namespace("bench")
            .build();
        let cached_idem = Idempotency::builder(store)
            .namespace("bench")
            .local_cache(10_000)
            .build();
        let bare = serve(Served::Bare).await;
        let layered = serve(Served::Layered(Box::new(
            IdempotencyLayer::new(idem.clone()).unary(CREATE_PAYMENT),
        )))
        .await;
        let shared = serve(Served::Layered(Box::new(
            IdempotencyLayer::new(idem.clone())
                .unary(CREATE_PAYMENT)
                .share_round_trips(true),
        )))
        .await;
        let cached = serve(Served::Layered(Box::new(
            IdempotencyLayer::new(cached_idem).unary(CREATE_PAYMENT),
        )))
        .await;
        let floor_redis =
            redis::aio::ConnectionManager::new(redis::Client::open(redis.url()).unwrap())
                .await
                .unwrap();
        let floor = serve(Served::Floor(FloorSvc { redis: floor_redis })).await;

        // The replay phase's keys, completed once.
        const POOL: u64 = 1_000;
        let pool_key = |i: u64| format!("replay-{}", i % POOL);
        for server in [&layered, &floor] {
            let mut client = PaymentsClient::new(server.clone());
            for i in 0..POOL {
                client.create_payment(request(&pool_key(i))).await.unwrap();
            }
        }

        let place = if pinned {
            "local Redis on a CPU of its own"
        } else {
            "local Redis"
        };
        println!(
            "unary RPCs/s, {concurrency} in flight, {secs} s per phase, {rounds} rounds ({place})"
        );
        let (mut b, mut f, mut r) = (Vec::new(), Vec::new(), Vec::new());
        // Ratios per round too: on a shared machine a round's phases see
        // the same load, so their ratio is steadier than the rates.
        let (mut fr, mut rr, mut cr) = (Vec::new(), Vec::new(), Vec::new());
        // idem against the floor, per round.
        let (mut ff, mut rf) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let fresh_key: Arc<dyn Fn(u64) -> String + Send + Sync> =
                Arc::new(move |i| format!("fresh-{round}-{i}"));
            let replay_key: Arc<dyn Fn(u64) -> String + Send + Sync> = Arc::new(pool_key);
            let bare_rps = phase(&bare, concurrency, secs, fresh_key.clone()).await;
            let fresh_rps = phase(&layered, concurrency, secs, fresh_key.clone()).await;
            let shared_key: Arc<dyn Fn(u64) -> String + Send + Sync> =
                Arc::new(move |i| format!("shared-{round}-{i}"));
            let shared_rps = phase(&shared, concurrency, secs, shared_key).await;
            let replay_rps = phase(&layered, concurrency, secs, replay_key.clone()).await;
            let replay_shared_rps = phase(&shared, concurrency, secs, replay_key.clone()).await;
            let cached_rps = phase(&cached, concurrency, secs, replay_key.clone()).await;
            let floor_key: Arc<dyn Fn(u64) -> String + Send + Sync> =
                Arc::new(move |i| format!("floor-{round}-{i}"));
            let floor_fresh_rps = phase(&floor, concurrency, secs, floor_key).await;
            let floor_replay_rps = phase(&floor, concurrency, secs, replay_key).await;
            println!(
                "round {round}: bare {bare_rps:.0}  fresh {fresh_rps:.0} ({:.2})  fresh-shared {shared_rps:.0} ({:.2})  replay {replay_rps:.0} ({:.2})  replay-shared {replay_shared_rps:.0} ({:.2})  cached {cached_rps:.0} ({:.2})  floor-fresh {floor_fresh_rps:.0} ({:.2})  floor-replay {floor_replay_rps:.0} ({:.2})",
                fresh_rps / bare_rps,
                shared_rps / bare_rps,
                replay_rps / bare_rps,
                replay_shared_rps / bare_rps,
                cached_rps / bare_rps,
                floor_fresh_rps / bare_rps,
                floor_replay_rps / bare_rps,
            );
            ff.push(fresh_rps / floor_fresh_rps);
            rf.push(replay_rps / floor_replay_rps);
            fr.push(fresh_rps / bare_rps);
            rr.push(replay_rps / bare_rps);
            cr.push(cached_rps / bare_rps);
            b.push(bare_rps);
            f.push(fresh_rps);
            r.push(replay_rps);
        }
        let (b, f, r) = (median(b), median(f), median(r));
        println!(
            "median: bare {b:.0}/s  fresh {f:.0}/s ({:.2} of bare)  replay {r:.0}/s ({:.2} of bare)",
            f / b,
            r / b
        );
        println!(
            "median of the rounds' ratios: fresh {:.2}  replay {:.2}  cached replay {:.2}",
            median(fr),
            median(rr),
            median(cr)
        );
        println!(
            "median of the rounds' ratios to the floor: fresh {:.2}  replay {:.2}",
            median(ff),
            median(rf)
        );
    });
}
