//! The grammar both ways: every key `encode` accepts, `decode` gives back;
//! every key it refuses, no header form of it is accepted; and the string
//! form agrees with an independent RFC 9651 parser (sfv).

use idem_key::{KeyError, MAX_KEY_LEN, decode, encode, validate};
use sfv::{BareItem, Item, Parser};

/// Keys at every edge of the grammar, valid or not.
fn cases() -> Vec<String> {
    let mut keys: Vec<String> = [
        "a",
        "abc",
        "5f0c7a3e-1c2b-4d5e-8f90-0123456789ab",
        "a b",
        " a ",
        " a",
        "a ",
        "\"",
        "\"abc",
        "abc\"",
        "a\"b",
        "a\\b",
        "\\",
        "\\\"",
        "\"\"",
        "~!#$%&'()*+,-./:;<=>?@[]^_`{|}",
        "a;b=1",
        "(a)",
        "",
        " ",
        "   ",
        "\t",
        "a\tb",
        "a\nb",
        "\u{7f}",
        "é",
        "ключ",
        "a\u{0}b",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    keys.push("k".repeat(MAX_KEY_LEN));
    keys.push("k".repeat(MAX_KEY_LEN + 1));
    keys.push(format!("\"{}", "k".repeat(MAX_KEY_LEN - 1)));
    keys.push(" ".repeat(MAX_KEY_LEN - 1) + "x");
    // Every printable ASCII character alone and inside a key.
    for b in 0x20u8..=0x7e {
        keys.push(char::from(b).to_string());
        keys.push(format!("x{}y", char::from(b)));
    }
    keys
}

/// Every header text that could carry `key`: bare, quoted, quoted with
/// everything escaped that may be.
fn header_forms(key: &str) -> Vec<String> {
    let quoted = |k: &str| {
        let mut s = String::from("\"");
        for c in k.chars() {
            if matches!(c, '"' | '\\') {
                s.push('\\');
            }
            s.push(c);
        }
        s.push('"');
        s
    };
    vec![key.to_owned(), quoted(key)]
}

#[test]
fn encode_then_decode_gives_the_key_back() {
    for key in cases() {
        match encode(&key) {
            Ok(header) => {
                assert_eq!(
                    decode(header.as_bytes()).as_deref(),
                    Ok(key.as_str()),
                    "{key:?} sent as {header:?}"
                );
                // The quoted form is the same key too.
                let quoted = header_forms(&key).pop().unwrap();
                assert_eq!(
                    decode(quoted.as_bytes()).as_deref(),
                    Ok(key.as_str()),
                    "{key:?} quoted"
                );
            }
            Err(e) => {
                assert_eq!(validate(&key), Err(e.clone()));
                // Refused by the client: no form of it gets through the server as this key.
                for form in header_forms(&key) {
                    assert_ne!(
                        decode(form.as_bytes()).as_deref(),
                        Ok(key.as_str()),
                        "{key:?} as {form:?}: {e}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_server_accepts_only_keys_the_client_could_send() {
    for key in cases() {
        for form in header_forms(&key) {
            if let Ok(decoded) = decode(form.as_bytes()) {
                let resent = encode(&decoded).unwrap_or_else(|e| {
                    panic!("{form:?} decodes to {decoded:?}, which encode refuses: {e}")
                });
                assert_eq!(decode(resent.as_bytes()).as_deref(), Ok(decoded.as_str()));
            }
        }
    }
}

#[test]
fn the_string_form_is_rfc_9651() {
    for key in cases() {
        let Ok(header) = encode(&key) else { continue };
        let quoted = header_forms(&key).pop().unwrap();
        for form in [header.to_string(), quoted] {
            if !form.starts_with('"') {
                continue;
            }
            let item: Item = Parser::new(&form)
                .parse()
                .unwrap_or_else(|e| panic!("sfv refuses {form:?}: {e}"));
            match item.bare_item {
                BareItem::String(s) => assert_eq!(s.as_str(), key, "{form:?}"),
                other => panic!("{form:?} parsed as {other:?}"),
            }
            assert!(item.params.is_empty());
        }
    }
    // And what sfv refuses as a string, decode refuses too.
    for bad in [r#""a"#, r#""a\nb""#, r#""a\"#, "\"a\u{7f}\"", r#""a" b"#] {
        assert!(Parser::new(bad).parse::<Item>().is_err(), "{bad:?}");
        assert!(decode(bad.as_bytes()).is_err(), "{bad:?}");
    }
}

#[test]
fn errors_are_precise() {
    assert_eq!(decode(b""), Err(KeyError::Empty));
    assert_eq!(decode(b"\"\""), Err(KeyError::Empty));
    assert_eq!(decode(b"\"   \""), Err(KeyError::OnlySpaces));
    assert_eq!(decode(b"a b"), Err(KeyError::SpaceInToken));
    assert_eq!(decode(b"\"abc"), Err(KeyError::Unterminated));
    assert_eq!(decode(b"\"a\\nb\""), Err(KeyError::BadEscape { at: 2 }));
    assert_eq!(decode(b"\"a\";x=1"), Err(KeyError::TrailingCharacters));
    assert_eq!(
        decode(b"a\tb"),
        Err(KeyError::NotPrintable { byte: b'\t', at: 1 })
    );
    assert_eq!(
        validate("caf\u{e9}"),
        Err(KeyError::NotPrintable { byte: 0xc3, at: 3 })
    );
    assert_eq!(
        validate(&"k".repeat(256)),
        Err(KeyError::TooLong { len: 256 })
    );
}
