//! `examples/payments_grpc.rs` driven by a client nobody here wrote: Python's
//! `grpcio`, with its own stubs generated from `examples/proto/payments.proto`
//! by `grpcio-tools`, calls the example's server with concurrent retries of
//! one `request_id`, a retry after its own deadline cut a call short, a
//! reused `request_id` and a missing one. The card processor's count shows
//! one charge per payment; the Python side asserts identical replies.
//!
//! grpcio and grpcio-tools live in `~/.cache/idem-grpcio`:
//! `cargo xtask setup` installs them (`python3 -m pip install --target
//! ~/.cache/idem-grpcio grpcio grpcio-tools`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

#[path = "../examples/payments_grpc.rs"]
#[allow(dead_code)]
mod example;

use idem::{Idempotency, MemoryStore};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where grpcio is installed, and the Python path that finds it.
fn grpcio_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("idem-grpcio")
}

fn require_grpcio() {
    let out = Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .env("PYTHONPATH", grpcio_dir())
        .output()
        .expect("python3 runs the gRPC client: install Python 3 (cargo xtask setup)");
    assert!(
        out.status.success(),
        "the Python client needs grpcio and grpcio-tools, which python3 cannot import from {} ({}); \
         run `cargo xtask setup` (it pip-installs them there)",
        grpcio_dir().display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// The client: asserts as it goes, prints `ok` last.
const CLIENT: &str = r#"
import json, sys, uuid
from concurrent.futures import ThreadPoolExecutor
import grpc
sys.path.insert(0, sys.argv[2])
import payments_pb2 as pb, payments_pb2_grpc as rpc

addr = sys.argv[1]
# gRPC's own retry policy: ABORTED (a call with this key in flight) and
# UNAVAILABLE are retried with backoff, the same request each time.
config = {"methodConfig": [{"name": [{"service": "payments.v1.Payments"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["ABORTED", "UNAVAILABLE"]}}]}
channel = grpc.insecure_channel(addr, options=[("grpc.enable_retries", 1),
                                               ("grpc.service_config", json.dumps(config))])
stub = rpc.PaymentsStub(channel)

def call(req, timeout=60):
    reply, c = stub.CreatePayment.with_call(req, timeout=timeout)
    replayed = dict(c.initial_metadata()).get("idempotent-replayed") == "true"
    return reply.SerializeToString(), reply, replayed

# 1. Eight concurrent sends of one payment: one charge, one reply.
rid = str(uuid.uuid4())
req = pb.CreatePaymentRequest(request_id=rid, order_id="order-1", amount_cents=1999, currency="EUR")
with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda _: call(req), range(8)))
first = results[0][0]
assert all(r[0] == first for r in results), "identical reply bytes"
assert results[0][1].charge_number == 1, results[0][1]
assert sum(1 for r in results if not r[2]) == 1, "one call ran it, the others got it replayed"

# 2. A later retry (its reply was lost): the same bytes, replayed.
again = call(req)
assert again[0] == first and again[2]

# 3. A call cut short by its own deadline, then retried: one charge.
rid2 = str(uuid.uuid4())
req2 = pb.CreatePaymentRequest(request_id=rid2, order_id="order-2", amount_cents=500, currency="EUR")
try:
    stub.CreatePayment(req2, timeout=0.05)
    raise AssertionError("the 50 ms deadline should have cut the call short")
except grpc.RpcError as e:
    # grpcio with retries enabled reports its own deadline as CANCELLED
    # ("Timeout expired"), without them as DEADLINE_EXCEEDED.
    assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), e
r2 = call(req2)
assert r2[1].charge_number == 2, r2[1]
assert call(req2)[0] == r2[0]

# 4. The same request_id for another payment: refused, nothing charged.
try:
    call(pb.CreatePaymentRequest(request_id=rid, order_id="order-1", amount_cents=2999, currency="EUR"))
    raise AssertionError("a reused request_id must be refused")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
    assert dict(e.trailing_metadata()).get("idem-error") == "key-reused", e.trailing_metadata()

# 5. No request_id: the example requires one.
try:
    call(pb.CreatePaymentRequest(order_id="order-3", amount_cents=1, currency="EUR"))
    raise AssertionError("a payment without request_id must be refused")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
print("ok")
"#;

fn generate_stubs(out: &Path) {
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/proto");
    let status = Command::new("python3")
        .args(["-m", "grpc_tools.protoc", "-I"])
        .arg(&proto)
        .arg(format!("--python_out={}", out.display()))
        .arg(format!("--grpc_python_out={}", out.display()))
        .arg(proto.join("payments.proto"))
        .env("PYTHONPATH", grpcio_dir())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "grpc_tools.protoc failed on payments.proto"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_retrying_one_request_id_charges_once_and_gets_identical_replies() {
    require_grpcio();
    let stubs = std::env::temp_dir().join(format!("idem-grpc-py-{}", std::process::id()));
    std::fs::create_dir_all(&stubs).unwrap();
    generate_stubs(&stubs);

    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("payments")
        .build();
    let service = example::PaymentsService::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(example::serve(idem, service.clone(), listener));

    let stubs_dir = stubs.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", CLIENT, &addr.to_string()])
            .arg(&stubs_dir)
            .env("PYTHONPATH", grpcio_dir())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(&stubs);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "the Python client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(service.charges(), 2, "one charge per payment");
}

#[test]
fn the_example_code_is_generated_from_its_proto() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto = root.join("examples/proto/payments.proto");
    let fds = protox::compile([&proto], [root.join("examples/proto")]).unwrap();
    let out =
        std::env::temp_dir().join(format!("idem-grpc-example-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_fds(fds)
        .unwrap();
    let fresh = std::fs::read_to_string(out.join("payments.v1.rs")).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let kept = std::fs::read_to_string(root.join("examples/pb/payments.v1.rs")).unwrap();
    assert!(
        fresh == kept,
        "examples/pb/payments.v1.rs is stale: regenerate it from {} (copy the fresh output over it)",
        proto.display()
    );
}
