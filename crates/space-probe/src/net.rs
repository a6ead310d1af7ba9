//! `space-probe net ...`: network checks run inside a sandbox by the network tests. Each prints
//! one JSON object on stdout; the exit status is 0 when the operation succeeded ("ok": true)
//! and 1 when it failed (a refused connection is a result, not a usage error), 2 on bad usage.
//!
//! ```text
//! net connect IP:PORT [--timeout-ms N] [--no-echo]
//!                                               TCP connect + one echo round trip (or connect only)
//! net dns NAME [--server IP[:PORT]]             A lookup (server: first nameserver of /etc/resolv.conf)
//! net http URL [opts]  /  net https URL [opts]  one GET (HTTP/1.1, Connection: close)
//!     -H 'K: V' (repeat)  --ip IP (skip DNS)  --ca PEM (default: $SSL_CERT_FILE)
//!     --discard (count the body, keep none)  --repeat N (N requests; latency percentiles)
//!     --timeout-ms N
//! net hold IP:PORT SECS                         keep an echo connection busy; report if it was cut
//! net env                                       the environment
//! net grep-proc STRING|hex:HEX [PATH]...        look for STRING in /proc/*/environ, /proc/*/cmdline
//! net upgrade-echo PORT                         answer one HTTP request with 101, then echo
//!                                               and the files under each PATH
//! ```
//!
//! Dependencies stay light and static: std sockets, a 60-line DNS client, rustls with ring.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Run `net <args>`; prints the JSON report.
pub fn main(args: &[String]) -> ExitCode {
    let result = match args.first().map(String::as_str) {
        Some("connect") => connect(&args[1..]),
        Some("dns") => dns(&args[1..]),
        Some("http") => http(&args[1..], false),
        Some("https") => http(&args[1..], true),
        Some("hold") => hold(&args[1..]),
        Some("env") => Ok(env()),
        Some("grep-proc") => grep_proc(&args[1..]),
        Some("upgrade-echo") => upgrade_echo(&args[1..]),
        other => Err(format!("unknown net subcommand {other:?}")),
    };
    match result {
        Ok(report) => {
            println!("{report}");
            if report["ok"] == Value::Bool(true) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(usage) => {
            eprintln!("space-probe net: {usage}");
            ExitCode::from(2)
        }
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|e| format!("{s:?} is not IP:PORT: {e}"))
}

fn flag_value<'a>(
    it: &mut impl Iterator<Item = &'a String>,
    flag: &str,
) -> Result<&'a String, String> {
    it.next().ok_or_else(|| format!("{flag} needs a value"))
}

fn timeout_arg(args: &[String], default_ms: u64) -> Result<Duration, String> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--timeout-ms" {
            let v = flag_value(&mut it, a)?;
            return v
                .parse()
                .map(Duration::from_millis)
                .map_err(|e| format!("--timeout-ms {v:?}: {e}"));
        }
    }
    Ok(Duration::from_millis(default_ms))
}

// ---------------------------------------------------------------------------------------------
// connect, hold

fn connect(args: &[String]) -> Result<Value, String> {
    let addr = parse_addr(args.first().ok_or("connect needs IP:PORT")?)?;
    let timeout = timeout_arg(&args[1..], 3000)?;
    let no_echo = args[1..].iter().any(|a| a == "--no-echo");
    let start = Instant::now();
    if no_echo {
        return Ok(match TcpStream::connect_timeout(&addr, timeout) {
            Ok(_) => json!({"ok": true, "connected": true, "ms": ms(start.elapsed())}),
            Err(e) => json!({
                "ok": false, "connected": false, "ms": ms(start.elapsed()), "error": e.to_string(),
            }),
        });
    }
    let mut s = match TcpStream::connect_timeout(&addr, timeout) {
        Ok(s) => s,
        Err(e) => {
            return Ok(json!({
                "ok": false, "connected": false, "echo": false,
                "ms": ms(start.elapsed()), "error": e.to_string(),
            }));
        }
    };
    let r = (|| -> io::Result<bool> {
        s.set_read_timeout(Some(timeout))?;
        s.write_all(b"space-probe\n")?;
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf)?;
        Ok(&buf == b"space-probe\n")
    })();
    Ok(match r {
        Ok(echo) => json!({"ok": echo, "connected": true, "echo": echo, "ms": ms(start.elapsed())}),
        Err(e) => json!({
            "ok": false, "connected": true, "echo": false,
            "ms": ms(start.elapsed()), "error": e.to_string(),
        }),
    })
}

