//! gRPC's length-prefixed messages: a flag byte (1 = compressed), a 4-byte
//! big-endian length, then the message (the gRPC over HTTP/2 spec, "Length-
//! Prefixed-Message"). The layer only counts and slices them: it never
//! decodes a message unless a method reads its key from one.

/// One length-prefixed message of a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Message<'a> {
    pub(crate) compressed: bool,
    pub(crate) bytes: &'a [u8],
}

/// Why a body is not a sequence of whole messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The body ends inside a prefix or a message.
    Truncated,
    /// A flag byte other than 0 or 1.
    BadFlag(u8),
}

/// The messages of a complete body, in order.
pub(crate) fn messages(mut buf: &[u8]) -> Result<Vec<Message<'_>>, FrameError> {
    let mut out = Vec::with_capacity(1);
    while !buf.is_empty() {
        let (head, rest) = buf.split_at_checked(5).ok_or(FrameError::Truncated)?;
        let [flag, a, b, c, d] = <[u8; 5]>::try_from(head).map_err(|_| FrameError::Truncated)?;
        let compressed = match flag {
            0 => false,
            1 => true,
            other => return Err(FrameError::BadFlag(other)),
        };
        let len = u32::from_be_bytes([a, b, c, d]) as usize;
        let (bytes, rest) = rest.split_at_checked(len).ok_or(FrameError::Truncated)?;
        out.push(Message { compressed, bytes });
        buf = rest;
    }
    Ok(out)
}

/// How many whole messages a body prefix holds so far, and whether the
/// prefix ends on a message boundary: the response side counts messages as
/// frames arrive, to tell a unary reply (one) from a stream (more).
pub(crate) fn count_messages(mut buf: &[u8]) -> usize {
    let mut n = 0;
    while let Some([_, a, b, c, d]) = buf.get(..5).and_then(|h| <[u8; 5]>::try_from(h).ok()) {
        let len = u32::from_be_bytes([a, b, c, d]) as usize;
        let Some(rest) = buf.get(5 + len..) else {
            // A message still arriving counts: it is a message all the same.
            return n + 1;
        };
        n += 1;
        buf = rest;
    }
    if buf.is_empty() { n } else { n + 1 }
}

/// Encodes one uncompressed message with its prefix.
#[cfg(test)]
pub(crate) fn encode(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_whole_messages() {
        let mut body = encode(b"abc");
        body.extend(encode(b""));
        let m = messages(&body).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].bytes, b"abc");
        assert_eq!(m[1].bytes, b"");
        assert!(!m[0].compressed);
        assert_eq!(messages(&[]).unwrap(), vec![]);
        assert_eq!(messages(&body[..4]), Err(FrameError::Truncated));
        assert_eq!(messages(&body[..7]), Err(FrameError::Truncated));
        assert_eq!(messages(&[7, 0, 0, 0, 0]), Err(FrameError::BadFlag(7)));
    }

    #[test]
    fn counts_partial_messages() {
        let mut body = encode(b"abc");
        assert_eq!(count_messages(&body), 1);
        assert_eq!(count_messages(&body[..2]), 1);
        body.extend(encode(b"de"));
        assert_eq!(count_messages(&body), 2);
        assert_eq!(count_messages(&body[..9]), 2);
        assert_eq!(count_messages(&[]), 0);
    }
}
