//! The clone of a sandbox init (decision 0061): on x86_64 into the caller's memory until
//! its exec (`CLONE_VM | CLONE_VFORK`), on a stack of its own, from a thread that enters the
//! launcher mount namespace and the slot's network namespace first; elsewhere fork-like.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::{CloneArgs, NetnsJoin, NsError, Prepared, check, child_main, parent_err};

/// Whether the child shares the caller's memory until it execs
/// (see [`super::launch_sandbox_init`]).
#[cfg(target_arch = "x86_64")]
pub(super) const SHARE_UNTIL_EXEC: u64 = (libc::CLONE_VM | libc::CLONE_VFORK) as u64;
#[cfg(not(target_arch = "x86_64"))]
pub(super) const SHARE_UNTIL_EXEC: u64 = 0;

/// The stack the child runs on until it execs: its own (it shares the caller's memory), with
/// an inaccessible page below it. Unmapped when the launch returns, after the exec.
pub(super) struct ChildStack {
    map: *mut libc::c_void,
}

impl ChildStack {
    const GUARD: usize = 4096;
    /// The child's setup runs a few frames deep; a debug build's frames are large.
    const SIZE: usize = 256 << 10;

    #[cfg(target_arch = "x86_64")]
    pub(super) fn new() -> io::Result<ChildStack> {
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::GUARD + Self::SIZE,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = ChildStack { map };
        // SAFETY: the range lies inside the mapping just made.
        check(unsafe {
            libc::mprotect(
                map.cast::<u8>().add(Self::GUARD).cast(),
                Self::SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        })?;
        Ok(stack)
    }

    /// No stack of its own where the child gets a copy of the caller's memory.
    #[cfg(not(target_arch = "x86_64"))]
    pub(super) fn new() -> io::Result<ChildStack> {
        Ok(ChildStack {
            map: std::ptr::null_mut(),
        })
    }

    pub(super) fn base(&self) -> u64 {
        if self.map.is_null() {
            0
        } else {
            self.map as u64 + Self::GUARD as u64
        }
    }

    pub(super) fn size(&self) -> u64 {
        if self.map.is_null() {
            0
        } else {
            Self::SIZE as u64
        }
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        if !self.map.is_null() {
            // SAFETY: the mapping made in `new`, which no one uses any more: the child has
            // exec'd or died (the launch waited for it).
            unsafe { libc::munmap(self.map, Self::GUARD + Self::SIZE) };
        }
    }
}

// SAFETY: the child only reads `Prepared` (C strings, pointer arrays into them and into the
// spec, integers), which the launch keeps alive and unchanged until the child has exec'd.
unsafe impl Sync for Prepared {}

/// The cloning thread's work: enters the launcher mount namespace and the slot's network
/// namespace, clones with every signal blocked (no handler of the caller's may run in the
/// child before it has reset them), and answers the child's pid. Where the child shares this
/// thread's memory (x86_64), the clone returns once it has exec'd or died.
pub(super) fn clone_init(
    args: &CloneArgs,
    prepared: &Prepared,
    mount_ns: Option<BorrowedFd<'_>>,
    netns: Option<NetnsJoin<'_>>,
) -> Result<libc::pid_t, NsError> {
    if let Some(mnt) = mount_ns {
        crate::mntns::enter(mnt).map_err(parent_err("enter the launcher mount namespace"))?;
    }
    // The child inherits this thread's network namespace: enter the slot for the clone only.
    if let Some(join) = netns {
        // SAFETY: plain integer arguments; affects only this thread, undone right after
        // clone3 below.
        if unsafe { libc::setns(join.ns.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
            return Err(NsError::Parent {
                op: "enter the sandbox's network namespace",
                source: io::Error::last_os_error(),
            });
        }
    }
    // SAFETY: sigset_t is plain data; sigfillset/pthread_sigmask only write the given sets.
    let old_mask = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        old
    };
    // SAFETY: `args` and the pidfd/pid words it points to are live for the call; the child
    // runs only `child_main` on `prepared` (raw syscalls, no allocation) and ends in execve or
    // _exit (see `clone3_child`).
    let ret = unsafe { clone3_child(args, prepared) };
    // SAFETY: restores the mask saved above for this thread.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut()) };
    if let Some(join) = netns {
        // SAFETY: plain integer arguments; returns this thread to the node's namespace.
        if unsafe { libc::setns(join.home.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
            // The child's setup goes on, but this thread must not outlive a failed return:
            // stop the process rather than leave a thread in a sandbox's network.
            eprintln!(
                "fatal: cannot return to the node's network namespace: {}",
                io::Error::last_os_error()
            );
            std::process::abort();
        }
    }
    ret.map_err(|source| NsError::Parent {
        op: "clone3 the sandbox init",
        source,
    })
}

/// The child's entry on its own stack.
#[cfg(target_arch = "x86_64")]
extern "C" fn child_entry(p: *const Prepared) -> ! {
    // SAFETY: the pointer the launch passed, to a `Prepared` alive until the exec.
    child_main(unsafe { &*p })
}

/// `clone3(args)`; the child runs [`child_main`] and never returns. Where the child shares
/// memory (x86_64) it starts on `args.stack` with the pointer in a register: raw `syscall`, so
/// that nothing of this thread's stack frame is used by both.
///
/// # Safety
/// `args` must describe a valid clone3 (its stack, where given, mapped and unused) and
/// `prepared` outlive the child's exec.
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_child(args: &CloneArgs, prepared: &Prepared) -> io::Result<libc::pid_t> {
    let ret: i64;
    // SAFETY: the syscall clobbers only rax, rcx and r11. In the child (rax == 0) the kernel
    // has set rsp to the top of `args.stack` (16-byte aligned, so the call below leaves the
    // entry's frame as the ABI wants); it calls `child_entry`, which never returns.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") args as *const CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") prepared as *const Prepared,
            in("r13") child_entry as extern "C" fn(*const Prepared) -> !,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret < 0 {
        Err(io::Error::from_raw_os_error(-ret as i32))
    } else {
        Ok(ret as libc::pid_t)
    }
}

/// `clone3(args)` without a stack: fork-like, the child continues on its copy of this one.
///
/// # Safety
/// As the x86_64 variant.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_child(args: &CloneArgs, prepared: &Prepared) -> io::Result<libc::pid_t> {
    // SAFETY: clone3 without CLONE_VM: the child gets a private copy of memory; it only runs
    // `child_main`, which never returns.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if ret == 0 {
        child_main(prepared);
    }
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as libc::pid_t)
    }
}

/// Waits until the child says it runs (true), or its end of the socket closes first (false:
/// the clone failed, or the child ended).
pub(super) fn wait_hello(sock: BorrowedFd<'_>, deadline: std::time::Instant) -> io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd on the stack; the count matches.
        let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r == 0 {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut b = 0u8;
        // SAFETY: reads at most one byte into a live stack byte.
        let n = unsafe { libc::recv(sock.as_raw_fd(), (&mut b as *mut u8).cast(), 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(n == 1);
    }
}
