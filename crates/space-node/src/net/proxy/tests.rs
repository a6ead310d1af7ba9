//! End-to-end tests of the egress proxy on loopback inside a throwaway network namespace:
//! a fake upstream HTTPS server with its own CA, an echo server, the proxy, and clients that
//! connect to the proxy's listener directly (upstream addresses are public-looking ones that
//! the [`Seams`] route to the loopback servers).

use std::collections::HashMap;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::net::{Egress, NetworkSpec, SecretBinding, SecretSource};

const PH: &str = "spc_ph_00112233445566778899aabbccddeeff";
const SECRET: &str = "sk-live-very-secret";

const API: &str = "api.test.example";
const OTHER: &str = "other.test.example";
const BULK: &str = "bulk.test.example";
const EVIL: &str = "evil.test.example";
const API_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const OTHER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
const BULK_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 12);
const EVIL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 13);

/// Removes the pinned namespace even when the test panics.
struct Pin(PathBuf, #[allow(dead_code)] tempfile::TempDir);

impl Drop for Pin {
    fn drop(&mut self) {
        let _ = space_sys::netns::remove_pinned(&self.0);
    }
}

/// Runs the future made by `make` on a fresh runtime inside a fresh network namespace with
/// only `lo` (up). Needs root.
fn in_fresh_netns<F: Future<Output = ()>>(make: impl FnOnce() -> F + Send) -> bool {
    if !rustix::process::geteuid().is_root() {
        eprintln!("needs root (network namespaces); not run");
        return false;
    }
    let dir = tempfile::tempdir().unwrap();
    let pin = Pin(dir.path().join("ns"), dir);
    space_sys::netns::create_pinned(&pin.0).unwrap();
    let ns = std::fs::File::open(&pin.0).unwrap();
    space_sys::netns::run_in(ns.as_fd(), || {
        let status = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("run ip");
        assert!(status.success(), "ip link set lo up: {status}");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(make());
    })
    .expect("test body in netns");
    true
}

struct FakeResolver(HashMap<String, Vec<Ipv4Addr>>);

#[async_trait::async_trait]
impl Resolve for FakeResolver {
    async fn lookup_v4(&self, name: &str) -> io::Result<Vec<Ipv4Addr>> {
        Ok(self.0.get(name).cloned().unwrap_or_default())
    }
}

struct FakeSecrets(HashMap<String, String>);

#[async_trait::async_trait]
impl SecretSource for FakeSecrets {
    async fn secret_value(&self, name: &str) -> Option<String> {
        self.0.get(name).cloned()
    }
}

/// A CA of the fake upstream world and a TLS server config for `hosts` signed by it.
struct UpstreamPki {
    ca_der: CertificateDer<'static>,
    ca_file: PathBuf,
    server: Arc<rustls::ServerConfig>,
}

fn upstream_pki(dir: &std::path::Path, hosts: &[&str]) -> UpstreamPki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "fake public CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = rcgen::CertifiedIssuer::self_signed(params, ca_key).unwrap();
    let ca_file = dir.join("upstream-ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf =
        rcgen::CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>())
            .unwrap()
            .signed_by(&leaf_key, &ca)
            .unwrap();
    let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone()],
        PrivatePkcs8KeyDer::from(leaf_key.serialize_der()).into(),
    )
    .unwrap();
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    UpstreamPki {
        ca_der: ca.der().clone(),
        ca_file,
        server: Arc::new(server),
    }
}

