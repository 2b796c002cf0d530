//! The canonical form of plain JSON, written by a scan of the bytes: what
//! most producers send (no escape in any string, integers only) needs no
//! serde visit per value. Anything else (an escape, a control character,
//! a float, `-0`, an integer of 19 digits or more, deep nesting) is left to
//! [`canon`](super::canon), which decides; so is every document this scan
//! would reject, errors included.
//!
//! For the documents it takes, the bytes are those [`canon`](super::canon)
//! writes: a plain string or integer is written back as it came, and
//! objects are put in order by the same [`write_in_order`].

use super::order::{Entry, write_in_order};

/// How deep the scan follows nesting: well inside serde_json's limit (128),
/// so whatever it takes the parser takes too.
const MAX_DEPTH: usize = 64;

/// Appends the canonical form of `payload` to `out` when the whole document
/// is plain; otherwise says so, with `out` and `entries` left in any state.
pub(super) fn canonical_into(out: &mut Vec<u8>, entries: &mut Vec<Entry>, payload: &[u8]) -> bool {
    // serde_json writes every byte of 0x80 and above as it came, once the
    // string is UTF-8: checked once for the whole document.
    if !payload.is_ascii() && std::str::from_utf8(payload).is_err() {
        return false;
    }
    let mut scan = Scan {
        p: payload,
        at: 0,
        out,
        entries,
    };
    scan.value(0).is_some() && {
        scan.skip_whitespace();
        scan.at == payload.len()
    }
}

struct Scan<'p, 'o> {
    p: &'p [u8],
    at: usize,
    out: &'o mut Vec<u8>,
    /// Each entry of the objects being written: its key (in `p`, where a
    /// plain key is its own unescaped form) and where it was written.
    entries: &'o mut Vec<Entry>,
}

impl Scan<'_, '_> {
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.p.get(self.at) {
            self.at += 1;
        }
    }

    /// Skips whitespace, then takes `byte` if it is next.
    fn eat(&mut self, byte: u8) -> bool {
        self.skip_whitespace();
        let next = self.p.get(self.at) == Some(&byte);
        if next {
            self.at += 1;
        }
        next
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        self.skip_whitespace();
        match self.p.get(self.at)? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => {
                let s = self.string()?;
                self.out.extend_from_slice(&self.p[s.start - 1..s.end + 1]);
                Some(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.integer(),
            _ => None,
        }
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.at += 1;
        self.out.push(b'{');
        if self.eat(b'}') {
            self.out.push(b'}');
            return Some(());
        }
        let body = self.out.len();
        // This object's entries are those above `base`.
        let base = self.entries.len();
        let mut in_order = true;
        loop {
            self.skip_whitespace();
            if self.p.get(self.at) != Some(&b'"') {
                return None;
            }
            if self.entries.len() > base {
                self.out.push(b',');
            }
            let start = self.out.len();
            let key = self.string()?;
            if let Some((previous, _)) = self.entries[base..].last() {
                // Strictly increasing: sorted, and no key twice.
                in_order &= self.p[previous.clone()] < self.p[key.clone()];
            }
            self.out
                .extend_from_slice(&self.p[key.start - 1..key.end + 1]);
            if !self.eat(b':') {
                return None;
            }
            self.out.push(b':');
            self.value(depth)?;
            self.entries.push((key, start..self.out.len()));
            if self.eat(b'}') {
                break;
            }
            if !self.eat(b',') {
                return None;
            }
        }
        if !in_order {
            write_in_order(self.out, body, self.p, &mut self.entries[base..]);
        }
        self.entries.truncate(base);
        self.out.push(b'}');
        Some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.at += 1;
        self.out.push(b'[');
        if !self.eat(b']') {
            loop {
                self.value(depth)?;
                if self.eat(b']') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
                self.out.push(b',');
            }
        }
        self.out.push(b']');
        Some(())
    }

    /// A string with nothing serde_json would write otherwise (no escape,
    /// no control character), `at` on its opening quote: its contents.
    fn string(&mut self) -> Option<std::ops::Range<usize>> {
        let start = self.at + 1;
        let len = self
            .p
            .get(start..)?
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
        if self.p[start + len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        Some(start..start + len)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at + word.len();
        (self.p.get(self.at..end) == Some(word)).then(|| {
            self.out.extend_from_slice(word);
            self.at = end;
        })
    }

    /// An integer serde_json reads as a `u64` or `i64` and writes back digit
    /// for digit: `0`, or up to 18 digits with no leading zero, signed or
    /// not.
    fn integer(&mut self) -> Option<()> {
        let signed = self.p.get(self.at) == Some(&b'-');
        let digits = self.at + usize::from(signed);
        let n = self
            .p
            .get(digits..)?
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        let plain = match self.p.get(digits)? {
            b'0' => n == 1 && !signed,
            b'1'..=b'9' => n <= 18,
            _ => false,
        };
        let end = digits + n;
        if !plain || matches!(self.p.get(end), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        self.out.extend_from_slice(&self.p[self.at..end]);
        self.at = end;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    fn plain(text: &str) -> Option<String> {
        let mut out = Vec::new();
        super::canonical_into(&mut out, &mut Vec::new(), text.as_bytes())
            .then(|| String::from_utf8_lossy(&out).into_owned())
    }

    #[test]
    fn what_producers_send_is_taken() {
        for (text, canonical) in [
            (
                r#"{"order":"o-1-5","amount":5}"#,
                r#"{"amount":5,"order":"o-1-5"}"#,
            ),
            (
                "{ \"b\" : [ 1 , -2 , true , false , null , { } ] ,\n\t\"a\" : { \"y\" : \"é 😀 /\" , \"x\" : [ ] } }\r\n",
                r#"{"a":{"x":[],"y":"é 😀 /"},"b":[1,-2,true,false,null,{}]}"#,
            ),
            (r#"{"b":1,"a":2,"b":3}"#, r#"{"a":2,"b":3}"#),
            (r#" "plain" "#, r#""plain""#),
            ("0", "0"),
            ("-123456789012345678", "-123456789012345678"),
        ] {
            assert_eq!(plain(text).as_deref(), Some(canonical), "{text}");
        }
    }

    #[test]
    fn what_it_is_unsure_of_goes_the_long_way() {
        for text in [
            r#"{"a":"\u00e9"}"#,
            r#"{"a":"\/"}"#,
            r#"{"a":1.5}"#,
            r#"{"a":1e3}"#,
            "-0",
            "01",
            "1234567890123456789",
            "[1,]",
            "{,}",
            r#"{"a"}"#,
            r#"{"a":1,}"#,
            "tru",
            "",
            "  ",
            "\"a\u{1}\"",
            "{} x",
            &format!("{}{}", "[".repeat(65), "]".repeat(65)),
        ] {
            assert_eq!(plain(text), None, "{text}");
        }
        let mut out = Vec::new();
        assert!(!super::canonical_into(
            &mut out,
            &mut Vec::new(),
            b"\"\xff\""
        ));
    }
}
