//! The certificate authorities space makes and keeps (one type, [`Ca`], three profiles).
//!
//! The node CA: a self-signed certificate authority made on first start, which sandboxes trust
//! (space-daemon installs it in their CA bundle), and which signs the leaf certificates the
//! egress proxy presents when it intercepts TLS to a host that a secret is bound to.
//!
//! The same type makes spaced's own API CA for `--e2b-domain` (decision 0030, a
//! [`CaProfile::api`]): a separate key, and name-constrained to that one domain, so that
//! trusting it vouches for nothing else.
//!
//! Files: `<dir>/ca.pem` (certificate) and `<dir>/ca.key` (PKCS#8 ECDSA P-256 key, mode 0600;
//! the directory is 0700). The CA's subject is fixed, so a lost `ca.pem` is re-made from the key
//! and leaves signed before still verify.
//!
//! Leaves are ECDSA P-256 (fast to make: well under a millisecond), valid 30 days, and kept in
//! a bounded per-host cache; a cached leaf older than a week is made again.
//!
//! The cluster CA ([`CaProfile::cluster`], decision 0033) signs the identities of the control
//! plane and of the nodes that joined it, for mTLS between them: names under
//! [`CLUSTER_DOMAIN`] only (its name constraint), each certificate good for both ends of a
//! connection, valid a year. A joining node keeps its key and sends only the public half
//! ([`RawP256`]); the control plane's identity is made afresh at each start.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints, PublicKeyData,
    SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

/// Leaves kept at most (one per intercepted host).
const LEAF_CACHE_MAX: usize = 1024;
/// Leaf certificate lifetime.
const LEAF_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);
/// A cached leaf older than this is made again (long before it expires).
const LEAF_REFRESH: Duration = Duration::from_secs(7 * 24 * 3600);
/// CA certificate lifetime.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Backdating of `not_before`, for clocks a little behind.
const BACKDATE: Duration = Duration::from_secs(24 * 3600);

const CA_COMMON_NAME: &str = "space node CA";
/// Cluster identities' lifetime.
const IDENTITY_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

/// The names of a cluster's members: a reserved suffix (ICANN's `.internal`), so that the
/// cluster CA, constrained to it, vouches for nothing anywhere else.
pub const CLUSTER_DOMAIN: &str = "space.internal";
/// The control plane's name in the cluster (every replica's).
pub const CONTROL_NAME: &str = "control.space.internal";

/// Node `id`'s name in the cluster.
pub fn node_name(id: &str) -> String {
    format!("{id}.nodes.{CLUSTER_DOMAIN}")
}

/// The SHA-256 of a certificate (DER), lowercase hex: how the control plane knows a node's
/// certificate, and how a join token pins the cluster CA.
pub fn fingerprint(der: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(der)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An ECDSA P-256 public key, the uncompressed point (65 bytes): the half of its key a
/// joining node sends.
#[derive(Debug, Clone)]
pub struct RawP256(pub Vec<u8>);

impl PublicKeyData for RawP256 {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// A member's identity as files hold it: its certificate and key, PEM.
#[derive(Clone)]
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").finish_non_exhaustive()
    }
}

/// A fresh P-256 key for a member: (its PEM, the raw public key to send).
pub fn new_member_key() -> Result<(String, RawP256), CaError> {
    let key = KeyPair::generate().map_err(|source| CaError::Generate {
        name: "a member key".into(),
        source,
    })?;
    Ok((key.serialize_pem(), RawP256(key.public_key_raw().to_vec())))
}
const CA_ORGANIZATION: &str = "space";

/// What a CA is for: its subject and, optionally, the one DNS subtree it may vouch for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaProfile {
    pub common_name: String,
    /// A name constraint (RFC 5280 4.2.1.10): leaves of this CA verify only for this domain
    /// and names under it.
    pub permitted_dns: Option<String>,
}

impl CaProfile {
    /// The node CA of the egress proxy (unconstrained: it stands in for any host).
    pub fn node() -> Self {
        Self {
            common_name: CA_COMMON_NAME.into(),
            permitted_dns: None,
        }
    }

