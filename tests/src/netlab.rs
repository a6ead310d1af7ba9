//! A fake internet for the network tests, entirely inside network namespaces this harness makes.
//!
//! ```text
//!  sandbox ── slot ── [node netns: spaced]  inet0 203.0.113.1/24 ──veth── node0 203.0.113.254/24 [inet netns]
//!                      default via .254                                     lo: 203.0.113.10  HTTP :80, HTTPS :443
//!                                                                               203.0.113.11  TCP echo :7000
//!                                                                               203.0.113.53  DNS :53 (UDP+TCP)
//!                                                                               198.51.100.20 TCP echo :7000
//!                                                 also 169.254.169.254, 10.99.0.1, 172.16.5.1, 192.168.77.1, 100.64.0.1
//!                                                      100.100.100.200, 168.63.129.16, 192.0.0.192
//!                      inet0 2001:db8:113::1/64 ──────── node0 2001:db8:113::254/64
//!                                                   lo: fd00:ec2::254, fd20:ce::254  TCP echo :7000
//! ```
//!
//! HTTP, HTTPS and the echo server listen on 0.0.0.0 of the inet namespace, so every lab
//! address answers on :80, :443 and :7000 (a blocked connection is blocked by policy, not
//! because nothing listens).
//!
//! The servers run in this test process (a tokio runtime the lab owns) on sockets created inside
//! the inet namespace; they record what they received so a test can assert what left the
//! sandbox and what the real servers saw (e.g. the real secret, never the placeholder).
//! The HTTPS server's certificate comes from the lab's own CA (`ca_path`), which spaced trusts
//! upstream through `--upstream-ca`. DNS answers `*.example.test`:
//! api, echo, other -> 203.0.113.10; raw -> 203.0.113.11; far -> 198.51.100.20;
//! `node.example.test` and every name one label under it -> 203.0.113.1 (the node itself, for
//! spaced's `--e2b-domain`); else NXDOMAIN.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{NodeNet, Spaced, run_cmd};

/// The node's address on the lab link.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The lab's router (the node's default gateway).
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 254);
/// HTTP :80 and HTTPS :443 (api/echo/other.example.test).
pub const WEB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// TCP echo :7000 (raw.example.test).
pub const RAW_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
/// TCP echo :7000 in another network (far.example.test).
pub const FAR_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
/// The lab's DNS server (spaced's `--dns-upstream`).
pub const DNS_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
/// Port of the TCP echo server (on every lab address).
pub const ECHO_PORT: u16 = 7000;
/// The cloud metadata address: the lab serves it too, so that "blocked" means blocked.
pub const META_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// The other cloud metadata addresses (Alibaba, Azure's WireServer, Oracle Cloud Classic),
/// served like the rest.
pub const METADATA_IPS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(100, 100, 100, 200),
    Ipv4Addr::new(168, 63, 129, 16),
    Ipv4Addr::new(192, 0, 0, 192),
];
/// The IPv6 metadata addresses (AWS, GCP): the node reaches them over the lab's IPv6 link; a
/// TCP echo listens on each.
pub const METADATA_IPS6: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254),
    Ipv6Addr::new(0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254),
];
/// The node's and the lab's ends of the IPv6 link.
const NODE_IP6: &str = "2001:db8:113::1/64";
const GATEWAY_IP6: &str = "2001:db8:113::254";

/// Lab addresses in private and shared ranges (10/8, 172.16/12, 192.168/16, 100.64/10): served
/// like the rest, default-denied by the egress policy.
pub const PRIVATE_IPS: [Ipv4Addr; 4] = [
    Ipv4Addr::new(10, 99, 0, 1),
    Ipv4Addr::new(172, 16, 5, 1),
    Ipv4Addr::new(192, 168, 77, 1),
    Ipv4Addr::new(100, 64, 0, 1),
];

/// A domain the lab's DNS points at the node (`NODE_IP`): itself and `*.NODE_DOMAIN`, as a
/// wildcard record for spaced's `--e2b-domain` would.
pub const NODE_DOMAIN: &str = "node.example.test";

/// The zone the lab's DNS serves.
pub fn zone(name: &str) -> Option<Ipv4Addr> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let under_node = name
        .strip_suffix(NODE_DOMAIN)
        .and_then(|l| l.strip_suffix('.'))
        .is_some_and(|l| !l.is_empty() && !l.contains('.'));
    match name.as_str() {
        "api.example.test" | "echo.example.test" | "other.example.test" => Some(WEB_IP),
        "raw.example.test" => Some(RAW_IP),
        "far.example.test" => Some(FAR_IP),
        NODE_DOMAIN => Some(NODE_IP),
        _ if under_node => Some(NODE_IP),
        _ => None,
    }
}

