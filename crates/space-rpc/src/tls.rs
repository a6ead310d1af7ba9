//! TLS between the cluster's members (decision 0033), and the TLS listener spaced's servers
//! share.
//!
//! - A node agent serves the node contract with its cluster identity and accepts only a
//!   client whose certificate, from the cluster CA, names the control plane
//!   ([`node_server_config`]).
//! - The control plane's cluster listener serves with its own identity; a client certificate
//!   is optional there (a node joins before it has one), and when given it must be the cluster
//!   CA's ([`control_server_config`]); which node it is, if any, the handlers decide from its
//!   fingerprint ([`PeerCert`]).
//! - Each side dials the other trusting only the cluster CA and expecting the other's cluster
//!   name ([`client_config`], [`tls_channel`]).
//!
//! Handshakes run in tasks of their own (at most [`MAX_HANDSHAKES`] at once, each bounded by
//! [`HANDSHAKE_TIMEOUT`]), so a client that never finishes one holds up nobody; finished ones
//! are handed to axum's server through [`TlsListener`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tonic::transport::{Channel, Endpoint};

/// Handshakes in progress at most; further connections wait to be accepted.
pub const MAX_HANDSHAKES: usize = 256;
/// A client that has not finished its handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A member's TLS material: the cluster CA's certificate and the member's own identity.
#[derive(Clone)]
pub struct ClusterTls {
    ca: CertificateDer<'static>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<rustls::pki_types::PrivateKeyDer<'static>>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ClusterTls {
    /// From PEM: the CA's certificate, the member's certificate and its key.
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self, String> {
        let cert = |pem: &str, what: &str| {
            rustls_pemfile::certs(&mut pem.as_bytes())
                .next()
                .ok_or_else(|| format!("no certificate in the {what}"))?
                .map_err(|e| format!("the {what} is not PEM: {e}"))
        };
        let key = rustls_pemfile::private_key(&mut key_pem.as_bytes())
            .map_err(|e| format!("the member key is not PEM: {e}"))?
            .ok_or("no private key in the member key")?;
        Ok(Self {
            ca: cert(ca_pem, "cluster CA")?,
            chain: vec![cert(cert_pem, "member certificate")?],
            key: Arc::new(key),
        })
    }

    fn roots(&self) -> Arc<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        // A CA certificate rustls cannot parse fails every handshake, with its reason.
        let _ = roots.add(self.ca.clone());
        Arc::new(roots)
    }

    fn client_verifier(&self, mandatory: bool) -> Arc<dyn ClientCertVerifier> {
        let b =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots(), provider());
        let b = if mandatory {
            b
        } else {
            b.allow_unauthenticated()
        };
        b.build().expect("a verifier over one root")
    }

    fn server(
        &self,
        verifier: Arc<dyn ClientCertVerifier>,
    ) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| format!("unusable member identity: {e}"))?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// A node agent's server: only the control plane may call it.
pub fn node_server_config(tls: &ClusterTls) -> Result<Arc<rustls::ServerConfig>, String> {
    tls.server(Arc::new(Named {
        inner: tls.client_verifier(true),
        name: ServerName::try_from(space_ca::CONTROL_NAME).expect("a DNS name"),
    }))
}

/// The control plane's cluster listener: a client certificate is optional (joins have none)
/// and, when given, must be the cluster CA's.
pub fn control_server_config(tls: &ClusterTls) -> Result<Arc<rustls::ServerConfig>, String> {
    tls.server(tls.client_verifier(false))
}

