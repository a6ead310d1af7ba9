//! What the node asks of the guest for networking (decision 0012), done once at startup from
//! daemon-only variables: the resolver (`SPACE_DNS`: the node's DNS inside the slot) and the
//! CA the egress proxy signs intercepted TLS with (`SPACE_CA_PEM`), installed as
//! `/etc/space/ca.pem` and in `/etc/space/ca-bundle.pem` (the distribution's bundle, if any,
//! plus the CA), which SSL_CERT_FILE and friends point at.

use std::fs;
use std::io;
use std::path::Path;

/// Bundles of common distributions, first found wins.
const SYSTEM_BUNDLES: &[&str] = &[
    "etc/ssl/certs/ca-certificates.crt",
    "etc/pki/tls/certs/ca-bundle.crt",
    "etc/ssl/cert.pem",
];

/// Replaces `path` (a symlink is replaced, not followed) with `data`, unless it already is a
/// regular file holding exactly that (the common case after the first start: no write, so no
/// copy-on-write of the fresh snapshot's metadata on the create path).
fn replace_file(path: &Path, data: &[u8]) -> io::Result<()> {
    if fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && m.len() == data.len() as u64)
        && fs::read(path).is_ok_and(|d| d == data)
    {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("space-tmp");
    fs::write(&tmp, data)?;
    fs::rename(&tmp, path)
}

/// Writes the resolver configuration and the CA files under `root` ("/" in a sandbox).
pub fn apply(root: &Path, dns: Option<&str>, ca_pem: Option<&str>) -> io::Result<()> {
    if let Some(dns) = dns {
        let conf = format!("# written by space-daemon: the node's resolver\nnameserver {dns}\n");
        replace_file(&root.join("etc/resolv.conf"), conf.as_bytes())?;
    }
    if let Some(ca) = ca_pem {
        let mut ca = ca.trim_end().to_owned();
        ca.push('\n');
        replace_file(&root.join("etc/space/ca.pem"), ca.as_bytes())?;
        let mut bundle = SYSTEM_BUNDLES
            .iter()
            .find_map(|b| fs::read_to_string(root.join(b)).ok())
            .unwrap_or_default();
        if !bundle.contains(&ca) {
            if !bundle.is_empty() && !bundle.ends_with('\n') {
                bundle.push('\n');
            }
            bundle.push_str(&ca);
        }
        replace_file(&root.join("etc/space/ca-bundle.pem"), bundle.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CA: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----";

    #[test]
    fn writes_resolver_and_bundles_once() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("etc/ssl/certs")).unwrap();
        fs::write(r.join("etc/ssl/certs/ca-certificates.crt"), "SYSTEM\n").unwrap();
        std::os::unix::fs::symlink("/nonexistent/resolv", r.join("etc/resolv.conf")).unwrap();
        apply(r, Some("127.0.0.1"), Some(CA)).unwrap();
        apply(r, Some("127.0.0.1"), Some(CA)).unwrap();
        let resolv = fs::read_to_string(r.join("etc/resolv.conf")).unwrap();
        assert!(resolv.contains("nameserver 127.0.0.1"));
        assert!(
            !fs::symlink_metadata(r.join("etc/resolv.conf"))
                .unwrap()
                .is_symlink()
        );
        let bundle = fs::read_to_string(r.join("etc/space/ca-bundle.pem")).unwrap();
        assert!(bundle.starts_with("SYSTEM\n"));
        assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 1);
        assert_eq!(
            fs::read_to_string(r.join("etc/space/ca.pem")).unwrap(),
            format!("{CA}\n")
        );
    }

    #[test]
    fn nothing_asked_nothing_written() {
        let root = tempfile::tempdir().unwrap();
        apply(root.path(), None, None).unwrap();
        assert!(!root.path().join("etc").exists());
    }
}
