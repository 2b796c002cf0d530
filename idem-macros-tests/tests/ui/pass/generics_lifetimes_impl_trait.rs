use idem::{idempotent, Idempotency, MemoryStore};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::borrow::Cow;
use std::fmt::Display;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct Repo<'a, T> {
    idem: &'a Idempotency,
    prefix: &'a str,
    default: T,
}

impl<'a, T: Clone + Serialize + DeserializeOwned + Send> Repo<'a, T> {
    #[idempotent(key = format!("{}/{}", self.prefix, id), using = self.idem)]
    pub async fn get<'b>(&'b self, id: &'b str, note: impl Display + Send) -> Result<T, Error> {
        let _ = note.to_string();
        Ok(self.default.clone())
    }
}

#[idempotent(key = name, using = idem)]
pub async fn greet<'a, N: Display + ?Sized>(idem: &'a Idempotency, name: &'a N) -> Result<Cow<'static, str>, Error> {
    Ok(Cow::Owned(format!("hello {name}")))
}

#[idempotent(key = key, using = idem, fingerprint = value)]
pub async fn generic<K: Display, V: Serialize + Clone + DeserializeOwned>(idem: &Idempotency, key: K, value: V) -> Result<Vec<V>, Error> {
    Ok(vec![value.clone(), value])
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let repo = Repo { idem: &idem, prefix: "p", default: 5u8 };
    assert_eq!(repo.get("a", 1).await.unwrap(), 5);
    assert_eq!(greet(&idem, "bob").await.unwrap(), "hello bob");
    assert_eq!(generic(&idem, 1, "x".to_string()).await.unwrap(), ["x", "x"]);
}
