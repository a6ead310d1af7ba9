//! Node storage: the btrfs volume (the data dir itself, or a loop-mounted sparse image), the
//! on-disk layout, subvolume operations behind the [`Subvolumes`] trait, and atomic JSON files.
//!
//! ```text
//! <volume>/templates/<name>/<version>/rootfs     read-only subvolume
//! <volume>/templates/<name>/<version>/template.json
//! <volume>/sandboxes/<id>/rootfs                 writable snapshot of the template
//! <volume>/sandboxes/<id>/sandbox.json           the node-side record
//! <run_dir>/sandboxes/<id>/guest.sock            guest channel (bound by the runtime)
//! <run_dir>/sandboxes/<id>/daemon.log
//! ```

use std::ffi::CString;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::mount::MountFlags;
use serde::Serialize;
use space_sys::btrfs::{self, BtrfsError};
use space_sys::loopdev::{self, LoopError, LoopOptions};

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("failed to {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Btrfs(#[from] BtrfsError),
    #[error(transparent)]
    Loop(#[from] LoopError),
    #[error("`{cmd}` failed: {detail}")]
    Command { cmd: String, detail: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("invalid JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl StorageError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        StorageError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Subvolume operations: the kernel-facing part of storage. [`Btrfs`] is the real one; tests
/// use a recording fake over plain directories.
pub trait Subvolumes: Send + Sync + 'static {
    fn create(&self, parent: &Path, name: &str) -> Result<(), StorageError>;
    /// O(1) writable (or read-only) copy of subvolume `src` at `dst_parent/name`.
    fn snapshot(
        &self,
        src: &Path,
        dst_parent: &Path,
        name: &str,
        readonly: bool,
    ) -> Result<(), StorageError>;
    /// Deletes the subvolume and every subvolume nested in it; missing is fine.
    fn delete(&self, path: &Path) -> Result<(), StorageError>;
    fn set_readonly(&self, path: &Path, readonly: bool) -> Result<(), StorageError>;
    fn is_subvolume(&self, path: &Path) -> bool;
    /// The volume's disk-quota groups (decision 0043); `None` where there are none.
    fn quotas(&self) -> Option<&dyn QuotaGroups> {
        None
    }
}

/// Groups of subvolumes charged together against one limit (decision 0043): btrfs level-1
/// qgroups under simple quotas. Every path is on the node's volume.
pub trait QuotaGroups: Send + Sync {
    /// Makes a group named after subvolume `first` and puts `first` in it; returns its id.
    fn create(&self, first: &Path) -> Result<u64, StorageError>;
    /// Puts subvolume `subvol` into group `group` (already in it is fine).
    fn join(&self, group: u64, subvol: &Path) -> Result<(), StorageError>;
    /// Sets (or, with `None`, lifts) the group's limit in bytes.
    fn limit(&self, group: u64, bytes: Option<u64>) -> Result<(), StorageError>;
    /// Bytes charged to the group; `None` when there is no such group.
    fn usage(&self, group: u64) -> Result<Option<u64>, StorageError>;
    /// Destroys the group (missing is fine). What its subvolumes still hold stays charged to
    /// them, not to it.
    fn destroy(&self, group: u64) -> Result<(), StorageError>;
    /// Every group of space's on the volume.
    fn groups(&self) -> Result<Vec<u64>, StorageError>;
}

/// Reflinks `src` to `dst` through a temporary name (a crash leaves no half file at `dst`).
pub(crate) fn clone_file_atomic(src: &Path, dst: &Path) -> Result<(), StorageError> {
    let tmp = dst.with_extension("new");
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StorageError::io("remove", &tmp, e)),
    }
    crate::runtime::microvm::clone_disk(src, &tmp)
        .map_err(|e| StorageError::io("reflink", &tmp, e))?;
    std::fs::rename(&tmp, dst).map_err(|e| StorageError::io("rename", &tmp, e))
}

/// Where the microvm copy `name` in `dir` is filled (`<name>.new`) before it is sealed.
pub(crate) fn filling(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.new"))
}

/// The writable subvolume a microvm copy (a snapshot's `rootfs`, a move's `base` or `final`)
/// is filled in: [`filling`], an earlier one cut short deleted first. Only
/// [`seal_vm_subvolume`] gives it its name, so a copy under its name is always whole.
pub(crate) fn new_vm_subvolume(
    subvols: &dyn Subvolumes,
    dir: &Path,
    name: &str,
) -> Result<PathBuf, StorageError> {
    let sub = filling(dir, name);
    if subvols.is_subvolume(&sub) {
        subvols.delete(&sub)?;
    }
    subvols.create(dir, &format!("{name}.new"))?;
    Ok(sub)
}

/// Reflinks the VM's `disk` into the filled copy `name` in `dir` (made first when missing),
/// makes it read-only and gives it its name.
pub(crate) fn seal_vm_subvolume(
    subvols: &dyn Subvolumes,
    dir: &Path,
    name: &str,
    disk: &Path,
) -> Result<(), StorageError> {
    let sub = filling(dir, name);
    if !subvols.is_subvolume(&sub) {
        new_vm_subvolume(subvols, dir, name)?;
    }
    clone_file_atomic(disk, &sub.join(crate::node::SANDBOX_DISK))?;
    subvols.set_readonly(&sub, true)?;
    let done = dir.join(name);
    std::fs::rename(&sub, &done).map_err(|e| StorageError::io("rename", &sub, e))
}

/// Real btrfs subvolumes through space-sys ioctls.
#[derive(Debug, Default)]
pub struct Btrfs {
    quotas: Option<BtrfsQuotas>,
}

impl Btrfs {
    /// Subvolumes with per-sandbox disk quotas: simple quotas are turned on for the volume at
    /// `root` when they are off (a volume with full qgroups on keeps them; decision 0043).
    /// Where the kernel has no simple quotas (before Linux 6.7) the error says so.
    pub fn with_quotas(root: &Path) -> Result<Self, StorageError> {
        let mode = btrfs::quota::enable_simple_quotas(root)?;
        tracing::info!(volume = %root.display(), mode = ?mode, "disk quotas are on");
        Ok(Self {
            quotas: Some(BtrfsQuotas {
                volume: root.to_path_buf(),
            }),
        })
    }
}

/// The level-1 qgroups of one volume.
#[derive(Debug)]
struct BtrfsQuotas {
    volume: PathBuf,
}

/// space's groups are level-1 qgroups `1/(0x5ACE << 32 | n)`: a volume's own groups (made
/// by its admin, on a btrfs data dir) are never taken for one, nor swept.
const SPACE_GROUP_TAG: u64 = 0x5ACE << 32;

fn space_group(n: u64) -> u64 {
    btrfs::quota::level1(SPACE_GROUP_TAG | (n & 0xFFFF_FFFF))
}

fn is_space_group(g: u64) -> bool {
    btrfs::quota::is_level1(g) && g & !(0xFFFF_FFFF | 1 << 48) == SPACE_GROUP_TAG
}

impl QuotaGroups for BtrfsQuotas {
    fn create(&self, first: &Path) -> Result<u64, StorageError> {
        // Named after `first`'s tree id. A subvolume id can come back after a remount (the
        // highest one deleted) while a group named after it still holds an earlier rootfs
        // of another sandbox: then one above the highest group there is.
        let tree = btrfs::subvolume_info(first)?.tree_id;
        let mut group = space_group(tree);
        if !btrfs::quota::create_qgroup(&self.volume, group)? {
            group = self.groups()?.into_iter().max().unwrap_or(group) + 1;
            if !is_space_group(group) || !btrfs::quota::create_qgroup(&self.volume, group)? {
                return Err(StorageError::Unsupported(format!(
                    "no free disk-quota group for subvolume {tree}"
                )));
            }
        }
        btrfs::quota::join(first, group)?;
        Ok(group)
    }
    fn join(&self, group: u64, subvol: &Path) -> Result<(), StorageError> {
        Ok(btrfs::quota::join(subvol, group)?)
    }
    fn limit(&self, group: u64, bytes: Option<u64>) -> Result<(), StorageError> {
        Ok(btrfs::quota::limit_exclusive(&self.volume, group, bytes)?)
    }
    fn usage(&self, group: u64) -> Result<Option<u64>, StorageError> {
        Ok(btrfs::quota::usage(&self.volume, group)?.map(|u| u.exclusive))
    }
    fn destroy(&self, group: u64) -> Result<(), StorageError> {
        Ok(btrfs::quota::destroy_qgroup(&self.volume, group)?)
    }
    fn groups(&self) -> Result<Vec<u64>, StorageError> {
        Ok(btrfs::quota::level1_groups(&self.volume)?
            .into_iter()
            .filter(|g| is_space_group(*g))
            .collect())
    }
}

impl Subvolumes for Btrfs {
    fn quotas(&self) -> Option<&dyn QuotaGroups> {
        self.quotas.as_ref().map(|q| q as &dyn QuotaGroups)
    }
    fn create(&self, parent: &Path, name: &str) -> Result<(), StorageError> {
        Ok(btrfs::create_subvolume(parent, name)?)
    }
    fn snapshot(
        &self,
        src: &Path,
        dst_parent: &Path,
        name: &str,
        readonly: bool,
    ) -> Result<(), StorageError> {
        Ok(btrfs::snapshot(src, dst_parent, name, readonly)?)
    }
    fn delete(&self, path: &Path) -> Result<(), StorageError> {
        Ok(btrfs::delete_subvolume(path)?)
    }
    fn set_readonly(&self, path: &Path, readonly: bool) -> Result<(), StorageError> {
        Ok(btrfs::set_readonly(path, readonly)?)
    }
    fn is_subvolume(&self, path: &Path) -> bool {
        btrfs::is_subvolume(path).unwrap_or(false)
    }
}

/// Paths of everything the node keeps on disk and under its run dir.
#[derive(Debug, Clone)]
pub struct Layout {
    pub volume: PathBuf,
    pub run_dir: PathBuf,
}

impl Layout {
    pub fn templates(&self) -> PathBuf {
        self.volume.join("templates")
    }
    pub fn template_dir(&self, name: &str) -> PathBuf {
        self.templates().join(name)
    }
    pub fn template_version_dir(&self, name: &str, version: u32) -> PathBuf {
        self.template_dir(name).join(version.to_string())
    }
    pub fn sandboxes(&self) -> PathBuf {
        self.volume.join("sandboxes")
    }
    /// Unpacked image layers, one read-only subvolume per chain id (`oci/mod.rs`).
    pub fn oci_layers(&self) -> PathBuf {
        self.volume.join("oci").join("layers")
    }
    /// Blobs being downloaded.
    pub fn oci_tmp(&self) -> PathBuf {
        self.volume.join("oci").join("tmp")
    }
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes().join(id)
    }
    pub fn sandbox_rootfs(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("rootfs")
    }
    pub fn sandbox_record(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("sandbox.json")
    }
    pub fn run_sandboxes(&self) -> PathBuf {
        self.run_dir.join("sandboxes")
    }
    pub fn run_sandbox_dir(&self, id: &str) -> PathBuf {
        self.run_sandboxes().join(id)
    }
    pub fn channel_socket(&self, id: &str) -> PathBuf {
        self.run_sandbox_dir(id).join("guest.sock")
    }

    /// Creates the top-level directories, and gives existing ones their modes: templates and
    /// the run dir's sandboxes 0700; the sandboxes dir and the run dir 0711, traversable (a
    /// sandbox's init, as its own host uid, attaches its rootfs at its host path) but not
    /// listable, so another host user can neither read a template nor find a sandbox.
    pub fn create_dirs(&self) -> Result<(), StorageError> {
        for (d, mode) in [
            (self.templates(), 0o700),
            (self.sandboxes(), 0o711),
            (self.run_dir.clone(), 0o711),
            (self.run_sandboxes(), 0o700),
        ] {
            dir_with_mode(&d, mode)?;
        }
        Ok(())
    }
}