/// One HTTP request the web server received.
#[derive(Clone, Debug, Serialize)]
pub struct HttpHit {
    pub tls: bool,
    /// SNI of the TLS connection it came on.
    pub sni: Option<String>,
    pub method: String,
    pub path: String,
    /// Header name (lowercase) -> values.
    pub headers: BTreeMap<String, Vec<String>>,
    pub peer: SocketAddr,
}

impl HttpHit {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .and_then(|v| v.first())
            .map(String::as_str)
    }
}

/// One TCP connection an echo server accepted.
#[derive(Clone, Debug)]
pub struct TcpHit {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub at: Instant,
}

/// One DNS question.
#[derive(Clone, Debug)]
pub struct DnsHit {
    pub name: String,
    pub qtype: String,
    pub peer: SocketAddr,
}

/// Everything the lab's servers saw.
#[derive(Default, Debug)]
pub struct Records {
    pub http: Vec<HttpHit>,
    pub tcp: Vec<TcpHit>,
    pub dns: Vec<DnsHit>,
    /// Every byte any lab server received, concatenated (to search for leaks).
    pub raw: Vec<u8>,
}

type Shared = Arc<Mutex<Records>>;

static LAB: AtomicU32 = AtomicU32::new(0);

/// The fake internet; dropped last (after the Spaced attached to it).
pub struct NetLab {
    /// `ip netns` name of the inet namespace.
    pub name: String,
    dir: tempfile::TempDir,
    /// PEM of the lab CA (issuer of the web server's certificate).
    pub ca_pem: String,
    records: Shared,
    rt: Option<tokio::runtime::Runtime>,
}

/// Run `f` on a fresh thread inside the network namespace pinned at `path`: sockets it makes
/// belong to that namespace.
fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> Result<T> {
    let ns = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    space_sys::netns::run_in(ns.as_fd(), f).with_context(|| format!("enter {}", path.display()))
}