fn hold(args: &[String]) -> Result<Value, String> {
    let addr = parse_addr(args.first().ok_or("hold needs IP:PORT SECS")?)?;
    let secs: u64 = args
        .get(1)
        .ok_or("hold needs SECS")?
        .parse()
        .map_err(|e| format!("SECS: {e}"))?;
    let start = Instant::now();
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(3)) {
        Ok(s) => s,
        Err(e) => {
            return Ok(
                json!({"ok": false, "connected": false, "cut": false, "error": e.to_string()}),
            );
        }
    };
    let connected_ms = ms(start.elapsed());
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut rounds = 0u64;
    let cut = loop {
        if start.elapsed() >= Duration::from_secs(secs) {
            break None;
        }
        let r = (|| -> io::Result<()> {
            s.write_all(b"ping\n")?;
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf)?;
            if &buf != b"ping\n" {
                return Err(io::Error::other("echo mismatch"));
            }
            Ok(())
        })();
        match r {
            Ok(()) => rounds += 1,
            Err(e) => break Some(e),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let held_ms = ms(start.elapsed());
    Ok(match cut {
        None => json!({
            "ok": true, "connected": true, "cut": false, "rounds": rounds,
            "connected_ms": connected_ms, "held_ms": held_ms,
        }),
        // "ok" is about the probe having held a connection at all; "cut" tells the story.
        Some(e) => json!({
            "ok": true, "connected": true, "cut": true, "rounds": rounds,
            "connected_ms": connected_ms, "cut_after_ms": held_ms, "error": e.to_string(),
        }),
    })
}

// ---------------------------------------------------------------------------------------------
// DNS

fn resolv_conf_server() -> Option<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .ok()?
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some("nameserver"))
                .then(|| f.next()?.parse::<Ipv4Addr>().ok())
                .flatten()
        })
        .map(|ip| SocketAddr::V4(SocketAddrV4::new(ip, 53)))
}

fn parse_server(s: &str) -> Result<SocketAddr, String> {
    if let Ok(ip) = s.parse::<Ipv4Addr>() {
        return Ok(SocketAddr::V4(SocketAddrV4::new(ip, 53)));
    }
    parse_addr(s)
}

struct DnsAnswer {
    rcode: u8,
    addrs: Vec<Ipv4Addr>,
}

fn dns_query(name: &str, id: u16) -> Vec<u8> {
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; 1 question
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]); // root, type A, class IN
    q
}

/// Offset just past the (possibly compressed) name at `i`.
fn skip_name(m: &[u8], mut i: usize) -> Option<usize> {
    loop {
        let len = *m.get(i)? as usize;
        if len == 0 {
            return Some(i + 1);
        }
        if len & 0xC0 == 0xC0 {
            return Some(i + 2);
        }
        i += 1 + len;
    }
}

fn dns_parse(m: &[u8], id: u16) -> Option<DnsAnswer> {
    if m.len() < 12 || u16::from_be_bytes([m[0], m[1]]) != id {
        return None;
    }
    let rcode = m[3] & 0x0F;
    let qd = u16::from_be_bytes([m[4], m[5]]);
    let an = u16::from_be_bytes([m[6], m[7]]);
    let mut i = 12;
    for _ in 0..qd {
        i = skip_name(m, i)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        i = skip_name(m, i)?;
        let rr = m.get(i..i + 10)?;
        let rtype = u16::from_be_bytes([rr[0], rr[1]]);
        let rdlen = u16::from_be_bytes([rr[8], rr[9]]) as usize;
        let rdata = m.get(i + 10..i + 10 + rdlen)?;
        if rtype == 1 && rdlen == 4 {
            addrs.push(Ipv4Addr::new(rdata[0], rdata[1], rdata[2], rdata[3]));
        }
        i += 10 + rdlen;
    }
    Some(DnsAnswer { rcode, addrs })
}