pub(crate) fn mkdir_p(path: &Path, mode: u32) -> Result<(), StorageError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|e| StorageError::io("create directory", path, e))
}

/// Creates `path` and its parents, and gives `path` itself `mode` even when it existed (a
/// data dir from an older spaced gets the modes this one keeps).
pub fn dir_with_mode(path: &Path, mode: u32) -> Result<(), StorageError> {
    mkdir_p(path, mode)?;
    set_mode(path, mode)
}

/// `chmod path mode`.
pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<(), StorageError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| StorageError::io("chmod", path, e))
}

/// Creates `path` (mode 0700), failing if it exists.
pub(crate) fn mkdir_private(path: &Path) -> Result<(), StorageError> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(path)
        .map_err(|e| StorageError::io("create directory", path, e))
}

/// Removes a directory tree if present (not following symlinks; NotFound is fine).
pub(crate) fn remove_tree(path: &Path) -> Result<(), StorageError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StorageError::io("remove", path, e)),
    }
}

/// Writes `value` as JSON to `path` atomically: a temporary file in the same directory, then
/// rename over. With `durable`, the temporary file is fsynced before the rename and the
/// directory after it, so the record survives a host crash.
pub fn write_json_atomic<T: Serialize>(
    path: &Path,
    value: &T,
    durable: bool,
) -> Result<(), StorageError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| StorageError::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(|e| StorageError::io("create", &tmp, e))?;
    f.write_all(&bytes)
        .map_err(|e| StorageError::io("write", &tmp, e))?;
    if durable {
        f.sync_all()
            .map_err(|e| StorageError::io("fsync", &tmp, e))?;
    }
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| StorageError::io("rename into place", path, e))?;
    if durable {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| StorageError::io("fsync directory", dir, e))?;
    }
    Ok(())
}

