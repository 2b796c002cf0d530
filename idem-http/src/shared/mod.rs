//! The pieces of an idempotency layer that do not depend on the protocol
//! above HTTP, shared with `idem-grpc` (gRPC is HTTP/2): the stored exchange
//! and its record format, the settings both layers have, and the steps of
//! one idempotent run. Not part of this crate's API: it may change in any
//! release, in step with `idem-grpc`.

pub mod record;
pub mod settings;
pub mod task;