impl NetLab {
    /// Make the inet namespace, the CA and the servers. Attach a node with `start_spaced`
    /// (or `attach` for a bare node namespace).
    pub fn new() -> Result<NetLab> {
        crate::require_root();
        let name = format!(
            "splab-{}-{}",
            std::process::id(),
            LAB.fetch_add(1, Ordering::SeqCst)
        );
        run_cmd("ip", &["netns", "add", &name])?;
        let mut lab = NetLab {
            name,
            dir: tempfile::Builder::new()
                .prefix("space-lab-")
                .tempdir_in("/var/tmp")?,
            ca_pem: String::new(),
            records: Shared::default(),
            rt: None,
        };
        run_cmd("ip", &["-n", &lab.name, "link", "set", "lo", "up"])?;
        for a in [WEB_IP, RAW_IP, DNS_IP, FAR_IP, META_IP]
            .into_iter()
            .chain(PRIVATE_IPS)
            .chain(METADATA_IPS)
        {
            run_cmd(
                "ip",
                &[
                    "-n",
                    &lab.name,
                    "addr",
                    "add",
                    &format!("{a}/32"),
                    "dev",
                    "lo",
                ],
            )?;
        }
        for a in METADATA_IPS6 {
            let a = format!("{a}/128");
            run_cmd(
                "ip",
                &["-n", &lab.name, "addr", "add", &a, "dev", "lo", "nodad"],
            )?;
        }
        let (ca_pem, tls) = make_tls()?;
        std::fs::write(lab.ca_path(), &ca_pem)?;
        lab.ca_pem = ca_pem;

        let bind_tcp = |ip: Ipv4Addr, port: u16| {
            std::net::TcpListener::bind(SocketAddrV4::new(ip, port))
                .with_context(|| format!("bind {ip}:{port} in the lab"))
        };
        let any = Ipv4Addr::UNSPECIFIED;
        let (http, https, echo, dns_tcp, dns_udp, echo6) = in_netns(&lab.path(), || {
            let echo6 = METADATA_IPS6
                .iter()
                .map(|ip| {
                    std::net::TcpListener::bind(SocketAddrV6::new(*ip, ECHO_PORT, 0, 0))
                        .with_context(|| format!("bind [{ip}]:{ECHO_PORT} in the lab"))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok::<_, anyhow::Error>((
                bind_tcp(any, 80)?,
                bind_tcp(any, 443)?,
                bind_tcp(any, ECHO_PORT)?,
                bind_tcp(DNS_IP, 53)?,
                std::net::UdpSocket::bind(SocketAddrV4::new(DNS_IP, 53))
                    .context("bind the lab's DNS (UDP)")?,
                echo6,
            ))
        })??;

        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        {
            let _g = rt.enter();
            let rec = &lab.records;
            let tcp = |l: std::net::TcpListener| -> Result<tokio::net::TcpListener> {
                l.set_nonblocking(true)?;
                Ok(tokio::net::TcpListener::from_std(l)?)
            };
            rt.spawn(serve_http(tcp(http)?, None, rec.clone()));
            rt.spawn(serve_http(tcp(https)?, Some(tls), rec.clone()));
            rt.spawn(serve_echo(tcp(echo)?, rec.clone()));
            for l in echo6 {
                rt.spawn(serve_echo(tcp(l)?, rec.clone()));
            }
            rt.spawn(serve_dns_tcp(tcp(dns_tcp)?, rec.clone()));
            dns_udp.set_nonblocking(true)?;
            rt.spawn(serve_dns_udp(
                tokio::net::UdpSocket::from_std(dns_udp)?,
                rec.clone(),
            ));
        }
        lab.rt = Some(rt);
        Ok(lab)
    }

    /// Path of the pinned inet namespace.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// The lab CA's PEM file (for `--upstream-ca` and the probe's `--ca`).
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("lab-ca.pem")
    }

    /// The spaced flags that point the node at the lab.
    pub fn spaced_flags(&self) -> Vec<String> {
        vec![
            "--dns-upstream".into(),
            DNS_IP.to_string(),
            "--upstream-ca".into(),
            self.ca_path().display().to_string(),
        ]
    }

    /// Link a node namespace to the lab: 203.0.113.1/24 there, default route via the lab.
    pub fn attach(&self, node: &NodeNet) -> Result<()> {
        let lab = self.name.as_str();
        let n = node.name.as_str();
        run_cmd(
            "ip",
            &[
                "-n", lab, "link", "add", "node0", "type", "veth", "peer", "name", "inet0",
                "netns", n,
            ],
        )?;
        run_cmd(
            "ip",
            &[
                "-n",
                lab,
                "addr",
                "add",
                &format!("{GATEWAY_IP}/24"),
                "dev",
                "node0",
            ],
        )?;
        run_cmd("ip", &["-n", lab, "link", "set", "node0", "up"])?;
        run_cmd(
            "ip",
            &[
                "-n",
                n,
                "addr",
                "add",
                &format!("{NODE_IP}/24"),
                "dev",
                "inet0",
            ],
        )?;
        run_cmd("ip", &["-n", n, "link", "set", "inet0", "up"])?;
        run_cmd(
            "ip",
            &[
                "-n",
                n,
                "route",
                "add",
                "default",
                "via",
                &GATEWAY_IP.to_string(),
            ],
        )?;
        run_cmd(
            "ip",
            &[
                "-n",
                n,
                "route",
                "add",
                "198.51.100.0/24",
                "via",
                &GATEWAY_IP.to_string(),
            ],
        )?;
        // IPv6, so that the node reaches the IPv6 metadata addresses (and a sandbox that
        // cannot is stopped by its slot, not by routing).
        let lab_ip6 = format!("{GATEWAY_IP6}/64");
        run_cmd(
            "ip",
            &["-n", lab, "addr", "add", &lab_ip6, "dev", "node0", "nodad"],
        )?;
        run_cmd(
            "ip",
            &["-n", n, "addr", "add", NODE_IP6, "dev", "inet0", "nodad"],
        )?;
        run_cmd(
            "ip",
            &["-n", n, "-6", "route", "add", "default", "via", GATEWAY_IP6],
        )?;
        Ok(())
    }

    /// Start a spaced in its own namespace, attached to the lab, with `spaced_flags` + `extra`.
    pub fn start_spaced(&self, extra: &[&str]) -> Result<Spaced> {
        let flags = self.spaced_flags();
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        let mut s = Spaced::prepare(&args, true)?;
        self.attach(s.net.as_ref().context("spaced has its own netns")?)?;
        s.spawn()?;
        Ok(s)
    }

    /// A copy of what the servers received so far.
    pub fn http_hits(&self) -> Vec<HttpHit> {
        self.records.lock().unwrap().http.clone()
    }

    pub fn tcp_hits(&self) -> Vec<TcpHit> {
        self.records.lock().unwrap().tcp.clone()
    }

    pub fn dns_hits(&self) -> Vec<DnsHit> {
        self.records.lock().unwrap().dns.clone()
    }

    /// Did any lab server ever receive these bytes (anywhere in a request, header or stream)?
    pub fn received(&self, needle: &str) -> bool {
        let r = self.records.lock().unwrap();
        !needle.is_empty() && r.raw.windows(needle.len()).any(|w| w == needle.as_bytes())
    }

    /// Forget everything recorded so far.
    pub fn clear(&self) {
        *self.records.lock().unwrap() = Records::default();
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        let _ = run_cmd("ip", &["netns", "del", &self.name]);
    }
}

// ---------------------------------------------------------------------------------------------
// TLS

/// A CA and one leaf for the web server's names; returns (CA PEM, server config).
fn make_tls() -> Result<(String, Arc<rustls::ServerConfig>)> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "space test lab CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;

