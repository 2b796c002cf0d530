use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct Service {
    pub idem: Option<idem::Idempotency>,
}

impl Service {
    #[idempotent(key = id, using = self.idem)]
    pub async fn charge(&self, id: u64) -> Result<u64, Error> {
        Ok(id)
    }
}

fn main() {}
