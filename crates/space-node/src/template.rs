//! Templates: read-only rootfs subvolumes, versioned (`templates/<name>/<version>/rootfs`).
//! `minimal` (Debian's busybox-static plus a minimal /etc) is built on first open; `base`, a
//! Debian userland, is imported on first open from the machine's cache that the setup scripts
//! build once with mmdebstrap (`--base-cache`, decision 0016); `import` copies a directory or
//! tar archive into a new version. Sandboxes pin the version they were created from, so
//! importing a name again never changes existing sandboxes.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};

use crate::api::{TemplateDefaults, TemplateInfo, TemplateSource};
use crate::storage::{self, Layout, StorageError, Subvolumes};

pub const BASE_TEMPLATE: &str = "base";
pub const MINIMAL_TEMPLATE: &str = "minimal";
/// What `template.json` says of a version built from busybox (`minimal`, and `base` before
/// it became Debian).
const BUSYBOX_SOURCE: &str = "busybox";
const PATH_ENV: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("invalid template source: {0}")]
    Source(String),
    #[error(
        "busybox not found at {0}: install Debian's busybox-static package (or set the node's busybox path)"
    )]
    BusyboxMissing(PathBuf),
    #[error("`{cmd}` failed: {detail}")]
    Command { cmd: String, detail: String },
    #[error("the base template's cache {0} is not usable: {1}")]
    BaseCache(PathBuf, String),
    /// The image (its manifest, config, or a layer's bytes) is not valid.
    #[error("{0}")]
    Image(String),
    #[error("image {0} not found (no such repository or tag in the registry)")]
    ImageNotFound(String),
    /// The registry could not be reached, or refused the request.
    #[error("{0}")]
    Registry(String),
    #[error(transparent)]
    Unpack(#[from] crate::oci::unpack::UnpackError),
}

fn io_err(op: &'static str, path: &Path, e: io::Error) -> TemplateError {
    TemplateError::Storage(StorageError::io(op, path, e))
}

/// `template.json` next to each version's rootfs.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TemplateMeta {
    name: String,
    version: u32,
    created_unix_ms: u64,
    source: String,
    #[serde(default)]
    defaults: TemplateDefaults,
}

/// All templates of the node, cached in memory (loaded on open, updated on import).
pub struct TemplateStore {
    layout: Layout,
    subvols: Arc<dyn Subvolumes>,
    /// name -> version -> info.
    cache: RwLock<BTreeMap<String, BTreeMap<u32, TemplateInfo>>>,
    /// Serializes builds (version numbers are assigned under it).
    build: Mutex<()>,
}

impl TemplateStore {
    /// Loads every complete template version; removes half-built ones (`<version>.partial`).
    pub fn load(layout: Layout, subvols: Arc<dyn Subvolumes>) -> Result<Self, TemplateError> {
        let store = Self {
            layout,
            subvols,
            cache: RwLock::new(BTreeMap::new()),
            build: Mutex::new(()),
        };
        let root = store.layout.templates();
        let mut cache = BTreeMap::new();
        for name_ent in read_dir(&root)? {
            let name = name_ent.file_name().to_string_lossy().into_owned();
            if crate::ids::validate_template_name(&name).is_err() {
                continue;
            }
            let mut versions = BTreeMap::new();
            for v_ent in read_dir(&name_ent.path())? {
                let fname = v_ent.file_name().to_string_lossy().into_owned();
                let path = v_ent.path();
                if fname.ends_with(".partial") {
                    tracing::warn!(path = %path.display(), "removing half-built template version");
                    store.subvols.delete(&path.join("rootfs"))?;
                    storage::remove_tree(&path)?;
                    continue;
                }
                let Ok(version) = fname.parse::<u32>() else {
                    continue;
                };
                let rootfs = path.join("rootfs");
                if !rootfs.is_dir() {
                    continue;
                }
                let meta = storage::read_json::<TemplateMeta>(&path.join("template.json")).ok();
                versions.insert(
                    version,
                    TemplateInfo {
                        name: name.clone(),
                        version,
                        created_unix_ms: meta.as_ref().map_or(0, |m| m.created_unix_ms),
                        path: rootfs,
                        source: meta.as_ref().map(|m| m.source.clone()).unwrap_or_default(),
                        defaults: meta.map(|m| m.defaults).unwrap_or_default(),
                    },
                );
            }
            if !versions.is_empty() {
                cache.insert(name, versions);
            }
        }
        *store.cache.write().unwrap_or_else(|e| e.into_inner()) = cache;
        Ok(store)
    }

