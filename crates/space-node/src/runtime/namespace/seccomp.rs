//! The sandbox's seccomp policy: allow by default, deny a fixed list of syscalls that reach
//! kernel surface a sandbox has no business with (mounts, namespaces, modules, kexec, bpf,
//! tracing other processes, keyrings, clock and swap control, ...).
//!
//! Two programs are installed (the kernel applies the most restrictive verdict of all):
//! 1. a hand-written prefix: wrong architecture (the 32-bit `int 0x80` ABI) kills the
//!    process, any x32 syscall number and `clone3` get `ENOSYS` (clone3 passes its flags in
//!    memory, which seccomp cannot inspect; libc then falls back to `clone`);
//! 2. the deny list, compiled with `seccompiler`: matches get `EPERM`; `clone` and `unshare`
//!    match only with a `CLONE_NEW*` flag, `personality` only with a non-default persona,
//!    `ioctl` only for `TIOCSTI`.

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

/// `open_tree_attr` (Linux 6.15), not yet in libc.
const SYS_OPEN_TREE_ATTR: i64 = 467;

/// Denied unconditionally, with EPERM.
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
    ("setns", libc::SYS_setns),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
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
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
];

/// Every `CLONE_NEW*` flag; `clone`/`unshare` with any of them is denied.
const NAMESPACE_FLAGS: [u64; 8] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
    0x80, // CLONE_NEWTIME (unshare only; in clone's flags these bits are the exit signal)
];

/// Personas a sandbox may select (what Docker allows): PER_LINUX, PER_LINUX32, UNAME26
/// variants, and the 0xffffffff query.
const ALLOWED_PERSONAS: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

const TIOCSTI: u64 = 0x5412;

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, v: u64) -> SeccompCondition {
    // Only fails for an argument index > 5, which none of ours is.
    SeccompCondition::new(arg, len, op, v).expect("valid seccomp condition")
}

fn any_namespace_flag(arg: u8, include_time: bool) -> Result<Vec<SeccompRule>, SeccompError> {
    NAMESPACE_FLAGS
        .iter()
        .filter(|f| include_time || **f != 0x80)
        .map(|f| {
            SeccompRule::new(vec![cond(
                arg,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(*f),
                *f,
            )])
            .map_err(SeccompError::Build)
        })
        .collect()
}

fn target_arch() -> Result<seccompiler::TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|_| SeccompError::Arch(std::env::consts::ARCH))
}

/// The deny-list program (seccompiler).
fn deny_list() -> Result<Vec<SockFilter>, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    rules.insert(libc::SYS_clone, any_namespace_flag(0, false)?);
    rules.insert(libc::SYS_unshare, any_namespace_flag(0, true)?);
    rules.insert(
        libc::SYS_personality,
        vec![SeccompRule::new(
            ALLOWED_PERSONAS
                .iter()
                .map(|p| cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *p))
                .collect(),
        )?],
    );
    rules.insert(
        libc::SYS_ioctl,
        vec![SeccompRule::new(vec![cond(
            1,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            TIOCSTI,
        )])?],
    );
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        target_arch()?,
    )?;
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

/// The hand-written prefix program (architecture, x32, clone3).
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
    #[allow(unreachable_code)]
    Ok(vec![
        stmt(BPF_LD_W_ABS, OFFSET_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, OFFSET_NR),
        jump(BPF_JGE_K, x32_bit, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        jump(BPF_JEQ_K, libc::SYS_clone3 as u32, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
    ])
}

/// Both programs, in installation order.
pub fn programs() -> Result<Vec<Vec<SockFilter>>, SeccompError> {
    Ok(vec![prefix()?, deny_list()?])
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
        // Most restrictive (numerically lowest action) wins, as in the kernel.
        progs
            .iter()
            .map(|p| run(p, X86_64, nr as u32, args))
            .min_by_key(|v| v & 0xffff_0000)
            .unwrap()
    }

    const EPERM: u32 = SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn policy_decisions() {
        let none = [0; 6];
        assert_eq!(verdict(libc::SYS_mount, none), EPERM);
        assert_eq!(verdict(libc::SYS_bpf, none), EPERM);
        assert_eq!(verdict(libc::SYS_ptrace, none), EPERM);
        assert_eq!(verdict(libc::SYS_read, none), SECCOMP_RET_ALLOW);
        assert_eq!(verdict(libc::SYS_clone3, none), ENOSYS);
        // fork-like clone is fine, a namespace clone is not.
        assert_eq!(
            verdict(libc::SYS_clone, [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]),
            SECCOMP_RET_ALLOW
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
        assert_eq!(
            verdict(libc::SYS_clone, [thread, 0, 0, 0, 0, 0]),
            SECCOMP_RET_ALLOW
        );
        assert_eq!(
            verdict(libc::SYS_unshare, [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0]),
            EPERM
        );
        assert_eq!(verdict(libc::SYS_unshare, [0x80, 0, 0, 0, 0, 0]), EPERM);
        assert_eq!(
            verdict(libc::SYS_unshare, [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0]),
            SECCOMP_RET_ALLOW
        );
        assert_eq!(verdict(libc::SYS_personality, none), SECCOMP_RET_ALLOW);
        assert_eq!(
            verdict(libc::SYS_personality, [0xffff_ffff, 0, 0, 0, 0, 0]),
            SECCOMP_RET_ALLOW
        );
        assert_eq!(
            verdict(libc::SYS_personality, [0x0040_0000, 0, 0, 0, 0, 0]),
            EPERM
        );
        assert_eq!(verdict(libc::SYS_ioctl, [1, TIOCSTI, 0, 0, 0, 0]), EPERM);
        assert_eq!(
            verdict(libc::SYS_ioctl, [1, 0x5401, 0, 0, 0, 0]),
            SECCOMP_RET_ALLOW
        );
        // x32 ABI numbers and foreign architectures.
        assert_eq!(verdict(0x4000_0000 | libc::SYS_mount, none), ENOSYS);
        let progs = programs().unwrap();
        assert_eq!(
            run(&progs[0], 0x4000_0003, 21, none),
            SECCOMP_RET_KILL_PROCESS
        );
    }
}