    let leaf_key = KeyPair::generate()?;
    let mut leaf_params = CertificateParams::new(vec![
        "api.example.test".to_string(),
        "echo.example.test".to_string(),
        "other.example.test".to_string(),
    ])?;
    leaf_params
        .distinguished_name
        .push(DnType::CommonName, "api.example.test");
    let leaf = leaf_params.signed_by(&leaf_key, &ca)?;

    let key = rustls::pki_types::PrivateKeyDer::try_from(leaf_key.serialize_der())
        .map_err(|e| anyhow::anyhow!("leaf key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone(), ca.der().clone()], key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((ca.pem(), Arc::new(cfg)))
}

// ---------------------------------------------------------------------------------------------
// Servers

/// A stream that appends every byte read to the lab's raw record.
struct Recording<S> {
    inner: S,
    records: Shared,
}

impl<S: AsyncRead + Unpin> AsyncRead for Recording<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        let new = &buf.filled()[before..];
        if !new.is_empty() {
            self.records.lock().unwrap().raw.extend_from_slice(new);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Recording<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// HTTP (plain, or TLS with `tls`). `/bytes/N` answers N bytes, `/quiet` answers "ok" (a
/// server that does not reflect what it got); every other path answers the request as JSON:
/// `{"tls","sni","method","path","headers":{name:[values]},"peer"}`.
async fn serve_http(
    listener: tokio::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    records: Shared,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    loop {
        let Ok((sock, peer)) = listener.accept().await else {
            continue;
        };
        let _ = sock.set_nodelay(true);
        let records = records.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            // Recorded as plaintext: below TLS for HTTPS, on the socket for HTTP.
            fn rec<S>(inner: S, records: &Shared) -> Recording<S> {
                Recording {
                    inner,
                    records: records.clone(),
                }
            }
            match acceptor {
                None => {
                    let _ =
                        serve_conn(rec(sock, &records), false, None, peer, records.clone()).await;
                }
                Some(acc) => {
                    let Ok(tls) = acc.accept(sock).await else {
                        return;
                    };
                    let sni = tls.get_ref().1.server_name().map(str::to_owned);
                    let _ = serve_conn(rec(tls, &records), true, sni, peer, records.clone()).await;
                }
            }
        });
    }
}

async fn serve_conn<S>(
    io: S,
    tls: bool,
    sni: Option<String>,
    peer: SocketAddr,
    records: Shared,
) -> hyper::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let records = records.clone();
        let sni = sni.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (k, v) in &parts.headers {
                headers
                    .entry(k.as_str().to_owned())
                    .or_default()
                    .push(String::from_utf8_lossy(v.as_bytes()).into_owned());
            }
            let path = parts
                .uri
                .path_and_query()
                .map(|p| p.as_str().to_owned())
                .unwrap_or_default();
            let hit = HttpHit {
                tls,
                sni,
                method: parts.method.to_string(),
                path: path.clone(),
                headers,
                peer,
            };
            records.lock().unwrap().http.push(hit.clone());
            drop(body);
            let resp = if path == "/quiet" {
                Response::builder().body(Full::new(Bytes::from_static(b"ok")))
            } else if let Some(n) = path
                .strip_prefix("/bytes/")
                .and_then(|n| n.parse::<usize>().ok())
            {
                Response::builder()
                    .header("content-type", "application/octet-stream")
                    .body(Full::new(Bytes::from(vec![b'x'; n])))
            } else {
                let json = serde_json::to_vec(&hit).unwrap_or_default();
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(json)))
            };
            Ok::<_, Infallible>(resp.expect("a valid response"))
        }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(io), svc)
        .await
}