    /// The newest version of `name`.
    pub fn latest(&self, name: &str) -> Option<TemplateInfo> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache
            .get(name)
            .and_then(|v| v.values().next_back())
            .cloned()
    }

    /// `f` of a version, without copying it out (for the launch path).
    pub fn with<R>(
        &self,
        name: &str,
        version: u32,
        f: impl FnOnce(&TemplateInfo) -> R,
    ) -> Option<R> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache.get(name).and_then(|v| v.get(&version)).map(f)
    }

    pub fn get(&self, name: &str, version: u32) -> Option<TemplateInfo> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache.get(name).and_then(|v| v.get(&version)).cloned()
    }

    /// The newest version of every template, by name.
    pub fn list(&self) -> Vec<TemplateInfo> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache
            .values()
            .filter_map(|v| v.values().next_back().cloned())
            .collect()
    }

    /// Every version of `name`, oldest first.
    pub fn versions(&self, name: &str) -> Vec<TemplateInfo> {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache
            .get(name)
            .map(|v| v.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Deletes `versions` of `name` (their rootfs subvolumes, disk images and warm
    /// checkpoints); the name goes when its last version does.
    pub fn remove(&self, name: &str, versions: &[u32]) -> Result<(), TemplateError> {
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        for v in versions {
            let dir = self.layout.template_version_dir(name, *v);
            // Out of the cache first: nothing new starts from a version being deleted.
            {
                let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
                if let Some(m) = cache.get_mut(name) {
                    m.remove(v);
                    if m.is_empty() {
                        cache.remove(name);
                    }
                }
            }
            let root = dir.join("rootfs");
            if self.subvols.is_subvolume(&root) {
                self.subvols.set_readonly(&root, false)?;
            }
            self.subvols.delete(&root)?;
            storage::remove_tree(&dir)?;
        }
        if self.versions(name).is_empty() {
            let _ = std::fs::remove_dir(self.layout.template_dir(name));
        }
        Ok(())
    }

    /// Builds `minimal` from the host's static busybox when no version of it exists.
    pub fn ensure_minimal(&self, busybox: &Path) -> Result<TemplateInfo, TemplateError> {
        if let Some(t) = self.latest(MINIMAL_TEMPLATE) {
            return Ok(t);
        }
        if !busybox.is_file() {
            return Err(TemplateError::BusyboxMissing(busybox.to_path_buf()));
        }
        let info = self.build_version(
            MINIMAL_TEMPLATE,
            BUSYBOX_SOURCE,
            TemplateDefaults::default(),
            |root| populate_minimal(root, busybox),
        )?;
        tracing::info!(path = %info.path.display(), version = info.version, "built the minimal template");
        Ok(info)
    }

    /// Imports `base` from `cache` (`rootfs/` and `defaults.json`, made by the setup scripts'
    /// mmdebstrap) when no Debian version of it exists yet; a `base` built from busybox by an
    /// older node gets a new version. `None` when there is no cache: `base` is then missing,
    /// and creates of it say how to build it.
    pub fn ensure_base(&self, cache: Option<&Path>) -> Result<Option<TemplateInfo>, TemplateError> {
        let latest = self.latest(BASE_TEMPLATE);
        if let Some(t) = &latest
            && t.source != BUSYBOX_SOURCE
        {
            return Ok(latest);
        }
        let Some(cache) = cache.filter(|c| c.join("rootfs").is_dir()) else {
            if latest.is_none() {
                tracing::warn!(
                    cache = ?cache,
                    "no Debian rootfs cache: the base template is missing (scripts/up builds it)"
                );
            }
            return Ok(latest);
        };
        let defaults_path = cache.join("defaults.json");
        let defaults: TemplateDefaults = match std::fs::read(&defaults_path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| TemplateError::BaseCache(defaults_path.clone(), e.to_string()))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => TemplateDefaults::default(),
            Err(e) => return Err(TemplateError::BaseCache(defaults_path, e.to_string())),
        };
        let t0 = std::time::Instant::now();
        let rootfs = cache.join("rootfs");
        let info = self.build_version(
            BASE_TEMPLATE,
            &format!("debian:{}", cache.display()),
            defaults,
            |root| copy_tree(&rootfs, root),
        )?;
        tracing::info!(
            version = info.version,
            cache = %cache.display(),
            ms = t0.elapsed().as_millis() as u64,
            "imported the Debian base template"
        );
        Ok(Some(info))
    }

    /// Imports `source` as a new version of `name` (blocking: run it off the async runtime).
    pub fn import(
        &self,
        name: &str,
        source: &TemplateSource,
    ) -> Result<TemplateInfo, TemplateError> {
        let (desc, src) = match source {
            TemplateSource::Dir(p) => ("dir", p),
            TemplateSource::Tar(p) => ("tar", p),
            TemplateSource::Snapshot { .. }
            | TemplateSource::Registry(_)
            | TemplateSource::Derived { .. } => {
                return Err(TemplateError::Source(
                    "snapshots and images become templates through the node".into(),
                ));
            }
        };
        let md = std::fs::metadata(src)
            .map_err(|e| TemplateError::Source(format!("{} cannot be read: {e}", src.display())))?;
        match source {
            TemplateSource::Dir(_) if !md.is_dir() => {
                return Err(TemplateError::Source(format!(
                    "{} is not a directory",
                    src.display()
                )));
            }
            TemplateSource::Tar(_) if !md.is_file() => {
                return Err(TemplateError::Source(format!(
                    "{} is not a file",
                    src.display()
                )));
            }
            _ => {}
        }
        let source_desc = format!("{desc}:{}", src.display());
        let info =
            self.build_version(
                name,
                &source_desc,
                TemplateDefaults::default(),
                |root| match source {
                    TemplateSource::Dir(p) => copy_tree(p, root),
                    // An uploaded archive is hostile input: it is applied as an image layer
                    // is, never by the host's tar (oci/unpack.rs).
                    TemplateSource::Tar(p) => {
                        let f = std::fs::File::open(p).map_err(|e| io_err("open", p, e))?;
                        let stats = crate::oci::unpack::apply_layer(root, f)?;
                        for note in stats.notes {
                            tracing::info!(name, note, "template import");
                        }
                        Ok(())
                    }
                    TemplateSource::Snapshot { .. }
                    | TemplateSource::Registry(_)
                    | TemplateSource::Derived { .. } => Ok(()),
                },
            )?;
        tracing::info!(name, version = info.version, source = %source_desc, "imported template");
        Ok(info)
    }

    /// Creates `templates/<name>/<next>.partial/rootfs`, fills it, adds the runtime's
    /// mountpoints, makes it read-only and renames the version into place.
    fn build_version(
        &self,
        name: &str,
        source: &str,
        defaults: TemplateDefaults,
        fill: impl FnOnce(&Path) -> Result<(), TemplateError>,
    ) -> Result<TemplateInfo, TemplateError> {
        self.build_version_from(name, source, defaults, None, fill)
    }

    /// A new version of `name` whose rootfs is a writable btrfs snapshot of the subvolume
    /// `src` (O(1): no data is copied), with the runtime's mountpoints added.
    pub fn from_subvolume(
        &self,
        name: &str,
        src: &Path,
        source: &str,
        defaults: TemplateDefaults,
    ) -> Result<TemplateInfo, TemplateError> {
        let info = self.build_version_from(name, source, defaults, Some(src), |_| Ok(()))?;
        tracing::info!(
            name,
            version = info.version,
            source,
            "made a template of a snapshot"
        );
        Ok(info)
    }

    /// A new version of `name` with an empty rootfs (an image of no layers).
    pub fn empty_version(
        &self,
        name: &str,
        source: &str,
        defaults: TemplateDefaults,
    ) -> Result<TemplateInfo, TemplateError> {
        self.build_version(name, source, defaults, |_| Ok(()))
    }

    /// [`Self::build_version`], its rootfs a new subvolume or (`from`) a snapshot of one.
    fn build_version_from(
        &self,
        name: &str,
        source: &str,
        defaults: TemplateDefaults,
        from: Option<&Path>,
        fill: impl FnOnce(&Path) -> Result<(), TemplateError>,
    ) -> Result<TemplateInfo, TemplateError> {
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        let version = {
            let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
            cache
                .get(name)
                .and_then(|v| v.keys().next_back().copied())
                .unwrap_or(0)
                + 1
        };
        let name_dir = self.layout.template_dir(name);
        storage::mkdir_p(&name_dir, 0o755)?;
        let partial = name_dir.join(format!("{version}.partial"));
        if partial.exists() {
            self.subvols.delete(&partial.join("rootfs"))?;
            storage::remove_tree(&partial)?;
        }
        storage::mkdir_p(&partial, 0o755)?;
        let result = (|| {
            let root = partial.join("rootfs");
            match from {
                Some(src) => self.subvols.snapshot(src, &partial, "rootfs", false)?,
                None => {
                    self.subvols.create(&partial, "rootfs")?;
                    set_mode(&root, 0o755)?;
                }
            }
            fill(&root)?;
            ensure_runtime_dirs(&root)?;
            let created_unix_ms = crate::state::now_unix_ms();
            storage::write_json_atomic(
                &partial.join("template.json"),
                &TemplateMeta {
                    name: name.to_string(),
                    version,
                    created_unix_ms,
                    source: source.to_string(),
                    defaults: defaults.clone(),
                },
                true,
            )?;
            self.subvols.set_readonly(&root, true)?;
            let final_dir = self.layout.template_version_dir(name, version);
            std::fs::rename(&partial, &final_dir)
                .map_err(|e| io_err("rename into place", &final_dir, e))?;
            Ok::<_, TemplateError>(TemplateInfo {
                name: name.to_string(),
                version,
                created_unix_ms,
                path: final_dir.join("rootfs"),
                defaults,
                source: source.to_string(),
            })
        })();
        match result {
            Ok(info) => {
                let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
                cache
                    .entry(name.to_string())
                    .or_default()
                    .insert(version, info.clone());
                Ok(info)
            }
            Err(e) => {
                let _ = self.subvols.delete(&partial.join("rootfs"));
                let _ = storage::remove_tree(&partial);
                Err(e)
            }
        }
    }
}

impl TemplateStore {
    /// A directory to receive a version of `name` sent by another node in (removed at the
    /// next start if the receive never finishes: it ends in `.partial`).
    pub fn receiving_dir(&self, name: &str) -> Result<PathBuf, TemplateError> {
        let name_dir = self.layout.template_dir(name);
        storage::mkdir_p(&name_dir, 0o755)?;
        let bits: u64 = rand::random();
        let dir = name_dir.join(format!("received-{bits:016x}.partial"));
        storage::mkdir_p(&dir, 0o755)?;
        Ok(dir)
    }

    /// Takes the version received in `dir` (its `template.json` and read-only `rootfs`) into
    /// the store under the version number it had on the sending node. A version this node
    /// has already is kept, and what was received is dropped.
    pub fn adopt_received(&self, name: &str, dir: &Path) -> Result<TemplateInfo, TemplateError> {
        let _guard = self.build.lock().unwrap_or_else(|e| e.into_inner());
        let drop_received = || {
            let _ = self.subvols.delete(&dir.join("rootfs"));
            let _ = storage::remove_tree(dir);
        };
        let meta = match storage::read_json::<TemplateMeta>(&dir.join("template.json")) {
            Ok(m)
                if m.name == name
                    && m.version > 0
                    && self.subvols.is_subvolume(&dir.join("rootfs")) =>
            {
                m
            }
            Ok(m) => {
                drop_received();
                return Err(TemplateError::Source(format!(
                    "the template received as {name} is {} version {} (or has no rootfs)",
                    m.name, m.version
                )));
            }
            Err(e) => {
                drop_received();
                return Err(e.into());
            }
        };
        if let Some(have) = self.get(name, meta.version) {
            drop_received();
            return Ok(have);
        }
        let final_dir = self.layout.template_version_dir(name, meta.version);
        if let Err(e) = std::fs::rename(dir, &final_dir) {
            drop_received();
            return Err(io_err("rename into place", &final_dir, e));
        }
        let info = TemplateInfo {
            name: name.to_string(),
            version: meta.version,
            created_unix_ms: meta.created_unix_ms,
            path: final_dir.join("rootfs"),
            defaults: meta.defaults,
            source: meta.source,
        };
        self.cache
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .insert(meta.version, info.clone());
        Ok(info)
    }
}

fn read_dir(path: &Path) -> Result<Vec<std::fs::DirEntry>, TemplateError> {
    let rd = match std::fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read directory", path, e)),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| io_err("read directory", path, e))?;
        if ent.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            out.push(ent);
        }
    }
    Ok(out)
}

