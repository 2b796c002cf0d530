//! idem-lambda's integration tests, one binary (`cargo test -p idem-lambda
//! --test it`): one module per topic.
//!
//! - `batch`: the SQS batch handler on hand-made events over a
//!   `MemoryStore`: each idem decision's place in `batchItemFailures`, the
//!   FIFO group rule, copies in a batch, the deadline rule;
//! - `queue`: real batches received from the local SQS endpoint (moto),
//!   answered, and the answer applied as Lambda's event source mapping
//!   applies it, until the queue drains;
//! - `crash_loop`: the same with worker processes SIGKILLed while the
//!   queue drains, on a Redis store that outlives them;
//! - `http`: API Gateway v1 and v2 events through `lambda_http`'s
//!   conversion and idem-http's layer.
//!
//! moto's own SQS-to-Lambda wiring ignores `batchItemFailures` (it deletes
//! nothing or everything), so these tests are their own event source
//! mapping: `support::apply` deletes every record not listed, and leaves
//! the listed ones to come back after the queue's visibility timeout.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod batch;
mod crash_loop;
mod docs;
mod http;
mod queue;
mod support;
