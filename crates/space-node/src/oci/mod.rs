//! OCI images as templates (decision 0017): pulled from a registry ([`registry`]) or read from
//! an OCI image layout or a `docker save` archive ([`archive`]), their layers applied one by
//! one ([`unpack`]) into a chain of read-only btrfs subvolumes, one per layer, keyed by the
//! layer's chain id. A template is then an O(1) snapshot of the chain's top; an image that
//! shares its lower layers with one already on the node fetches and unpacks only the rest.

pub mod archive;
pub mod registry;
/// Hostile layer unpacking lives in its own crate (the control plane unpacks build contexts
/// with it too).
pub use space_unpack as unpack;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use oci_spec::image::ImageConfiguration;
use sha2::{Digest, Sha256};

use crate::api::{TemplateDefaults, TemplateEvent};
use crate::storage::{self, Subvolumes};
use crate::template::TemplateError;

/// One layer of an image: its blob's digest (compressed, as the manifest names it) and the
/// digest of its uncompressed tar (the config's diff id).
#[derive(Debug, Clone)]
pub struct Layer {
    pub digest: String,
    pub diff_id: String,
    pub size: u64,
}

pub use crate::api::TemplateProgress as Progress;

pub(crate) fn say(progress: &Progress, ev: TemplateEvent) {
    let _ = progress.send(ev);
}

/// Layer `i` of `n` is done: the layer's notes, then its step line.
pub(crate) fn layer_done(progress: &Progress, i: usize, n: usize, notes: &[String], text: String) {
    for note in notes {
        say(progress, TemplateEvent::Note(note.clone()));
    }
    say(
        progress,
        TemplateEvent::Step {
            n: i as u32 + 1,
            of: n as u32,
            text,
        },
    );
}

/// `sha256:<64 hex>`, the only digest algorithm images use in practice.
pub fn check_digest(d: &str) -> Result<&str, TemplateError> {
    match d.strip_prefix("sha256:") {
        Some(hex)
            if hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(hex)
        }
        _ => Err(TemplateError::Image(format!(
            "{d:?} is not a sha256 digest (sha256:<64 lowercase hex digits>)"
        ))),
    }
}

/// A layer's media type must be a tar (plain, gzip or zstd; OCI or Docker).
pub fn check_layer_media_type(media_type: &str) -> Result<(), TemplateError> {
    if media_type.contains(".tar") || media_type.contains("rootfs.diff") {
        Ok(())
    } else {
        Err(TemplateError::Image(format!(
            "layer media type {media_type} is not a filesystem layer"
        )))
    }
}

/// The chain id of every layer: the first layer's diff id, then
/// `sha256(parent chain id + " " + diff id)` (the OCI image spec's definition).
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(parent) => format!(
                "sha256:{:x}",
                Sha256::digest(format!("{parent} {d}").as_bytes())
            ),
        };
        out.push(next);
    }
    out
}

/// The image config's Env, User, WorkingDir, Entrypoint and Cmd as a template's defaults.
pub fn defaults_from_config(cfg: &ImageConfiguration) -> TemplateDefaults {
    let Some(c) = cfg.config() else {
        return TemplateDefaults::default();
    };
    let mut env = BTreeMap::new();
    for kv in c.env().iter().flatten() {
        if let Some((k, v)) = kv.split_once('=')
            && !k.is_empty()
        {
            env.insert(k.to_string(), v.to_string());
        }
    }
    let non_empty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
    // `user:group`: the daemon takes a user (by name or uid) and that user's groups.
    let user = non_empty(c.user()).map(|u| u.split(':').next().unwrap_or_default().to_string());
    TemplateDefaults {
        user: user.filter(|u| !u.is_empty()),
        env,
        workdir: non_empty(c.working_dir()),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
        ..TemplateDefaults::default()
    }
}

/// Parses an image config, checking it names one diff id per layer.
pub fn parse_config(bytes: &[u8], layers: usize) -> Result<ImageConfiguration, TemplateError> {
    let cfg = ImageConfiguration::from_reader(bytes)
        .map_err(|e| TemplateError::Image(format!("the image config is not valid: {e}")))?;
    let n = cfg.rootfs().diff_ids().len();
    if n != layers {
        return Err(TemplateError::Image(format!(
            "the image config names {n} layer diff ids, the manifest {layers} layers"
        )));
    }
    for d in cfg.rootfs().diff_ids() {
        check_digest(d)?;
    }
    if cfg.os() != &oci_spec::image::Os::Linux {
        return Err(TemplateError::Image(format!(
            "the image is for {}, not linux",
            cfg.os()
        )));
    }
    Ok(cfg)
}

/// The node's unpacked layers: `oci/layers/<chain hex>/rootfs`, read-only subvolumes, each a
/// snapshot of its parent's with one layer applied.
pub struct LayerCache {
    dir: PathBuf,
    subvols: Arc<dyn Subvolumes>,
    /// One chain is built at a time (two pulls of one image never race for a chain id).
    build: std::sync::Mutex<()>,
}

