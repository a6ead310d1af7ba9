//! What a connection's first bytes say about where it goes: the SNI of a TLS ClientHello, or
//! the Host header of a plain HTTP/1.x request. Parsing is bounded by the buffer the caller
//! gives (the proxy reads at most [`super::PEEK_MAX`] bytes) and never panics on hostile input.

use std::net::Ipv4Addr;

/// The protocol a connection speaks, judged from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tls,
    Http,
    Other,
}

/// The outcome of looking at a connection's first bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniff {
    /// More bytes are needed to decide.
    Incomplete,
    /// Decided: the protocol, and the name the client asked for (lowercase, without a trailing
    /// dot or port), if it gave a valid DNS name.
    Done { proto: Proto, name: Option<String> },
}

/// What the bytes seen so far allow when no more will come (timeout, end of stream, buffer
/// full): the protocol from the first byte, no name.
pub fn give_up(buf: &[u8]) -> (Proto, Option<String>) {
    let proto = match buf.first() {
        Some(0x16) => Proto::Tls,
        Some(b) if b.is_ascii_uppercase() => Proto::Http,
        _ => Proto::Other,
    };
    (proto, None)
}

/// Looks at the first bytes of a connection.
pub fn sniff(buf: &[u8]) -> Sniff {
    match buf.first() {
        None => Sniff::Incomplete,
        Some(0x16) => match client_hello_sni(buf) {
            Parse::Incomplete => Sniff::Incomplete,
            Parse::Malformed => Sniff::Done {
                proto: Proto::Other,
                name: None,
            },
            Parse::Done(name) => Sniff::Done {
                proto: Proto::Tls,
                name,
            },
        },
        Some(b) if b.is_ascii_uppercase() => match http_host(buf) {
            Parse::Incomplete => Sniff::Incomplete,
            Parse::Malformed => Sniff::Done {
                proto: Proto::Other,
                name: None,
            },
            Parse::Done(name) => Sniff::Done {
                proto: Proto::Http,
                name,
            },
        },
        Some(_) => Sniff::Done {
            proto: Proto::Other,
            name: None,
        },
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Parse {
    Incomplete,
    Malformed,
    Done(Option<String>),
}

/// A valid DNS host name, normalized (lowercase, no trailing dot); None for IP literals and
/// anything else.
pub fn normalize_host(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    let s = s.strip_suffix('.').unwrap_or(s);
    if s.is_empty() || s.len() > 253 || s.parse::<Ipv4Addr>().is_ok() {
        return None;
    }
    for label in s.split('.') {
        if label.is_empty()
            || label.len() > 63
            || !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return None;
        }
    }
    Some(s.to_ascii_lowercase())
}

/// A bounds-checked reader over a complete structure: running short means malformed.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| b[0] as usize)
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(n)
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(n)
    }
}

const TLS_HANDSHAKE: u8 = 0x16;
const CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: usize = 0;
/// Largest TLS record payload allowed (2^14 plus the expansion TLS 1.2 permits).
const MAX_RECORD: usize = 16384 + 2048;
/// A ClientHello larger than this is not worth waiting for.
const MAX_HELLO: usize = 64 * 1024;

/// The SNI of the ClientHello that starts `buf` (which may span several records).
fn client_hello_sni(buf: &[u8]) -> Parse {
    let mut hs: Vec<u8> = Vec::new();
    let mut off = 0;
    loop {
        let Some(header) = buf.get(off..off + 5) else {
            return Parse::Incomplete;
        };
        if header[0] != TLS_HANDSHAKE || header[1] != 3 {
            return Parse::Malformed;
        }
        let len = u16::from_be_bytes([header[3], header[4]]) as usize;
        if len == 0 || len > MAX_RECORD {
            return Parse::Malformed;
        }
        let Some(payload) = buf.get(off + 5..off + 5 + len) else {
            return Parse::Incomplete;
        };
        hs.extend_from_slice(payload);
        off += 5 + len;
        if hs.len() < 4 {
            continue;
        }
        if hs[0] != CLIENT_HELLO {
            return Parse::Malformed;
        }
        let body_len = u32::from_be_bytes([0, hs[1], hs[2], hs[3]]) as usize;
        if body_len > MAX_HELLO {
            return Parse::Malformed;
        }
        if hs.len() >= 4 + body_len {
            return match hello_body_sni(&hs[4..4 + body_len]) {
                Some(name) => Parse::Done(name),
                None => Parse::Malformed,
            };
        }
    }
}

