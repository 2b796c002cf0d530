//! Where keys come from (metadata, AIP-155 `request_id`, AEP-155
//! `idempotency_key.key`), which are refused, tenants, and methods the
//! layer does not protect.

use crate::support::pb::{CreateOrderRequest, CreatePaymentRequest, IdempotencyKey};
use crate::support::{CREATE_ORDER, CREATE_PAYMENT, TestServer, WATCH, payment, slug, with_key};
use idem_grpc::{IdempotencyLayer, UnaryMethod};
use idem_testkit::TestContext;
use tonic::Code;

fn field_keyed(idem: idem_core::Idempotency) -> IdempotencyLayer {
    IdempotencyLayer::new(idem)
        .method(
            UnaryMethod::new(CREATE_PAYMENT)
                .key_from_request(|r: &CreatePaymentRequest| Some(r.request_id.clone())),
        )
        .method(
            UnaryMethod::new(CREATE_ORDER).key_from_request(|r: &CreateOrderRequest| {
                Some(r.idempotency_key.as_ref()?.key.clone())
            }),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aip_155_request_id_and_aep_155_idempotency_key_are_keys() {
    let ctx = TestContext::redis().await.with_namespace("grpc-field");
    let server = TestServer::start(field_keyed(ctx.idem()), ctx.ledger().clone()).await;
    let mut client = server.client().await;
    let mut m = payment(300);
    m.request_id = "3f2a6b1e-0000-4000-8000-000000000001".into();
    let a = client.create_payment(m.clone()).await.unwrap();
    let b = client.create_payment(m.clone()).await.unwrap();
    assert_eq!((a.get_ref().run, b.get_ref().run), (1, 1));
    assert_eq!(b.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(server.ledger.count(&m.request_id), 1);

    let order = CreateOrderRequest {
        idempotency_key: Some(IdempotencyKey {
            key: "order-key-1".into(),
            first_sent: 1_700_000_000,
        }),
        item: "book".into(),
    };
    let a = client.create_order(order.clone()).await.unwrap();
    let b = client.create_order(order.clone()).await.unwrap();
    assert_eq!((a.get_ref().run, b.get_ref().run), (1, 1));
    assert_eq!(b.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(server.ledger.count("order-key-1"), 1);

    // Same request_id, another amount: reused.
    let mut other = m.clone();
    other.amount_cents = 301;
    let s = client.create_payment(other).await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert_eq!(slug(&s).as_deref(), Some("key-reused"));

    // No request_id: runs unprotected (the key is optional by default).
    client.create_payment(payment(1)).await.unwrap();
    client.create_payment(payment(1)).await.unwrap();
    assert_eq!(server.ledger.count(""), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_and_missing_keys_are_invalid_argument_and_nothing_runs() {
    let ctx = TestContext::redis().await.with_namespace("grpc-badkey");
    let server = TestServer::start(
        field_keyed(ctx.idem())
            .unary("/idem.test.v1.Payments/Other")
            .require_key(true),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    let mut m = payment(1);
    m.request_id = "tab\there".into();
    let s = client.create_payment(m).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(slug(&s).as_deref(), Some("invalid-key"));

    let mut m = payment(1);
    m.request_id = "k".repeat(256);
    let s = client.create_payment(m).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().contains("255"), "{s:?}");

    let s = client.create_payment(payment(1)).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(slug(&s).as_deref(), Some("missing-key"));
    assert_eq!(server.ledger.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_metadata_keys_are_invalid_argument() {
    let ctx = TestContext::redis().await.with_namespace("grpc-mdkey");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    for bad in ["\"unterminated", "a b", "\"\""] {
        let a = raw
            .call(CREATE_PAYMENT, &[("idempotency-key", bad)], &payment(1))
            .await;
        assert_eq!(a.grpc_status().as_deref(), Some("3"), "{bad}: {a:?}");
        assert_eq!(a.headers["idem-error"], "invalid-key");
    }
    let a = raw
        .call(
            CREATE_PAYMENT,
            &[("idempotency-key", "a"), ("idempotency-key", "b")],
            &payment(1),
        )
        .await;
    assert_eq!(a.grpc_status().as_deref(), Some("3"));
    // The quoted and bare forms are one key.
    let a = raw
        .call(CREATE_PAYMENT, &[("idempotency-key", "same")], &payment(1))
        .await;
    let b = raw
        .call(
            CREATE_PAYMENT,
            &[("idempotency-key", "\"same\"")],
            &payment(1),
        )
        .await;
    assert!(!a.replayed() && b.replayed());
    assert_eq!(server.ledger.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_sent_to_a_streaming_or_undeclared_method_is_refused_never_run_unprotected() {
    let ctx = TestContext::redis().await.with_namespace("grpc-stream");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    let s = client.watch(with_key(payment(1), "w-1")).await.unwrap_err();
    assert_eq!(s.code(), Code::Unimplemented);
    assert_eq!(slug(&s).as_deref(), Some("not-unary"));
    assert!(s.message().contains(WATCH), "{s:?}");
    let s = client
        .create_order(with_key(CreateOrderRequest::default(), "o-1"))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unimplemented);
    assert_eq!(server.ledger.total(), 0);
    // Without a key they are not the layer's business.
    let mut stream = client.watch(payment(1)).await.unwrap().into_inner();
    let mut n = 0;
    while stream.message().await.unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_method_declared_unary_streams_once_and_is_not_kept() {
    let ctx = TestContext::redis()
        .await
        .with_namespace("grpc-misdeclared");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(WATCH),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    let mut stream = client
        .watch(with_key(payment(1), "w"))
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while stream.message().await.unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, 3, "the stream reaches the client whole");
    let s = client.watch(with_key(payment(1), "w")).await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert_eq!(slug(&s).as_deref(), Some("response-not-kept"));
    assert_eq!(server.ledger.count("w"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_credential_has_its_own_key_space() {
    let ctx = TestContext::redis().await.with_namespace("grpc-tenant");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    let a = raw
        .call(
            CREATE_PAYMENT,
            &[("idempotency-key", "t"), ("authorization", "Bearer a")],
            &payment(1),
        )
        .await;
    let b = raw
        .call(
            CREATE_PAYMENT,
            &[("idempotency-key", "t"), ("authorization", "Bearer b")],
            &payment(2),
        )
        .await;
    assert_eq!(a.grpc_status().as_deref(), Some("0"));
    assert_eq!(
        b.grpc_status().as_deref(),
        Some("0"),
        "B's other message under A's key is B's own operation"
    );
    assert!(!b.replayed());
    assert_eq!(server.ledger.count("t"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_a_declared_method_runs_unprotected_unless_a_key_is_required() {
    let ctx = TestContext::redis().await.with_namespace("grpc-nokey");
    let optional = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = optional.client().await;
    for run in 1..=2u64 {
        let r = client.create_payment(payment(7)).await.unwrap();
        assert_eq!(r.get_ref().run, run);
    }
    let required = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .require_key(true),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = required.client().await;
    let s = client.create_payment(payment(7)).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert_eq!(slug(&s).as_deref(), Some("missing-key"));
    assert!(s.message().contains("idempotency-key"), "{s:?}");
    assert_eq!(ctx.ledger().total(), 2);
}

/// On a method keyed by a request field, the `idempotency-key` metadata
/// entry is ignored: an over-long or doubled entry next to a valid
/// `request_id` neither refuses the first call nor its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_keyed_method_ignores_the_metadata_entry() {
    let ctx = TestContext::redis().await.with_namespace("grpc-field-md");
    let server = TestServer::start(field_keyed(ctx.idem()), ctx.ledger().clone()).await;
    let raw = server.raw();
    let long = "k".repeat(300);
    let entries: [&[(&str, &str)]; 2] = [
        &[("idempotency-key", long.as_str())],
        &[("idempotency-key", "a"), ("idempotency-key", "b")],
    ];
    for (i, metadata) in entries.into_iter().enumerate() {
        let mut m = payment(10);
        m.request_id = format!("3f2a6b1e-0000-4000-8000-00000000010{i}");
        let first = raw.call(CREATE_PAYMENT, metadata, &m).await;
        assert_eq!(first.grpc_status().as_deref(), Some("0"), "{first:?}");
        assert!(!first.replayed());
        let again = raw.call(CREATE_PAYMENT, metadata, &m).await;
        assert_eq!(again.grpc_status().as_deref(), Some("0"), "{again:?}");
        assert!(again.replayed(), "the retry replays: {again:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(server.ledger.total(), 2);
}

/// A tenant read from a metadata entry is its exact bytes: two different
/// non-UTF-8 values are two tenants, so one never gets the other's reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_utf8_tenant_values_are_distinct_tenants() {
    let ctx = TestContext::redis()
        .await
        .with_namespace("grpc-tenant-bytes");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .tenant_from_metadata(http::HeaderName::from_static("x-tenant")),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    let as_tenant = |tenant: &'static [u8]| {
        let raw = raw.clone();
        async move {
            raw.call_bytes(
                CREATE_PAYMENT,
                &[("idempotency-key", b"t-1"), ("x-tenant", tenant)],
                &payment(1),
            )
            .await
        }
    };
    let a = as_tenant(b"acme\xff").await;
    let b = as_tenant(b"acme\xfe").await;
    assert_eq!(a.grpc_status().as_deref(), Some("0"));
    assert_eq!(b.grpc_status().as_deref(), Some("0"));
    assert!(!b.replayed(), "another tenant's reply was replayed: {b:?}");
    assert_eq!(server.ledger.count("t-1"), 2);
    let a2 = as_tenant(b"acme\xff").await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    assert_eq!(server.ledger.count("t-1"), 2);
}

/// A `-bin` tenant entry is its decoded bytes: the padded and unpadded
/// base64 forms of one value are one tenant, other values other tenants,
/// and a value that is not base64 is refused before the handler runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bin_tenant_is_its_decoded_bytes() {
    let ctx = TestContext::redis().await.with_namespace("grpc-tenant-bin");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .tenant_from_metadata(http::HeaderName::from_static("x-tenant-bin")),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    let call = |tenant: &'static str| {
        let raw = raw.clone();
        async move {
            raw.call(
                CREATE_PAYMENT,
                &[("idempotency-key", "b-1"), ("x-tenant-bin", tenant)],
                &payment(1),
            )
            .await
        }
    };
    // "YWI=" and "YWI" are both b"ab".
    let padded = call("YWI=").await;
    let unpadded = call("YWI").await;
    assert_eq!(padded.grpc_status().as_deref(), Some("0"));
    assert!(!padded.replayed());
    assert!(unpadded.replayed(), "one value, one tenant: {unpadded:?}");
    assert_eq!(unpadded.body, padded.body);
    let other = call("YWM=").await;
    assert!(!other.replayed());
    assert_eq!(server.ledger.count("b-1"), 2);
    // Not base64: refused, never a tenant of its own raw bytes.
    let bad = call("!!").await;
    assert_eq!(bad.grpc_status().as_deref(), Some("3"), "{bad:?}");
    assert_eq!(bad.headers["idem-error"], "invalid-tenant");
    assert_eq!(server.ledger.count("b-1"), 2);
}
