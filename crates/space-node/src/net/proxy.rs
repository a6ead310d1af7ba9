//! The transparent egress proxy (decision 0012): every TCP connection a sandbox makes to ports
//! 80 and 443 is redirected by the node's root table to the node's one listener, in its own
//! namespace (decision 0059), which finds the sandbox by the connection's source address and
//! decides where it may go and how:
//!
//! 1. read the first bytes (at most [`PEEK_MAX`], at most [`PEEK_TIMEOUT`]): a TLS ClientHello
//!    gives the SNI, a plain HTTP/1.x request its Host header;
//! 2. a name the sandbox's policy allows is resolved by the node (never the sandbox's DNS) and
//!    the first address the policy accepts for it is used; otherwise the original destination
//!    (`SO_ORIGINAL_DST`) is used if the policy allows that address; otherwise the connection
//!    is refused (closed; plain HTTP gets a 403 naming the host). Addresses of the node itself
//!    and loopback are never connected to;
//! 3. TLS to a host that one of the sandbox's secrets is bound to is intercepted (see [`mitm`]):
//!    the sandbox sees a leaf of the node CA, the upstream is verified against the public and
//!    configured roots, and the secret's placeholder is replaced by its value in the bound
//!    header only. Everything else is copied through byte for byte.
//!
//! Every connection is registered with the sandbox's [`SandboxNet`], whose policy updates
//! cancel the connections they no longer allow; a cancelled connection's sockets are dropped.
//!
//! A connection made straight to the listener (not redirected) has no original destination:
//! it may only go by name, to port 443 for TLS and 80 otherwise.

mod mitm;
pub mod sniff;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::ca::Ca;
use super::policy::{Policy, matches_host};
use super::{Resolve, SandboxNet, Secrets, SlotLookup, slot_of};
use sniff::{Proto, Sniff};

/// At most this many bytes are read before deciding.
pub const PEEK_MAX: usize = 16 * 1024;
/// At most this long is waited for them.
pub const PEEK_TIMEOUT: Duration = Duration::from_secs(5);
/// Simultaneous proxied connections per sandbox; more are closed at once.
pub const MAX_CONNS_PER_SANDBOX: usize = 1024;

/// A slot as the proxy serves it: its sandbox's network state, and its share of the proxy
/// ([`MAX_CONNS_PER_SANDBOX`] connections at once).
#[derive(Debug, Clone)]
pub struct ProxySlot {
    pub net: Arc<SandboxNet>,
    pub limit: Arc<Semaphore>,
}

impl ProxySlot {
    pub fn new(net: Arc<SandboxNet>) -> ProxySlot {
        ProxySlot {
            net,
            limit: Arc::new(Semaphore::new(MAX_CONNS_PER_SANDBOX)),
        }
    }
}
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Copy buffer per direction on the pass-through path.
const COPY_BUF: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("failed to read upstream CA file {path}")]
    UpstreamCaRead {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no usable certificate in upstream CA file {0}")]
    UpstreamCaEmpty(PathBuf),
    #[error("failed to configure TLS")]
    Tls(#[source] rustls::Error),
}

/// Admits at most a few warnings per second (the guest can trigger them).
#[derive(Debug)]
pub(crate) struct LogLimiter {
    start: Instant,
    second: AtomicU64,
    count: AtomicU32,
}

impl LogLimiter {
    const PER_SECOND: u32 = 10;

    pub(crate) fn new() -> LogLimiter {
        LogLimiter {
            start: Instant::now(),
            second: AtomicU64::new(0),
            count: AtomicU32::new(0),
        }
    }

    pub(crate) fn allow(&self) -> bool {
        let now = self.start.elapsed().as_secs();
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.count.store(0, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed) < Self::PER_SECOND
    }
}

/// Presents, for any SNI, a leaf of the node CA. The SNI is the sandbox's choice, so the
/// warning a bad one causes is rate-limited.
#[derive(Debug)]
struct LeafResolver(Arc<Ca>, LogLimiter);

impl ResolvesServerCert for LeafResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = hello.server_name()?;
        match self.0.leaf(name) {
            Ok(leaf) => Some(leaf),
            Err(e) => {
                if self.1.allow() {
                    tracing::warn!(error = %e, "failed to make a leaf certificate");
                }
                None
            }
        }
    }
}

