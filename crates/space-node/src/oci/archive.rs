//! Images on the node's filesystem: an OCI image layout (a directory, or a tar of one) and a
//! `docker save` archive (legacy, or Docker 25's OCI-layout form). Blobs are read in place
//! (a tar is indexed once, then read at offsets); every name the archive gives is resolved
//! beneath it, and every blob with a known digest is verified as it is read.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use oci_spec::image::{ImageIndex, ImageManifest, MediaType};
use rustix::fs::{self as rfs, Mode, OFlags, ResolveFlags};
use serde::Deserialize;

use super::unpack::Verifying;
use super::{Layer, Resolved, check_digest, check_layer_media_type, parse_config};
use crate::template::TemplateError;

/// Manifests, configs and indexes are small: anything bigger is refused, not read.
const MAX_JSON_BYTES: u64 = 8 << 20;
/// Symlinks followed inside a tar archive before giving up.
const MAX_LINKS: usize = 8;

/// What a directory or tar holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OciLayout,
    DockerSave,
}

/// Where blobs are read from.
enum Store {
    Dir(rustix::fd::OwnedFd, PathBuf),
    Tar {
        path: PathBuf,
        entries: HashMap<String, Loc>,
    },
}

enum Loc {
    File { offset: u64, size: u64 },
    Link(String),
}

/// An image found in a directory or tar archive, ready to apply.
pub struct LocalImage {
    store: Store,
    pub resolved: Resolved,
    /// The name of each layer's blob in the store.
    blobs: Vec<String>,
}

impl std::fmt::Debug for LocalImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalImage")
            .field("resolved", &self.resolved)
            .finish()
    }
}

fn bad(msg: impl Into<String>) -> TemplateError {
    TemplateError::Image(msg.into())
}

/// Normalizes a name inside an archive (`./a//b` → `a/b`); `None` if it climbs out.
fn normalize(name: &str) -> Option<String> {
    let mut out: Vec<&str> = Vec::new();
    for c in name.split('/') {
        match c {
            "" | "." => {}
            ".." => return None,
            c => out.push(c),
        }
    }
    Some(out.join("/"))
}

/// Which image format a directory holds, if any.
pub fn detect_dir(dir: &Path) -> Option<Format> {
    if dir.join("oci-layout").is_file() && dir.join("index.json").is_file() {
        Some(Format::OciLayout)
    } else if dir.join("manifest.json").is_file() {
        Some(Format::DockerSave)
    } else {
        None
    }
}

/// Which image format a tar archive holds, if any (a plain rootfs tar is `None`). Indexes
/// the archive's entries on the way (only headers are read).
fn index_tar(path: &Path) -> Result<(Option<Format>, HashMap<String, Loc>), TemplateError> {
    let file = File::open(path).map_err(|e| bad(format!("cannot open {}: {e}", path.display())))?;
    let mut archive = tar::Archive::new(file);
    let mut entries = HashMap::new();
    let iter = archive
        .entries_with_seek()
        .map_err(|e| bad(format!("{} is not a tar archive: {e}", path.display())))?;
    for entry in iter {
        let entry = entry.map_err(|e| {
            bad(format!(
                "{} is not a valid tar archive: {e}",
                path.display()
            ))
        })?;
        let Some(name) = entry
            .path()
            .ok()
            .and_then(|p| p.to_str().map(str::to_owned))
            .and_then(|p| normalize(&p))
        else {
            continue;
        };
        let kind = entry.header().entry_type();
        let loc = if kind.is_file() {
            Loc::File {
                offset: entry.raw_file_position(),
                size: entry.size(),
            }
        } else if kind.is_symlink() || kind.is_hard_link() {
            let Some(target) = entry.link_name().ok().flatten() else {
                continue;
            };
            let target = target.to_string_lossy();
            let joined = if kind.is_symlink() && !target.starts_with('/') {
                match name.rsplit_once('/') {
                    Some((dir, _)) => format!("{dir}/{target}"),
                    None => target.into_owned(),
                }
            } else {
                target.into_owned()
            };
            match normalize(&joined) {
                Some(t) => Loc::Link(t),
                None => continue,
            }
        } else {
            continue;
        };
        entries.insert(name, loc);
    }
    let format = if entries.contains_key("oci-layout") && entries.contains_key("index.json") {
        Some(Format::OciLayout)
    } else if entries.contains_key("manifest.json") {
        Some(Format::DockerSave)
    } else {
        None
    };
    Ok((format, entries))
}

