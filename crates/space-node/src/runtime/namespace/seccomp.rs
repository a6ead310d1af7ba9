//! The sandbox's seccomp policy: an allowlist (decision 0041). A syscall runs only if it is
//! named here; the list starts from what container runtimes' default profiles (Docker's
//! `default.json`) allow a container without CAP_SYS_ADMIN, less the surfaces this platform
//! denies on purpose ([`DENIED`]), plus a few syscalls newer than that profile.
//!
//! Two programs are installed. The kernel runs both and applies the most restrictive verdict;
//! between two `ERRNO`s it keeps the one of the filter installed last, so the prefix goes
//! last and its ENOSYS wins over the allowlist's EPERM:
//! 1. a hand-written prefix: wrong architecture (the 32-bit `int 0x80` ABI) kills the
//!    process; any x32 syscall number, `clone3` and any number above [`LAST_KNOWN`] get
//!    `ENOSYS` (clone3 passes its flags in memory, which seccomp cannot inspect; libc then
//!    falls back to `clone`; a syscall newer than this list looks to libc like an older
//!    kernel, which it handles);
//! 2. the allowlist, compiled with `seccompiler`: a listed syscall is allowed, with argument
//!    conditions for a few of them; everything else, and a listed syscall whose conditions
//!    fail, gets `EPERM`:
//!    - `clone` and `unshare` only without a `CLONE_NEW*` flag;
//!    - `personality` only with a default persona;
//!    - `socket` only for the families in [`SOCKET_FAMILIES`];
//!    - `ioctl` only for the request families in [`IOCTL_FAMILIES`]: no btrfs ioctl is in it.
//!
//! Cost: since Linux 5.11 the kernel caches, per syscall number, "always allowed whatever the
//! arguments", so an unconditionally listed syscall does not run the filter at all; only the
//! conditional ones above do.

