//! Disk images: a template's ext4 image built from its rootfs directory without mounting
//! (`mkfs.ext4 -d`), and per-sandbox copies made with FICLONE (O(1) on btrfs).

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::RuntimeError;

/// Room added to the image on top of 1.5 x the rootfs's content (for what the sandbox writes).
pub const HEADROOM_BYTES: u64 = 256 << 20;
const BLOCK: u64 = 4096;

/// What [`image_size`] needs to know about a rootfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TreeUsage {
    /// Bytes the content takes in 4 KiB blocks (files, long symlinks and directories).
    pub bytes: u64,
    /// Number of inodes (every entry, the root included).
    pub inodes: u64,
}

/// Walks `root` without following symlinks.
pub fn tree_usage(root: &Path) -> io::Result<TreeUsage> {
    let mut u = TreeUsage {
        bytes: BLOCK,
        inodes: 1,
    };
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = fs::read_dir(&d)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot list {}: {e}", d.display())))?;
        for e in entries {
            let e = e?;
            let md = e.path().symlink_metadata()?;
            u.inodes += 1;
            if md.is_dir() {
                stack.push(e.path());
                u.bytes += BLOCK;
            } else if md.file_type().is_symlink() && md.len() < 60 {
                // Fast symlinks live in the inode.
            } else if md.is_file() || md.file_type().is_symlink() {
                u.bytes += md.len().div_ceil(BLOCK) * BLOCK;
            }
        }
    }
    Ok(u)
}

/// Image size for a rootfs: content x 1.5 + [`HEADROOM_BYTES`], in whole MiB.
pub fn image_size(u: TreeUsage) -> u64 {
    (u.bytes + u.bytes / 2 + HEADROOM_BYTES).div_ceil(1 << 20) << 20
}

/// Inodes to ask mkfs for: twice what the rootfs holds plus 64 Ki for what the sandbox adds
/// (mkfs's default, one per 16 KiB, runs out on trees of many small files).
pub fn inode_count(u: TreeUsage) -> u64 {
    u.inodes * 2 + 65536
}

fn setup(step: &'static str) -> impl FnOnce(io::Error) -> RuntimeError {
    move |source| RuntimeError::Setup { step, source }
}

/// mkfs.ext4 in PATH or the sbin directories (root's PATH may lack them under some shells).
fn find_mkfs() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
}

/// Builds `image`, an ext4 filesystem holding `rootfs` (owners, modes and xattrs as on disk),
/// without mounting anything. Idempotent: an existing `image` is left as it is. The file is
/// sparse, written under a temporary name in the same directory and renamed into place, so a
/// crash never leaves a half-built image at `image`.
pub fn ensure_template_disk(rootfs: &Path, image: &Path) -> Result<(), RuntimeError> {
    if image.exists() {
        return Ok(());
    }
    // One build at a time in this process: concurrent creates (and a template checkpoint's
    // builder) wait for the first and then find its image.
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    if image.exists() {
        return Ok(());
    }
    if !rootfs.is_dir() {
        return Err(setup("build a template disk")(io::Error::new(
            io::ErrorKind::NotFound,
            format!("rootfs {} is not a directory", rootfs.display()),
        )));
    }
    let mkfs = find_mkfs().ok_or_else(|| {
        setup("build a template disk")(io::Error::new(
            io::ErrorKind::NotFound,
            "mkfs.ext4 not installed: apt-get install e2fsprogs",
        ))
    })?;
    let usage = tree_usage(rootfs).map_err(setup("measure the template rootfs"))?;
    let size = image_size(usage);
    let name = image
        .file_name()
        .ok_or_else(|| {
            setup("build a template disk")(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} has no file name", image.display()),
            ))
        })?
        .to_string_lossy()
        .into_owned();
    let tmp = image.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(setup("create the template disk"))?;
        f.set_len(size).map_err(setup("size the template disk"))?;
        drop(f);
        let out = Command::new(&mkfs)
            .args([
                "-q",
                "-F",
                "-t",
                "ext4",
                "-L",
                "space-root",
                "-b",
                "4096",
                "-I",
                "256",
            ])
            .arg("-N")
            .arg(inode_count(usage).to_string())
            // The image is sparse and mkfs discards (punches) it first, so zeroing the inode
            // tables and journal now costs nothing and spares the guest's lazy init writes.
            .args([
                "-E",
                "root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0",
            ])
            .arg("-d")
            .arg(rootfs)
            .arg(&tmp)
            .stdin(Stdio::null())
            .output()
            .map_err(setup("run mkfs.ext4"))?;
        if !out.status.success() {
            return Err(setup("build a template disk")(io::Error::other(format!(
                "{} -d {} {} failed ({}): {}",
                mkfs.display(),
                rootfs.display(),
                tmp.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))));
        }
        fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(setup("sync the template disk"))?;
        fs::rename(&tmp, image).map_err(setup("rename the template disk into place"))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Makes `dst` (which must not exist) a reflink copy of `src` with FICLONE: O(1) on btrfs
/// and XFS, sharing every block until either side writes. Where the filesystem cannot
/// reflink this fails (no silent full copy: a sandbox disk must not cost its size in time
/// and space), and `dst` is removed.
pub fn clone_disk(src: &Path, dst: &Path) -> io::Result<()> {
    let ctx = |what: &str, e: io::Error| io::Error::new(e.kind(), format!("{what}: {e}"));
    let from =
        fs::File::open(src).map_err(|e| ctx(&format!("cannot open {}", src.display()), e))?;
    let mode = from.metadata()?.mode() & 0o777;
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(dst)
        .map_err(|e| ctx(&format!("cannot create {}", dst.display()), e))?;
    if let Err(e) = rustix::fs::ioctl_ficlone(&to, &from) {
        drop(to);
        let _ = fs::remove_file(dst);
        let e = io::Error::from(e);
        let why = match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::EINVAL) | Some(libc::ENOTTY) => {
                "the filesystem cannot reflink (btrfs or XFS with reflink=1 needed); \
                 refusing a full copy"
            }
            Some(libc::EXDEV) => "source and destination are on different filesystems",
            _ => "FICLONE failed",
        };
        return Err(io::Error::new(
            e.kind(),
            format!(
                "cannot clone {} to {}: {why} ({e})",
                src.display(),
                dst.display()
            ),
        ));
    }
    Ok(())
}