fn lookup(name: &str, server: SocketAddr, timeout: Duration) -> io::Result<DnsAnswer> {
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(server)?;
    let id = (std::process::id() as u16) ^ (Instant::now().elapsed().subsec_nanos() as u16);
    sock.send(&dns_query(name, id))?;
    let mut buf = [0u8; 1500];
    let deadline = Instant::now() + timeout;
    loop {
        let n = sock.recv(&mut buf)?;
        if let Some(a) = dns_parse(&buf[..n], id) {
            return Ok(a);
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no matching answer",
            ));
        }
    }
}

fn dns(args: &[String]) -> Result<Value, String> {
    let name = args.first().ok_or("dns needs NAME")?;
    let mut server = None;
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--server" => server = Some(parse_server(flag_value(&mut it, a)?)?),
            "--timeout-ms" => {
                flag_value(&mut it, a)?;
            }
            _ => return Err(format!("unknown dns argument {a:?}")),
        }
    }
    let timeout = timeout_arg(&args[1..], 3000)?;
    let Some(server) = server.or_else(resolv_conf_server) else {
        return Ok(json!({"ok": false, "error": "no nameserver in /etc/resolv.conf"}));
    };
    let start = Instant::now();
    Ok(match lookup(name, server, timeout) {
        Ok(a) => json!({
            "ok": a.rcode == 0 && !a.addrs.is_empty(),
            "rcode": a.rcode,
            "addrs": a.addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "server": server.to_string(),
            "ms": ms(start.elapsed()),
        }),
        Err(e) => json!({"ok": false, "server": server.to_string(), "error": e.to_string()}),
    })
}

// ---------------------------------------------------------------------------------------------
// HTTP and HTTPS

struct HttpArgs {
    host: String,
    port: u16,
    path: String,
    headers: Vec<String>,
    ip: Option<Ipv4Addr>,
    ca: Option<PathBuf>,
    discard: bool,
    repeat: usize,
    timeout: Duration,
}

fn parse_http_args(args: &[String], tls: bool) -> Result<HttpArgs, String> {
    let url = args.first().ok_or("http needs URL")?;
    let scheme = if tls { "https://" } else { "http://" };
    let rest = url
        .strip_prefix(scheme)
        .ok_or_else(|| format!("{url:?} does not start with {scheme}"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().map_err(|e| format!("port {p:?}: {e}"))?),
        None => (authority, if tls { 443 } else { 80 }),
    };
    let mut a = HttpArgs {
        host: host.to_owned(),
        port,
        path: path.to_owned(),
        headers: Vec::new(),
        ip: None,
        ca: None,
        discard: false,
        repeat: 1,
        timeout: Duration::from_secs(5),
    };
    let mut it = args[1..].iter();
    while let Some(f) = it.next() {
        match f.as_str() {
            "-H" | "--header" => {
                let h = flag_value(&mut it, f)?;
                if !h.contains(':') || h.contains(['\r', '\n']) {
                    return Err(format!("bad header {h:?}"));
                }
                a.headers.push(h.clone());
            }
            "--ip" => {
                let v = flag_value(&mut it, f)?;
                a.ip = Some(v.parse().map_err(|e| format!("--ip {v:?}: {e}"))?);
            }
            "--ca" => a.ca = Some(PathBuf::from(flag_value(&mut it, f)?)),
            "--discard" => a.discard = true,
            "--repeat" => {
                let v = flag_value(&mut it, f)?;
                a.repeat = v.parse().map_err(|e| format!("--repeat {v:?}: {e}"))?;
            }
            "--timeout-ms" => {
                let v = flag_value(&mut it, f)?;
                a.timeout =
                    Duration::from_millis(v.parse().map_err(|e| format!("--timeout-ms: {e}"))?);
            }
            _ => return Err(format!("unknown http argument {f:?}")),
        }
    }
    Ok(a)
}

fn tls_config(ca: Option<&Path>) -> io::Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let path = match ca {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os("SSL_CERT_FILE")
            .map(PathBuf::from)
            .ok_or_else(|| io::Error::other("SSL_CERT_FILE is not set and no --ca given"))?,
    };
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("read {}: {e}", path.display())))?;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?;
        // A bundle may hold certificates this verifier cannot use; skip those.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(io::Error::other(format!(
            "no usable certificate in {}",
            path.display()
        )));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

struct Response {
    status: u16,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
    body_len: usize,
}