/// The server name of a complete ClientHello body: Some(None) when it has no (valid) SNI,
/// None when malformed.
fn hello_body_sni(body: &[u8]) -> Option<Option<String>> {
    let mut c = Cursor(body);
    c.take(2)?; // legacy_version
    c.take(32)?; // random
    c.vec8()?; // legacy_session_id
    c.vec16()?; // cipher_suites
    c.vec8()?; // legacy_compression_methods
    if c.0.is_empty() {
        return Some(None); // no extensions (SSLv3-style hello)
    }
    let mut exts = Cursor(c.vec16()?);
    while !exts.0.is_empty() {
        let ty = exts.u16()?;
        let data = exts.vec16()?;
        if ty != EXT_SERVER_NAME {
            continue;
        }
        let mut list = Cursor(Cursor(data).vec16()?);
        while !list.0.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type == 0 {
                return Some(normalize_host(name));
            }
        }
        return Some(None);
    }
    Some(None)
}

/// Longest method token we accept ("OPTIONS", "PROPFIND", ...).
const MAX_METHOD: usize = 16;

/// The Host header of the HTTP/1.x request that starts `buf`. Decided as soon as the Host line
/// is complete (headers after it need not have arrived).
fn http_host(buf: &[u8]) -> Parse {
    // Request line: METHOD SP target SP HTTP/1.x CRLF
    let method_len = buf
        .iter()
        .take(MAX_METHOD + 1)
        .position(|&b| !(b.is_ascii_uppercase() || b == b'-' || b == b'_'));
    match method_len {
        None if buf.len() <= MAX_METHOD => return Parse::Incomplete,
        None => return Parse::Malformed,
        Some(0) => return Parse::Malformed,
        Some(n) if buf[n] != b' ' => return Parse::Malformed,
        Some(_) => {}
    }
    let mut lines = Lines { buf, pos: 0 };
    let Some(request_line) = lines.next_line() else {
        return Parse::Incomplete;
    };
    let Some(version) = request_line.rsplit(|&b| b == b' ').next() else {
        return Parse::Malformed;
    };
    if !version.starts_with(b"HTTP/1.") {
        return Parse::Malformed;
    }
    loop {
        let Some(line) = lines.next_line() else {
            return Parse::Incomplete;
        };
        if line.is_empty() {
            return Parse::Done(None); // end of headers, no Host
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return Parse::Malformed;
        };
        if line[..colon].eq_ignore_ascii_case(b"host") {
            let value = line[colon + 1..].trim_ascii();
            return Parse::Done(host_without_port(value).and_then(normalize_host));
        }
    }
}

/// `example.com:8080` -> `example.com`; IPv6 literals (`[::1]:80`) -> None.
fn host_without_port(value: &[u8]) -> Option<&[u8]> {
    if value.first() == Some(&b'[') {
        return None;
    }
    match value.iter().rposition(|&b| b == b':') {
        Some(i) if value[i + 1..].iter().all(u8::is_ascii_digit) => Some(&value[..i]),
        Some(_) => None,
        None => Some(value),
    }
}

