//! Loop devices through ioctls: attach a backing file to a free `/dev/loopN`
//! (LOOP_CTL_GET_FREE + LOOP_CONFIGURE) and find the device a file is already attached to.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("failed to {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn err(op: &'static str, path: &Path, source: impl Into<io::Error>) -> LoopError {
    LoopError::Io {
        op,
        path: path.to_path_buf(),
        source: source.into(),
    }
}

/// How to attach a backing file.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoopOptions {
    /// Bypass the host page cache for the backing file (LO_FLAGS_DIRECT_IO).
    pub direct_io: bool,
    /// Detach automatically when the last user (e.g. the mount) goes away.
    pub autoclear: bool,
    pub read_only: bool,
    /// Logical block size of the device; 0 keeps the kernel default (512).
    pub block_size: u32,
}

/// An attached loop device. Dropping it closes our fd; with `autoclear` the kernel detaches
/// the device once nothing else (a mount) holds it.
#[derive(Debug)]
pub struct LoopDevice {
    fd: OwnedFd,
    path: PathBuf,
}

impl LoopDevice {
    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl AsFd for LoopDevice {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Attaches `backing` to the first free loop device.
pub fn attach(backing: &Path, opts: LoopOptions) -> Result<LoopDevice, LoopError> {
    let ctl_path = Path::new("/dev/loop-control");
    let ctl = rustix::fs::open(ctl_path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| err("open", ctl_path, e))?;
    let ro = if opts.read_only {
        OFlags::RDONLY
    } else {
        OFlags::RDWR
    };
    let direct = if opts.direct_io {
        OFlags::DIRECT
    } else {
        OFlags::empty()
    };
    let file = rustix::fs::open(backing, ro | direct | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| err("open loop backing file", backing, e))?;
    let mut flags = 0;
    if opts.read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    if opts.autoclear {
        flags |= LO_FLAGS_AUTOCLEAR;
    }
    if opts.direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    // Another process may grab the free device between GET_FREE and CONFIGURE: retry.
    let mut last = None;
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument pointer; `ctl` is an open fd.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as libc::Ioctl) };
        if n < 0 {
            return Err(err(
                "get a free loop device from",
                ctl_path,
                io::Error::last_os_error(),
            ));
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = rustix::fs::open(&path, ro | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| err("open", &path, e))?;
        // SAFETY: all-zero is a valid LoopConfig (plain integers and byte arrays).
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = file.as_raw_fd() as u32;
        cfg.block_size = opts.block_size;
        cfg.info.lo_flags = flags;
        let name = backing.as_os_str().as_encoded_bytes();
        let len = name.len().min(LO_NAME_SIZE - 1);
        cfg.info.lo_file_name[..len].copy_from_slice(&name[..len]);
        // SAFETY: `cfg` is a live struct loop_config (size asserted at compile time) whose fd
        // field names `file`, open for the duration of the call; `dev` is an open loop device.
        let rc = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                LOOP_CONFIGURE as libc::Ioctl,
                &mut cfg as *mut LoopConfig,
            )
        };
        if rc == 0 {
            return Ok(LoopDevice { fd: dev, path });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(err("configure loop device for", backing, e));
        }
        last = Some(e);
    }
    Err(err(
        "find a free loop device for",
        backing,
        last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EBUSY)),
    ))
}

/// The loop devices `backing` is attached to (from /sys/block/loop*/loop/backing_file).
pub fn find_attached(backing: &Path) -> Result<Vec<PathBuf>, LoopError> {
    let backing = std::fs::canonicalize(backing).map_err(|e| err("resolve", backing, e))?;
    let sys = Path::new("/sys/block");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(sys).map_err(|e| err("read", sys, e))? {
        let entry = entry.map_err(|e| err("read", sys, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(file) = std::fs::read_to_string(entry.path().join("loop/backing_file")) else {
            continue;
        };
        if Path::new(file.trim_end_matches('\n')) == backing {
            out.push(PathBuf::from(format!("/dev/{name}")));
        }
    }
    Ok(out)
}

/// A scratch btrfs filesystem on a loop-mounted sparse image, for real-kernel tests.
/// Unmounted (lazily) and deleted on drop.
#[cfg(test)]
pub(crate) mod test_support {
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::{AtomicU32, Ordering};

    use rustix::mount::{MountFlags, UnmountFlags};

    use super::{LoopOptions, attach};

    pub(crate) struct BtrfsImage {
        dir: PathBuf,
        mnt: PathBuf,
    }

    impl BtrfsImage {
        pub(crate) fn new() -> std::io::Result<Self> {
            static N: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "space-sys-btrfs-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir)?;
            let img = dir.join("fs.img");
            std::fs::File::create(&img)?.set_len(256 << 20)?;
            let out = Command::new("mkfs.btrfs").arg("-q").arg(&img).output()?;
            if !out.status.success() {
                return Err(std::io::Error::other(format!(
                    "mkfs.btrfs failed: {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            let dev = attach(
                &img,
                LoopOptions {
                    autoclear: true,
                    ..Default::default()
                },
            )
            .map_err(std::io::Error::other)?;
            let mnt = dir.join("mnt");
            std::fs::create_dir(&mnt)?;
            rustix::mount::mount(dev.path(), &mnt, "btrfs", MountFlags::NOATIME, None)?;
            Ok(Self { dir, mnt })
        }

        pub(crate) fn mountpoint(&self) -> &Path {
            &self.mnt
        }
    }

    impl Drop for BtrfsImage {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(&self.mnt, UnmountFlags::DETACH);
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_and_find() {
        let dir = std::env::temp_dir().join(format!("space-sys-loop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("x.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let dev = attach(
            &img,
            LoopOptions {
                autoclear: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(dev.path().to_str().unwrap().starts_with("/dev/loop"));
        assert_eq!(find_attached(&img).unwrap(), vec![dev.path().to_path_buf()]);
        drop(dev);
        // autoclear: with no mount holding it, closing the last fd detaches the device.
        assert!(find_attached(&img).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
        let missing = attach(&dir.join("missing.img"), LoopOptions::default()).unwrap_err();
        assert!(missing.to_string().contains("missing.img"), "{missing}");
    }
}
