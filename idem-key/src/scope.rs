//! The scope a server layer stores a key under: its own scope plus the
//! request's tenant, and the default tenant, a digest of the request's
//! credentials. Shared by idem's HTTP layer (`idem-http`) and gRPC layer
//! (`idem-grpc`), so both isolate tenants the same way.

use sha2::{Digest, Sha256};
use std::fmt::Write;

/// Longest scope idem-core accepts.
const MAX_SCOPE_LEN: usize = 255;

/// `escape(scope)`, or `escape(scope) "|" escape(tenant)` with a tenant.
///
/// `escape` percent-encodes `%`, `|`, `#` and control characters, so `|`
/// only ever separates the two parts and the mapping is injective: two
/// different (scope, tenant) pairs never give the same string. (idem-core
/// then percent-escapes `:` and `%` of the whole scope, which is injective
/// too.) A tenant too long to fit in the 255-byte scope is replaced by `#`
/// and its SHA-256 in hex; `#` cannot start an escaped tenant.
///
/// ```
/// use idem_key::scope::compose;
/// assert_eq!(compose("http", None), "http");
/// assert_eq!(compose("http", Some("acme")), "http|acme");
/// assert_ne!(compose("a|b", None), compose("a", Some("b")));
/// ```
pub fn compose(scope: &str, tenant: Option<&str>) -> String {
    compose_bytes(scope, tenant.map(str::as_bytes))
}

/// [`compose`] for a tenant given as bytes (a header or metadata value as
/// sent, which need not be UTF-8): a UTF-8 tenant gives exactly what
/// [`compose`] gives, and each byte of the tenant that is not part of valid
/// UTF-8 is written `%XX` (upper-case hex).
///
/// Injective over all byte strings, UTF-8 or not: outside `%XX` triples the
/// escaped form holds no `%`, so reading each `%XX` back as its byte and
/// every other character as its UTF-8 gives the tenant back. So two
/// different tenants never share a scope, and a non-UTF-8 tenant never
/// takes the scope of a UTF-8 one (whose form is unchanged).
///
/// ```
/// use idem_key::scope::{compose, compose_bytes};
/// assert_eq!(compose_bytes("grpc", Some(b"acme")), compose("grpc", Some("acme")));
/// assert_eq!(compose_bytes("grpc", Some(b"acme\xff")), "grpc|acme%FF");
/// assert_ne!(compose_bytes("grpc", Some(b"\xff")), compose_bytes("grpc", Some(b"\xfe")));
/// // The UTF-8 tenant "%FF" is escaped to "%25FF": no collision.
/// assert_ne!(compose_bytes("grpc", Some(b"\xff")), compose("grpc", Some("%FF")));
/// ```
pub fn compose_bytes(scope: &str, tenant: Option<&[u8]>) -> String {
    let mut out = String::with_capacity(scope.len() + tenant.map_or(0, <[u8]>::len) + 1);
    escape_into(&mut out, scope);
    if let Some(tenant) = tenant {
        out.push('|');
        let mark = out.len();
        for chunk in tenant.utf8_chunks() {
            escape_into(&mut out, chunk.valid());
            for b in chunk.invalid() {
                // Writing to a String cannot fail.
                let _ = write!(out, "%{b:02X}");
            }
        }
        if out.len() > MAX_SCOPE_LEN {
            out.truncate(mark);
            out.push('#');
            for b in Sha256::digest(tenant) {
                let _ = write!(out, "{b:02x}");
            }
        }
    }
    out
}

fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        if matches!(c, '%' | '|' | '#') || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
}

