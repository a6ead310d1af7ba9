//! A mount namespace to clone sandbox inits from (issue 16, decision 0053).
//!
//! A sandbox init gets its mount namespace with `CLONE_NEWNS`, which copies every mount of
//! the namespace it is cloned from, and the init then detaches all of them again when it
//! pivots into its rootfs. The node's own namespace holds one mount per network slot (each
//! slot's namespace is pinned by a bind mount of `nsfs`), so both steps grew with the number
//! of sandboxes: 8.9 ms for `unshare -m` with 3,000 slots here against 1.6 ms with none.
//!
//! [`launcher`] makes, once, a private copy of the caller's mount namespace without any
//! `nsfs` mount; the launch's cloning thread [`enter`]s it. Mounts made in
//! the node's namespace afterwards do not propagate into the copy (it is private), which is
//! what keeps it small: so it must be made after everything a sandbox init reads through a
//! path (the volume holding the rootfs, the daemon binary) is mounted.

use std::ffi::CString;
use std::fs;
use std::io;
#[cfg(test)]
use std::os::fd::AsFd;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::mount::raw_umount_detach;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Mount points of `nsfs` mounts in a `/proc/.../mountinfo` text, deepest first.
pub fn nsfs_mount_points(mountinfo: &str) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| {
            let (head, tail) = l.split_once(" - ")?;
            if tail.split_whitespace().next()? != "nsfs" {
                return None;
            }
            head.split_whitespace().nth(4).map(unescape_mountinfo)
        })
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

/// A path field of `/proc/.../mountinfo`, which escapes space, tab, newline and backslash
/// as `\ooo` (octal).
pub fn unescape_mountinfo(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsStr::from_bytes(&out))
}

/// A private copy of the calling process's mount namespace with every `nsfs` mount
/// detached, open (the fd keeps it alive). Made on a short-lived thread; the caller's thread
/// and the process keep their namespace.
pub fn launcher() -> io::Result<OwnedFd> {
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<OwnedFd> {
            // SAFETY: plain integer argument; unsharing the mount namespace (and with it the
            // filesystem attributes) affects only this thread, which ends below.
            cvt(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
            let root = CString::new("/").expect("no NUL");
            // SAFETY: valid C strings (or null) for the call; changes propagation in this
            // thread's new namespace only.
            cvt(unsafe {
                libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                )
            })?;
            let info = fs::read_to_string("/proc/thread-self/mountinfo")?;
            for point in nsfs_mount_points(&info) {
                let c = CString::new(point.as_os_str().as_bytes())
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
                match raw_umount_detach(&c) {
                    Ok(()) => {}
                    // Gone with a parent detached before it.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(fs::File::open("/proc/thread-self/ns/mnt")?.into())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("mount namespace thread panicked")))
    })
}

/// Moves the calling thread into mount namespace `mnt` (from [`launcher`]): a process it
/// then clones with `CLONE_NEWNS` copies that namespace. Only for a thread of its own, which
/// ends soon after (it unshares its filesystem attributes first, as a thread must to change
/// namespace): [`crate::ns::launch_sandbox_init`]'s cloning thread.
pub fn enter(mnt: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain integer arguments; both affect only this thread.
    cvt(unsafe { libc::unshare(libc::CLONE_FS) })?;
    // SAFETY: as above; `mnt` is an open mount namespace fd for the call.
    cvt(unsafe { libc::setns(mnt.as_raw_fd(), libc::CLONE_NEWNS) })?;
    Ok(())
}

/// Runs `f` on a fresh thread inside mount namespace `mnt` ([`enter`]). The calling thread
/// is unaffected.
#[cfg(test)]
fn run_in<T: Send>(mnt: BorrowedFd<'_>, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<T> {
            enter(mnt)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("mount namespace thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nsfs_mounts_deepest_first_and_unescapes() {
        let info = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:4 net:[4026532] /run/space/netns/slot-1 rw shared:5 - nsfs nsfs rw
41 22 0:4 net:[4026533] /run/a\\040b/deep/er/slot-2 rw shared:5 - nsfs nsfs rw
42 22 0:25 / /run rw,nosuid shared:6 - tmpfs tmpfs rw
";
        assert_eq!(
            nsfs_mount_points(info),
            [
                PathBuf::from("/run/a b/deep/er/slot-2"),
                PathBuf::from("/run/space/netns/slot-1"),
            ]
        );
        assert!(nsfs_mount_points("garbage\n\n").is_empty());
        assert_eq!(unescape_mountinfo("a\\134b\\0"), PathBuf::from("a\\b\\0"));
    }

    #[test]
    fn the_launcher_namespace_holds_no_namespace_pins() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("needs root");
            return;
        }
        let pin = std::env::temp_dir().join(format!("space-mntns-test-{}", std::process::id()));
        crate::netns::create_pinned(&pin).unwrap();
        let mnt = launcher().unwrap();
        let inside = run_in(mnt.as_fd(), || {
            fs::read_to_string("/proc/thread-self/mountinfo").unwrap()
        })
        .unwrap();
        assert!(nsfs_mount_points(&inside).is_empty(), "{inside}");
        // The volume-like mounts stay: the root is there, and this process's view is intact.
        assert!(inside.lines().count() > 1);
        let here = fs::read_to_string("/proc/thread-self/mountinfo").unwrap();
        assert!(nsfs_mount_points(&here).contains(&pin), "{here}");
        crate::netns::remove_pinned(&pin).unwrap();
    }
}
