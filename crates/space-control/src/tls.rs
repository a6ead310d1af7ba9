//! spaced's HTTPS listener (decision 0030): the same API as the plain listener, over TLS, with
//! either a certificate spaced was given (`--tls-cert`, `--tls-key`) or leaves spaced issues for
//! its `--e2b-domain` from its own name-constrained CA (an [`IssueCert`]; spaced passes the
//! node crate's CA).
//!
//! The listener itself, [`TlsListener`], is space-rpc's (the cluster's listeners use it too).

use std::path::Path;
use std::sync::Arc;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

pub use space_rpc::tls::{HANDSHAKE_TIMEOUT, MAX_HANDSHAKES, TlsListener};

/// A CA that makes a leaf certificate for one DNS name (cached by the issuer as it likes).
pub trait IssueCert: Send + Sync {
    fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, String>;
}

/// Where the listener's certificate comes from.
pub enum ServerCerts {
    /// One certificate chain and key, served whatever the client asks for.
    Given(Arc<CertifiedKey>),
    /// A leaf per name, issued by `ca` for `domain` and the names one label under it (E2B's
    /// `api.DOMAIN` and `PORT-ID.DOMAIN`); other names get no certificate (the handshake
    /// fails), and a client that sends no name gets the domain's.
    Issued {
        ca: Arc<dyn IssueCert>,
        domain: String,
    },
}

impl std::fmt::Debug for ServerCerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Given(_) => f.write_str("ServerCerts::Given"),
            Self::Issued { domain, .. } => write!(f, "ServerCerts::Issued({domain})"),
        }
    }
}

impl ServerCerts {
    /// The certificate for a client that asked for `name` (its SNI), if any.
    pub fn for_name(&self, name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        match self {
            Self::Given(key) => Some(key.clone()),
            Self::Issued { ca, domain } => {
                let name = name.unwrap_or(domain).trim_end_matches('.');
                let name = name.to_ascii_lowercase();
                let under = name
                    .strip_suffix(domain.as_str())
                    .and_then(|label| label.strip_suffix('.'));
                let ok =
                    name == *domain || under.is_some_and(|l| !l.is_empty() && !l.contains('.'));
                if !ok {
                    return None;
                }
                match ca.leaf(&name) {
                    Ok(leaf) => Some(leaf),
                    Err(e) => {
                        tracing::error!(error = %e, %name, "cannot issue a certificate");
                        None
                    }
                }
            }
        }
    }
}

impl ResolvesServerCert for ServerCerts {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.for_name(hello.server_name())
    }
}

/// Reads a PEM certificate chain and its private key (PKCS#8, PKCS#1 or SEC1).
pub fn load_given(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let cert_pem = read(cert)?;
    let chain = rustls_pemfile::certs(&mut cert_pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{} is not PEM: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("no certificate in {}", cert.display()));
    }
    let key_pem = read(key)?;
    let der = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| format!("{} is not PEM: {e}", key.display()))?
        .ok_or_else(|| format!("no private key in {}", key.display()))?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&der)
        .map_err(|e| format!("unusable key in {}: {e}", key.display()))?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match().map_err(|e| {
        format!(
            "the key in {} does not belong to the certificate in {}: {e}",
            key.display(),
            cert.display()
        )
    })?;
    Ok(certified)
}

/// The listener's TLS settings: TLS 1.2 and 1.3 (ring), HTTP/2 and HTTP/1.1 by ALPN.
pub fn server_config(certs: ServerCerts) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(certs));
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Self-signed leaves: which names get one is what is under test here (the API CA itself
    /// is tested in space-node's `ca`).
    struct SelfSigned;

    impl IssueCert for SelfSigned {
        fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, String> {
            let c = rcgen::generate_simple_self_signed(vec![name.to_owned()])
                .map_err(|e| e.to_string())?;
            let key = rustls::pki_types::PrivateKeyDer::Pkcs8(c.signing_key.serialize_der().into());
            let signer =
                rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| e.to_string())?;
            Ok(Arc::new(CertifiedKey::new(
                vec![c.cert.der().clone()],
                signer,
            )))
        }
    }

    fn issued(domain: &str) -> ServerCerts {
        ServerCerts::Issued {
            ca: Arc::new(SelfSigned),
            domain: domain.into(),
        }
    }

    #[test]
    fn issued_certificates_cover_the_domain_and_one_label_below_only() {
        let certs = issued("sb.example.test");
        for ok in [
            Some("sb.example.test"),
            Some("api.sb.example.test"),
            Some("49983-abcdefghij0123456789.SB.example.test."),
            None,
        ] {
            assert!(certs.for_name(ok).is_some(), "{ok:?}");
        }
        for no in [
            "example.test",
            "evil.test",
            "a.b.sb.example.test",
            "xsb.example.test",
            ".sb.example.test",
        ] {
            assert!(certs.for_name(Some(no)).is_none(), "{no}");
        }
    }

    #[test]
    fn given_certificates_are_checked_when_loaded() {
        let tmp = tempfile::tempdir().unwrap();
        let p = |n: &str| tmp.path().join(n);
        let a = rcgen::generate_simple_self_signed(vec!["a.test".into()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["b.test".into()]).unwrap();
        std::fs::write(p("a.pem"), a.cert.pem()).unwrap();
        std::fs::write(p("a.key"), a.signing_key.serialize_pem()).unwrap();
        std::fs::write(p("b.key"), b.signing_key.serialize_pem()).unwrap();
        std::fs::write(p("junk"), "not pem").unwrap();
        load_given(&p("a.pem"), &p("a.key")).unwrap();
        let err = |c: &str, k: &str| load_given(&p(c), &p(k)).unwrap_err();
        assert!(err("a.pem", "b.key").contains("does not belong"));
        assert!(err("junk", "a.key").contains("no certificate"));
        assert!(err("a.pem", "junk").contains("no private key"));
        assert!(err("missing.pem", "a.key").contains("cannot read"));
    }
}