use std::collections::BTreeMap;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};
use space_sys::ns::SockFilter;

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("failed to build the seccomp filter")]
    Build(#[from] seccompiler::BackendError),
    #[error("unsupported architecture {0}")]
    Arch(&'static str),
}

// Syscalls newer than the libc crate's tables (the same numbers on x86_64 and aarch64, whose
// tables are unified from 403 on).
/// `io_pgetevents` (Linux 4.18), missing from the libc crate's table.
#[cfg(target_arch = "x86_64")]
const SYS_IO_PGETEVENTS: i64 = 333;
#[cfg(target_arch = "aarch64")]
const SYS_IO_PGETEVENTS: i64 = 292;
const SYS_CACHESTAT: i64 = 451;
const SYS_MAP_SHADOW_STACK: i64 = 453;
const SYS_FUTEX_WAKE: i64 = 454;
const SYS_FUTEX_WAIT: i64 = 455;
const SYS_FUTEX_REQUEUE: i64 = 456;
const SYS_STATMOUNT: i64 = 457;
const SYS_LISTMOUNT: i64 = 458;
const SYS_SETXATTRAT: i64 = 463;
const SYS_GETXATTRAT: i64 = 464;
const SYS_LISTXATTRAT: i64 = 465;
const SYS_REMOVEXATTRAT: i64 = 466;
const SYS_OPEN_TREE_ATTR: i64 = 467;

/// The highest syscall number this policy knows (`open_tree_attr`, Linux 6.15). Anything
/// above gets ENOSYS from the prefix.
pub const LAST_KNOWN: i64 = SYS_OPEN_TREE_ATTR;

/// Allowed unconditionally, on every architecture.
pub const ALLOWED: &[(&str, i64)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("bind", libc::SYS_bind),
    ("brk", libc::SYS_brk),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    ("chdir", libc::SYS_chdir),
    ("chroot", libc::SYS_chroot),
    ("clock_getres", libc::SYS_clock_getres),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("close", libc::SYS_close),
    ("close_range", libc::SYS_close_range),
    ("connect", libc::SYS_connect),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("dup", libc::SYS_dup),
    ("dup3", libc::SYS_dup3),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("eventfd2", libc::SYS_eventfd2),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    ("fadvise64", libc::SYS_fadvise64),
    ("fallocate", libc::SYS_fallocate),
    ("fanotify_mark", libc::SYS_fanotify_mark),
    ("fchdir", libc::SYS_fchdir),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchmodat2", libc::SYS_fchmodat2),
    ("fchown", libc::SYS_fchown),
    ("fchownat", libc::SYS_fchownat),
    ("fcntl", libc::SYS_fcntl),
    ("fdatasync", libc::SYS_fdatasync),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("flock", libc::SYS_flock),
    ("fremovexattr", libc::SYS_fremovexattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("fstatfs", libc::SYS_fstatfs),
    ("fsync", libc::SYS_fsync),
    ("ftruncate", libc::SYS_ftruncate),
    ("futex", libc::SYS_futex),
    ("futex_waitv", libc::SYS_futex_waitv),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("getcpu", libc::SYS_getcpu),
    ("getcwd", libc::SYS_getcwd),
    ("getdents64", libc::SYS_getdents64),
    ("getegid", libc::SYS_getegid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getgroups", libc::SYS_getgroups),
    ("getitimer", libc::SYS_getitimer),
    ("getpeername", libc::SYS_getpeername),
    ("getpgid", libc::SYS_getpgid),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("getpriority", libc::SYS_getpriority),
    ("getrandom", libc::SYS_getrandom),
    ("getresgid", libc::SYS_getresgid),
    ("getresuid", libc::SYS_getresuid),
    ("getrlimit", libc::SYS_getrlimit),
    ("getrusage", libc::SYS_getrusage),
    ("getsid", libc::SYS_getsid),
    ("getsockname", libc::SYS_getsockname),
    ("getsockopt", libc::SYS_getsockopt),
    ("gettid", libc::SYS_gettid),
    ("gettimeofday", libc::SYS_gettimeofday),
    ("getuid", libc::SYS_getuid),
    ("getxattr", libc::SYS_getxattr),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    ("io_cancel", libc::SYS_io_cancel),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_getevents", libc::SYS_io_getevents),
    ("io_pgetevents", SYS_IO_PGETEVENTS),
    ("io_setup", libc::SYS_io_setup),
    ("io_submit", libc::SYS_io_submit),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("ioprio_set", libc::SYS_ioprio_set),
    ("kill", libc::SYS_kill),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("linkat", libc::SYS_linkat),
    ("listen", libc::SYS_listen),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("lseek", libc::SYS_lseek),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("madvise", libc::SYS_madvise),
    ("membarrier", libc::SYS_membarrier),
    ("memfd_create", libc::SYS_memfd_create),
    ("memfd_secret", libc::SYS_memfd_secret),
    ("mincore", libc::SYS_mincore),
    ("mkdirat", libc::SYS_mkdirat),
    ("mknodat", libc::SYS_mknodat),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("mlockall", libc::SYS_mlockall),
    ("mmap", libc::SYS_mmap),
    ("mprotect", libc::SYS_mprotect),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_open", libc::SYS_mq_open),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mremap", libc::SYS_mremap),
    ("mseal", libc::SYS_mseal),
    ("msgctl", libc::SYS_msgctl),
    ("msgget", libc::SYS_msgget),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgsnd", libc::SYS_msgsnd),
    ("msync", libc::SYS_msync),
    ("munlock", libc::SYS_munlock),
    ("munlockall", libc::SYS_munlockall),
    ("munmap", libc::SYS_munmap),
    ("nanosleep", libc::SYS_nanosleep),
    ("newfstatat", libc::SYS_newfstatat),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("pipe2", libc::SYS_pipe2),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("ppoll", libc::SYS_ppoll),
    ("prctl", libc::SYS_prctl),
    ("pread64", libc::SYS_pread64),
    ("preadv", libc::SYS_preadv),
    ("preadv2", libc::SYS_preadv2),
    ("prlimit64", libc::SYS_prlimit64),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("pselect6", libc::SYS_pselect6),
    ("pwrite64", libc::SYS_pwrite64),
    ("pwritev", libc::SYS_pwritev),
    ("pwritev2", libc::SYS_pwritev2),
    ("read", libc::SYS_read),
    ("readahead", libc::SYS_readahead),
    ("readlinkat", libc::SYS_readlinkat),
    ("readv", libc::SYS_readv),
    ("recvfrom", libc::SYS_recvfrom),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("removexattr", libc::SYS_removexattr),
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("rseq", libc::SYS_rseq),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_yield", libc::SYS_sched_yield),
    ("seccomp", libc::SYS_seccomp),
    ("semctl", libc::SYS_semctl),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semtimedop", libc::SYS_semtimedop),
    ("sendfile", libc::SYS_sendfile),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("sendmsg", libc::SYS_sendmsg),
    ("sendto", libc::SYS_sendto),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("setfsgid", libc::SYS_setfsgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setgid", libc::SYS_setgid),
    ("setgroups", libc::SYS_setgroups),
    ("setitimer", libc::SYS_setitimer),
    ("setpgid", libc::SYS_setpgid),
    ("setpriority", libc::SYS_setpriority),
    ("setregid", libc::SYS_setregid),
    ("setresgid", libc::SYS_setresgid),
    ("setresuid", libc::SYS_setresuid),
    ("setreuid", libc::SYS_setreuid),
    ("setrlimit", libc::SYS_setrlimit),
    ("setsid", libc::SYS_setsid),
    ("setsockopt", libc::SYS_setsockopt),
    ("setuid", libc::SYS_setuid),
    ("setxattr", libc::SYS_setxattr),
    ("shmat", libc::SYS_shmat),
    ("shmctl", libc::SYS_shmctl),
    ("shmdt", libc::SYS_shmdt),
    ("shmget", libc::SYS_shmget),
    ("shutdown", libc::SYS_shutdown),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("signalfd4", libc::SYS_signalfd4),
    ("socketpair", libc::SYS_socketpair),
    ("splice", libc::SYS_splice),
    ("statx", libc::SYS_statx),
    ("symlinkat", libc::SYS_symlinkat),
    ("sync", libc::SYS_sync),
    ("sync_file_range", libc::SYS_sync_file_range),
    ("syncfs", libc::SYS_syncfs),
    ("sysinfo", libc::SYS_sysinfo),
    ("tee", libc::SYS_tee),
    ("tgkill", libc::SYS_tgkill),
    ("timer_create", libc::SYS_timer_create),
    ("timer_delete", libc::SYS_timer_delete),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_settime", libc::SYS_timer_settime),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("times", libc::SYS_times),
    ("tkill", libc::SYS_tkill),
    ("truncate", libc::SYS_truncate),
    ("umask", libc::SYS_umask),
    ("uname", libc::SYS_uname),
    ("unlinkat", libc::SYS_unlinkat),
    ("utimensat", libc::SYS_utimensat),
    ("vmsplice", libc::SYS_vmsplice),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
    ("cachestat", SYS_CACHESTAT),
    ("map_shadow_stack", SYS_MAP_SHADOW_STACK),
    ("futex_wake", SYS_FUTEX_WAKE),
    ("futex_wait", SYS_FUTEX_WAIT),
    ("futex_requeue", SYS_FUTEX_REQUEUE),
    ("setxattrat", SYS_SETXATTRAT),
    ("getxattrat", SYS_GETXATTRAT),
    ("listxattrat", SYS_LISTXATTRAT),
    ("removexattrat", SYS_REMOVEXATTRAT),
];

/// Allowed unconditionally on x86_64 only: the legacy syscalls that newer architectures
/// dropped (`open`, `stat`, `fork`, ...), and x86's own.
#[cfg(target_arch = "x86_64")]
pub const ALLOWED_X86_64: &[(&str, i64)] = &[
    ("access", libc::SYS_access),
    ("alarm", libc::SYS_alarm),
    ("arch_prctl", libc::SYS_arch_prctl),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("creat", libc::SYS_creat),
    ("dup2", libc::SYS_dup2),
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("eventfd", libc::SYS_eventfd),
    ("fork", libc::SYS_fork),
    ("fstat", libc::SYS_fstat),
    ("futimesat", libc::SYS_futimesat),
    ("get_thread_area", libc::SYS_get_thread_area),
    ("getdents", libc::SYS_getdents),
    ("getpgrp", libc::SYS_getpgrp),
    ("inotify_init", libc::SYS_inotify_init),
    ("lchown", libc::SYS_lchown),
    ("link", libc::SYS_link),
    ("lstat", libc::SYS_lstat),
    ("mkdir", libc::SYS_mkdir),
    ("mknod", libc::SYS_mknod),
    ("modify_ldt", libc::SYS_modify_ldt),
    ("open", libc::SYS_open),
    ("pause", libc::SYS_pause),
    ("pipe", libc::SYS_pipe),
    ("poll", libc::SYS_poll),
    ("readlink", libc::SYS_readlink),
    ("rename", libc::SYS_rename),
    ("rmdir", libc::SYS_rmdir),
    ("select", libc::SYS_select),
    ("set_thread_area", libc::SYS_set_thread_area),
    ("signalfd", libc::SYS_signalfd),
    ("stat", libc::SYS_stat),
    ("statfs", libc::SYS_statfs),
    ("symlink", libc::SYS_symlink),
    ("time", libc::SYS_time),
    ("unlink", libc::SYS_unlink),
    ("utime", libc::SYS_utime),
    ("utimes", libc::SYS_utimes),
    ("vfork", libc::SYS_vfork),
];
#[cfg(not(target_arch = "x86_64"))]
pub const ALLOWED_X86_64: &[(&str, i64)] = &[];

/// Named here because a sandbox must never reach them; none is in [`ALLOWED`] (a unit test
/// holds that), so each gets EPERM. Docker's profile allows a few of them (`ptrace`,
/// `io_uring_*`, `name_to_handle_at`, `adjtimex`); this platform does not (decision 0041).
pub const DENIED: &[(&str, i64)] = &[
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("open_tree_attr", SYS_OPEN_TREE_ATTR),
    ("fsopen", libc::SYS_fsopen),
    ("fsmount", libc::SYS_fsmount),
    ("fsconfig", libc::SYS_fsconfig),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("statmount", SYS_STATMOUNT),
    ("listmount", SYS_LISTMOUNT),
    ("setns", libc::SYS_setns),
    ("sethostname", libc::SYS_sethostname),
    ("setdomainname", libc::SYS_setdomainname),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("fanotify_init", libc::SYS_fanotify_init),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("process_madvise", libc::SYS_process_madvise),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("kcmp", libc::SYS_kcmp),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("acct", libc::SYS_acct),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("syslog", libc::SYS_syslog),
    ("quotactl", libc::SYS_quotactl),
    ("quotactl_fd", libc::SYS_quotactl_fd),
    ("nfsservctl", libc::SYS_nfsservctl),
    ("vhangup", libc::SYS_vhangup),
    ("uselib", libc::SYS_uselib),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("mbind", libc::SYS_mbind),
    ("set_mempolicy", libc::SYS_set_mempolicy),
    ("migrate_pages", libc::SYS_migrate_pages),
    ("move_pages", libc::SYS_move_pages),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
];

/// Every `CLONE_NEW*` flag of `clone` (its low byte is the exit signal, so CLONE_NEWTIME,
/// 0x80, is not among them there).
const CLONE_NS_MASK: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;
/// `unshare`'s namespace flags: those of clone plus CLONE_NEWTIME.
const UNSHARE_NS_MASK: u64 = CLONE_NS_MASK | 0x80;

/// Personas a sandbox may select (what Docker allows): PER_LINUX, PER_LINUX32, UNAME26
/// variants, and the 0xffffffff query.
const ALLOWED_PERSONAS: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Socket families a sandbox may open: local, IPv4, IPv6, netlink (its own network
/// namespace's routes and addresses; changing them needs CAP_NET_ADMIN, which it lacks) and
/// packet (which needs CAP_NET_RAW, which it lacks too: kept so the error is EPERM from the
/// kernel's own check). AF_VSOCK, AF_ALG, AF_KEY, AF_XDP, the radio and legacy families, and
/// every other one are refused.
pub const SOCKET_FAMILIES: &[(&str, i32)] = &[
    ("AF_UNIX", libc::AF_UNIX),
    ("AF_INET", libc::AF_INET),
    ("AF_INET6", libc::AF_INET6),
    ("AF_NETLINK", libc::AF_NETLINK),
    ("AF_PACKET", libc::AF_PACKET),
];

/// One family of ioctl requests: the requests `r` with `r & mask == value`, except those
/// named in `except`.
#[derive(Debug, Clone, Copy)]
pub struct IoctlFamily {
    pub name: &'static str,
    pub mask: u32,
    pub value: u32,
    pub except: &'static [(&'static str, u32)],
}

impl IoctlFamily {
    /// One request exactly.
    const fn exact(name: &'static str, value: u32) -> IoctlFamily {
        IoctlFamily {
            name,
            mask: u32::MAX,
            value,
            except: &[],
        }
    }
}

const TIOCSTI: u32 = 0x5412;
const TIOCLINUX: u32 = 0x541C;
const TIOCCONS: u32 = 0x541D;
const TIOCSETD: u32 = 0x5423;

/// Every ioctl a sandbox may issue, by family. The request's type byte (bits 8..16) names
/// its subsystem; a mask without the size and direction bits (16..32) admits every size.
/// Not here, so refused: btrfs's own ioctls (type 0x94 except the three VFS reflink calls
/// that share it: subvolumes, snapshots, balance, send, quota groups, ...), block devices
/// (0x12), loop devices (0x4C), namespaces (0xB7), pidfds (0xFF), seccomp notifications
/// (0x21), consoles and virtual terminals (`K`, `V`), KVM (0xAE), the filesystem's UUID and
/// sysfs path (0x15), TUN (`T` 0xC8 and up), and everything else.
pub const IOCTL_FAMILIES: &[IoctlFamily] = &[
    IoctlFamily {
        // Terminals and FIO* (TCGETS, TIOCGWINSZ, TIOCSCTTY, TIOCGPTN, FIONREAD, FIONBIO,
        // FIOCLEX, ...): type 'T', numbers below 0x80. Faking input (TIOCSTI), console
        // redirection (TIOCCONS, TIOCLINUX) and line disciplines (TIOCSETD) excepted.
        name: "terminal and FIO* ('T' 0x00-0x7f)",
        mask: 0xff80,
        value: 0x5400,
        except: &[
            ("TIOCSTI", TIOCSTI),
            ("TIOCLINUX", TIOCLINUX),
            ("TIOCCONS", TIOCCONS),
            ("TIOCSETD", TIOCSETD),
        ],
    },
    IoctlFamily {
        // Sockets (SIOCGIFCONF, SIOCGIFINDEX, SIOCGSTAMP, ...); the set-ones need
        // CAP_NET_ADMIN, which a sandbox lacks.
        name: "socket (0x89)",
        mask: 0xffff_ff00,
        value: 0x8900,
        except: &[],
    },
    IoctlFamily {
        // File attributes (FS_IOC_GETFLAGS/SETFLAGS for lsattr/chattr, FS_IOC_FIEMAP, ...).
        name: "file attributes ('f')",
        mask: 0xff00,
        value: 0x6600,
        except: &[],
    },
    IoctlFamily::exact("FS_IOC_FSGETXATTR", 0x801c_581f),
    IoctlFamily::exact("FS_IOC_FSSETXATTR", 0x401c_5820),
    IoctlFamily::exact("FS_IOC_GETVERSION", 0x8008_7601),
    IoctlFamily::exact("FIGETBSZ", 0x2),
    // Reflinks (cp --reflink, the default of coreutils' cp): VFS calls, not btrfs's,
    // though they share its type byte. Their space is charged like any write.
    IoctlFamily::exact("FICLONE", 0x4004_9409),
    IoctlFamily::exact("FICLONERANGE", 0x4020_940d),
    IoctlFamily::exact("FIDEDUPERANGE", 0xc018_9436),
];

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, v: u64) -> SeccompCondition {
    // Only fails for an argument index > 5, which none of ours is.
    SeccompCondition::new(arg, len, op, v).expect("valid seccomp condition")
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conds).map_err(SeccompError::Build)
}

