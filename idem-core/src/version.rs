//! Result versions: the version a stored result carries, and what a call
//! does with a stored result of another version ([`VersionRule`]).
//!
//! See docs/semantics.md, "Result versions", for the table of what each
//! rule does with an older and a newer record.

use crate::error::Error;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::sync::Arc;

/// An upgrade, erased of its type: the stored JSON and its version in,
/// the current type's JSON out.
type ErasedUpgrade =
    dyn Fn(serde_json::Value, u32) -> Result<serde_json::Value, Error> + Send + Sync;

/// A typed upgrade function.
type Upgrade<T> = dyn Fn(serde_json::Value, u32) -> Result<T, Error> + Send + Sync;

/// What a call does with a stored result whose version is not its own
/// ([`Call::result_version`](crate::Call::result_version)). A result of
/// the call's own version is always decoded as it is.
///
/// | rule | older record (stored < current) | newer record (stored > current: a rolling deploy, a rollback) |
/// | --- | --- | --- |
/// | [`Decode`](VersionRule::Decode) (the default) | decoded as the current type (serde defaults fill new fields) | decoded as the current type (unknown fields are ignored) |
/// | [`Upgrade`](VersionRule::Upgrade) | the function gets the stored JSON and its version, returns the current type | decoded as the current type, as `Decode` |
/// | [`Reject`](VersionRule::Reject) | [`Error::ResultVersion`] with the stored JSON | [`Error::ResultVersion`] with the stored JSON |
///
/// Under every rule the body is **not** run again and the record is
/// neither released nor rewritten: a decode that fails answers
/// [`Error::Codec`] and leaves the record for a reader that can read it
/// (the process of the other version, during a rolling deploy).
///
/// ```
/// use idem_core::{Error, Idempotency, MemoryStore, VersionRule};
/// use serde::{Deserialize, Serialize};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
///
/// // Version 0 stored a bare amount in cents.
/// let _: u64 = idem.call("charge", "o-1").run(|| async { Ok::<_, Error>(500) }).await?;
///
/// // Version 1 stores a receipt; version-0 records are upgraded.
/// #[derive(Serialize, Deserialize, Debug, PartialEq)]
/// struct Receipt { cents: u64, currency: String }
/// let upgrade = VersionRule::upgrade(|json, _stored| {
///     let cents = json.as_u64().ok_or_else(|| Error::codec("not an amount"))?;
///     Ok(Receipt { cents, currency: "EUR".into() })
/// });
/// let r: Receipt = idem
///     .call("charge", "o-1")
///     .result_version(1)
///     .on_other_version(upgrade)
///     .run(|| async { Err(Error::codec("a replay never runs the body")) })
///     .await?;
/// assert_eq!(r, Receipt { cents: 500, currency: "EUR".into() });
/// # Ok::<(), Error>(()) }).unwrap();
/// ```
#[derive(Default)]
#[non_exhaustive]
pub enum VersionRule<T> {
    /// Decode the stored JSON as the current type, as a call without
    /// versions does: serde's defaults (`#[serde(default)]`, `Option`
    /// fields) fill what an older record lacks, and fields a newer record
    /// has are ignored (never put `#[serde(deny_unknown_fields)]` on a
    /// stored type: a rollback must read the records of the newer build).
    /// A stored JSON that does not fit answers [`Error::Codec`].
    #[default]
    Decode,
    /// Convert an **older** record: the function gets the stored JSON and
    /// the version it was stored with, and returns the current type (or an
    /// error, returned as the call's). A **newer** record is decoded as
    /// with [`Decode`](VersionRule::Decode): an upgrade knows only the
    /// versions that came before it. Build it with
    /// [`VersionRule::upgrade`].
    Upgrade(Arc<Upgrade<T>>),
    /// Answer [`Error::ResultVersion`], carrying the stored JSON and both
    /// versions, for the handler to answer from (a 409, a "retry later"
    /// while a deploy rolls out).
    Reject,
}