/// Whether the tar archive at `path` is an image (OCI layout or `docker save`). Images are
/// read as tools write them, uncompressed: a compressed archive is a root filesystem.
pub fn tar_is_image(path: &Path) -> Result<bool, TemplateError> {
    let mut magic = [0u8; 4];
    let n = File::open(path)
        .and_then(|mut f| f.read(&mut magic))
        .map_err(|e| bad(format!("cannot open {}: {e}", path.display())))?;
    if magic[..n].starts_with(&[0x1f, 0x8b]) || magic[..n].starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Ok(false);
    }
    Ok(index_tar(path)?.0.is_some())
}

impl Store {
    fn open(&self, name: &str) -> Result<Box<dyn Read + Send>, TemplateError> {
        let missing = |e: String| bad(format!("the archive's blob {name} cannot be read: {e}"));
        match self {
            Store::Dir(fd, _) => {
                let name = normalize(name)
                    .ok_or_else(|| missing("it climbs out of the archive".into()))?;
                let fd = rfs::openat2(
                    fd,
                    OsStr::from_bytes(name.as_bytes()),
                    OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
                )
                .map_err(|e| missing(e.to_string()))?;
                let file = File::from(fd);
                if !file.metadata().map(|m| m.is_file()).unwrap_or(false) {
                    return Err(missing("it is not a regular file".into()));
                }
                Ok(Box::new(file))
            }
            Store::Tar { path, entries } => {
                let mut name = normalize(name)
                    .ok_or_else(|| missing("it climbs out of the archive".into()))?;
                for _ in 0..MAX_LINKS {
                    match entries.get(&name) {
                        None => return Err(missing("it is not in the archive".into())),
                        Some(Loc::Link(t)) => name = t.clone(),
                        Some(Loc::File { offset, size }) => {
                            let mut f = File::open(path).map_err(|e| missing(e.to_string()))?;
                            f.seek(SeekFrom::Start(*offset))
                                .map_err(|e| missing(e.to_string()))?;
                            return Ok(Box::new(f.take(*size)));
                        }
                    }
                }
                Err(missing("it is a chain of too many links".into()))
            }
        }
    }

    /// A small JSON document, checked against `digest` when one is known.
    fn read_json(&self, name: &str, digest: Option<&str>) -> Result<Vec<u8>, TemplateError> {
        let mut buf = Vec::new();
        let r = self.open(name)?;
        let mut r: Box<dyn Read> = match digest {
            Some(d) => Box::new(Verifying::new(r, d)),
            None => r,
        };
        (&mut r)
            .take(MAX_JSON_BYTES + 1)
            .read_to_end(&mut buf)
            .map_err(|e| bad(format!("the archive's {name} cannot be read: {e}")))?;
        if buf.len() as u64 > MAX_JSON_BYTES {
            return Err(bad(format!(
                "the archive's {name} is over {MAX_JSON_BYTES} bytes"
            )));
        }
        Ok(buf)
    }
}

fn blob_name(digest: &str) -> Result<String, TemplateError> {
    Ok(format!("blobs/sha256/{}", check_digest(digest)?))
}

impl LocalImage {
    /// Opens a directory (an OCI layout, or an unpacked `docker save`).
    pub fn open_dir(dir: &Path) -> Result<Self, TemplateError> {
        let format = detect_dir(dir).ok_or_else(|| {
            bad(format!(
                "{} is neither an OCI image layout (oci-layout, index.json) nor a docker save \
                 archive (manifest.json)",
                dir.display()
            ))
        })?;
        let fd = rfs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| bad(format!("cannot open {}: {e}", dir.display())))?;
        Self::resolve(Store::Dir(fd, dir.to_path_buf()), format, dir)
    }

    /// Opens a tar archive holding an OCI layout or a `docker save`.
    pub fn open_tar(path: &Path) -> Result<Self, TemplateError> {
        let (format, entries) = index_tar(path)?;
        let format = format.ok_or_else(|| {
            bad(format!(
                "{} holds neither an OCI image layout nor a docker save archive",
                path.display()
            ))
        })?;
        let store = Store::Tar {
            path: path.to_path_buf(),
            entries,
        };
        Self::resolve(store, format, path)
    }

    fn resolve(store: Store, format: Format, shown: &Path) -> Result<Self, TemplateError> {
        let (resolved, blobs) = match format {
            Format::OciLayout => resolve_oci(&store, shown)?,
            Format::DockerSave => resolve_docker(&store, shown)?,
        };
        Ok(Self {
            store,
            resolved,
            blobs,
        })
    }

    /// Layer `i`'s blob, verified against its digest as it is read (a `docker save` layer
    /// has only its diff id, which applying it checks).
    pub fn open_layer(&self, i: usize) -> Result<Box<dyn Read + Send>, TemplateError> {
        let r = self.store.open(&self.blobs[i])?;
        let digest = &self.resolved.layers[i].digest;
        Ok(if digest.is_empty() {
            r
        } else {
            Box::new(Verifying::new(r, digest))
        })
    }

    pub fn path(&self) -> &Path {
        match &self.store {
            Store::Dir(_, p) => p,
            Store::Tar { path, .. } => path,
        }
    }
}

