//! Network namespaces owned by the node: create one pinned by a bind mount, run code inside
//! one (on a short-lived thread, so the caller's thread never changes namespace), and read the
//! original destination of a redirected connection.
//!
//! A network namespace is per thread for `setns`, so a multi-threaded process (tokio) can
//! enter one on a dedicated thread. Sockets keep the namespace they were created in for their
//! whole life, which is how the node serves DNS and its egress proxy inside every slot while
//! accepting on them from its ordinary runtime.

use std::ffi::CString;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::mount::{raw_mount, raw_umount_detach};

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Enter network namespace `ns` on the calling thread.
fn setns_net(ns: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain integer arguments; `ns` is a live fd for the duration of the call.
    cvt(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }).map(drop)
}

/// Creates a new network namespace and pins it by bind-mounting it on `path` (an empty file
/// created here, mode 0444). The namespace lives until [`remove_pinned`], even with no process
/// in it. Runs on a fresh thread: the caller's thread keeps its namespace.
pub fn create_pinned(path: &Path) -> io::Result<()> {
    let target = cpath(path)?;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(path)?;
    let pinned = std::thread::scope(|s| {
        s.spawn(|| -> io::Result<()> {
            // SAFETY: plain integer argument; affects only this (short-lived) thread's
            // namespaces, as CLONE_NEWNET is per task.
            cvt(unsafe { libc::unshare(libc::CLONE_NEWNET) })?;
            raw_mount(
                c"/proc/thread-self/ns/net",
                &target,
                None,
                libc::MS_BIND,
                None,
            )
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
    });
    if let Err(e) = pinned {
        let _ = fs::remove_file(path);
        return Err(e);
    }
    Ok(())
}

/// Creates a new, unpinned network namespace (loopback only, down) and returns it opened: it
/// lives while that descriptor, a process inside or a device's user keeps it. Runs on a fresh
/// thread: the caller's thread keeps its namespace.
pub fn create_anonymous() -> io::Result<std::os::fd::OwnedFd> {
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<std::os::fd::OwnedFd> {
            // SAFETY: plain integer argument; affects only this (short-lived) thread's
            // namespaces, as CLONE_NEWNET is per task.
            cvt(unsafe { libc::unshare(libc::CLONE_NEWNET) })?;
            Ok(fs::File::open("/proc/thread-self/ns/net")?.into())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
    })
}

/// Unpins a namespace made by [`create_pinned`] (lazy unmount, then unlink). The namespace
/// itself goes once its last process and socket are gone. A missing path is fine.
pub fn remove_pinned(path: &Path) -> io::Result<()> {
    let target = cpath(path)?;
    match raw_umount_detach(&target) {
        Ok(()) => {}
        // Not mounted (a half-made pin) or already gone.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) => {}
        Err(e) => return Err(e),
    }
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Runs `f` on a fresh thread that first enters network namespace `ns` (a pinned namespace
/// file or `/proc/PID/ns/net`, opened). Sockets created by `f` belong to `ns` for their whole
/// life; processes spawned by `f` start in `ns`. The calling thread is unaffected.
pub fn run_in<T: Send>(ns: BorrowedFd<'_>, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<T> {
            setns_net(ns)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
    })
}

/// `SO_ORIGINAL_DST` of an accepted IPv4 TCP socket whose connection was redirected by
/// netfilter NAT (`redirect`/`dnat`): where the client meant to connect.
pub fn original_dst(sock: BorrowedFd<'_>) -> io::Result<SocketAddrV4> {
    // SAFETY: sockaddr_in is plain data; zeroed is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SO_ORIGINAL_DST (80) at level SOL_IP; the kernel writes at most `len` bytes into `addr`.
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: `addr` and `len` are live locals; the kernel writes at most `len` bytes.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    })?;
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn inode_of_current_netns() -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::metadata("/proc/thread-self/ns/net").unwrap().ino()
    }

    #[test]
    fn pinned_namespace_is_distinct_and_removable() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("space-netns-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let pin = dir.join("ns");
        let _ = remove_pinned(&pin);
        create_pinned(&pin).unwrap();
        let before = inode_of_current_netns();
        let file = fs::File::open(&pin).unwrap();
        let inside = run_in(file.as_fd(), inode_of_current_netns).unwrap();
        assert_ne!(inside, before, "run_in must run in the pinned namespace");
        assert_eq!(
            inode_of_current_netns(),
            before,
            "caller's thread unchanged"
        );
        // A listener made inside is not reachable from the caller's namespace.
        let inside_listener = run_in(file.as_fd(), || std::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        let port = inside_listener.local_addr().unwrap().port();
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
        drop(file);
        remove_pinned(&pin).unwrap();
        assert!(!pin.exists());
        remove_pinned(&pin).unwrap();
        let _ = fs::remove_dir(&dir);
    }

    #[test]
    fn original_dst_of_a_plain_socket_is_an_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        // Without conntrack NAT there is no original destination (ENOENT), never garbage.
        match original_dst(s.as_fd()) {
            Err(_) => {}
            Ok(a) => assert_eq!(std::net::SocketAddr::V4(a), c.peer_addr().unwrap()),
        }
    }
}