    /// spaced's API CA for `domain` (`--e2b-domain`).
    pub fn api(domain: &str) -> Self {
        Self {
            common_name: format!("space API CA for {domain}"),
            permitted_dns: Some(domain.to_owned()),
        }
    }

    /// The cluster CA (decision 0033): names under [`CLUSTER_DOMAIN`] only.
    pub fn cluster() -> Self {
        Self {
            common_name: "space cluster CA".into(),
            permitted_dns: Some(CLUSTER_DOMAIN.into()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("failed to {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid CA key in {path}")]
    Key {
        path: PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("CA certificate {cert} does not belong to the key in {key}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("CA certificate {cert} was not made as {common_name:?}")]
    ProfileMismatch { cert: PathBuf, common_name: String },
    #[error("no certificate in {0}")]
    NoCertificate(PathBuf),
    #[error("failed to make a certificate for {name:?}")]
    Generate {
        name: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("failed to load a generated key")]
    Sign(#[source] rustls::Error),
}

/// The node CA, with its cache of leaf certificates.
pub struct Ca {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    leaves: Mutex<HashMap<String, (Instant, Arc<CertifiedKey>)>>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CaError + 'a {
    move |source| CaError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f; // positive
    SerialNumber::from_slice(&bytes)
}

/// The CA's parameters: the profile's fixed subject, usages and constraint (so the issuer is
/// the same for any certificate made from the same key), validity from now.
fn ca_params(profile: &CaProfile) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, profile.common_name.as_str());
    dn.push(DnType::OrganizationName, CA_ORGANIZATION);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.name_constraints = profile.permitted_dns.as_ref().map(|d| NameConstraints {
        permitted_subtrees: vec![GeneralSubtree::DnsName(d.clone())],
        excluded_subtrees: Vec::new(),
    });
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = SystemTime::now();
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + CA_VALIDITY).into();
    params.serial_number = Some(random_serial());
    params
}

/// Writes `data` to `path` atomically (temporary file, fsync, rename) with `mode`.
fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), CaError> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err("create", &tmp))?;
    f.write_all(data).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("sync", &tmp))?;
    fs::rename(&tmp, path).map_err(io_err("rename into place", path))
}

fn read_optional(path: &Path) -> Result<Option<String>, CaError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("read", path)(e)),
    }
}

fn first_cert(pem: &str, path: &Path) -> Result<CertificateDer<'static>, CaError> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .ok_or_else(|| CaError::NoCertificate(path.to_owned()))?
        .map_err(io_err("parse", path))
}

/// Whether `haystack` contains `needle` (the key's SubjectPublicKeyInfo in a certificate).
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

impl Ca {
    /// Loads the node CA from `dir`, or makes it (and `dir`) on first use. A missing `ca.pem`
    /// next to an existing key is made again from that key.
    pub fn load_or_create(dir: &Path) -> Result<Ca, CaError> {
        Self::load_or_create_as(dir, &CaProfile::node())
    }

