//! Owner tokens: who holds a claim.

use std::fmt;

/// A random 128-bit owner token, fresh per claim, written as 32 lowercase hex
/// digits. `complete`, `release` and `extend` act only for the token that
/// holds the record, so a holder that lost its lease cannot overwrite its
/// successor.
///
/// ```
/// use idem_core::store::Token;
/// let (a, b) = (Token::random(), Token::random());
/// assert_ne!(a, b);
/// assert_eq!(a.as_str().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token {
    /// The 128 bits, for stores that keep them raw (PostgreSQL's `bytea`).
    raw: [u8; 16],
    /// The same bits as lowercase hex digits, for stores that keep text
    /// (Redis), kept beside the raw ones so [`Token::as_str`] can borrow.
    hex: [u8; 32],
}

impl Token {
    /// Stands in where no claim is made (a local cache hit): never sent.
    pub(crate) const UNUSED: Token = Token {
        raw: [0; 16],
        hex: [b'0'; 32],
    };

    /// A fresh token from the thread-local CSPRNG.
    ///
    /// ```
    /// let t = idem_core::store::Token::random();
    /// assert!(t.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
    /// ```
    pub fn random() -> Token {
        Token::from_u128(rand::random::<u128>())
    }

    /// A token with the given bits (tests and model checks use fixed tokens).
    ///
    /// ```
    /// assert_eq!(idem_core::store::Token::from_u128(255).as_str(), "000000000000000000000000000000ff");
    /// ```
    pub fn from_u128(bits: u128) -> Token {
        Token::from_raw(bits.to_be_bytes())
    }

    /// A token from its 16 raw bytes (as [`Token::as_raw`] gives them, most
    /// significant first), for stores that keep tokens as bytes.
    ///
    /// ```
    /// use idem_core::store::Token;
    /// let t = Token::random();
    /// assert_eq!(Token::from_raw(*t.as_raw()), t);
    /// assert_eq!(Token::from_raw([0xab; 16]).as_str(), "ab".repeat(16));
    /// ```
    pub fn from_raw(raw: [u8; 16]) -> Token {
        let mut hex = [0u8; 32];
        // 32 digits for 16 bytes: the lengths always agree, so this
        // cannot fail.
        let _ = hex::encode_to_slice(raw, &mut hex);
        Token { raw, hex }
    }

    /// The token's 16 raw bytes, most significant first: what a store that
    /// keeps bytes rather than hex digits writes and compares.
    ///
    /// ```
    /// let t = idem_core::store::Token::from_u128(0x0102);
    /// assert_eq!(t.as_raw()[14..], [1, 2]);
    /// ```
    pub fn as_raw(&self) -> &[u8; 16] {
        &self.raw
    }

    /// The 32 hex digits.
    ///
    /// ```
    /// assert_eq!(idem_core::store::Token::from_u128(1).as_str().len(), 32);
    /// ```
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever written into the array.
        std::str::from_utf8(&self.hex).unwrap_or_default()
    }

    /// The 32 hex digits as bytes (the raw bytes are [`Token::as_raw`]).
    ///
    /// ```
    /// assert_eq!(idem_core::store::Token::from_u128(0).as_bytes(), &[b'0'; 32]);
    /// ```
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.hex
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", self.as_str())
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Token;

    #[test]
    fn digits_and_raw_bytes_spell_the_same_bits() {
        for bits in [
            0,
            1,
            0xff,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            let t = Token::from_u128(bits);
            assert_eq!(t.as_str(), format!("{bits:032x}"));
            assert_eq!(*t.as_raw(), bits.to_be_bytes());
            assert_eq!(Token::from_raw(*t.as_raw()), t);
        }
        assert_eq!(Token::UNUSED, Token::from_u128(0));
    }
}