impl LayerCache {
    /// Opens the cache, removing layers left half-applied by a crash.
    pub fn open(dir: PathBuf, subvols: Arc<dyn Subvolumes>) -> Result<Self, TemplateError> {
        storage::mkdir_p(&dir, 0o700)?;
        for ent in std::fs::read_dir(&dir)
            .map_err(|e| storage::StorageError::io("read directory", &dir, e))?
        {
            let Ok(ent) = ent else { continue };
            if ent.file_name().to_string_lossy().ends_with(".partial") {
                subvols.delete(&ent.path().join("rootfs"))?;
                storage::remove_tree(&ent.path())?;
            }
        }
        Ok(Self {
            dir,
            subvols,
            build: std::sync::Mutex::new(()),
        })
    }

    /// Where a chain's rootfs is (whether or not it is there yet).
    pub fn rootfs(&self, chain_id: &str) -> PathBuf {
        let hex = chain_id.strip_prefix("sha256:").unwrap_or(chain_id);
        self.dir.join(hex).join("rootfs")
    }

    pub fn has(&self, chain_id: &str) -> bool {
        self.rootfs(chain_id).is_dir()
    }

    /// Applies `layer` on top of `parent`'s chain (or an empty tree) as `chain_id`, checking
    /// that the uncompressed stream is `diff_id`. A failure leaves nothing behind.
    pub fn add(
        &self,
        parent: Option<&str>,
        chain_id: &str,
        diff_id: &str,
        layer: impl Read,
    ) -> Result<unpack::LayerStats, TemplateError> {
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        if self.has(chain_id) {
            return Ok(unpack::LayerStats::default());
        }
        let hex = check_digest(chain_id)?;
        let partial = self.dir.join(format!("{hex}.partial"));
        if partial.exists() {
            self.subvols.delete(&partial.join("rootfs"))?;
            storage::remove_tree(&partial)?;
        }
        storage::mkdir_p(&partial, 0o700)?;
        let result = (|| {
            match parent {
                Some(p) => self
                    .subvols
                    .snapshot(&self.rootfs(p), &partial, "rootfs", false)?,
                None => {
                    self.subvols.create(&partial, "rootfs")?;
                    std::fs::set_permissions(
                        partial.join("rootfs"),
                        std::os::unix::fs::PermissionsExt::from_mode(0o755),
                    )
                    .map_err(|e| storage::StorageError::io("chmod", &partial, e))?;
                }
            }
            let root = partial.join("rootfs");
            let stats = unpack::apply_layer(&root, layer)?;
            if stats.diff_id != diff_id {
                return Err(TemplateError::Image(format!(
                    "a layer's content does not match the image config: its uncompressed digest \
                     is {}, the config says {diff_id}",
                    stats.diff_id
                )));
            }
            self.subvols.set_readonly(&root, true)?;
            let done = self.dir.join(hex);
            std::fs::rename(&partial, &done)
                .map_err(|e| storage::StorageError::io("rename into place", &done, e))?;
            Ok(stats)
        })();
        if result.is_err() {
            let _ = self.subvols.delete(&partial.join("rootfs"));
            let _ = storage::remove_tree(&partial);
        }
        result
    }
}

/// A short form of a digest for progress lines.
pub fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

/// Human-readable bytes (`12.3 MB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["B", "kB", "MB", "GB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// An image ready to become a template: its config and layers, and where it came from.
#[derive(Debug)]
pub struct Resolved {
    pub config: ImageConfiguration,
    pub layers: Vec<Layer>,
    /// `template.json`'s source (`oci:REF@DIGEST`, `oci-archive:PATH`).
    pub source: String,
}

impl Resolved {
    pub fn chain_ids(&self) -> Vec<String> {
        chain_ids(
            &self
                .layers
                .iter()
                .map(|l| l.diff_id.clone())
                .collect::<Vec<_>>(),
        )
    }
}

/// The rootfs of an empty image (no layers) is a fresh empty tree: the caller builds it.
pub fn top_rootfs(cache: &LayerCache, r: &Resolved) -> Option<PathBuf> {
    r.chain_ids().last().map(|c| cache.rootfs(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_spec() {
        let a = format!("sha256:{}", "a".repeat(64));
        let b = format!("sha256:{}", "b".repeat(64));
        let ids = chain_ids(&[a.clone(), b.clone()]);
        assert_eq!(ids[0], a);
        let want = format!("sha256:{:x}", Sha256::digest(format!("{a} {b}").as_bytes()));
        assert_eq!(ids[1], want);
    }

    #[test]
    fn digests_are_checked() {
        assert!(check_digest(&format!("sha256:{}", "0".repeat(64))).is_ok());
        for bad in [
            "sha256:abc",
            "md5:00",
            "",
            &format!("sha256:{}", "G".repeat(64)),
        ] {
            assert!(check_digest(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn human_bytes_reads_well() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(12_300_000), "12.3 MB");
    }
}