/// An HTTPS server answering every request with its headers (`name: value` lines), an empty
/// line and its body.
async fn echo_https(server: Arc<rustls::ServerConfig>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(server);
    tokio::spawn(async move {
        loop {
            let (sock, _) = listener.accept().await.unwrap();
            let _ = sock.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(sock).await else {
                    return;
                };
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let mut out = String::new();
                        for (k, v) in req.headers() {
                            out.push_str(&format!(
                                "{k}: {}\n",
                                String::from_utf8_lossy(v.as_bytes())
                            ));
                        }
                        out.push('\n');
                        let body = req.into_body().collect().await?.to_bytes();
                        out.push_str(&String::from_utf8_lossy(&body));
                        Ok::<_, hyper::Error>(http::Response::new(Full::new(Bytes::from(out))))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    addr
}

/// A TCP server that sends back whatever it receives.
async fn echo_tcp() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.3:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let _ = sock.set_nodelay(true);
            tokio::spawn(async move {
                let (mut r, mut w) = sock.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

struct World {
    _dir: tempfile::TempDir,
    ca: Arc<Ca>,
    pki: UpstreamPki,
    https: SocketAddr,
    echo: SocketAddr,
    resolver: Arc<FakeResolver>,
    secrets: Arc<Secrets>,
}

impl World {
    async fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let ca = Arc::new(Ca::load_or_create(&dir.path().join("ca")).unwrap());
        let pki = upstream_pki(dir.path(), &[API, OTHER, EVIL]);
        let https = echo_https(pki.server.clone()).await;
        let echo = echo_tcp().await;
        let resolver = Arc::new(FakeResolver(HashMap::from([
            (API.to_owned(), vec![API_IP]),
            (OTHER.to_owned(), vec![OTHER_IP]),
            // The first address is loopback: never used.
            (BULK.to_owned(), vec![Ipv4Addr::LOCALHOST, BULK_IP]),
            (EVIL.to_owned(), vec![EVIL_IP]),
        ])));
        let secrets = Arc::new(Secrets::default());
        secrets.set(Arc::new(FakeSecrets(HashMap::from([(
            "TOKEN".to_owned(),
            SECRET.to_owned(),
        )]))));
        World {
            _dir: dir,
            ca,
            pki,
            https,
            echo,
            resolver,
            secrets,
        }
    }

    fn routes(&self) -> HashMap<SocketAddrV4, SocketAddr> {
        let mut routes = HashMap::new();
        for ip in [API_IP, OTHER_IP, EVIL_IP] {
            routes.insert(SocketAddrV4::new(ip, 443), self.https);
        }
        for port in [80, 443] {
            routes.insert(SocketAddrV4::new(BULK_IP, port), self.echo);
        }
        routes
    }

    fn proxy(&self, original_dst: Option<SocketAddrV4>) -> Arc<EgressProxy> {
        Arc::new(
            EgressProxy::build(
                self.ca.clone(),
                Some(&self.pki.ca_file),
                self.resolver.clone(),
                self.secrets.clone(),
                Seams {
                    routes: self.routes(),
                    original_dst,
                },
            )
            .unwrap(),
        )
    }

    /// A proxy listener serving a sandbox with `spec` and a binding of TOKEN to `API`.
    async fn serve(
        &self,
        spec: NetworkSpec,
        original_dst: Option<SocketAddrV4>,
    ) -> (SocketAddr, Arc<SandboxNet>) {
        let policy = Policy::new(&spec, &["10.213.0.0/16".parse().unwrap()]).unwrap();
        let sandbox = SandboxNet::new(
            "sb-test",
            Ipv4Addr::new(10, 213, 0, 2),
            policy,
            vec![SecretBinding {
                name: "TOKEN".into(),
                placeholder: PH.into(),
                hosts: vec![API.into()],
                header: "Authorization: Bearer {}".into(),
                inject: false,
                secret: String::new(),
            }],
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // The test's clients connect from 127.0.0.1: that is the sandbox's slot.
        let slot = ProxySlot::new(sandbox.clone());
        self.proxy(original_dst).serve_node(
            listener,
            Arc::new(move |src| (src == Ipv4Addr::LOCALHOST).then(|| slot.clone())),
        );
        (addr, sandbox)
    }
}

fn allowlist(names: &[&str]) -> NetworkSpec {
    NetworkSpec {
        egress: Egress::Allowlist,
        allow: names.iter().map(|s| s.to_string()).collect(),
    }
}

fn tls_client(roots: &[&CertificateDer<'static>]) -> tokio_rustls::TlsConnector {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add((*r).clone()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(store)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTPS request through the proxy at `proxy` to `host`; returns the echo.
async fn https_request(
    proxy: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> io::Result<String> {
    let (status, echo) = https_request_as(proxy, connector, host, host, headers, body).await?;
    assert_eq!(status, 200, "{echo}");
    Ok(echo)
}

/// One HTTPS request through the proxy with SNI `sni` and Host `host`; returns the status and
/// the body.
async fn https_request_as(
    proxy: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
    sni: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> io::Result<(u16, String)> {
    let tcp = TcpStream::connect(proxy).await?;
    tcp.set_nodelay(true)?;
    let tls = connector
        .connect(ServerName::try_from(sni.to_owned()).unwrap(), tcp)
        .await?;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(io::Error::other)?;
    tokio::spawn(conn);
    let mut req = http::Request::post("/echo").header("host", host);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender
        .send_request(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .map_err(io::Error::other)?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(io::Error::other)?
        .to_bytes();
    Ok((status, String::from_utf8(bytes.to_vec()).unwrap()))
}

#[test]
fn secret_reaches_the_bound_header_of_the_bound_host_only() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let (proxy, sandbox) = w.serve(allowlist(&[API, OTHER]), None).await;
        let bearer = format!("Bearer {PH}");
        let headers = [("authorization", bearer.as_str()), ("x-copy", PH)];

        // Intercepted: the client trusts the node CA only.
        let node = tls_client(&[w.ca.cert_der()]);
        let echo = https_request(proxy, &node, API, &headers, &format!("body {PH}"))
            .await
            .unwrap();
        assert!(
            echo.contains(&format!("authorization: Bearer {SECRET}\n")),
            "{echo}"
        );
        assert!(echo.contains(&format!("x-copy: {PH}\n")), "{echo}");
        assert!(echo.ends_with(&format!("\nbody {PH}")), "{echo}");
        assert_eq!(echo.matches(SECRET).count(), 1, "{echo}");

        // Every request of a kept-alive connection gets it.
        let tcp = TcpStream::connect(proxy).await.unwrap();
        let tls = node
            .connect(ServerName::try_from(API).unwrap(), tcp)
            .await
            .unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(conn);
        for _ in 0..3 {
            sender.ready().await.unwrap();
            let req = http::Request::get("/")
                .header("host", API)
                .header("authorization", &bearer)
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = sender.send_request(req).await.unwrap();
            let echo = resp.into_body().collect().await.unwrap().to_bytes();
            let echo = String::from_utf8_lossy(&echo);
            assert!(
                echo.contains(&format!("authorization: Bearer {SECRET}\n")),
                "{echo}"
            );
        }
        drop(sender);

        // Another host: passed through untouched (the client sees the real certificate).
        let public = tls_client(&[&w.pki.ca_der]);
        let echo = https_request(proxy, &public, OTHER, &headers, PH)
            .await
            .unwrap();
        assert!(
            echo.contains(&format!("authorization: Bearer {PH}\n")),
            "{echo}"
        );
        assert!(!echo.contains(SECRET));
        // ... and the intercepted host is not: its certificate is the node CA's.
        assert!(
            https_request(proxy, &public, API, &headers, "")
                .await
                .is_err()
        );

        // The binding removed: the placeholder goes out as it is.
        sandbox.set_secrets(vec![]);
        let echo = https_request(proxy, &public, API, &headers, "")
            .await
            .unwrap();
        assert!(
            echo.contains(&format!("authorization: Bearer {PH}\n")),
            "{echo}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(sandbox.connections(), 0);
    });
}

#[test]
fn secrets_go_only_where_sni_host_and_destination_agree() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let bearer = format!("Bearer {PH}");
        let headers = [("authorization", bearer.as_str())];
        let node = tls_client(&[w.ca.cert_der()]);
        let (proxy, _) = w.serve(allowlist(&[API, OTHER]), None).await;
        // The SNI is the bound host, the Host another one (a CDN routing by Host would hand
        // the secret to it): refused, nothing reaches the upstream.
        for host in [
            OTHER,
            EVIL,
            "api.test.example:8443",
            "api.test.example.evil.com",
        ] {
            let (status, body) = https_request_as(proxy, &node, API, host, &headers, "")
                .await
                .unwrap();
            assert_eq!(status, 421, "{host}: {body}");
            assert!(
                !body.contains(SECRET) && body.contains(API),
                "{host}: {body}"
            );
        }
        // The same host however it is spelt is the same host.
        for host in [
            "API.test.example",
            "api.test.example.",
            "api.test.example:443",
        ] {
            let (status, echo) = https_request_as(proxy, &node, API, host, &headers, "")
                .await
                .unwrap();
            assert_eq!(status, 200, "{host}: {echo}");
            assert!(echo.contains(SECRET), "{host}: {echo}");
        }

        // The bound name as SNI, but the policy admits only the address the sandbox chose:
        // the connection goes by address, so it is passed through, never intercepted (the
        // client sees the upstream's own certificate and the placeholder stays).
        let by_address = NetworkSpec {
            egress: Egress::Allowlist,
            allow: vec![format!("{API_IP}/32")],
        };
        let (proxy, _) = w
            .serve(by_address, Some(SocketAddrV4::new(API_IP, 443)))
            .await;
        assert!(
            https_request(proxy, &node, API, &headers, "")
                .await
                .is_err()
        );
        let public = tls_client(&[&w.pki.ca_der]);
        let echo = https_request(proxy, &public, API, &headers, "")
            .await
            .unwrap();
        assert!(
            echo.contains(&format!("authorization: Bearer {PH}\n")) && !echo.contains(SECRET),
            "{echo}"
        );
    });
}

#[test]
fn missing_secret_value_leaves_the_placeholder() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        w.secrets.set(Arc::new(FakeSecrets(HashMap::new())));
        let (proxy, _sandbox) = w.serve(allowlist(&[API]), None).await;
        let bearer = format!("Bearer {PH}");
        let node = tls_client(&[w.ca.cert_der()]);
        let echo = https_request(proxy, &node, API, &[("authorization", &bearer)], "")
            .await
            .unwrap();
        assert!(
            echo.contains(&format!("authorization: Bearer {PH}\n")),
            "{echo}"
        );
    });
}

#[test]
fn disallowed_names_and_addresses_are_refused() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let (proxy, sandbox) = w.serve(allowlist(&[API, BULK]), None).await;
        let public = tls_client(&[&w.pki.ca_der]);
        let err = https_request(proxy, &public, EVIL, &[], "").await;
        assert!(err.is_err(), "{err:?}");

        let mut tcp = TcpStream::connect(proxy).await.unwrap();
        tcp.write_all(format!("GET / HTTP/1.1\r\nHost: {EVIL}:80\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut resp = String::new();
        tcp.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{resp}");
        assert!(
            resp.contains(EVIL) && resp.contains("egress policy"),
            "{resp}"
        );
        assert_eq!(sandbox.connections(), 0);

        // Plain HTTP to an allowed name passes (BULK resolves to loopback first: skipped).
        let mut tcp = TcpStream::connect(proxy).await.unwrap();
        let req = format!("GET / HTTP/1.1\r\nHost: {BULK}\r\n\r\n");
        tcp.write_all(req.as_bytes()).await.unwrap();
        let mut back = vec![0; req.len()];
        tcp.read_exact(&mut back).await.unwrap();
        assert_eq!(back, req.as_bytes());
    });
}

#[test]
fn by_address_when_redirected() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let open = NetworkSpec {
            egress: Egress::Open,
            allow: vec![],
        };
        // No name (binary protocol): the original destination decides.
        let (proxy, _) = w
            .serve(open.clone(), Some(SocketAddrV4::new(BULK_IP, 443)))
            .await;
        let mut tcp = TcpStream::connect(proxy).await.unwrap();
        tcp.write_all(b"\x00binary").await.unwrap();
        let mut back = [0u8; 7];
        tcp.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"\x00binary");

        // Private, loopback and the node's own addresses (even public ones) are refused.
        let node_public = Ipv4Addr::new(198, 51, 100, 1);
        let st = std::process::Command::new("ip")
            .args(["addr", "add", "198.51.100.1/32", "dev", "lo"])
            .status()
            .unwrap();
        assert!(st.success(), "ip addr add: {st}");
        assert!(Policy::new(&open, &[]).unwrap().allows_ip(node_public, 80));
        for dst in [
            node_public,
            Ipv4Addr::new(10, 1, 2, 3),
            Ipv4Addr::LOCALHOST,
            Ipv4Addr::new(127, 0, 0, 3),
        ] {
            let (proxy, _) = w
                .serve(open.clone(), Some(SocketAddrV4::new(dst, 80)))
                .await;
            let mut tcp = TcpStream::connect(proxy).await.unwrap();
            tcp.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            let mut resp = String::new();
            tcp.read_to_string(&mut resp).await.unwrap();
            assert!(resp.starts_with("HTTP/1.1 403"), "{dst}: {resp}");
            assert!(resp.contains(&dst.to_string()), "{resp}");
        }
    });
}