/// Read a whole HTTP/1.1 response up to EOF (we sent `Connection: close`).
fn read_response(r: &mut dyn Read, discard: bool) -> io::Result<Response> {
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut body_len = 0usize;
    let mut head_end = None;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            // rustls reports a peer that closed without close_notify; the body is complete
            // when the connection says so (Connection: close), so treat it as EOF.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        };
        if discard && head_end.is_some() {
            body_len += n;
            continue;
        }
        raw.extend_from_slice(&buf[..n]);
        if head_end.is_none()
            && let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n")
        {
            head_end = Some(i + 4);
            if discard {
                body_len += raw.len() - (i + 4);
                raw.truncate(i + 4);
            }
        }
    }
    let end = head_end.ok_or_else(|| {
        io::Error::other(format!("no complete response head in {} bytes", raw.len()))
    })?;
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad status line {status_line:?}")))?;
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[end..].to_vec();
    if !discard {
        if headers
            .get("transfer-encoding")
            .is_some_and(|v| v.contains("chunked"))
        {
            body = dechunk(&body)?;
        }
        body_len = body.len();
    }
    Ok(Response {
        status,
        headers,
        body,
        body_len,
    })
}

fn dechunk(mut b: &[u8]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| io::Error::other("truncated chunk size"))?;
        let size_str = String::from_utf8_lossy(&b[..line_end]);
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|e| io::Error::other(format!("chunk size {size_str:?}: {e}")))?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = b
            .get(..size)
            .ok_or_else(|| io::Error::other("truncated chunk"))?;
        out.extend_from_slice(chunk);
        b = b.get(size + 2..).unwrap_or_default();
    }
}

fn one_request(
    a: &HttpArgs,
    tls: Option<&Arc<rustls::ClientConfig>>,
    ip: Ipv4Addr,
) -> io::Result<Response> {
    let addr = SocketAddr::V4(SocketAddrV4::new(ip, a.port));
    let tcp = TcpStream::connect_timeout(&addr, a.timeout)?;
    tcp.set_read_timeout(Some(a.timeout))?;
    tcp.set_write_timeout(Some(a.timeout))?;
    tcp.set_nodelay(true)?;
    let default_port = if tls.is_some() { 443 } else { 80 };
    let host_header = if a.port == default_port {
        a.host.clone()
    } else {
        format!("{}:{}", a.host, a.port)
    };
    let mut req = format!(
        "GET {} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: space-probe\r\nConnection: close\r\n",
        a.path
    );
    for h in &a.headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    match tls {
        None => {
            let mut s = tcp;
            s.write_all(req.as_bytes())?;
            read_response(&mut s, a.discard)
        }
        Some(cfg) => {
            let name = rustls::pki_types::ServerName::try_from(a.host.clone())
                .map_err(|e| io::Error::other(format!("server name {:?}: {e}", a.host)))?;
            let conn =
                rustls::ClientConnection::new(cfg.clone(), name).map_err(io::Error::other)?;
            let mut s = rustls::StreamOwned::new(conn, tcp);
            s.write_all(req.as_bytes())?;
            s.flush()?;
            read_response(&mut s, a.discard)
        }
    }
}