fn run(cmd: &mut Command) -> Result<(), TemplateError> {
    let desc = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| TemplateError::Command {
        cmd: desc.clone(),
        detail: e.to_string(),
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(TemplateError::Command {
            cmd: desc,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// Copies the tree `src` into the (empty) directory `dst`, keeping owners, modes, links,
/// hardlinks and xattrs; reflinks where both are on the same btrfs.
fn copy_tree(src: &Path, dst: &Path) -> Result<(), TemplateError> {
    run(Command::new("cp")
        .arg("-a")
        .arg("--reflink=auto")
        .arg("--")
        .arg(format!("{}/.", src.display()))
        .arg(dst))
}

fn set_mode(path: &Path, mode: u32) -> Result<(), TemplateError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("chmod", path, e))
}

fn mkdir_mode(path: &Path, mode: u32) -> Result<(), TemplateError> {
    match std::fs::create_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err("create directory", path, e)),
    }
    set_mode(path, mode)
}

fn write_file(path: &Path, content: &str, mode: u32) -> Result<(), TemplateError> {
    std::fs::write(path, content).map_err(|e| io_err("write", path, e))?;
    set_mode(path, mode)
}

/// Makes `root/<name>` a real directory (replacing a symlink or file an imported tree may put
/// there, so nothing below is ever created through a symlink).
fn ensure_real_dir(root: &Path, name: &str, mode: u32) -> Result<(), TemplateError> {
    let p = root.join(name);
    match std::fs::symlink_metadata(&p) {
        Ok(md) if md.is_dir() => return Ok(()),
        Ok(_) => std::fs::remove_file(&p).map_err(|e| io_err("remove", &p, e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("stat", &p, e)),
    }
    mkdir_mode(&p, mode)
}

/// The directories every rootfs needs for the runtime: mountpoints for /proc, /dev, /sys,
/// /tmp, and `/.space/space-daemon`, the bind target of the daemon binary.
pub fn ensure_runtime_dirs(root: &Path) -> Result<(), TemplateError> {
    for (name, mode) in [
        ("proc", 0o555),
        ("dev", 0o755),
        ("sys", 0o555),
        ("tmp", 0o1777),
        (".space", 0o755),
    ] {
        ensure_real_dir(root, name, mode)?;
    }
    let daemon = root.join(".space/space-daemon");
    match std::fs::symlink_metadata(&daemon) {
        Ok(md) if md.is_file() => return Ok(()),
        Ok(md) if md.is_dir() => {
            std::fs::remove_dir_all(&daemon).map_err(|e| io_err("remove", &daemon, e))?
        }
        Ok(_) => std::fs::remove_file(&daemon).map_err(|e| io_err("remove", &daemon, e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("stat", &daemon, e)),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&daemon)
        .map_err(|e| io_err("create", &daemon, e))?;
    Ok(())
}

/// Fills the minimal template: busybox with a symlink per applet, a minimal /etc, home dirs.
fn populate_minimal(root: &Path, busybox: &Path) -> Result<(), TemplateError> {
    for (dir, mode) in [
        ("bin", 0o755),
        ("sbin", 0o755),
        ("usr", 0o755),
        ("usr/bin", 0o755),
        ("usr/sbin", 0o755),
        ("usr/local", 0o755),
        ("usr/local/bin", 0o755),
        ("usr/local/sbin", 0o755),
        ("etc", 0o755),
        ("root", 0o700),
        ("home", 0o755),
        ("home/user", 0o755),
        ("var", 0o755),
        ("var/tmp", 0o1777),
        ("run", 0o755),
        ("mnt", 0o755),
    ] {
        mkdir_mode(&root.join(dir), mode)?;
    }
    let home = root.join("home/user");
    std::os::unix::fs::chown(&home, Some(1000), Some(1000))
        .map_err(|e| io_err("chown", &home, e))?;

    let bb = root.join("bin/busybox");
    std::fs::copy(busybox, &bb).map_err(|e| io_err("copy busybox to", &bb, e))?;
    set_mode(&bb, 0o755)?;
    let out = Command::new(busybox)
        .arg("--list-full")
        .output()
        .map_err(|e| io_err("run (--list-full)", busybox, e))?;
    if !out.status.success() {
        return Err(TemplateError::Command {
            cmd: format!("{} --list-full", busybox.display()),
            detail: out.status.to_string(),
        });
    }
    let list = String::from_utf8_lossy(&out.stdout);
    let mut n = 0;
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        // Entries look like "usr/bin/awk"; accept only plain relative paths.
        let rel = Path::new(applet);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            || applet == "bin/busybox"
        {
            continue;
        }
        let link = root.join(rel);
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("create directory", parent, e))?;
        }
        match std::os::unix::fs::symlink("/bin/busybox", &link) {
            Ok(()) => n += 1,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("symlink", &link, e)),
        }
    }
    if !root.join("bin/sh").exists() {
        std::os::unix::fs::symlink("/bin/busybox", root.join("bin/sh"))
            .map_err(|e| io_err("symlink", &root.join("bin/sh"), e))?;
    }
    tracing::debug!(applets = n, "linked busybox applets");

    let etc = root.join("etc");
    write_file(
        &etc.join("passwd"),
        "root:x:0:0:root:/root:/bin/sh\n\
         user:x:1000:1000:user:/home/user:/bin/sh\n\
         nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        0o644,
    )?;
    write_file(
        &etc.join("group"),
        "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
        0o644,
    )?;
    write_file(
        &etc.join("shadow"),
        "root:*:19000:0:99999:7:::\nuser:*:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n",
        0o640,
    )?;
    write_file(&etc.join("hostname"), "sandbox\n", 0o644)?;
    write_file(
        &etc.join("hosts"),
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        0o644,
    )?;
    write_file(
        &etc.join("os-release"),
        "NAME=\"space minimal\"\nID=space-minimal\nVERSION_ID=1\nPRETTY_NAME=\"space minimal (busybox)\"\n",
        0o644,
    )?;
    write_file(
        &etc.join("profile"),
        &format!("export PATH={PATH_ENV}\nexport PS1='\\u@\\h:\\w\\$ '\numask 022\n"),
        0o644,
    )?;
    write_file(&etc.join("shells"), "/bin/sh\n/bin/ash\n", 0o644)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::fake::DirSubvolumes;
    use std::os::unix::fs::MetadataExt;

    fn store(dir: &Path) -> (TemplateStore, Arc<DirSubvolumes>) {
        let layout = Layout {
            volume: dir.join("vol"),
            run_dir: dir.join("run"),
        };
        layout.create_dirs().unwrap();
        let fake = Arc::new(DirSubvolumes::default());
        (TemplateStore::load(layout, fake.clone()).unwrap(), fake)
    }

    #[test]
    fn minimal_template_has_busybox_users_and_mountpoints() {
        let dir = tempfile::tempdir().unwrap();
        let (s, fake) = store(dir.path());
        let t = s.ensure_minimal(Path::new("/bin/busybox")).unwrap();
        assert_eq!((t.name.as_str(), t.version), ("minimal", 1));
        let r = &t.path;
        assert_eq!(
            std::fs::read_link(r.join("bin/sh")).unwrap(),
            Path::new("/bin/busybox")
        );
        assert!(
            std::fs::symlink_metadata(r.join("usr/bin/awk"))
                .unwrap()
                .is_symlink()
        );
        let passwd = std::fs::read_to_string(r.join("etc/passwd")).unwrap();
        assert!(passwd.contains("user:x:1000:1000:user:/home/user:/bin/sh"));
        assert_eq!(std::fs::metadata(r.join("home/user")).unwrap().uid(), 1000);
        assert_eq!(
            std::fs::metadata(r.join("tmp")).unwrap().mode() & 0o7777,
            0o1777
        );
        assert!(
            std::fs::metadata(r.join(".space/space-daemon"))
                .unwrap()
                .is_file()
        );
        for d in ["proc", "dev", "sys", "root"] {
            assert!(r.join(d).is_dir(), "{d}");
        }
        assert!(
            fake.calls
                .lock()
                .unwrap()
                .iter()
                .any(|c| c.starts_with("readonly") && c.ends_with("true"))
        );
        // Second call reuses it.
        assert_eq!(
            s.ensure_minimal(Path::new("/bin/busybox")).unwrap().version,
            1
        );
        // A fresh load sees it.
        let (s2, _) = store(dir.path());
        assert_eq!(s2.latest("minimal").unwrap().version, 1);
    }

    #[test]
    fn missing_busybox_names_the_package() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = store(dir.path());
        let err = s
            .ensure_minimal(Path::new("/nonexistent/busybox"))
            .unwrap_err();
        assert!(err.to_string().contains("busybox-static"), "{err}");
        assert!(s.list().is_empty());
    }

    #[test]
    fn import_makes_new_versions_and_neutralizes_symlinked_mountpoints() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = store(dir.path());
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("etc")).unwrap();
        std::fs::write(src.join("etc/motd"), "hi").unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        // A hostile tree: /.space points outside; creating the daemon file must not follow it.
        std::os::unix::fs::symlink(&outside, src.join(".space")).unwrap();
        std::os::unix::fs::symlink("/", src.join("tmp")).unwrap();

        let v1 = s.import("mine", &TemplateSource::Dir(src.clone())).unwrap();
        assert_eq!(v1.version, 1);
        assert_eq!(
            std::fs::read_to_string(v1.path.join("etc/motd")).unwrap(),
            "hi"
        );
        assert!(
            !std::fs::symlink_metadata(v1.path.join(".space"))
                .unwrap()
                .is_symlink()
        );
        assert!(
            !std::fs::symlink_metadata(v1.path.join("tmp"))
                .unwrap()
                .is_symlink()
        );
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none());

        // Tar import of the same name is version 2; list shows the newest only.
        let tar = dir.path().join("t.tar.gz");
        run(Command::new("tar")
            .arg("-czf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("etc"))
        .unwrap();
        let v2 = s.import("mine", &TemplateSource::Tar(tar)).unwrap();
        assert_eq!(v2.version, 2);
        assert!(v2.path.join("etc/motd").is_file());
        let list = s.list();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].version, 2);
        assert_eq!(s.get("mine", 1).unwrap().version, 1);

        let err = s
            .import("mine", &TemplateSource::Dir(dir.path().join("nope")))
            .unwrap_err();
        assert!(matches!(err, TemplateError::Source(_)) && err.to_string().contains("nope"));
        let err = s.import("mine", &TemplateSource::Tar(src)).unwrap_err();
        assert!(matches!(err, TemplateError::Source(_)));
    }

    #[test]
    fn failed_import_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = store(dir.path());
        let bad = dir.path().join("bad.tar");
        std::fs::write(&bad, b"not a tar archive at all").unwrap();
        assert!(s.import("x", &TemplateSource::Tar(bad)).is_err());
        let entries: Vec<_> = std::fs::read_dir(dir.path().join("vol/templates/x"))
            .unwrap()
            .collect();
        assert!(entries.is_empty());
        assert!(s.latest("x").is_none());
    }

    #[test]
    fn base_is_imported_from_the_cache_with_its_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = store(dir.path());
        // No cache: no base, and no error.
        assert!(s.ensure_base(None).unwrap().is_none());
        let cache = dir.path().join("cache");
        assert!(s.ensure_base(Some(&cache)).unwrap().is_none());
        // An older node's busybox base is replaced by a new version once a cache exists.
        let old = s
            .build_version(
                BASE_TEMPLATE,
                BUSYBOX_SOURCE,
                TemplateDefaults::default(),
                |_| Ok(()),
            )
            .unwrap();
        assert_eq!(
            s.ensure_base(Some(&cache)).unwrap().unwrap().version,
            old.version
        );
        std::fs::create_dir_all(cache.join("rootfs/etc")).unwrap();
        std::fs::write(cache.join("rootfs/etc/debian_version"), "12.0\n").unwrap();
        std::fs::write(
            cache.join("defaults.json"),
            r#"{"user":"user","env":{"LANG":"C.UTF-8"}}"#,
        )
        .unwrap();
        let t = s.ensure_base(Some(&cache)).unwrap().unwrap();
        assert_eq!(t.version, 2);
        assert_eq!(t.defaults.user.as_deref(), Some("user"));
        assert_eq!(t.defaults.env["LANG"], "C.UTF-8");
        assert!(t.path.join("etc/debian_version").is_file());
        assert!(t.path.join(".space/space-daemon").is_file());
        // Done once: a second open reuses it, and a fresh load keeps the defaults.
        assert_eq!(s.ensure_base(Some(&cache)).unwrap().unwrap().version, 2);
        let (s2, _) = store(dir.path());
        assert_eq!(s2.latest("base").unwrap().defaults, t.defaults);
        // A broken defaults file is an error that names it.
        let (s3, _) = store(&dir.path().join("other"));
        std::fs::write(cache.join("defaults.json"), "{\"shell\": 1}").unwrap();
        let e = s3.ensure_base(Some(&cache)).unwrap_err();
        assert!(e.to_string().contains("defaults.json"), "{e}");
    }
}