/// Test seams: where connections really go, and a fixed original destination (tests connect
/// to the listener directly, without NAT).
#[derive(Debug, Default)]
struct Seams {
    routes: HashMap<SocketAddrV4, SocketAddr>,
    original_dst: Option<SocketAddrV4>,
}

/// The node's egress proxy, shared by all slots ([`EgressProxy::serve`] runs one accept loop
/// per slot).
pub struct EgressProxy {
    server_tls: Arc<rustls::ServerConfig>,
    client_tls: TlsConnector,
    resolver: Arc<dyn Resolve>,
    secrets: Arc<Secrets>,
    warn: Arc<LogLimiter>,
    seams: Seams,
}

impl std::fmt::Debug for EgressProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxy").finish_non_exhaustive()
    }
}

/// The roots upstream servers are verified against: the Mozilla roots, the system's (best
/// effort) and the certificates of `extra` (a PEM file).
fn upstream_roots(extra: Option<&Path>) -> Result<rustls::RootCertStore, ProxyError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let native = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    tracing::debug!(
        added,
        errors = native.errors.len(),
        "system CA certificates"
    );
    if let Some(path) = extra {
        let err = |source| ProxyError::UpstreamCaRead {
            path: path.to_owned(),
            source,
        };
        let pem = std::fs::read(path).map_err(err)?;
        let certs = rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(ProxyError::UpstreamCaEmpty(path.to_owned()));
        }
    }
    Ok(roots)
}

/// Whether `ip` is an address of this host (binding to it succeeds only then).
fn is_local(ip: Ipv4Addr) -> bool {
    std::net::UdpSocket::bind(SocketAddrV4::new(ip, 0)).is_ok()
}

/// Never connected to, whatever the policy says.
fn forbidden_target(ip: Ipv4Addr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || ip.is_broadcast() || is_local(ip)
}

/// A stream whose first bytes were already read: they are read again first.
struct Prefixed {
    prefix: Vec<u8>,
    pos: usize,
    inner: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.pos);
            let start = self.pos;
            buf.put_slice(&self.prefix[start..start + n]);
            self.pos += n;
            if self.pos == self.prefix.len() {
                self.prefix = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Reads the connection's first bytes until they say where it goes (bounded in size and
/// time). None when the client went away without sending anything.
async fn read_hello(client: &mut TcpStream) -> Option<(Vec<u8>, Proto, Option<String>)> {
    let mut buf = vec![0u8; PEEK_MAX];
    let mut len = 0;
    let deadline = tokio::time::Instant::now() + PEEK_TIMEOUT;
    loop {
        if let Sniff::Done { proto, name } = sniff::sniff(&buf[..len]) {
            buf.truncate(len);
            return Some((buf, proto, name));
        }
        if len == PEEK_MAX {
            break;
        }
        match tokio::time::timeout_at(deadline, client.read(&mut buf[len..])).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => len += n,
            Ok(Err(_)) => return None,
        }
    }
    if len == 0 {
        return None;
    }
    buf.truncate(len);
    let (proto, name) = sniff::give_up(&buf);
    Some((buf, proto, name))
}

/// Where a connection may go.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    /// The name it is allowed by (None: allowed by address).
    name: Option<String>,
    ip: Ipv4Addr,
}

async fn http_error(client: &mut TcpStream, status: &str, body: &str) {
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), client.write_all(resp.as_bytes())).await;
    let _ = client.shutdown().await;
}

impl EgressProxy {
    /// A proxy that presents leaves of `ca` to sandboxes, verifies upstreams against the
    /// public roots, the system's and `upstream_ca`, resolves names with `resolver` and takes
    /// secret values from `secrets`.
    pub fn new(
        ca: Arc<Ca>,
        upstream_ca: Option<&Path>,
        resolver: Arc<dyn Resolve>,
        secrets: Arc<Secrets>,
    ) -> Result<Arc<EgressProxy>, ProxyError> {
        Ok(Arc::new(Self::build(
            ca,
            upstream_ca,
            resolver,
            secrets,
            Seams::default(),
        )?))
    }