/// `cred:` and the first 128 bits of a SHA-256 over `(name, value)` pairs
/// of credential headers (or gRPC metadata), or `None` when there are none.
///
/// The credentials themselves never reach the store, only this digest;
/// each name and value is length-prefixed, so no two sets hash alike. The
/// prefix keeps the digest apart from anything else that could name a
/// tenant.
///
/// ```
/// use idem_key::scope::credentials_tenant;
/// let a = credentials_tenant([("authorization", &b"Bearer a"[..])]).unwrap();
/// assert!(a.starts_with("cred:") && a.len() == 37);
/// assert_ne!(Some(a), credentials_tenant([("authorization", &b"Bearer b"[..])]));
/// assert_eq!(credentials_tenant::<[(&str, &[u8]); 0]>([]), None);
/// ```
pub fn credentials_tenant<'a, I>(pairs: I) -> Option<String>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    let mut hasher: Option<Sha256> = None;
    for (name, value) in pairs {
        let h = hasher.get_or_insert_with(|| {
            let mut h = Sha256::new();
            // The domain separator predates this module (idem-http's):
            // kept, so that stored keys keep their tenants.
            h.update(b"idem-http tenant v1\0");
            h
        });
        h.update((name.len() as u64).to_be_bytes());
        h.update(name.as_bytes());
        h.update((value.len() as u64).to_be_bytes());
        h.update(value);
    }
    let digest = hasher?.finalize();
    let mut out = String::with_capacity(5 + 32);
    out.push_str("cred:");
    for b in digest.iter().take(16) {
        // Writing to a String cannot fail.
        let _ = write!(out, "{b:02x}");
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_never_collide() {
        assert_eq!(compose("http", None), "http");
        assert_eq!(compose("http", Some("acme")), "http|acme");
        assert_ne!(compose("http", Some("")), compose("http", None));
        assert_ne!(compose("a|b", None), compose("a", Some("b")));
        assert_ne!(compose("a", Some("b|c")), compose("a|b", Some("c")));
        assert_ne!(compose("h", Some("a:b")), compose("h:a", Some("b")));
        assert_eq!(compose("h", Some("a%|#\n")), "h|a%25%7C%23%0A");
    }

    #[test]
    fn byte_tenants_keep_utf8_forms_and_never_collide() {
        for t in ["", "acme", "a%|#\n", "é\u{85}", &"t".repeat(400)] {
            assert_eq!(
                compose_bytes("g", Some(t.as_bytes())),
                compose("g", Some(t))
            );
        }
        assert_eq!(compose_bytes("g", Some(b"a\xffb")), "g|a%FFb");
        // A lone continuation byte and the character it belongs to.
        assert_eq!(compose_bytes("g", Some(b"\x85")), "g|%85");
        assert_eq!(compose_bytes("g", Some("\u{85}".as_bytes())), "g|%C2%85");
        let forms: Vec<String> = [&b"\xff"[..], b"\xfe", b"%FF", b"\xc2", b"\xc2\x85", b"\x85"]
            .iter()
            .map(|t| compose_bytes("g", Some(t)))
            .collect();
        for (i, a) in forms.iter().enumerate() {
            for b in forms.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
        let long: Vec<u8> = std::iter::repeat_n(0xffu8, 200).collect();
        let hashed = compose_bytes("g", Some(&long));
        assert!(hashed.starts_with("g|#") && hashed.len() <= MAX_SCOPE_LEN);
    }

    #[test]
    fn long_tenants_are_hashed() {
        let long = "t".repeat(400);
        let s = compose("http", Some(&long));
        assert!(s.len() <= MAX_SCOPE_LEN);
        assert!(s.starts_with("http|#"));
        assert_ne!(s, compose("http", Some(&"t".repeat(401))));
        // An escaped tenant never starts with '#', so it cannot look hashed.
        assert!(compose("http", Some("#abc")).starts_with("http|%23"));
    }

    #[test]
    fn credential_sets_hash_apart() {
        let t = |pairs: &[(&'static str, &'static [u8])]| credentials_tenant(pairs.iter().copied());
        assert_ne!(
            t(&[("authorization", b"a"), ("authorization", b"b")]),
            t(&[("authorization", b"ab")])
        );
        assert_eq!(t(&[("authorization", b"a")]), t(&[("authorization", b"a")]));
    }
}