fn target_arch() -> Result<seccompiler::TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|_| SeccompError::Arch(std::env::consts::ARCH))
}

/// The conditional rules: syscall number -> rules (any one matching allows).
fn conditional() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    use SeccompCmpArgLen::{Dword, Qword};
    use SeccompCmpOp::{Eq, MaskedEq, Ne};
    let mut rules = BTreeMap::new();
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(0, Qword, MaskedEq(CLONE_NS_MASK), 0)])?],
    );
    rules.insert(
        libc::SYS_unshare,
        vec![rule(vec![cond(0, Qword, MaskedEq(UNSHARE_NS_MASK), 0)])?],
    );
    rules.insert(
        libc::SYS_personality,
        ALLOWED_PERSONAS
            .iter()
            .map(|p| rule(vec![cond(0, Dword, Eq, *p)]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_socket,
        SOCKET_FAMILIES
            .iter()
            .map(|(_, f)| rule(vec![cond(0, Dword, Eq, *f as u64)]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_ioctl,
        IOCTL_FAMILIES
            .iter()
            .map(|f| {
                let mut c = vec![cond(1, Dword, MaskedEq(f.mask.into()), f.value.into())];
                c.extend(
                    f.except
                        .iter()
                        .map(|(_, r)| cond(1, Dword, Ne, (*r).into())),
                );
                rule(c)
            })
            .collect::<Result<_, _>>()?,
    );
    Ok(rules)
}

/// The allowlist program (seccompiler).
fn allowlist() -> Result<Vec<SockFilter>, SeccompError> {
    let mut rules = conditional()?;
    for (_, nr) in ALLOWED.iter().chain(ALLOWED_X86_64) {
        rules.insert(*nr, Vec::new());
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        target_arch()?,
    )?;
    compile(filter)
}

/// A seccompiler filter as the classic-BPF program the init installs.
fn compile(filter: SeccompFilter) -> Result<Vec<SockFilter>, SeccompError> {
    let prog: seccompiler::BpfProgram = filter.try_into()?;
    Ok(prog
        .into_iter()
        .map(|i| SockFilter {
            code: i.code,
            jt: i.jt,
            jf: i.jf,
            k: i.k,
        })
        .collect())
}

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x15;
const BPF_JGT_K: u16 = 0x25;
const BPF_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;

fn stmt(code: u16, k: u32) -> SockFilter {
    SockFilter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> SockFilter {
    SockFilter { code, jt, jf, k }
}

/// The hand-written prefix program (architecture, x32, clone3, unknown numbers).
fn prefix() -> Result<Vec<SockFilter>, SeccompError> {
    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xC000_003E;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xC000_00B7;
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    return Err(SeccompError::Arch(std::env::consts::ARCH));
    // x32 syscalls carry this bit in their number on x86_64 (`__X32_SYSCALL_BIT`).
    let x32_bit: u32 = if cfg!(target_arch = "x86_64") {
        0x4000_0000
    } else {
        u32::MAX
    };
    let enosys = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    #[allow(unreachable_code)]
    Ok(vec![
        stmt(BPF_LD_W_ABS, OFFSET_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, OFFSET_NR),
        jump(BPF_JGE_K, x32_bit, 0, 1),
        stmt(BPF_RET_K, enosys),
        jump(BPF_JEQ_K, libc::SYS_clone3 as u32, 0, 1),
        stmt(BPF_RET_K, enosys),
        jump(BPF_JGT_K, LAST_KNOWN as u32, 0, 1),
        stmt(BPF_RET_K, enosys),
        stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
    ])
}

/// Both programs, in installation order: the prefix last, so that its ENOSYS (clone3, x32,
/// unknown numbers) beats the allowlist's EPERM for the same call.
pub fn programs() -> Result<Vec<Vec<SockFilter>>, SeccompError> {
    Ok(vec![allowlist()?, prefix()?])
}

/// The policy before decision 0041, for the benchmark that compares the two: the same
/// prefix, then a deny list of [`DENIED`] (allow by default).
#[cfg(test)]
pub(super) fn programs_before_allowlist() -> Result<Vec<Vec<SockFilter>>, SeccompError> {
    let rules = DENIED.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        target_arch()?,
    )?;
    Ok(vec![compile(filter)?, prefix()?])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny classic-BPF interpreter for the subset our programs use, so the policy can be
    /// checked without installing it.
    fn run(prog: &[SockFilter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let i = prog[pc];
            match i.code {
                0x20 => {
                    let k = i.k as usize;
                    acc = u32::from_ne_bytes(data[k..k + 4].try_into().unwrap());
                }
                0x06 => return i.k,
                0x54 => acc &= i.k, // ALU AND K
                0x15 | 0x35 | 0x25 | 0x45 => {
                    let t = match i.code {
                        0x15 => acc == i.k,
                        0x35 => acc >= i.k,
                        0x25 => acc > i.k,
                        _ => acc & i.k != 0,
                    };
                    pc += usize::from(if t { i.jt } else { i.jf });
                }
                0x05 => pc += i.k as usize, // JA
                other => panic!("unexpected BPF op {other:#x} at {pc}"),
            }
            pc += 1;
        }
    }

    const X86_64: u32 = 0xC000_003E;

    fn verdict(nr: i64, args: [u64; 6]) -> u32 {
        let progs = programs().unwrap();
        // As the kernel does: from the filter installed last to the first, keep the first
        // verdict with the most restrictive (numerically lowest) action.
        let mut verdict = SECCOMP_RET_ALLOW;
        for p in progs.iter().rev() {
            let v = run(p, X86_64, nr as u32, args);
            if v & 0xffff_0000 < verdict & 0xffff_0000 {
                verdict = v;
            }
        }
        verdict
    }

    const EPERM: u32 = SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    const ALLOW: u32 = SECCOMP_RET_ALLOW;

    fn ioctl(req: u64) -> u32 {
        verdict(libc::SYS_ioctl, [1, req, 0, 0, 0, 0])
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn policy_decisions() {
        let none = [0; 6];
        for nr in [libc::SYS_mount, libc::SYS_bpf, libc::SYS_ptrace] {
            assert_eq!(verdict(nr, none), EPERM, "syscall {nr}");
        }
        assert_eq!(verdict(libc::SYS_io_uring_setup, none), EPERM);
        assert_eq!(verdict(libc::SYS_read, none), ALLOW);
        assert_eq!(verdict(libc::SYS_openat, none), ALLOW);
        assert_eq!(verdict(libc::SYS_clone3, none), ENOSYS);
        // fork-like clone is fine, a namespace clone is not.
        assert_eq!(
            verdict(libc::SYS_clone, [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(
            verdict(
                libc::SYS_clone,
                [(libc::CLONE_NEWUSER | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0]
            ),
            EPERM
        );
        // pthread_create's flags carry no CLONE_NEW* bit.
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(verdict(libc::SYS_clone, [thread, 0, 0, 0, 0, 0]), ALLOW);
        assert_eq!(
            verdict(libc::SYS_unshare, [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0]),
            EPERM
        );
        assert_eq!(verdict(libc::SYS_unshare, [0x80, 0, 0, 0, 0, 0]), EPERM);
        assert_eq!(
            verdict(libc::SYS_unshare, [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(verdict(libc::SYS_personality, none), ALLOW);
        assert_eq!(
            verdict(libc::SYS_personality, [0xffff_ffff, 0, 0, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(
            verdict(libc::SYS_personality, [0x0040_0000, 0, 0, 0, 0, 0]),
            EPERM
        );
        // Sockets: the named families only.
        let socket = |family: i32| verdict(libc::SYS_socket, [family as u64, 1, 0, 0, 0, 0]);
        assert_eq!(socket(libc::AF_INET), ALLOW);
        assert_eq!(socket(libc::AF_UNIX), ALLOW);
        assert_eq!(socket(libc::AF_NETLINK), ALLOW);
        for refused in [
            libc::AF_VSOCK,
            libc::AF_ALG,
            libc::AF_KEY,
            libc::AF_XDP,
            255,
        ] {
            assert_eq!(socket(refused), EPERM, "family {refused}");
        }
        // x32 ABI numbers, numbers newer than the policy, and foreign architectures.
        assert_eq!(verdict(0x4000_0000 | libc::SYS_mount, none), ENOSYS);
        assert_eq!(verdict(LAST_KNOWN + 1, none), ENOSYS);
        assert_eq!(verdict(4095, none), ENOSYS);
        let progs = programs().unwrap();
        assert_eq!(
            run(&progs[1], 0x4000_0003, 21, none),
            SECCOMP_RET_KILL_PROCESS
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn ioctls_are_allowed_by_family_and_btrfs_is_not_one() {
        // Terminals, FIO*, sockets, file attributes, reflinks.
        for req in [
            0x5401u64,   // TCGETS
            0x5413,      // TIOCGWINSZ
            0x540E,      // TIOCSCTTY
            0x8004_5430, // TIOCGPTN
            0x4004_5431, // TIOCSPTLCK
            0x541B,      // FIONREAD
            0x5421,      // FIONBIO
            0x5451,      // FIOCLEX
            0x8912,      // SIOCGIFCONF
            0x8933,      // SIOCGIFINDEX
            0x8008_6601, // FS_IOC_GETFLAGS
            0xc020_660b, // FS_IOC_FIEMAP
            0x4004_9409, // FICLONE
            0x4020_940d, // FICLONERANGE
        ] {
            assert_eq!(ioctl(req), ALLOW, "ioctl {req:#x}");
        }
        // The kernel reads the request as a 32-bit number: high bits change nothing.
        assert_eq!(ioctl(0xffff_ffff_0000_5401), ALLOW);
        for req in [
            0x5412u64,   // TIOCSTI
            0x541C,      // TIOCLINUX
            0x541D,      // TIOCCONS
            0x5423,      // TIOCSETD
            0x4004_54ca, // TUNSETIFF
            0x5000_940e, // BTRFS_IOC_SUBVOL_CREATE
            0x5000_9417, // BTRFS_IOC_SNAP_CREATE_V2
            0x5000_940f, // BTRFS_IOC_SNAP_DESTROY
            0x4010_942f, // BTRFS_IOC_QGROUP_ASSIGN
            0x8008_9419, // BTRFS_IOC_SUBVOL_GETFLAGS
            0x4c80,      // LOOP_CTL_ADD
            0x8008_1272, // BLKGETSIZE64
            0xb701,      // NS_GET_USERNS
            0x8010_1500, // FS_IOC_GETFSUUID
            0x4b33,      // KDGKBTYPE
            0xae01,      // KVM_CREATE_VM
        ] {
            assert_eq!(ioctl(req), EPERM, "ioctl {req:#x}");
        }
    }

    #[test]
    fn the_lists_are_consistent() {
        use std::collections::BTreeSet;
        let allowed: Vec<i64> = ALLOWED.iter().chain(ALLOWED_X86_64).map(|s| s.1).collect();
        let unique: BTreeSet<i64> = allowed.iter().copied().collect();
        assert_eq!(unique.len(), allowed.len(), "a syscall is listed twice");
        let conditional = conditional().unwrap();
        for (name, nr) in ALLOWED.iter().chain(ALLOWED_X86_64) {
            assert!(*nr <= LAST_KNOWN, "{name} is above LAST_KNOWN");
            // An unconditional entry would replace the conditions.
            assert!(!conditional.contains_key(nr), "{name} is also conditional");
            assert_eq!(verdict(*nr, [0; 6]), SECCOMP_RET_ALLOW, "{name}");
        }
        for (name, nr) in DENIED {
            assert!(!unique.contains(nr), "{name} is both allowed and denied");
            assert!(!conditional.contains_key(nr), "{name} is conditional");
            assert_eq!(
                verdict(*nr, [0; 6]),
                SECCOMP_RET_ERRNO | libc::EPERM as u32,
                "{name}"
            );
        }
        // Small enough for the kernel (BPF_MAXINSNS) with room to spare.
        let progs = programs().unwrap();
        assert!(
            progs[0].len() < 2048,
            "allowlist is {} insns",
            progs[0].len()
        );
    }
}