struct Lines<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Lines<'a> {
    /// The next CRLF-terminated line (without the CRLF), or None if it is not complete yet.
    fn next_line(&mut self) -> Option<&'a [u8]> {
        let rest = &self.buf[self.pos..];
        let end = rest.windows(2).position(|w| w == b"\r\n")?;
        self.pos += end + 2;
        Some(&rest[..end])
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::sync::Arc;

    /// A real ClientHello as rustls writes it, with SNI `name`.
    pub(crate) fn client_hello(name: &str) -> Vec<u8> {
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut out = Vec::new();
        conn.write_tls(&mut out).unwrap();
        out
    }

    fn done(proto: Proto, name: Option<&str>) -> Sniff {
        Sniff::Done {
            proto,
            name: name.map(str::to_owned),
        }
    }

    #[test]
    fn sni_of_a_real_client_hello() {
        let hello = client_hello("API.Example.com");
        assert_eq!(sniff(&hello), done(Proto::Tls, Some("api.example.com")));
        // Extra bytes after the hello do not matter.
        let mut more = hello.clone();
        more.extend_from_slice(b"trailing application data");
        assert_eq!(sniff(&more), done(Proto::Tls, Some("api.example.com")));
    }

    #[test]
    fn truncated_client_hello_is_incomplete_at_every_length() {
        let hello = client_hello("api.example.com");
        for n in 1..hello.len() {
            assert_eq!(sniff(&hello[..n]), Sniff::Incomplete, "at {n} bytes");
        }
    }

    #[test]
    fn client_hello_split_across_records() {
        let hello = client_hello("split.example.com");
        let payload = &hello[5..];
        let (a, b) = payload.split_at(40);
        let mut split = Vec::new();
        for part in [a, b] {
            split.extend_from_slice(&[0x16, 3, 1]);
            split.extend_from_slice(&(part.len() as u16).to_be_bytes());
            split.extend_from_slice(part);
        }
        assert_eq!(sniff(&split), done(Proto::Tls, Some("split.example.com")));
        assert_eq!(sniff(&split[..split.len() - 1]), Sniff::Incomplete);
    }

    #[test]
    fn malformed_client_hellos_have_no_name() {
        let hello = client_hello("api.example.com");
        // Not a ClientHello (ServerHello type).
        let mut bad = hello.clone();
        bad[5] = 2;
        assert_eq!(sniff(&bad), done(Proto::Other, None));
        // Record length zero or oversized.
        assert_eq!(sniff(&[0x16, 3, 1, 0, 0]), done(Proto::Other, None));
        assert_eq!(sniff(&[0x16, 3, 1, 0xff, 0xff]), done(Proto::Other, None));
        // Not TLS 1.x.
        assert_eq!(sniff(&[0x16, 2, 0, 0, 4]), done(Proto::Other, None));
        // A handshake length larger than the hello allows.
        assert_eq!(
            sniff(&[0x16, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff]),
            done(Proto::Other, None)
        );
        // An inner length running past the end: cut the extensions short but keep the
        // declared lengths (record and handshake) consistent with the shorter body.
        let mut short = hello.clone();
        let cut = 20;
        short.truncate(short.len() - cut);
        let rec_len = u16::from_be_bytes([short[3], short[4]]) as usize - cut;
        short[3..5].copy_from_slice(&(rec_len as u16).to_be_bytes());
        let hs_len = rec_len - 4;
        short[6..9].copy_from_slice(&(hs_len as u32).to_be_bytes()[1..]);
        assert_eq!(sniff(&short), done(Proto::Other, None));
        // Garbage everywhere never panics.
        for seed in 0..2000u32 {
            let mut junk = hello.clone();
            let i = (seed as usize * 7919) % junk.len();
            junk[i] ^= (seed % 251 + 1) as u8;
            let _ = sniff(&junk);
        }
    }

    #[test]
    fn invalid_sni_names_are_dropped() {
        assert_eq!(normalize_host(b"1.2.3.4"), None);
        assert_eq!(normalize_host(b"bad name.com"), None);
        assert_eq!(normalize_host(b"a..b"), None);
        assert_eq!(normalize_host(&[b'a'; 300]), None);
        assert_eq!(normalize_host(b"\xff.com"), None);
        assert_eq!(
            normalize_host(b"Ok.Example.COM."),
            Some("ok.example.com".into())
        );
    }

    #[test]
    fn http_host_header() {
        let req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nhOsT:  Example.com:8080 \r\n\r\n";
        assert_eq!(sniff(req), done(Proto::Http, Some("example.com")));
        // Decided once the Host line is complete.
        let partial = b"POST / HTTP/1.1\r\nHost: api.example.com\r\nContent-Le";
        assert_eq!(sniff(partial), done(Proto::Http, Some("api.example.com")));
        for n in 1..partial.len() - 12 {
            assert_eq!(sniff(&partial[..n]), Sniff::Incomplete, "at {n} bytes");
        }
        // No Host at all (HTTP/1.0), IP literal, IPv6 literal: no name.
        assert_eq!(
            sniff(b"GET / HTTP/1.0\r\nAccept: */*\r\n\r\n"),
            done(Proto::Http, None)
        );
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n"),
            done(Proto::Http, None)
        );
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n"),
            done(Proto::Http, None)
        );
    }

    #[test]
    fn malformed_and_oversized_http() {
        assert_eq!(sniff(b"get / HTTP/1.1\r\n"), done(Proto::Other, None));
        assert_eq!(sniff(b"GET\t/ HTTP/1.1\r\n"), done(Proto::Other, None));
        assert_eq!(
            sniff(b"GET / SPDY/3\r\nHost: a.com\r\n\r\n"),
            done(Proto::Other, None)
        );
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n"),
            done(Proto::Other, None)
        );
        assert_eq!(sniff(&[b'A'; 40]), done(Proto::Other, None));
        assert_eq!(sniff(b"\x00\x01binary"), done(Proto::Other, None));
        // A header block that never ends stays incomplete; the proxy's bound then applies.
        let mut huge = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
        huge.extend(std::iter::repeat_n(b'a', 32 * 1024));
        assert_eq!(sniff(&huge), Sniff::Incomplete);
        assert_eq!(give_up(&huge), (Proto::Http, None));
        assert_eq!(give_up(&[0x16, 3]), (Proto::Tls, None));
        assert_eq!(give_up(b""), (Proto::Other, None));
    }
}