fn percentile_ms(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn http(args: &[String], tls: bool) -> Result<Value, String> {
    let a = parse_http_args(args, tls)?;
    let cfg = if tls {
        match tls_config(a.ca.as_deref()) {
            Ok(c) => Some(c),
            Err(e) => return Ok(json!({"ok": false, "error": e.to_string()})),
        }
    } else {
        None
    };
    let ip = match (a.ip, a.host.parse::<Ipv4Addr>()) {
        (Some(ip), _) | (None, Ok(ip)) => ip,
        (None, Err(_)) => {
            let Some(server) = resolv_conf_server() else {
                return Ok(json!({"ok": false, "error": "no nameserver in /etc/resolv.conf"}));
            };
            match lookup(&a.host, server, a.timeout) {
                Ok(ans) if ans.rcode == 0 && !ans.addrs.is_empty() => ans.addrs[0],
                Ok(ans) => {
                    return Ok(json!({
                        "ok": false, "dns_rcode": ans.rcode,
                        "error": format!("DNS lookup of {} failed: rcode {}, {} addresses",
                            a.host, ans.rcode, ans.addrs.len()),
                    }));
                }
                Err(e) => {
                    return Ok(
                        json!({"ok": false, "error": format!("DNS lookup of {}: {e}", a.host)}),
                    );
                }
            }
        }
    };
    let mut samples = Vec::with_capacity(a.repeat);
    let mut last = None;
    for _ in 0..a.repeat.max(1) {
        let start = Instant::now();
        match one_request(&a, cfg.as_ref(), ip) {
            Ok(r) => {
                samples.push(ms(start.elapsed()));
                last = Some(r);
            }
            Err(e) => {
                return Ok(json!({
                    "ok": false, "ip": ip.to_string(), "error": e.to_string(),
                    "completed": samples.len(),
                }));
            }
        }
    }
    let r = last.expect("at least one request ran");
    let total: f64 = samples.iter().sum();
    let mut sorted = samples.clone();
    sorted.sort_by(f64::total_cmp);
    let mut report = json!({
        "ok": true,
        "ip": ip.to_string(),
        "status": r.status,
        "headers": r.headers,
        "bytes": r.body_len,
        "ms": samples.last().copied().unwrap_or_default(),
    });
    if !a.discard {
        let body = &r.body[..r.body.len().min(256 * 1024)];
        report["body"] = Value::String(String::from_utf8_lossy(body).into_owned());
    }
    if a.repeat > 1 {
        report["samples"] = json!(samples.len());
        report["p50_ms"] = json!(percentile_ms(&sorted, 50.0));
        report["p90_ms"] = json!(percentile_ms(&sorted, 90.0));
        report["p99_ms"] = json!(percentile_ms(&sorted, 99.0));
        report["mean_ms"] = json!(total / samples.len() as f64);
    }
    Ok(report)
}

// ---------------------------------------------------------------------------------------------
// env, grep-proc

fn env() -> Value {
    let vars: BTreeMap<String, String> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    json!({"ok": true, "env": vars})
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Largest file read by grep-proc.
const MAX_FILE: u64 = 4 * 1024 * 1024;

fn grep_tree(
    path: &Path,
    needle: &[u8],
    depth: u32,
    found: &mut Vec<String>,
    unreadable: &mut Vec<String>,
    scanned: &mut u64,
) {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        unreadable.push(path.display().to_string());
        return;
    };
    if meta.is_dir() {
        // Pseudo file systems are searched through /proc/<pid> only.
        if depth > 0
            && ["/proc", "/sys", "/dev"]
                .iter()
                .any(|p| path == Path::new(p))
        {
            return;
        }
        if depth > 32 {
            return;
        }
        match std::fs::read_dir(path) {
            Ok(rd) => {
                for e in rd.flatten() {
                    grep_tree(&e.path(), needle, depth + 1, found, unreadable, scanned);
                }
            }
            Err(_) => unreadable.push(path.display().to_string()),
        }
    } else if meta.is_file() && meta.len() <= MAX_FILE {
        match std::fs::read(path) {
            Ok(b) => {
                *scanned += 1;
                if contains(&b, needle) {
                    found.push(path.display().to_string());
                }
            }
            Err(_) => unreadable.push(path.display().to_string()),
        }
    }
}

fn grep_proc(args: &[String]) -> Result<Value, String> {
    let arg = args.first().ok_or("grep-proc needs STRING")?;
    // `hex:...` keeps the needle itself out of this process's own command line.
    let decoded = match arg.strip_prefix("hex:") {
        Some(h) => Some(
            (0..h.len() / 2)
                .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16))
                .collect::<Result<Vec<u8>, _>>()
                .map_err(|e| format!("bad hex needle: {e}"))?,
        ),
        None => None,
    };
    let needle: &[u8] = decoded.as_deref().unwrap_or(arg.as_bytes());
    let mut found = Vec::new();
    let mut unreadable = Vec::new();
    let mut scanned = 0u64;
    let mut pids = 0u64;
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().parse::<u32>().is_err() {
                continue;
            }
            pids += 1;
            for f in ["environ", "cmdline"] {
                let p = e.path().join(f);
                match std::fs::read(&p) {
                    Ok(b) => {
                        scanned += 1;
                        if contains(&b, needle) {
                            found.push(p.display().to_string());
                        }
                    }
                    Err(_) => unreadable.push(p.display().to_string()),
                }
            }
        }
    }
    for p in &args[1..] {
        grep_tree(
            Path::new(p),
            needle,
            0,
            &mut found,
            &mut unreadable,
            &mut scanned,
        );
    }
    Ok(json!({
        "ok": true,
        "found": found,
        "pids": pids,
        "scanned": scanned,
        "unreadable": unreadable,
    }))
}