/// A client trusting only the cluster CA, presenting the member's identity.
pub fn client_config(tls: &ClusterTls) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(tls.roots())
        .with_client_auth_cert(tls.chain.clone(), tls.key.clone_key())
        .map_err(|e| format!("unusable member identity: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// A client trusting only the CA in `ca_pem`, with no identity of its own (a node joining).
pub fn anonymous_client_config(ca_pem: &str) -> Result<Arc<rustls::ClientConfig>, String> {
    let ca = rustls_pemfile::certs(&mut ca_pem.as_bytes())
        .next()
        .ok_or("no certificate in the cluster CA")?
        .map_err(|e| format!("the cluster CA is not PEM: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca)
        .map_err(|e| format!("unusable cluster CA: {e}"))?;
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A client that accepts any server certificate: only for fetching the cluster CA's
/// certificate before a join, whose hash the join token then checks (nothing else is sent or
/// believed over it).
pub fn any_server_config() -> Arc<rustls::ClientConfig> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider())))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(cfg)
}

#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A gRPC channel to `addr` (HOST:PORT) over TLS with `config`, which must present the
/// certificate of `server_name`. Lazy: it connects at the first call, and again after a
/// failure; HTTP/2 pings find a dead peer within about 30 s.
///
/// `addr` may list several addresses (`HOST:PORT,HOST:PORT`: control-plane replicas): each
/// connection goes to the first that answers, starting with the one that answered last, so
/// a replica that dies is left for the next at the next reconnect.
pub fn tls_channel(
    addr: &str,
    server_name: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<Channel, String> {
    let targets: Arc<Vec<String>> = Arc::new(
        addr.split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_owned)
            .collect(),
    );
    let first = targets
        .first()
        .ok_or_else(|| format!("no address in {addr:?}"))?;
    let endpoint = Endpoint::from_shared(format!("http://{first}"))
        .map_err(|e| format!("bad address {addr:?}: {e}"))?;
    let name = ServerName::try_from(server_name.to_owned())
        .map_err(|e| format!("bad server name {server_name:?}: {e}"))?;
    let last_good = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let (config, name) = (config.clone(), name.clone());
        let (targets, last_good) = (targets.clone(), last_good.clone());
        async move {
            let start = last_good.load(std::sync::atomic::Ordering::Relaxed);
            let mut last_err = None;
            for k in 0..targets.len() {
                let i = (start + k) % targets.len();
                let tried = async {
                    let tcp = TcpStream::connect(&targets[i]).await?;
                    tcp.set_nodelay(true)?;
                    TlsConnector::from(config.clone())
                        .connect(name.clone(), tcp)
                        .await
                }
                .await;
                match tried {
                    Ok(tls) => {
                        last_good.store(i, std::sync::atomic::Ordering::Relaxed);
                        return Ok::<_, std::io::Error>(TokioIo::new(tls));
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            Err(last_err.unwrap_or_else(|| std::io::Error::other("no address")))
        }
    });
    Ok(crate::keepalive(endpoint).connect_with_connector_lazy(connector))
}

/// A client-certificate verifier that also requires the certificate to name `name`.
#[derive(Debug)]
struct Named {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for Named {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::General(format!("client certificate: {e}")))?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| {
                rustls::Error::General(format!(
                    "the client certificate does not name {}",
                    self.name.to_str()
                ))
            })?;
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The fingerprint of the certificate a TLS client presented, if it presented one: put in
/// each request's extensions (axum's `ConnectInfo`) by a server over [`TlsListener`].
#[derive(Debug, Clone, Default)]
pub struct PeerCert(pub Option<String>);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>>
    for PeerCert
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Self {
        let (_, conn) = stream.io().get_ref();
        PeerCert(
            conn.peer_certificates()
                .and_then(|c| c.first())
                .map(|c| space_ca::fingerprint(c)),
        )
    }
}

/// A TCP listener whose connections come out TLS-terminated (an [`axum::serve::Listener`]).
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Starts accepting on `tcp`. The accept loop ends when the listener is dropped.
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = tokio::select! {
                    _ = tx.closed() => return,
                    r = tcp.accept() => match r {
                        Ok(c) => c,
                        Err(e) => {
                            // EMFILE and the like: wait a little rather than spin.
                            tracing::warn!(error = %e, "TLS listener: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                };
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::warn!(error = %e, "cannot set TCP_NODELAY");
                }
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let shake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                    drop(slot);
                    match shake {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { ready, local })
    }

    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.local
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop never ends while the receiver lives; if it did, accept nothing.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster CA in a temporary directory and members' TLS material from it.
    struct Cluster {
        _dir: tempfile::TempDir,
        ca: space_ca::Ca,
    }

    impl Cluster {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let ca = space_ca::Ca::load_or_create_as(dir.path(), &space_ca::CaProfile::cluster())
                .unwrap();
            Self { _dir: dir, ca }
        }

        fn member(&self, name: &str) -> ClusterTls {
            let id = self.ca.new_identity(name).unwrap();
            ClusterTls::from_pem(self.ca.cert_pem(), &id.cert_pem, &id.key_pem).unwrap()
        }
    }

    /// Whether a client with `client` completes a handshake with a server of `server` and
    /// gets a byte back through it.
    async fn handshake(
        server: Arc<rustls::ServerConfig>,
        client: Arc<rustls::ClientConfig>,
        name: &str,
    ) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut listener = TlsListener::new(tcp, server).unwrap();
        tokio::spawn(async move {
            use axum::serve::Listener;
            let (mut io, _) = listener.accept().await;
            let _ = io.write_all(b"!").await;
            let _ = io.flush().await;
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from(name.to_owned()).unwrap();
        let Ok(mut tls) = TlsConnector::from(client).connect(name, tcp).await else {
            return false;
        };
        // TLS 1.3: a refused client certificate shows at the first read.
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), tls.read(&mut b)).await,
            Ok(Ok(1))
        )
    }

    #[tokio::test]
    async fn a_node_serves_only_the_control_plane() {
        let c = Cluster::new();
        let node = c.member(&space_ca::node_name("n1"));
        let server = node_server_config(&node).unwrap();
        let node_name = space_ca::node_name("n1");
        let control = client_config(&c.member(space_ca::CONTROL_NAME)).unwrap();
        assert!(handshake(server.clone(), control, &node_name).await);
        // Another node's certificate, from the same CA: not the control plane.
        let other = client_config(&c.member(&space_ca::node_name("n2"))).unwrap();
        assert!(!handshake(server.clone(), other, &node_name).await);
        // No certificate at all.
        let anonymous = anonymous_client_config(c.ca.cert_pem()).unwrap();
        assert!(!handshake(server.clone(), anonymous, &node_name).await);
        // The control plane's name, from another cluster's CA.
        let foreign = Cluster::new();
        let forged = client_config(&ClusterTls {
            ca: c.member(space_ca::CONTROL_NAME).ca,
            ..foreign.member(space_ca::CONTROL_NAME)
        })
        .unwrap();
        assert!(!handshake(server, forged, &node_name).await);
    }

    #[tokio::test]
    async fn members_check_each_others_names_and_ca() {
        let c = Cluster::new();
        let control = c.member(space_ca::CONTROL_NAME);
        let server = control_server_config(&control).unwrap();
        // A node (or a joining node without a certificate) reaches the control plane by its
        // cluster name only.
        let node = client_config(&c.member(&space_ca::node_name("n1"))).unwrap();
        assert!(handshake(server.clone(), node.clone(), space_ca::CONTROL_NAME).await);
        assert!(!handshake(server.clone(), node, "other.space.internal").await);
        let anonymous = anonymous_client_config(c.ca.cert_pem()).unwrap();
        assert!(handshake(server.clone(), anonymous, space_ca::CONTROL_NAME).await);
        // A client trusting another CA does not take this control plane for its own.
        let foreign = Cluster::new();
        let stranger = anonymous_client_config(foreign.ca.cert_pem()).unwrap();
        assert!(!handshake(server.clone(), stranger, space_ca::CONTROL_NAME).await);
        // Only the CA fetch before a join accepts any server.
        assert!(handshake(server, any_server_config(), space_ca::CONTROL_NAME).await);
    }
}
