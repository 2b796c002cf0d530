//! An AWS Lambda function behind API Gateway (or a function URL): `POST
//! /payments` runs once per `Idempotency-Key`; a retry gets the stored
//! response with `Idempotent-Replayed: true`, a retry while the first runs
//! `409` with `Retry-After`.
//! Cargo.toml: `idem = { version = "0.1", features = ["lambda", "dynamodb"] }`,
//! `aws-config = "1"`, `http = "1"`, `tokio = { version = "1", features = ["macros", "rt-multi-thread"] }`.
use idem::Idempotency;
use idem::dynamodb::{DynamoStore, aws_sdk_dynamodb};
use idem::lambda::http::lambda_http::Error;
use idem::lambda::http::{Body, IdempotencyLayer, Request, run, service_fn};
use std::convert::Infallible;
use std::time::Duration;

async fn create_payment(req: Request) -> Result<http::Response<Body>, Infallible> {
    // … charge the card: runs once per Idempotency-Key …
    let _body = req.into_body();
    let created = http::Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"id":"pay_1"}"#));
    Ok(created.unwrap_or_default())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let aws = aws_config::load_from_env().await;
    let store = DynamoStore::new(
        aws_sdk_dynamodb::Client::new(&aws),
        std::env::var("IDEM_TABLE")?,
    )?;
    let idem = Idempotency::builder(store)
        .namespace("payments")
        .lease(Duration::from_secs(30)) // bounded further by each invocation's deadline
        .build();
    let layer = IdempotencyLayer::new(idem).require_key(true);
    run(layer, service_fn(create_payment)).await
}