    /// [`Ca::load_or_create`] for a CA of `profile`. The profile names the CA's subject: a
    /// `ca.pem` made for another profile is refused ([`CaError::ProfileMismatch`]).
    pub fn load_or_create_as(dir: &Path, profile: &CaProfile) -> Result<Ca, CaError> {
        fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(io_err("set permissions of", dir))?;
        let key_path = dir.join("ca.key");
        let cert_path = dir.join("ca.pem");

        let key = match read_optional(&key_path)? {
            Some(pem) => {
                fs::set_permissions(&key_path, fs::Permissions::from_mode(0o600))
                    .map_err(io_err("set permissions of", &key_path))?;
                KeyPair::from_pem(&pem).map_err(|source| CaError::Key {
                    path: key_path.clone(),
                    source,
                })?
            }
            None => {
                let key = KeyPair::generate().map_err(|source| CaError::Generate {
                    name: profile.common_name.clone(),
                    source,
                })?;
                write_atomic(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
                // A certificate of an older key would not match: make a new one.
                let _ = fs::remove_file(&cert_path);
                key
            }
        };

        let cert_pem = match read_optional(&cert_path)? {
            Some(pem) => pem,
            None => {
                let cert =
                    ca_params(profile)
                        .self_signed(&key)
                        .map_err(|source| CaError::Generate {
                            name: profile.common_name.clone(),
                            source,
                        })?;
                let pem = cert.pem();
                write_atomic(&cert_path, pem.as_bytes(), 0o644)?;
                pem
            }
        };
        let cert_der = first_cert(&cert_pem, &cert_path)?;
        if !contains(&cert_der, &key.subject_public_key_info()) {
            return Err(CaError::KeyMismatch {
                cert: cert_path,
                key: key_path,
            });
        }
        if !contains(&cert_der, profile.common_name.as_bytes()) {
            return Err(CaError::ProfileMismatch {
                cert: cert_path,
                common_name: profile.common_name.clone(),
            });
        }
        Ok(Ca {
            cert_pem,
            cert_der,
            issuer: Issuer::new(ca_params(profile), key),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate, PEM (what sandboxes trust).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// A leaf certificate and key for `host` (a DNS name), from the cache or made now.
    pub fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, CaError> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        {
            let leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((made, leaf)) = leaves.get(&host)
                && made.elapsed() < LEAF_REFRESH
            {
                return Ok(leaf.clone());
            }
        }
        // Made outside the lock; two racing makers both produce a valid leaf.
        let leaf = Arc::new(self.make_leaf(&host)?);
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if leaves.len() >= LEAF_CACHE_MAX && !leaves.contains_key(&host) {
            // Evict the oldest entry (rare: more than LEAF_CACHE_MAX intercepted hosts).
            if let Some(oldest) = leaves
                .iter()
                .min_by_key(|(_, (made, _))| *made)
                .map(|(k, _)| k.clone())
            {
                leaves.remove(&oldest);
            }
        }
        leaves.insert(host, (Instant::now(), leaf.clone()));
        Ok(leaf)
    }

    fn make_leaf(&self, host: &str) -> Result<CertifiedKey, CaError> {
        let gen_err = |source| CaError::Generate {
            name: host.to_owned(),
            source,
        };
        let mut params = CertificateParams::new(vec![host.to_owned()]).map_err(gen_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + LEAF_VALIDITY).into();
        params.serial_number = Some(random_serial());
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(gen_err)?;
        let key_der = PrivatePkcs8KeyDer::from(key.serialize_der()).into();
        let signer =
            rustls::crypto::ring::sign::any_supported_type(&key_der).map_err(CaError::Sign)?;
        Ok(CertifiedKey::new(vec![cert.der().clone()], signer))
    }

    /// A certificate for `name` (a cluster member) over `public_key`, good for both ends of a
    /// TLS connection, valid a year: PEM.
    pub fn issue_identity(
        &self,
        name: &str,
        public_key: &impl PublicKeyData,
    ) -> Result<String, CaError> {
        let gen_err = |source| CaError::Generate {
            name: name.to_owned(),
            source,
        };
        let mut params = CertificateParams::new(vec![name.to_owned()]).map_err(gen_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + IDENTITY_VALIDITY).into();
        params.serial_number = Some(random_serial());
        let cert = params
            .signed_by(public_key, &self.issuer)
            .map_err(gen_err)?;
        Ok(cert.pem())
    }

    /// A fresh key and its certificate for `name` (the control plane's own identity).
    pub fn new_identity(&self, name: &str) -> Result<Identity, CaError> {
        let (key_pem, public) = new_member_key()?;
        Ok(Identity {
            cert_pem: self.issue_identity(name, &public)?,
            key_pem,
        })
    }

    /// Leaves in the cache.
    pub fn cached_leaves(&self) -> usize {
        self.leaves.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use std::os::unix::fs::MetadataExt;

    /// Whether a client trusting only `ca` accepts `leaf` for `host`.
    fn check_leaf(ca: &Ca, leaf: &CertifiedKey, host: &str) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.cert_der().clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        let name = rustls::pki_types::ServerName::try_from(host.to_owned()).unwrap();
        verifier
            .verify_server_cert(
                &leaf.cert[0],
                &[],
                &name,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .map(drop)
    }

    fn verify_leaf(ca: &Ca, leaf: &CertifiedKey, host: &str) {
        check_leaf(ca, leaf, host).unwrap();
    }

    #[test]
    fn created_with_private_modes_then_loaded_unchanged() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ca");
        let ca = Ca::load_or_create(&dir).unwrap();
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(
            fs::metadata(dir.join("ca.key")).unwrap().mode() & 0o777,
            0o600
        );
        let again = Ca::load_or_create(&dir).unwrap();
        assert_eq!(again.cert_pem(), ca.cert_pem());
        // A leaf of the reloaded CA verifies under the original certificate.
        let leaf = again.leaf("api.example.com").unwrap();
        verify_leaf(&ca, &leaf, "api.example.com");
    }

    #[test]
    fn lost_certificate_is_remade_from_the_key() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(tmp.path()).unwrap();
        let key_before = fs::read(tmp.path().join("ca.key")).unwrap();
        fs::remove_file(tmp.path().join("ca.pem")).unwrap();
        let remade = Ca::load_or_create(tmp.path()).unwrap();
        assert_eq!(fs::read(tmp.path().join("ca.key")).unwrap(), key_before);
        // Leaves of the remade CA chain to the old certificate (same subject and key).
        let leaf = remade.leaf("x.example.org").unwrap();
        verify_leaf(&ca, &leaf, "x.example.org");
    }

    #[test]
    fn foreign_certificate_is_refused() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        Ca::load_or_create(a.path()).unwrap();
        Ca::load_or_create(b.path()).unwrap();
        fs::copy(a.path().join("ca.pem"), b.path().join("ca.pem")).unwrap();
        assert!(matches!(
            Ca::load_or_create(b.path()),
            Err(CaError::KeyMismatch { .. })
        ));
        fs::write(b.path().join("ca.key"), "garbage").unwrap();
        assert!(matches!(
            Ca::load_or_create(b.path()),
            Err(CaError::Key { .. })
        ));
    }

    #[test]
    fn leaves_are_cached_per_host_and_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = Ca::load_or_create(tmp.path()).unwrap();
        let a = ca.leaf("a.example.com").unwrap();
        let a2 = ca.leaf("A.Example.com.").unwrap();
        assert!(Arc::ptr_eq(&a, &a2));
        let b = ca.leaf("b.example.com").unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        verify_leaf(&ca, &b, "b.example.com");
        // The leaf does not verify for another name.
        assert!(check_leaf(&ca, &b, "a.example.com").is_err());
        for i in 0..LEAF_CACHE_MAX + 5 {
            ca.leaf(&format!("h{i}.example.com")).unwrap();
        }
        assert_eq!(ca.cached_leaves(), LEAF_CACHE_MAX);
    }

    #[test]
    fn an_api_ca_vouches_only_for_its_domain() {
        let tmp = tempfile::tempdir().unwrap();
        let profile = CaProfile::api("sb.example.test");
        let ca = Ca::load_or_create_as(tmp.path(), &profile).unwrap();
        let ok = ca.leaf("49983-abc.sb.example.test").unwrap();
        verify_leaf(&ca, &ok, "49983-abc.sb.example.test");
        // Signed by the same key, but outside the name constraint: no client accepts it.
        let out = ca.leaf("api.bank.example").unwrap();
        let err = check_leaf(&ca, &out, "api.bank.example").unwrap_err();
        assert!(format!("{err:?}").contains("NameConstraint"), "{err:?}");
        // Loaded again as it was made; as another profile (the node CA's), refused.
        Ca::load_or_create_as(tmp.path(), &profile).unwrap();
        assert!(matches!(
            Ca::load_or_create(tmp.path()),
            Err(CaError::ProfileMismatch { .. })
        ));
    }
}