fn pattern(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Sends `prefix` + `data` through the proxy to the echo server and reads it all back.
async fn round_trip(proxy: SocketAddr, prefix: &[u8], data: Arc<Vec<u8>>) -> Vec<u8> {
    let tcp = TcpStream::connect(proxy).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (mut r, mut w) = tcp.into_split();
    let total = prefix.len() + data.len();
    let prefix = prefix.to_vec();
    let writer = tokio::spawn(async move {
        w.write_all(&prefix).await.unwrap();
        for chunk in data.chunks(256 * 1024) {
            w.write_all(chunk).await.unwrap();
        }
        w
    });
    let mut back = Vec::with_capacity(total);
    while back.len() < total {
        let n = r.read_buf(&mut back).await.unwrap();
        assert!(n > 0, "closed after {} of {total} bytes", back.len());
    }
    drop(writer.await.unwrap());
    back
}

#[test]
fn pass_through_is_byte_exact_for_64_mib() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let (proxy, _) = w.serve(allowlist(&[BULK]), None).await;
        let data = Arc::new(pattern(64 << 20));
        let prefix = format!("POST /bulk HTTP/1.1\r\nHost: {BULK}\r\n\r\n");
        let back = round_trip(proxy, prefix.as_bytes(), data.clone()).await;
        assert_eq!(&back[..prefix.len()], prefix.as_bytes());
        assert!(back[prefix.len()..] == data[..], "echoed bytes differ");

        // The same through a TLS ClientHello (not intercepted: no binding for BULK).
        let hello = sniff::tests::client_hello(BULK);
        let back = round_trip(proxy, &hello, Arc::new(pattern(1 << 20))).await;
        assert_eq!(&back[..hello.len()], &hello[..]);
    });
}