/// `upgrade-echo PORT`: accept one connection on 0.0.0.0:PORT, answer its HTTP request with
/// `101 Switching Protocols` (as a WebSocket server would), then echo every byte until EOF.
/// Shows that an inbound proxy pipes an upgraded connection both ways.
fn upgrade_echo(args: &[String]) -> Result<Value, String> {
    let port: u16 = args
        .first()
        .ok_or("upgrade-echo needs PORT")?
        .parse()
        .map_err(|e| format!("bad port: {e}"))?;
    let listener =
        std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("bind: {e}"))?;
    let (mut conn, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 16 << 10 {
            return Err("request head too long".into());
        }
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return Err("connection closed before the request head ended".into()),
        }
    }
    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let upgrade = text.contains("upgrade: websocket");
    conn.write_all(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut echoed = 0u64;
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if conn.write_all(&buf[..n]).is_err() {
                    break;
                }
                echoed += n as u64;
            }
        }
    }
    Ok(json!({"ok": true, "upgrade_requested": upgrade, "echoed": echoed}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_round_trip_parses_answers_behind_compressed_names() {
        let q = dns_query("api.example.test", 0x1234);
        let mut m = q.clone();
        m[2] = 0x81;
        m[3] = 0x80;
        m[7] = 2; // two answers
        for ip in [[203, 0, 113, 10], [203, 0, 113, 11]] {
            m.extend_from_slice(&[0xC0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
            m.extend_from_slice(&ip);
        }
        let a = dns_parse(&m, 0x1234).unwrap();
        assert_eq!(a.rcode, 0);
        assert_eq!(
            a.addrs,
            vec![
                Ipv4Addr::new(203, 0, 113, 10),
                Ipv4Addr::new(203, 0, 113, 11)
            ]
        );
        assert!(dns_parse(&m, 0x4321).is_none(), "a foreign id is ignored");
        m[3] = 0x85;
        assert_eq!(dns_parse(&m, 0x1234).unwrap().rcode, 5);
    }

    #[test]
    fn responses_are_split_and_dechunked() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = read_response(&mut &raw[..], false).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.headers["x-a"], "b");
        assert_eq!(r.body, b"abcde");
        let r = read_response(&mut &raw[..], true).unwrap();
        assert_eq!(
            r.body_len,
            raw.len() - raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() - 4
        );
        assert!(read_response(&mut &b"HTTP/1.1 200"[..], false).is_err());
    }

    #[test]
    fn urls_parse() {
        let a = parse_http_args(&["https://api.example.test:8443/x?y".into()], true).unwrap();
        assert_eq!(
            (a.host.as_str(), a.port, a.path.as_str()),
            ("api.example.test", 8443, "/x?y")
        );
        let a = parse_http_args(&["http://h".into(), "-H".into(), "A: b".into()], false).unwrap();
        assert_eq!((a.port, a.path.as_str(), a.headers.len()), (80, "/", 1));
        assert!(parse_http_args(&["http://h".into()], true).is_err());
        assert!(
            parse_http_args(&["http://h".into(), "-H".into(), "nocolon".into()], false).is_err()
        );
    }

    #[test]
    fn grep_finds_needles_in_files() {
        let d = tempdir();
        std::fs::write(d.join("a"), b"xx spc_ph_needle yy").unwrap();
        std::fs::write(d.join("b"), b"nothing").unwrap();
        let r = grep_proc(&["spc_ph_needle".into(), d.display().to_string()]).unwrap();
        let found: Vec<String> = serde_json::from_value(r["found"].clone()).unwrap();
        assert!(found.iter().any(|f| f.ends_with("/a")), "{r}");
        assert!(!found.iter().any(|f| f.ends_with("/b")), "{r}");
        let _ = std::fs::remove_dir_all(&d);
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("space-probe-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
