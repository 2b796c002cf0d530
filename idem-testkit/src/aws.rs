//! The local AWS endpoint the DynamoDB, SQS and Lambda tests talk to: moto's
//! server as `cargo xtask setup` starts it (`xtask/aws/moto_server.py`,
//! DynamoDB requests one at a time so a conditional write is atomic per item,
//! as on DynamoDB), at `IDEM_AWS_ENDPOINT` or `http://127.0.0.1:4566`.
//!
//! Every test makes its own tables and queues ([`unique_name`]) and deletes
//! them after; none depends on what the endpoint already holds.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The environment variable naming the local AWS endpoint.
pub const AWS_ENDPOINT_ENV: &str = "IDEM_AWS_ENDPOINT";

/// The local AWS endpoint's URL: `IDEM_AWS_ENDPOINT`, or
/// `http://127.0.0.1:4566`.
///
/// ```
/// assert!(idem_testkit::aws_endpoint().starts_with("http"));
/// ```
pub fn aws_endpoint() -> String {
    std::env::var(AWS_ENDPOINT_ENV).unwrap_or_else(|_| "http://127.0.0.1:4566".to_owned())
}

/// An SDK configuration for the local endpoint: region `us-east-1`, fixed
/// test credentials, no retries (a test sees each request's own answer).
///
/// # Panics
///
/// When nothing answers at the endpoint, saying how to start one: a test
/// that cannot reach its service fails, it never passes silently.
pub async fn aws_config() -> aws_config::SdkConfig {
    let endpoint = aws_endpoint();
    require_endpoint(&endpoint);
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(aws_credential_types::Credentials::new(
            "idem-test",
            "idem-test",
            None,
            None,
            "idem-testkit",
        ))
        .retry_config(aws_config::retry::RetryConfig::disabled())
        .load()
        .await
}

/// A DynamoDB client on the local endpoint.
pub async fn dynamodb_client() -> aws_sdk_dynamodb::Client {
    aws_sdk_dynamodb::Client::new(&aws_config().await)
}

/// An SQS client on the local endpoint.
pub async fn sqs_client() -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::new(&aws_config().await)
}

/// A name no other test (or test process) uses: `<prefix>-<pid>-<n>-<nanos>`,
/// within the 80 characters SQS allows a queue name.
///
/// ```
/// let a = idem_testkit::unique_name("orders");
/// assert!(a.starts_with("orders-"));
/// assert_ne!(a, idem_testkit::unique_name("orders"));
/// ```
pub fn unique_name(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

#[allow(clippy::panic, reason = "a test without its service fails, saying why")]
fn require_endpoint(endpoint: &str) {
    let addr = endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/');
    let reachable = addr
        .parse()
        .ok()
        .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok())
        .is_some()
        || TcpStream::connect(addr).is_ok();
    if !reachable {
        panic!(
            "the local AWS endpoint is not reachable at {endpoint}. These tests need one: \
             `cargo xtask setup` installs and starts moto's server there, or set \
             {AWS_ENDPOINT_ENV} to an endpoint that serves DynamoDB and SQS"
        );
    }
}