#[test]
fn tightened_policy_cuts_live_connections() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let (proxy, sandbox) = w.serve(allowlist(&[BULK, API]), None).await;
        let mut tcp = TcpStream::connect(proxy).await.unwrap();
        let req = format!("GET / HTTP/1.1\r\nHost: {BULK}\r\n\r\n");
        tcp.write_all(req.as_bytes()).await.unwrap();
        let mut back = vec![0; req.len()];
        tcp.read_exact(&mut back).await.unwrap();
        assert_eq!(sandbox.connections(), 1);

        // Still allowed: nothing cut.
        let same = Policy::new(&allowlist(&[BULK]), &[]).unwrap();
        assert_eq!(sandbox.set_policy(same), 0);
        tcp.write_all(b"ping").await.unwrap();
        let mut pong = [0u8; 4];
        tcp.read_exact(&mut pong).await.unwrap();

        let tighter = Policy::new(&allowlist(&[API]), &[]).unwrap();
        assert_eq!(sandbox.set_policy(tighter), 1);
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(2), tcp.read_to_end(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(sandbox.connections(), 0);

        // New connections to the name are refused now.
        let mut tcp = TcpStream::connect(proxy).await.unwrap();
        tcp.write_all(req.as_bytes()).await.unwrap();
        let mut resp = String::new();
        tcp.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    });
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Prints pass-through throughput and per-request latency (direct, passed through,
/// intercepted). `cargo test -p space-node --release net::proxy::tests::bench -- --ignored
/// --nocapture`
#[test]
#[ignore]
fn bench() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        let (proxy, _) = w.serve(allowlist(&[BULK, API, OTHER]), None).await;
        let data = Arc::new(pattern(512 << 20));
        let prefix = format!("POST / HTTP/1.1\r\nHost: {BULK}\r\n\r\n");
        for via in ["direct", "proxy"] {
            let to = if via == "direct" { w.echo } else { proxy };
            let start = Instant::now();
            let pre: &[u8] = if via == "direct" {
                b""
            } else {
                prefix.as_bytes()
            };
            let back = round_trip(to, pre, data.clone()).await;
            let secs = start.elapsed().as_secs_f64();
            assert_eq!(back.len(), pre.len() + data.len());
            println!(
                "throughput {via}: {:.0} MB/s (512 MiB echoed)",
                (data.len() as f64) / secs / 1e6
            );
        }
        let node = tls_client(&[w.ca.cert_der()]);
        let public = tls_client(&[&w.pki.ca_der]);
        let n = 300;
        for (label, to, conn, host) in [
            ("direct https", w.https, &public, OTHER),
            ("passed-through https", proxy, &public, OTHER),
            ("intercepted https", proxy, &node, API),
        ] {
            let mut times = Vec::with_capacity(n);
            for _ in 0..n {
                let start = Instant::now();
                https_request(to, conn, host, &[("authorization", PH)], "x")
                    .await
                    .unwrap();
                times.push(start.elapsed());
            }
            println!(
                "{label}: p50 {:?} per request on a new connection",
                p50(times)
            );
        }
        // Requests on one intercepted keep-alive connection.
        let tcp = TcpStream::connect(proxy).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let tls = node
            .connect(ServerName::try_from(API).unwrap(), tcp)
            .await
            .unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let start = Instant::now();
            let req = http::Request::get("/")
                .header("host", API)
                .header("authorization", format!("Bearer {PH}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            sender.ready().await.unwrap();
            let resp = sender.send_request(req).await.unwrap();
            resp.into_body().collect().await.unwrap();
            times.push(start.elapsed());
        }
        println!("intercepted keep-alive request: p50 {:?}", p50(times));
    });
}