impl<T> VersionRule<T> {
    /// The [`Upgrade`](VersionRule::Upgrade) rule with `f`.
    ///
    /// ```
    /// let rule = idem_core::VersionRule::upgrade(|json, version| {
    ///     Ok(format!("v{version}: {json}"))
    /// });
    /// # let _ = rule;
    /// ```
    pub fn upgrade<F>(f: F) -> VersionRule<T>
    where
        F: Fn(serde_json::Value, u32) -> Result<T, Error> + Send + Sync + 'static,
    {
        VersionRule::Upgrade(Arc::new(f))
    }

    /// The rule's name: `decode`, `upgrade` or `reject`.
    ///
    /// ```
    /// assert_eq!(idem_core::VersionRule::<u8>::Reject.name(), "reject");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            VersionRule::Decode => "decode",
            VersionRule::Upgrade(_) => "upgrade",
            VersionRule::Reject => "reject",
        }
    }
}

impl<T> Clone for VersionRule<T> {
    fn clone(&self) -> Self {
        match self {
            VersionRule::Decode => VersionRule::Decode,
            VersionRule::Upgrade(f) => VersionRule::Upgrade(f.clone()),
            VersionRule::Reject => VersionRule::Reject,
        }
    }
}

impl<T> fmt::Debug for VersionRule<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A result type that declares its version and its rule once, for every
/// call that stores it: [`Call::versioned`](crate::Call::versioned) sets
/// both. Bump [`VERSION`](Versioned::VERSION) when the stored JSON of the
/// type changes in a way its serde defaults do not cover.
///
/// Do not use `std::any::type_name` as a version: it is not stable
/// between compilers nor between refactors of the module tree.
///
/// ```
/// use idem_core::{Error, Idempotency, MemoryStore, Versioned, VersionRule};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, Debug, PartialEq)]
/// struct Receipt { id: String, #[serde(default)] fee: u64 }
///
/// impl Versioned for Receipt {
///     const VERSION: u32 = 2;
///     fn on_other_version() -> VersionRule<Self> { VersionRule::Reject }
/// }
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let _: u32 = idem.call("charge", "o-1").run(|| async { Ok::<_, Error>(1) }).await?;
/// let r: Result<Receipt, Error> = idem
///     .call("charge", "o-1")
///     .versioned::<Receipt>()
///     .run(|| async { Err(Error::codec("not run again")) })
///     .await;
/// assert!(matches!(r, Err(Error::ResultVersion { stored: 0, current: 2, .. })));
/// # Ok::<(), Error>(()) }).unwrap();
/// ```
pub trait Versioned: Serialize + DeserializeOwned + 'static {
    /// The version this build stores and reads as its own.
    const VERSION: u32;

    /// What calls of this type do with a result of another version
    /// ([`VersionRule::Decode`] unless overridden).
    fn on_other_version() -> VersionRule<Self> {
        VersionRule::Decode
    }
}

/// A [`VersionRule`] as a call keeps it, erased of its type.
#[derive(Clone, Default)]
pub(crate) enum ReadRule {
    #[default]
    Decode,
    Upgrade(Arc<ErasedUpgrade>),
    Reject,
}

impl ReadRule {
    /// `rule` erased: an upgrade's value is turned back into JSON, which
    /// the call decodes as its type (a round trip only on the upgrade path).
    pub(crate) fn of<T: Serialize + 'static>(rule: VersionRule<T>) -> ReadRule {
        match rule {
            VersionRule::Decode => ReadRule::Decode,
            VersionRule::Reject => ReadRule::Reject,
            VersionRule::Upgrade(f) => ReadRule::Upgrade(Arc::new(move |json, stored| {
                let value = f(json, stored)?;
                serde_json::to_value(&value).map_err(|e| {
                    Error::codec(format!(
                        "the upgrade of a version-{stored} result returned a value that cannot \
                         be serialized: {e}; fix the type's Serialize impl"
                    ))
                    .with_source(e)
                })
            })),
        }
    }
}

impl fmt::Debug for ReadRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReadRule::Decode => "decode",
            ReadRule::Upgrade(_) => "upgrade",
            ReadRule::Reject => "reject",
        })
    }
}