async fn serve_echo(listener: tokio::net::TcpListener, records: Shared) {
    loop {
        let Ok((mut sock, peer)) = listener.accept().await else {
            continue;
        };
        let local = sock.local_addr().unwrap_or(peer);
        records.lock().unwrap().tcp.push(TcpHit {
            local,
            peer,
            at: Instant::now(),
        });
        let records = records.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match sock.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                records.lock().unwrap().raw.extend_from_slice(&buf[..n]);
                if sock.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Answer one DNS message from the zone.
fn dns_answer(query: &[u8], peer: SocketAddr, records: &Shared) -> Option<Vec<u8>> {
    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::{RData, Record, RecordType, rdata::A};
    let q = Message::from_vec(query).ok()?;
    let mut resp = Message::response(q.metadata.id, q.metadata.op_code);
    resp.metadata.recursion_desired = q.metadata.recursion_desired;
    resp.metadata.authoritative = true;
    let mut rcode = ResponseCode::NoError;
    for question in &q.queries {
        let name = question.name().to_ascii();
        records.lock().unwrap().dns.push(DnsHit {
            name: name.trim_end_matches('.').to_owned(),
            qtype: question.query_type().to_string(),
            peer,
        });
        resp.add_query(question.clone());
        match zone(&name) {
            Some(ip) if question.query_type() == RecordType::A => {
                resp.add_answer(Record::from_rdata(
                    question.name().clone(),
                    60,
                    RData::A(A(ip)),
                ));
            }
            Some(_) => {}
            None => rcode = ResponseCode::NXDomain,
        }
    }
    resp.metadata.response_code = rcode;
    resp.to_vec().ok()
}

async fn serve_dns_udp(sock: tokio::net::UdpSocket, records: Shared) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
            continue;
        };
        if let Some(answer) = dns_answer(&buf[..n], peer, &records) {
            let _ = sock.send_to(&answer, peer).await;
        }
    }
}

async fn serve_dns_tcp(listener: tokio::net::TcpListener, records: Shared) {
    loop {
        let Ok((mut sock, peer)) = listener.accept().await else {
            continue;
        };
        let records = records.clone();
        tokio::spawn(async move {
            loop {
                let Ok(len) = sock.read_u16().await else {
                    return;
                };
                let mut msg = vec![0u8; len as usize];
                if sock.read_exact(&mut msg).await.is_err() {
                    return;
                }
                let Some(answer) = dns_answer(&msg, peer, &records) else {
                    return;
                };
                let mut out = (answer.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&answer);
                if sock.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zone_answers_the_lab_names_only() {
        assert_eq!(zone("api.example.test"), Some(WEB_IP));
        assert_eq!(zone("ECHO.example.test."), Some(WEB_IP));
        assert_eq!(zone("raw.example.test"), Some(RAW_IP));
        assert_eq!(zone("far.example.test"), Some(FAR_IP));
        assert_eq!(zone("nope.example.test"), None);
        assert_eq!(zone("node.example.test"), Some(NODE_IP));
        assert_eq!(zone("49983-abc.NODE.example.test."), Some(NODE_IP));
        assert_eq!(zone("a.b.node.example.test"), None);
        assert_eq!(zone("example.test"), None);
    }

    #[test]
    fn dns_answers_a_and_nxdomain() {
        use hickory_proto::op::{Message, Query, ResponseCode};
        use hickory_proto::rr::{Name, RecordType};
        let records = Shared::default();
        let peer: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        let ask = |name: &str, t: RecordType| {
            let mut q = Message::query();
            q.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
            Message::from_vec(&dns_answer(&q.to_vec().unwrap(), peer, &records).unwrap()).unwrap()
        };
        let a = ask("api.example.test.", RecordType::A);
        assert_eq!(a.metadata.response_code, ResponseCode::NoError);
        assert_eq!(a.answers.len(), 1);
        let a = ask("api.example.test.", RecordType::AAAA);
        assert_eq!(a.metadata.response_code, ResponseCode::NoError);
        assert!(a.answers.is_empty());
        let a = ask("x.invalid.", RecordType::A);
        assert_eq!(a.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(records.lock().unwrap().dns.len(), 3);
    }
}