    fn build(
        ca: Arc<Ca>,
        upstream_ca: Option<&Path>,
        resolver: Arc<dyn Resolve>,
        secrets: Arc<Secrets>,
        seams: Seams,
    ) -> Result<EgressProxy, ProxyError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(ProxyError::Tls)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(LeafResolver(ca, LogLimiter::new())));
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(ProxyError::Tls)?
            .with_root_certificates(upstream_roots(upstream_ca)?)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(EgressProxy {
            server_tls: Arc::new(server),
            client_tls: TlsConnector::from(Arc::new(client)),
            resolver,
            secrets,
            warn: Arc::new(LogLimiter::new()),
            seams,
        })
    }

    /// Accepts and proxies every slot's connections on `listener`, in the node's own
    /// namespace (decision 0059: the root table redirects a slot's ports 80 and 443 here),
    /// until the returned task is aborted, which also ends its connections. Each connection
    /// is served under the policy of the slot its source address belongs to; one from no
    /// slot is closed.
    pub fn serve_node(
        self: &Arc<Self>,
        listener: TcpListener,
        lookup: SlotLookup<ProxySlot>,
    ) -> JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move { this.accept_loop(listener, lookup).await })
    }

    async fn accept_loop(self: Arc<Self>, listener: TcpListener, lookup: SlotLookup<ProxySlot>) {
        let listen_addr = listener.local_addr().ok();
        // Dropped (aborting every connection) when this task is aborted.
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((sock, peer)) => {
                        let Some(ProxySlot { net: sandbox, limit }) = slot_of(&lookup, peer) else {
                            tracing::debug!(%peer, "proxied connection from no slot; closed");
                            continue;
                        };
                        let Ok(permit) = limit.try_acquire_owned() else {
                            if self.warn.allow() {
                                tracing::warn!(sandbox = %sandbox.id(),
                                    "too many proxied connections; closing a new one");
                            }
                            continue;
                        };
                        let this = self.clone();
                        conns.spawn(async move {
                            this.handle(sock, listen_addr, &sandbox).await;
                            drop(permit);
                        });
                    }
                    Err(e) => {
                        if self.warn.allow() {
                            tracing::warn!(error = %e, "proxy accept failed");
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    }

    /// Where the client meant to connect, if it was redirected (not when it connected to the
    /// listener itself).
    fn original_dst(
        &self,
        client: &TcpStream,
        listen_addr: Option<SocketAddr>,
    ) -> Option<SocketAddrV4> {
        if let Some(dst) = self.seams.original_dst {
            return Some(dst);
        }
        let dst = SocketAddr::V4(space_sys::netns::original_dst(client.as_fd()).ok()?);
        if Some(dst) == listen_addr || Some(dst) == client.local_addr().ok() {
            return None;
        }
        match dst {
            SocketAddr::V4(d) => Some(d),
            SocketAddr::V6(_) => None,
        }
    }

    /// The policy's verdict for a connection to `name` (if the client named one) on `port`
    /// whose original destination was `dst_ip` (if redirected).
    async fn decide(
        &self,
        policy: &Policy,
        name: Option<&str>,
        dst_ip: Option<Ipv4Addr>,
        port: u16,
    ) -> Option<Target> {
        if let Some(name) = name.filter(|n| policy.allows_name_on(n, port)) {
            match tokio::time::timeout(RESOLVE_TIMEOUT, self.resolver.lookup_v4(name)).await {
                Ok(Ok(ips)) => {
                    if let Some(ip) = ips
                        .into_iter()
                        .find(|&ip| policy.allows_resolved_ip(ip) && !forbidden_target(ip))
                    {
                        return Some(Target {
                            name: Some(name.to_owned()),
                            ip,
                        });
                    }
                }
                Ok(Err(e)) => tracing::debug!(name, error = %e, "proxy lookup failed"),
                Err(_) => tracing::debug!(name, "proxy lookup timed out"),
            }
        }
        dst_ip
            .filter(|&ip| policy.allows_ip(ip, port) && !forbidden_target(ip))
            .map(|ip| Target { name: None, ip })
    }

    async fn connect(&self, to: SocketAddrV4) -> io::Result<TcpStream> {
        let addr = self
            .seams
            .routes
            .get(&to)
            .copied()
            .unwrap_or(SocketAddr::V4(to));
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    async fn handle(
        &self,
        mut client: TcpStream,
        listen_addr: Option<SocketAddr>,
        sandbox: &Arc<SandboxNet>,
    ) {
        let _ = client.set_nodelay(true);
        let dst = self.original_dst(&client, listen_addr);
        let Some((hello, proto, name)) = read_hello(&mut client).await else {
            return;
        };
        let port = match (dst, proto) {
            (Some(d), _) => d.port(),
            (None, Proto::Tls) => 443,
            (None, _) => 80,
        };
        let dst_ip = dst.map(|d| *d.ip());
        let policy = sandbox.policy();
        let target = self.decide(&policy, name.as_deref(), dst_ip, port).await;
        let guard = target
            .as_ref()
            .map(|t| sandbox.register(t.name.as_deref(), t.ip, port))
            .filter(|g| !g.cancel.is_cancelled());
        let (Some(target), Some(guard)) = (target, guard) else {
            tracing::debug!(sandbox = %sandbox.id(), name = ?name, ip = ?dst_ip, port,
                verdict = "refused", "egress");
            if proto == Proto::Http {
                let host = name
                    .clone()
                    .or_else(|| dst_ip.map(|ip| ip.to_string()))
                    .unwrap_or_else(|| "this host".into());
                let body = format!("{host} is not allowed by the egress policy of this sandbox\n");
                http_error(&mut client, "403 Forbidden", &body).await;
            }
            return;
        };
        // Secrets go only where the name, the address and the Host agree: the target must have
        // been reached by the SNI (the node resolved it; an address the sandbox picked is
        // passed through untouched), the upstream proves the name with its certificate, and
        // each request must name it (`mitm`).
        let intercept = proto == Proto::Tls
            && target
                .name
                .as_deref()
                .is_some_and(|n| sandbox.secrets().iter().any(|b| matches_host(&b.hosts, n)));
        tracing::debug!(sandbox = %sandbox.id(), name = ?name, ip = %target.ip, port,
            by_name = target.name.is_some(),
            verdict = if intercept { "intercept" } else { "pass" }, "egress");
        let work = async {
            let upstream = match self.connect(SocketAddrV4::new(target.ip, port)).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(sandbox = %sandbox.id(), ip = %target.ip, port, error = %e,
                        "upstream connect failed");
                    if proto == Proto::Http {
                        http_error(&mut client, "502 Bad Gateway", "upstream unreachable\n").await;
                    }
                    return;
                }
            };
            match (intercept, name) {
                (true, Some(host)) => {
                    let client = Prefixed {
                        prefix: hello,
                        pos: 0,
                        inner: client,
                    };
                    self.intercept(client, host, port, upstream, sandbox, &guard.cancel)
                        .await
                }
                _ => pass(client, &hello, upstream).await,
            }
        };
        tokio::select! {
            _ = guard.cancel.cancelled() => {
                tracing::debug!(sandbox = %sandbox.id(), ip = %target.ip, "connection cut by policy");
            }
            _ = work => {}
        }
    }

    /// Serves `client` (the bytes already read put back in front) as `mitm` does.
    async fn intercept(
        &self,
        client: Prefixed,
        host: String,
        port: u16,
        upstream: TcpStream,
        sandbox: &Arc<SandboxNet>,
        cancel: &tokio_util::sync::CancellationToken,
    ) {
        let Ok(server_name) = ServerName::try_from(host.clone()) else {
            return;
        };
        let acceptor = TlsAcceptor::from(self.server_tls.clone());
        let (client, upstream) = tokio::join!(
            tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(client)),
            tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                self.client_tls.connect(server_name, upstream)
            ),
        );
        let client = match client {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::debug!(sandbox = %sandbox.id(), host, error = %e, "client TLS handshake failed");
                return;
            }
            Err(_) => return,
        };
        let upstream = match upstream {
            Ok(Ok(u)) => Ok(u),
            Ok(Err(e)) => {
                if self.warn.allow() {
                    tracing::warn!(sandbox = %sandbox.id(), host, error = %e,
                        "upstream TLS handshake failed");
                }
                Err(format!("TLS handshake with {host} failed: {e}"))
            }
            Err(_) => Err(format!("TLS handshake with {host} timed out")),
        };
        let ctx = mitm::Ctx {
            host,
            port,
            sandbox: sandbox.clone(),
            secrets: self.secrets.clone(),
            cancel: cancel.clone(),
            warn: self.warn.clone(),
        };
        mitm::serve(client, upstream, ctx).await;
    }
}

/// Copies both ways, the bytes already read from the client first.
async fn pass(mut client: TcpStream, hello: &[u8], mut upstream: TcpStream) {
    if upstream.write_all(hello).await.is_err() {
        return;
    }
    let _ =
        tokio::io::copy_bidirectional_with_sizes(&mut client, &mut upstream, COPY_BUF, COPY_BUF)
            .await;
}
