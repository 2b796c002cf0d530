//! The error type test bodies return, and the classes of idem errors that
//! fault tests accept.

use idem_core::Error;

/// What a test body fails with: idem's own errors (the `From` idem needs),
/// or a failure of the body itself.
#[derive(Debug)]
pub enum BodyError {
    /// An error from idem (claim refused, store unavailable, ...).
    Idem(Error),
    /// The body's own failure, with a message to match on.
    Boom(String),
}

impl From<Error> for BodyError {
    fn from(e: Error) -> Self {
        BodyError::Idem(e)
    }
}

impl BodyError {
    /// The idem error inside, if this is one.
    pub fn idem(&self) -> Option<&Error> {
        match self {
            BodyError::Idem(e) => Some(e),
            BodyError::Boom(_) => None,
        }
    }
}

/// True for [`Error::Unavailable`].
pub fn is_unavailable(e: &Error) -> bool {
    matches!(e, Error::Unavailable { .. })
}

/// True for the errors a caller may legitimately get while the store is
/// faulty: the store is unreachable, or another (live) holder has the key.
pub fn is_typed_store_error(e: &Error) -> bool {
    matches!(e, Error::Unavailable { .. } | Error::InProgress { .. })
}
