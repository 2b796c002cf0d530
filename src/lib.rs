//! placeholder
pub use idem_core::*;
pub use idem_macros::idempotent;
