use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

// Type errors in the body point at the body, as without the attribute.
#[idempotent(key = id)]
pub async fn charge(id: u64) -> Result<String, Error> {
    if id == 0 {
        return Ok(0);
    }
    Ok(id)
}

fn main() {}