#[test]
fn redirected_connections_use_the_original_destination() {
    in_fresh_netns(|| async {
        let w = World::new().await;
        // As the slot ruleset does: connections to ports 80 and 443 go to the listener.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let rules = format!(
            "table ip t {{\n chain out {{\n type nat hook output priority -100;\n \
             ip daddr 192.0.2.0/24 tcp dport {{ 80, 443 }} redirect to :{port}\n }}\n}}\n"
        );
        let mut nft = std::process::Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        nft.stdin
            .take()
            .unwrap()
            .write_all(rules.as_bytes())
            .unwrap();
        assert!(nft.wait().unwrap().success(), "nft");
        // 192.0.2.0/24 needs a route (with a source address) for connect() to start; the
        // redirect then applies.
        let st = std::process::Command::new("ip")
            .args([
                "route",
                "add",
                "192.0.2.0/24",
                "dev",
                "lo",
                "src",
                "127.0.0.1",
            ])
            .status()
            .unwrap();
        assert!(st.success());

        let target = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 7), 80);
        let mut routes = w.routes();
        routes.insert(target, w.echo);
        let proxy = Arc::new(
            EgressProxy::build(
                w.ca.clone(),
                None,
                w.resolver.clone(),
                w.secrets.clone(),
                Seams {
                    routes,
                    original_dst: None,
                },
            )
            .unwrap(),
        );
        let spec = NetworkSpec {
            egress: Egress::Allowlist,
            allow: vec!["192.0.2.7".into(), BULK.into()],
        };
        let sandbox = SandboxNet::new(
            "sb-nat",
            Ipv4Addr::new(10, 213, 0, 2),
            Policy::new(&spec, &[]).unwrap(),
            vec![],
        );
        let slot = ProxySlot::new(sandbox.clone());
        proxy.serve_node(listener, Arc::new(move |_| Some(slot.clone())));

        // Redirected, no name: the original destination (address and port) decides.
        let mut tcp = TcpStream::connect(target).await.unwrap();
        let req = b"GET / HTTP/1.0\r\n\r\n";
        tcp.write_all(req).await.unwrap();
        let mut back = [0u8; 18];
        tcp.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, req);
        drop(tcp);

        // Another redirected address, not allowed: refused, naming it.
        let mut tcp = TcpStream::connect("192.0.2.8:80").await.unwrap();
        tcp.write_all(req).await.unwrap();
        let mut resp = String::new();
        tcp.read_to_string(&mut resp).await.unwrap();
        assert!(
            resp.starts_with("HTTP/1.1 403") && resp.contains("192.0.2.8"),
            "{resp}"
        );

        // Straight to the listener (not redirected): by name only, default port.
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let req = format!("GET / HTTP/1.1\r\nHost: {BULK}\r\n\r\n");
        tcp.write_all(req.as_bytes()).await.unwrap();
        let mut back = vec![0; req.len()];
        tcp.read_exact(&mut back).await.unwrap();
        assert_eq!(back, req.as_bytes());
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        tcp.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        let mut resp = String::new();
        tcp.read_to_string(&mut resp).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    });
}
