//! The local AWS endpoint the DynamoDB, SQS and Lambda tests talk to: moto's
//! server as `cargo xtask setup` starts it (`xtask/aws/moto_server.py`,
//! DynamoDB requests one at a time so a conditional write is atomic per item,
//! as on DynamoDB), at `IDEM_AWS_ENDPOINT` or `http://127.0.0.1:4566`.
//!
//! Every test makes its own tables and queues ([`unique_name`]) and deletes
//! them after; none depends on what the endpoint already holds.

use crate::spawn::{self, Slot};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
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
    config_for(endpoint, "idem-test", "idem-test").await
}

/// An SDK configuration for `endpoint` with these credentials, as
/// [`aws_config`] makes one.
async fn config_for(endpoint: String, key_id: &str, secret: &str) -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(aws_credential_types::Credentials::new(
            key_id,
            secret,
            None,
            None,
            "idem-testkit",
        ))
        .retry_config(aws_config::retry::RetryConfig::disabled())
        .load()
        .await
}

/// A moto server of the test's own, on a free port, that enforces IAM:
/// it answers its first `free_requests` requests without checking who
/// sends them (moto's `INITIAL_NO_AUTH_ACTION_COUNT`: time for the test to
/// create its tables, users, policies and access keys), then checks every
/// request's credentials and policies as AWS does. The shared endpoint
/// never enforces IAM, so a test of refused credentials needs its own.
/// The server is the one `cargo xtask setup` installs, started by the same
/// wrapper (`xtask/aws/moto_server.py`); it is killed on drop.
#[derive(Debug)]
pub struct IamMoto {
    child: Slot,
    port: u16,
    _dir: tempfile::TempDir,
}

impl IamMoto {
    /// Starts the server and waits until it answers.
    ///
    /// # Panics
    ///
    /// When moto is not installed (saying how to install it) or does not
    /// come up.
    #[allow(clippy::panic, reason = "a test without its service fails, saying why")]
    pub fn start(free_requests: u32) -> IamMoto {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        let moto = home.join(".cache/idem-moto");
        if !moto.join("moto").is_dir() {
            panic!(
                "moto is not installed in {}: `cargo xtask setup` installs it",
                moto.display()
            );
        }
        let wrapper = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../xtask/aws/moto_server.py");
        let dir = tempfile::Builder::new()
            .prefix("idem-moto-iam-")
            .tempdir()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot make a directory for moto: {e}"));
        let log_path = dir.path().join("moto.log");
        let log = std::fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot create moto's log: {e}"));
        let err = log
            .try_clone()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot share moto's log: {e}"));
        let port = crate::free_port();
        let mut cmd = Command::new("python3");
        cmd.arg(&wrapper)
            .arg(port.to_string())
            .env("PYTHONPATH", &moto)
            .env("INITIAL_NO_AUTH_ACTION_COUNT", free_requests.to_string())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        let child = spawn::spawn(cmd)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot run python3 for moto: {e}"));
        let moto = IamMoto {
            child: Slot::default(),
            port,
            _dir: dir,
        };
        moto.child.set(child);
        let what = format!("moto (IAM enforced) on port {port}");
        moto.child
            .wait_ready(&what, Duration::from_secs(60), &log_path, || {
                TcpStream::connect(("127.0.0.1", port)).is_ok()
            });
        moto
    }

    /// The server's URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// An SDK configuration for this server with these credentials (any
    /// for the free requests; an access key the test created after).
    pub async fn config(&self, key_id: &str, secret: &str) -> aws_config::SdkConfig {
        config_for(self.endpoint(), key_id, secret).await
    }

    /// Creates an IAM user whose one policy allows `actions` (e.g.
    /// `"dynamodb:GetItem"`) on every resource, and its access key: three
    /// of the free requests. Returns the key's id and secret.
    ///
    /// # Panics
    ///
    /// When moto refuses a request or its answer has no access key.
    #[allow(clippy::panic, reason = "a test without its service fails, saying why")]
    pub fn user_allowed(&self, user: &str, actions: &[&str]) -> (String, String) {
        let policy = format!(
            r#"{{"Version":"2012-10-17","Statement":[{{"Effect":"Allow","Action":[{}],"Resource":"*"}}]}}"#,
            actions
                .iter()
                .map(|a| format!("\"{a}\""))
                .collect::<Vec<_>>()
                .join(",")
        );
        self.iam(&[("Action", "CreateUser"), ("UserName", user)]);
        self.iam(&[
            ("Action", "PutUserPolicy"),
            ("UserName", user),
            ("PolicyName", "idem-test"),
            ("PolicyDocument", &policy),
        ]);
        let answer = self.iam(&[("Action", "CreateAccessKey"), ("UserName", user)]);
        let field = |name: &str| {
            answer
                .split_once(&format!("<{name}>"))
                .and_then(|(_, rest)| rest.split_once(&format!("</{name}>")))
                .map(|(value, _)| value.to_owned())
                .unwrap_or_else(|| panic!("moto's CreateAccessKey answer has no {name}: {answer}"))
        };
        (field("AccessKeyId"), field("SecretAccessKey"))
    }

    /// One IAM query-API request, unsigned (moto does not check the free
    /// requests; the header only routes it to IAM). Returns the body.
    #[allow(clippy::panic, reason = "a test without its service fails, saying why")]
    fn iam(&self, params: &[(&str, &str)]) -> String {
        use std::io::{Read, Write};
        let mut body = String::from("Version=2010-05-08");
        for (k, v) in params {
            body.push('&');
            body.push_str(k);
            body.push('=');
            for b in v.bytes() {
                if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                    body.push(char::from(b));
                } else {
                    body.push_str(&format!("%{b:02X}"));
                }
            }
        }
        let request = format!(
            "POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: AWS4-HMAC-SHA256 \
             Credential=idem-test/20260101/us-east-1/iam/aws4_request, SignedHeaders=host, \
             Signature=0\r\nContent-Type: application/x-www-form-urlencoded\r\n\
             Content-Length: {len}\r\nConnection: close\r\n\r\n{body}",
            port = self.port,
            len = body.len(),
        );
        let mut answer = String::new();
        let sent = TcpStream::connect(("127.0.0.1", self.port)).and_then(|mut s| {
            s.write_all(request.as_bytes())?;
            s.read_to_string(&mut answer)
        });
        if let Err(e) = sent {
            panic!("moto (IAM enforced) did not answer {params:?}: {e}");
        }
        if !answer.starts_with("HTTP/1.1 200") {
            panic!("moto refused {params:?}: {answer}");
        }
        answer
    }
}

impl Drop for IamMoto {
    fn drop(&mut self) {
        self.child.kill();
    }
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