/// Makes an already written file and its directory entry durable (fsync both). Used off the
/// hot path, after a record was written with `durable: false`.
pub fn sync_file_and_dir(path: &Path) -> Result<(), StorageError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| StorageError::io("fsync", path, e))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StorageError::io("fsync directory", dir, e))
}

pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, StorageError> {
    let bytes = std::fs::read(path).map_err(|e| StorageError::io("read", path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| StorageError::Json {
        path: path.to_path_buf(),
        source: e,
    })
}

/// The btrfs volume the node stores everything on.
#[derive(Debug, Clone)]
pub struct Volume {
    /// Root directory of the volume (templates/ and sandboxes/ live here).
    pub root: PathBuf,
    /// The sparse image backing the volume when the data dir is not btrfs.
    pub image: Option<PathBuf>,
}

/// Mount options of the loop-mounted image: `noatime` (no metadata writes on reads), barriers
/// kept. Measured on the 2-core dev VM (ext4 host fs, 60 snapshots of a busybox template):
/// snapshot p50 3.9 ms with a buffered loop device, 6.4 ms with a direct-I/O loop device,
/// 1.3 ms with `nobarrier`. Every btrfs commit flushes, and a flush on a loop device is an
/// fsync of the image; `nobarrier` would save ~2.6 ms per create but lets a host crash
/// corrupt the whole volume, so it is not used. The loop device is buffered (faster here).
/// The volume image's mount: no set-id programs and no device nodes work through it on the
/// host (a sandbox's own mount clears nosuid again for sudo inside: decision 0021).
pub const LOOP_MOUNT_FLAGS: MountFlags = MountFlags::NOATIME
    .union(MountFlags::NOSUID)
    .union(MountFlags::NODEV);
pub const LOOP_MOUNT_DATA: &str = "";

/// Makes sure a btrfs volume backs `data_dir`: the data dir itself when it is btrfs;
/// otherwise the sparse image `data_dir/space-btrfs.img` (created with `mkfs.btrfs` when
/// missing) loop-mounted at `data_dir/volume` (reused when already mounted there).
///
/// Host users other than root cannot read what is in it: the data dir and the volume's root
/// are 0711 (traversable for a sandbox's init, not listable) and the image 0600.
pub fn prepare_volume(data_dir: &Path, image_size_bytes: u64) -> Result<Volume, StorageError> {
    dir_with_mode(data_dir, 0o711)?;
    let data_dir =
        std::fs::canonicalize(data_dir).map_err(|e| StorageError::io("resolve", data_dir, e))?;
    if btrfs::is_btrfs(&data_dir)? {
        tracing::info!(path = %data_dir.display(), "data dir is btrfs; using it directly");
        if !mount_has_nosuid_nodev(&data_dir) {
            tracing::warn!(path = %data_dir.display(),
                "the data dir's filesystem is mounted without nosuid and nodev: mount it with \
                 both, so that no set-id program or device node in a template or sandbox tree \
                 works on the host");
        }
        return Ok(Volume {
            root: data_dir,
            image: None,
        });
    }
    let image = data_dir.join("space-btrfs.img");
    let mnt = data_dir.join("volume");
    mkdir_p(&mnt, 0o711)?;
    if let Some(fstype) = mounted_fstype(&mnt)? {
        if fstype == "btrfs" {
            tracing::info!(mount = %mnt.display(), image = %image.display(),
                "reusing the already mounted btrfs volume");
            // A mount made before the volume was nosuid and nodev gets them now.
            rustix::mount::mount_remount(&mnt, MountFlags::BIND | LOOP_MOUNT_FLAGS, "")
                .map_err(|e| StorageError::io("remount nosuid,nodev", &mnt, e.into()))?;
            set_mode(&image, 0o600)?;
            set_mode(&mnt, 0o711)?;
            return Ok(Volume {
                root: mnt,
                image: Some(image),
            });
        }
        return Err(StorageError::io(
            "use (something other than btrfs is mounted there)",
            &mnt,
            io::Error::from_raw_os_error(libc::EBUSY),
        ));
    }
    if !image.exists() {
        create_image(&image, image_size_bytes)?;
    }
    set_mode(&image, 0o600)?;
    let dev = loopdev::attach(
        &image,
        LoopOptions {
            autoclear: true,
            ..Default::default()
        },
    )?;
    let data = CString::new(LOOP_MOUNT_DATA).unwrap_or_default();
    rustix::mount::mount(
        dev.path(),
        &mnt,
        "btrfs",
        LOOP_MOUNT_FLAGS,
        Some(data.as_c_str()),
    )
    .map_err(|e| StorageError::io("mount btrfs image at", &mnt, e.into()))?;
    // The mount now holds the device; autoclear detaches it on unmount.
    tracing::info!(image = %image.display(), device = %dev.path().display(),
        mount = %mnt.display(), "mounted the btrfs volume image");
    drop(dev);
    // The mount's root is the filesystem's own root directory (0755 from mkfs).
    set_mode(&mnt, 0o711)?;
    Ok(Volume {
        root: mnt,
        image: Some(image),
    })
}

fn create_image(image: &Path, size: u64) -> Result<(), StorageError> {
    let tmp = image.with_extension("img.partial");
    let f = std::fs::File::create(&tmp).map_err(|e| StorageError::io("create", &tmp, e))?;
    f.set_len(size)
        .map_err(|e| StorageError::io("size (sparse)", &tmp, e))?;
    drop(f);
    let out = Command::new("mkfs.btrfs")
        .arg("-q")
        .arg(&tmp)
        .output()
        .map_err(|e| StorageError::Command {
            cmd: "mkfs.btrfs".into(),
            detail: format!("{e} (install the btrfs-progs package)"),
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(StorageError::Command {
            cmd: format!("mkfs.btrfs -q {}", tmp.display()),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    std::fs::rename(&tmp, image).map_err(|e| StorageError::io("rename into place", image, e))?;
    tracing::warn!(image = %image.display(), size_bytes = size,
        "data dir is not btrfs: created a sparse btrfs image for node storage");
    Ok(())
}

/// Whether the mount that holds `path` has both nosuid and nodev.
fn mount_has_nosuid_nodev(path: &Path) -> bool {
    rustix::fs::statvfs(path).is_ok_and(|s| {
        s.f_flag.contains(rustix::fs::StatVfsMountFlags::NOSUID)
            && s.f_flag.contains(rustix::fs::StatVfsMountFlags::NODEV)
    })
}

/// The filesystem type mounted exactly at `path` (the top-most mount there), from
/// /proc/self/mountinfo.
pub fn mounted_fstype(path: &Path) -> Result<Option<String>, StorageError> {
    let mi = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(mi).map_err(|e| StorageError::io("read", mi, e))?;
    Ok(fstype_at(&text, path))
}

fn fstype_at(mountinfo: &str, path: &Path) -> Option<String> {
    let mut found = None;
    for line in mountinfo.lines() {
        let mut fields = line.split(' ');
        let mountpoint = fields.nth(4);
        let Some(mp) = mountpoint else { continue };
        if space_sys::mntns::unescape_mountinfo(mp) != path {
            continue;
        }
        let mut rest = fields.skip_while(|f| *f != "-");
        rest.next();
        if let Some(fstype) = rest.next() {
            // Later lines are mounted on top of earlier ones.
            found = Some(fstype.to_string());
        }
    }
    found
}

#[cfg(test)]
pub(crate) mod fake {
    //! Plain directories standing in for subvolumes, recording every call.
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    use super::{StorageError, Subvolumes};

    #[derive(Debug, Default)]
    pub(crate) struct DirSubvolumes {
        pub(crate) calls: Mutex<Vec<String>>,
        /// Paths of "subvolumes" (directories created through this fake).
        pub(crate) subvols: Mutex<Vec<PathBuf>>,
        /// Fail the next snapshot (rollback tests).
        pub(crate) fail_snapshot: Mutex<bool>,
    }

    fn copy_tree(src: &Path, dst: &Path) -> std::io::Result<()> {
        let st = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", src.display()))
            .arg(dst)
            .status()?;
        if st.success() {
            Ok(())
        } else {
            Err(std::io::Error::other("cp -a failed"))
        }
    }

    impl Subvolumes for DirSubvolumes {
        fn create(&self, parent: &Path, name: &str) -> Result<(), StorageError> {
            let p = parent.join(name);
            self.calls
                .lock()
                .unwrap()
                .push(format!("create {}", p.display()));
            std::fs::create_dir(&p).map_err(|e| StorageError::io("create", &p, e))?;
            self.subvols.lock().unwrap().push(p);
            Ok(())
        }
        fn snapshot(
            &self,
            src: &Path,
            dst_parent: &Path,
            name: &str,
            readonly: bool,
        ) -> Result<(), StorageError> {
            let p = dst_parent.join(name);
            self.calls.lock().unwrap().push(format!(
                "snapshot {} {} ro={readonly}",
                src.display(),
                p.display()
            ));
            if std::mem::take(&mut *self.fail_snapshot.lock().unwrap()) {
                return Err(StorageError::io(
                    "snapshot (injected)",
                    &p,
                    std::io::Error::other("injected failure"),
                ));
            }
            std::fs::create_dir(&p).map_err(|e| StorageError::io("create", &p, e))?;
            copy_tree(src, &p).map_err(|e| StorageError::io("copy", &p, e))?;
            self.subvols.lock().unwrap().push(p);
            Ok(())
        }
        fn delete(&self, path: &Path) -> Result<(), StorageError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("delete {}", path.display()));
            self.subvols.lock().unwrap().retain(|p| p != path);
            super::remove_tree(path)
        }
        fn set_readonly(&self, path: &Path, readonly: bool) -> Result<(), StorageError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("readonly {} {readonly}", path.display()));
            Ok(())
        }
        fn is_subvolume(&self, path: &Path) -> bool {
            self.subvols.lock().unwrap().iter().any(|p| p == path)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn mountinfo_parsing_finds_topmost_fstype() {
        let mi = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 7:3 / /var/lib/space/volume rw,noatime shared:50 - btrfs /dev/loop3 rw,ssd
91 22 0:5 / /var/lib/my\\040dir rw - tmpfs tmpfs rw
92 90 0:6 / /var/lib/space/volume rw - tmpfs tmpfs rw
";
        assert_eq!(
            fstype_at(mi, Path::new("/var/lib/space/volume")).as_deref(),
            Some("tmpfs")
        );
        assert_eq!(
            fstype_at(mi, Path::new("/var/lib/my dir")).as_deref(),
            Some("tmpfs")
        );
        assert_eq!(fstype_at(mi, Path::new("/var/lib")), None);
        assert_eq!(
            fstype_at(
                &mi.lines().take(2).collect::<Vec<_>>().join("\n"),
                Path::new("/var/lib/space/volume")
            )
            .as_deref(),
            Some("btrfs")
        );
    }

    #[test]
    fn json_is_written_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.json");
        write_json_atomic(&p, &vec![1, 2, 3], true).unwrap();
        write_json_atomic(&p, &vec![4], false).unwrap();
        let v: Vec<i32> = read_json(&p).unwrap();
        assert_eq!(v, vec![4]);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.json")]);
        std::fs::write(&p, b"{broken").unwrap();
        let err = read_json::<Vec<i32>>(&p).unwrap_err();
        assert!(err.to_string().contains("x.json"), "{err}");
    }

    /// Unmounts the volume of a test data dir on drop.
    pub(crate) struct Unmount(pub(crate) PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }

    /// Real kernel (root, btrfs-progs): a non-btrfs data dir gets a loop-mounted sparse image,
    /// and a second prepare reuses the mount instead of mounting again.
    #[test]
    fn loop_image_is_created_mounted_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let v = prepare_volume(&data, 256 << 20).unwrap();
        let _u = Unmount(v.root.clone());
        let data = std::fs::canonicalize(&data).unwrap();
        assert_eq!(v.root, data.join("volume"));
        assert_eq!(
            v.image.as_deref(),
            Some(data.join("space-btrfs.img").as_path())
        );
        assert_eq!(mounted_fstype(&v.root).unwrap().as_deref(), Some("btrfs"));
        let img_md = std::fs::metadata(data.join("space-btrfs.img")).unwrap();
        assert_eq!(img_md.len(), 256 << 20);
        use std::os::unix::fs::MetadataExt;
        assert!(img_md.blocks() * 512 < 256 << 20, "image is sparse");
        std::fs::write(v.root.join("marker"), b"1").unwrap();
        let mounts_before = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .count();
        let v2 = prepare_volume(&data, 256 << 20).unwrap();
        assert_eq!(v2.root, v.root);
        assert!(v2.root.join("marker").exists());
        let mounts_after = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .count();
        assert_eq!(mounts_before, mounts_after, "reused, not mounted twice");
        // A btrfs data dir is used directly.
        let v3 = prepare_volume(&v.root.join("inner"), 1).unwrap();
        assert_eq!(v3.root, v.root.join("inner"));
        assert!(v3.image.is_none());
    }

    fn p50(mut v: Vec<std::time::Duration>) -> std::time::Duration {
        v.sort();
        v[v.len() / 2]
    }

    /// Benchmark (run with --ignored --nocapture): snapshot/delete latency of a base-like
    /// template on the loop image under different loop/mount settings.
    #[test]
    #[ignore = "benchmark"]
    fn snapshot_latency_on_loop_image() {
        use std::time::Instant;
        let variants: [(&str, bool, &str); 4] = [
            ("buffered loop, noatime", false, ""),
            ("direct-io loop, noatime", true, ""),
            ("buffered loop, noatime,nobarrier", false, "nobarrier"),
            ("direct-io loop, noatime,nobarrier", true, "nobarrier"),
        ];
        for (name, dio, data) in variants {
            let dir = tempfile::tempdir().unwrap();
            let img = dir.path().join("img");
            std::fs::File::create(&img)
                .unwrap()
                .set_len(2 << 30)
                .unwrap();
            assert!(
                Command::new("mkfs.btrfs")
                    .arg("-q")
                    .arg(&img)
                    .status()
                    .unwrap()
                    .success()
            );
            let dev = loopdev::attach(
                &img,
                LoopOptions {
                    direct_io: dio,
                    autoclear: true,
                    read_only: false,
                    block_size: if dio { 4096 } else { 0 },
                },
            )
            .unwrap();
            let mnt = dir.path().join("mnt");
            std::fs::create_dir(&mnt).unwrap();
            let data_c = CString::new(data).unwrap();
            rustix::mount::mount(
                dev.path(),
                &mnt,
                "btrfs",
                MountFlags::NOATIME,
                Some(data_c.as_c_str()),
            )
            .unwrap();
            drop(dev);
            let _u = Unmount(mnt.clone());
            btrfs::create_subvolume(&mnt, "tmpl").unwrap();
            let t = mnt.join("tmpl");
            for i in 0..300 {
                std::os::unix::fs::symlink("/bin/busybox", t.join(format!("l{i}"))).unwrap();
            }
            std::fs::copy("/bin/busybox", t.join("busybox")).unwrap();
            btrfs::set_readonly(&t, true).unwrap();
            std::fs::create_dir(mnt.join("sb")).unwrap();
            let (mut snap, mut del, mut rec) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..60 {
                let n = format!("s{i}");
                let t0 = Instant::now();
                btrfs::snapshot(&t, &mnt.join("sb"), &n, false).unwrap();
                snap.push(t0.elapsed());
                let t0 = Instant::now();
                write_json_atomic(
                    &mnt.join("sb").join(format!("{n}.json")),
                    &vec![1u8; 300],
                    true,
                )
                .unwrap();
                rec.push(t0.elapsed());
                // Dirty the snapshot a little, as a sandbox would.
                std::fs::write(mnt.join("sb").join(&n).join("f"), b"x").unwrap();
            }
            for i in 0..60 {
                let t0 = Instant::now();
                btrfs::delete_subvolume(&mnt.join("sb").join(format!("s{i}"))).unwrap();
                del.push(t0.elapsed());
            }
            println!(
                "{name}: snapshot p50 {:?}, fsynced record p50 {:?}, delete p50 {:?}",
                p50(snap),
                p50(rec),
                p50(del)
            );
        }
    }
}