/// index.json → (nested indexes →) the linux/amd64 (or only) image manifest → config, layers.
fn resolve_oci(store: &Store, shown: &Path) -> Result<(Resolved, Vec<String>), TemplateError> {
    let mut index: ImageIndex = serde_json::from_slice(&store.read_json("index.json", None)?)
        .map_err(|e| {
            bad(format!(
                "{}: index.json is not an OCI image index: {e}",
                shown.display()
            ))
        })?;
    for _depth in 0..4 {
        let manifests = index.manifests();
        let pick = if manifests.len() == 1 {
            manifests.first()
        } else {
            manifests.iter().find(|m| {
                m.platform().as_ref().is_some_and(|p| {
                    p.os() == &oci_spec::image::Os::Linux
                        && p.architecture() == &oci_spec::image::Arch::Amd64
                })
            })
        };
        let Some(desc) = pick else {
            return Err(bad(format!(
                "{}: the image index has {} manifests and none is for linux/amd64",
                shown.display(),
                manifests.len()
            )));
        };
        let digest = desc.digest().to_string();
        let bytes = store.read_json(&blob_name(&digest)?, Some(&digest))?;
        if matches!(desc.media_type(), MediaType::ImageIndex)
            || desc.media_type().to_string().contains("manifest.list")
        {
            index = serde_json::from_slice(&bytes)
                .map_err(|e| bad(format!("the nested image index {digest} is not valid: {e}")))?;
            continue;
        }
        let manifest: ImageManifest = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("the image manifest {digest} is not valid: {e}")))?;
        let cfg_digest = manifest.config().digest().to_string();
        let cfg_bytes = store.read_json(&blob_name(&cfg_digest)?, Some(&cfg_digest))?;
        let config = parse_config(&cfg_bytes, manifest.layers().len())?;
        let mut layers = Vec::new();
        let mut blobs = Vec::new();
        for (l, diff_id) in manifest.layers().iter().zip(config.rootfs().diff_ids()) {
            check_layer_media_type(l.media_type().as_ref())?;
            let d = l.digest().to_string();
            blobs.push(blob_name(&d)?);
            layers.push(Layer {
                digest: d,
                diff_id: diff_id.clone(),
                size: l.size(),
            });
        }
        let source = format!("oci-archive:{}@{digest}", shown.display());
        return Ok((
            Resolved {
                config,
                layers,
                source,
            },
            blobs,
        ));
    }
    Err(bad(format!(
        "{}: image indexes nest too deep",
        shown.display()
    )))
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// manifest.json's first image → its config and layer tars.
fn resolve_docker(store: &Store, shown: &Path) -> Result<(Resolved, Vec<String>), TemplateError> {
    let list: Vec<DockerManifest> =
        serde_json::from_slice(&store.read_json("manifest.json", None)?).map_err(|e| {
            bad(format!(
                "{}: manifest.json is not a docker save manifest: {e}",
                shown.display()
            ))
        })?;
    let Some(m) = list.into_iter().next() else {
        return Err(bad(format!(
            "{}: manifest.json names no image",
            shown.display()
        )));
    };
    // The config's name is its digest (`<hex>.json`, or `blobs/sha256/<hex>`) when it looks
    // like one: then it is verified too.
    let stem = m
        .config
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .trim_end_matches(".json");
    let cfg_digest = format!("sha256:{stem}");
    let known = check_digest(&cfg_digest)
        .is_ok()
        .then_some(cfg_digest.as_str());
    let config = parse_config(&store.read_json(&m.config, known)?, m.layers.len())?;
    let layers = config
        .rootfs()
        .diff_ids()
        .iter()
        .map(|d| Layer {
            digest: String::new(),
            diff_id: d.clone(),
            size: 0,
        })
        .collect();
    let tag = m
        .repo_tags
        .and_then(|t| t.into_iter().next())
        .unwrap_or_default();
    Ok((
        Resolved {
            config,
            layers,
            source: format!("docker-archive:{}:{tag}", shown.display()),
        },
        m.layers,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalized_and_never_climb() {
        assert_eq!(normalize("./a//b/").as_deref(), Some("a/b"));
        assert_eq!(normalize("a/../b"), None);
        assert_eq!(normalize("/blobs/x").as_deref(), Some("blobs/x"));
    }

    #[test]
    fn a_plain_rootfs_tar_is_not_an_image() {
        let dir = tempfile::tempdir().unwrap();
        let tar = dir.path().join("r.tar");
        let mut b = tar::Builder::new(File::create(&tar).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "etc/hostname", &b"abc"[..]).unwrap();
        b.into_inner().unwrap();
        assert!(!tar_is_image(&tar).unwrap());
    }
}
