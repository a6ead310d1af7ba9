//! btrfs quota groups through ioctls (no `btrfs` CLI): turning simple quotas on, level-1
//! groups with an exclusive-bytes limit, membership, and usage read from the quota tree.
//!
//! Simple quotas (squota, Linux 6.7+) charge every extent to the subvolume that wrote it, for
//! as long as it exists, whoever else shares it later. A snapshot therefore starts at zero,
//! and what a sandbox writes stays charged to it while any snapshot keeps it alive. Full
//! qgroups track sharing exactly, at a cost on every commit (decision 0043 has both measured).
//! A write past a group's limit fails with `EDQUOT`.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use super::{
    BtrfsError, IOC_READ, IOC_WRITE, SearchKey, btrfs_ioctl, ioc, open_dir, search, subvolume_info,
};

const BTRFS_QUOTA_TREE_OBJECTID: u64 = 8;
const BTRFS_QGROUP_STATUS_KEY: u32 = 240;
const BTRFS_QGROUP_INFO_KEY: u32 = 242;
const BTRFS_QGROUP_RELATION_KEY: u32 = 246;
const BTRFS_QGROUP_STATUS_FLAG_ON: u64 = 1 << 0;
const BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE: u64 = 1 << 3;
const BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA: u64 = 4;
const BTRFS_QGROUP_LIMIT_MAX_EXCL: u64 = 1 << 1;

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

/// `struct btrfs_ioctl_qgroup_assign_args`.
#[repr(C)]
struct AssignArgs {
    assign: u64,
    src: u64,
    dst: u64,
}

/// `struct btrfs_ioctl_qgroup_create_args`.
#[repr(C)]
struct CreateArgs {
    create: u64,
    qgroupid: u64,
}

/// `struct btrfs_qgroup_limit`.
#[repr(C)]
struct Limit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_qgroup_limit_args`.
#[repr(C)]
struct LimitArgs {
    qgroupid: u64,
    lim: Limit,
}

const _: () = assert!(std::mem::size_of::<QuotaCtlArgs>() == 16);
const _: () = assert!(std::mem::size_of::<AssignArgs>() == 24);
const _: () = assert!(std::mem::size_of::<CreateArgs>() == 16);
const _: () = assert!(std::mem::size_of::<LimitArgs>() == 48);

const IOC_QUOTA_CTL: u32 = ioc(
    IOC_READ | IOC_WRITE,
    40,
    std::mem::size_of::<QuotaCtlArgs>(),
);
const IOC_QGROUP_ASSIGN: u32 = ioc(IOC_WRITE, 41, std::mem::size_of::<AssignArgs>());
const IOC_QGROUP_CREATE: u32 = ioc(IOC_WRITE, 42, std::mem::size_of::<CreateArgs>());
const IOC_QGROUP_LIMIT: u32 = ioc(IOC_READ, 43, std::mem::size_of::<LimitArgs>());

/// How a volume accounts disk use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    Off,
    /// Full qgroups (`btrfs quota enable`).
    Full,
    /// Simple quotas (`btrfs quota enable --simple`).
    Simple,
}

/// The id of level-1 qgroup `n` (`1/n`): a group of subvolumes' qgroups.
pub const fn level1(n: u64) -> u64 {
    (1 << 48) | n
}

/// Whether `qgroupid` is a level-1 group.
pub const fn is_level1(qgroupid: u64) -> bool {
    qgroupid >> 48 == 1
}

/// The quota mode of the volume holding `path` (its quota tree's status item).
pub fn quota_mode(path: &Path) -> Result<QuotaMode, BtrfsError> {
    let fd = open_dir(path)?;
    let mut key = quota_key(BTRFS_QGROUP_STATUS_KEY, 0);
    let mut flags = None;
    match search(&fd, path, &mut key, |_, typ, _, item| {
        // struct btrfs_qgroup_status_item: version, generation, flags (le64), ...
        if typ == BTRFS_QGROUP_STATUS_KEY
            && let Some(f) = item.get(16..24)
        {
            flags = Some(u64::from_le_bytes(f.try_into().unwrap_or([0; 8])));
        }
    }) {
        Ok(()) => {}
        // No quota tree: quotas were never turned on (or were turned off).
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(QuotaMode::Off),
        Err(e) => return Err(e),
    }
    Ok(match flags {
        Some(f) if f & BTRFS_QGROUP_STATUS_FLAG_ON == 0 => QuotaMode::Off,
        Some(f) if f & BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE != 0 => QuotaMode::Simple,
        Some(_) => QuotaMode::Full,
        None => QuotaMode::Off,
    })
}

/// Turns simple quotas on for the volume holding `path` (BTRFS_IOC_QUOTA_CTL); a volume with
/// quotas already on (either mode) is left as it is. Extents written before stay uncharged.
pub fn enable_simple_quotas(path: &Path) -> Result<QuotaMode, BtrfsError> {
    let mode = quota_mode(path)?;
    if mode != QuotaMode::Off {
        return Ok(mode);
    }
    let fd = open_dir(path)?;
    let mut args = QuotaCtlArgs {
        cmd: BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA,
        status: 0,
    };
    // SAFETY: `args` is a live btrfs_ioctl_quota_ctl_args (size asserted).
    unsafe { btrfs_ioctl(&fd, IOC_QUOTA_CTL, &mut args) }
        .map_err(|e| BtrfsError::io("turn simple quotas on for", path, e))?;
    quota_mode(path)
}

/// Creates qgroup `qgroupid`; `false` when it exists already.
pub fn create_qgroup(path: &Path, qgroupid: u64) -> Result<bool, BtrfsError> {
    qgroup_create_ctl(path, qgroupid, true, "create qgroup on")
}

/// Destroys qgroup `qgroupid` after taking its members out of it (a missing one is fine).
pub fn destroy_qgroup(path: &Path, qgroupid: u64) -> Result<(), BtrfsError> {
    for member in members(path, qgroupid)? {
        assign_ctl(path, member, qgroupid, false)?;
    }
    qgroup_create_ctl(path, qgroupid, false, "destroy qgroup on").map(drop)
}

fn qgroup_create_ctl(
    path: &Path,
    qgroupid: u64,
    create: bool,
    op: &'static str,
) -> Result<bool, BtrfsError> {
    let fd = open_dir(path)?;
    let mut args = CreateArgs {
        create: u64::from(create),
        qgroupid,
    };
    // SAFETY: `args` is a live btrfs_ioctl_qgroup_create_args (size asserted).
    match unsafe { btrfs_ioctl(&fd, IOC_QGROUP_CREATE, &mut args) } {
        Ok(_) => Ok(true),
        Err(e) if create && e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) if !create && e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(BtrfsError::io(op, path, e)),
    }
}

/// Puts the subvolume at `subvol` (its level-0 qgroup) into group `parent`; already in it is
/// fine. The subvolume must be on the volume `parent` is on.
pub fn join(subvol: &Path, parent: u64) -> Result<(), BtrfsError> {
    let id = subvolume_info(subvol)?.tree_id;
    assign_ctl(subvol, id, parent, true)
}

/// Puts qgroup `child` into (or, with `assign: false`, out of) group `parent`.
pub fn assign(path: &Path, child: u64, parent: u64, assign: bool) -> Result<(), BtrfsError> {
    assign_ctl(path, child, parent, assign)
}

fn assign_ctl(path: &Path, src: u64, dst: u64, assign: bool) -> Result<(), BtrfsError> {
    let fd = open_dir(path)?;
    let mut args = AssignArgs {
        assign: u64::from(assign),
        src,
        dst,
    };
    // SAFETY: `args` is a live btrfs_ioctl_qgroup_assign_args (size asserted). A positive
    // return asks for a rescan (full qgroups only); simple quotas need none.
    match unsafe { btrfs_ioctl(&fd, IOC_QGROUP_ASSIGN, &mut args) } {
        Ok(_) => Ok(()),
        Err(e) if assign && e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        Err(e) if !assign && e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(BtrfsError::io(
            if assign {
                "add a qgroup to a group on"
            } else {
                "take a qgroup out of a group on"
            },
            path,
            e,
        )),
    }
}

/// Sets (or, with `None`, lifts) the limit on the bytes charged to qgroup `qgroupid`.
pub fn limit_exclusive(path: &Path, qgroupid: u64, bytes: Option<u64>) -> Result<(), BtrfsError> {
    let fd = open_dir(path)?;
    let mut args = LimitArgs {
        qgroupid,
        lim: Limit {
            flags: BTRFS_QGROUP_LIMIT_MAX_EXCL,
            // The kernel reads u64::MAX as no limit (`btrfs qgroup limit none`).
            max_excl: bytes.unwrap_or(u64::MAX),
            max_rfer: 0,
            rsv_rfer: 0,
            rsv_excl: 0,
        },
    };
    // SAFETY: `args` is a live btrfs_ioctl_qgroup_limit_args (size asserted).
    unsafe { btrfs_ioctl(&fd, IOC_QGROUP_LIMIT, &mut args) }
        .map_err(|e| BtrfsError::io("set a qgroup limit on", path, e))?;
    Ok(())
}

/// What a qgroup is charged, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Referenced: everything its subvolumes reach (with simple quotas, equal to `exclusive`).
    pub referenced: u64,
    /// Exclusive: what is charged to it (with simple quotas, what its subvolumes wrote).
    pub exclusive: u64,
}

/// The usage of qgroup `qgroupid`, or `None` when there is no such group.
pub fn usage(path: &Path, qgroupid: u64) -> Result<Option<Usage>, BtrfsError> {
    let fd = open_dir(path)?;
    let mut key = quota_key(BTRFS_QGROUP_INFO_KEY, qgroupid);
    let mut found = None;
    search_quota(&fd, path, &mut key, |_, typ, offset, item| {
        // struct btrfs_qgroup_info_item: generation, rfer, rfer_cmpr, excl, excl_cmpr (le64).
        if typ == BTRFS_QGROUP_INFO_KEY
            && offset == qgroupid
            && let (Some(r), Some(x)) = (item.get(8..16), item.get(24..32))
        {
            found = Some(Usage {
                referenced: u64::from_le_bytes(r.try_into().unwrap_or([0; 8])),
                exclusive: u64::from_le_bytes(x.try_into().unwrap_or([0; 8])),
            });
        }
    })?;
    Ok(found)
}

/// The qgroups in group `parent` (RELATION items keyed by the parent).
pub fn members(path: &Path, parent: u64) -> Result<Vec<u64>, BtrfsError> {
    let fd = open_dir(path)?;
    let mut out = Vec::new();
    let mut key = SearchKey {
        tree_id: BTRFS_QUOTA_TREE_OBJECTID,
        min_objectid: parent,
        max_objectid: parent,
        min_type: BTRFS_QGROUP_RELATION_KEY,
        max_type: BTRFS_QGROUP_RELATION_KEY,
        min_offset: 0,
        max_offset: u64::MAX,
        min_transid: 0,
        max_transid: u64::MAX,
        ..SearchKey::default()
    };
    loop {
        let mut last = None;
        search_quota(&fd, path, &mut key, |objectid, typ, offset, _| {
            last = Some(offset);
            // Each relation is stored twice: (child, parent) and (parent, child).
            if typ == BTRFS_QGROUP_RELATION_KEY && objectid == parent && offset < parent {
                out.push(offset);
            }
        })?;
        match last {
            Some(o) if o < u64::MAX => key.min_offset = o + 1,
            _ => break,
        }
    }
    out.dedup();
    Ok(out)
}

/// Every level-1 qgroup on the volume holding `path`.
pub fn level1_groups(path: &Path) -> Result<Vec<u64>, BtrfsError> {
    let fd = open_dir(path)?;
    let mut out = Vec::new();
    let mut key = SearchKey {
        min_offset: level1(0),
        max_offset: (2 << 48) - 1,
        ..quota_key(BTRFS_QGROUP_INFO_KEY, 0)
    };
    loop {
        let mut last = None;
        search_quota(&fd, path, &mut key, |_, typ, offset, _| {
            last = Some(offset);
            if typ == BTRFS_QGROUP_INFO_KEY && is_level1(offset) {
                out.push(offset);
            }
        })?;
        match last {
            Some(o) if o < key.max_offset => key.min_offset = o + 1,
            _ => break,
        }
    }
    Ok(out)
}

/// A search key for the item of one type at `offset` in the quota tree (objectid 0).
fn quota_key(typ: u32, offset: u64) -> SearchKey {
    SearchKey {
        tree_id: BTRFS_QUOTA_TREE_OBJECTID,
        min_objectid: 0,
        max_objectid: 0,
        min_offset: offset,
        max_offset: offset,
        min_transid: 0,
        max_transid: u64::MAX,
        min_type: typ,
        max_type: typ,
        ..SearchKey::default()
    }
}

/// A search of the quota tree: with quotas off there is no such tree, and nothing is in it.
fn search_quota(
    fd: &OwnedFd,
    path: &Path,
    key: &mut SearchKey,
    f: impl FnMut(u64, u32, u64, &[u8]),
) -> Result<(), BtrfsError> {
    match search(fd, path, key, f) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

/// Whether an error is the kernel's "quota exceeded".
pub fn is_quota_exceeded(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EDQUOT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::btrfs::{create_subvolume, snapshot, subvolume_info};
    use crate::loopdev::test_support::BtrfsImage;
    use std::io::Write;

    #[test]
    fn ioctl_numbers_match_kernel_headers() {
        // From <linux/btrfs.h> as compiled by the kernel's own headers.
        assert_eq!(IOC_QUOTA_CTL, 0xC010_9428);
        assert_eq!(IOC_QGROUP_ASSIGN, 0x4018_9429);
        assert_eq!(IOC_QGROUP_CREATE, 0x4010_942A);
        assert_eq!(IOC_QGROUP_LIMIT, 0x8030_942B);
    }

    fn write_mib(path: &Path, mib: usize) -> io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        let chunk = vec![0x5a_u8; 1 << 20];
        for _ in 0..mib {
            f.write_all(&chunk)?;
        }
        f.sync_all()
    }

    fn sync(path: &Path) {
        let f = std::fs::File::open(path).unwrap();
        rustix::fs::syncfs(&f).unwrap();
    }

    /// Real kernel (root, Linux 6.7+): simple quotas on, a level-1 group with a limit over a
    /// subvolume and its snapshot; a write past the limit is EDQUOT, the usage is read back,
    /// a neighbour outside the group is unaffected, and the group is destroyed cleanly.
    #[test]
    fn a_group_limit_is_edquot_and_snapshots_stay_charged() {
        let img = BtrfsImage::new().expect("btrfs test image (root, btrfs-progs)");
        let mnt = img.mountpoint();
        assert_eq!(quota_mode(mnt).unwrap(), QuotaMode::Off);
        assert_eq!(level1_groups(mnt).unwrap(), Vec::<u64>::new());
        assert_eq!(enable_simple_quotas(mnt).unwrap(), QuotaMode::Simple);
        assert_eq!(enable_simple_quotas(mnt).unwrap(), QuotaMode::Simple);
        create_subvolume(mnt, "a").unwrap();
        create_subvolume(mnt, "b").unwrap();
        let a = mnt.join("a");
        let group = level1(subvolume_info(&a).unwrap().tree_id);
        assert!(create_qgroup(mnt, group).unwrap());
        assert!(!create_qgroup(mnt, group).unwrap());
        join(&a, group).unwrap();
        join(&a, group).unwrap();
        limit_exclusive(mnt, group, Some(32 << 20)).unwrap();
        write_mib(&a.join("f"), 20).unwrap();
        snapshot(&a, mnt, "a-snap", true).unwrap();
        join(&mnt.join("a-snap"), group).unwrap();
        // The snapshot keeps f alive: removing it frees nothing of the quota.
        std::fs::remove_file(a.join("f")).unwrap();
        sync(mnt);
        let err = write_mib(&a.join("g"), 20).unwrap_err();
        assert!(is_quota_exceeded(&err), "{err}");
        // The neighbour has no limit.
        write_mib(&mnt.join("b/big"), 40).unwrap();
        sync(mnt);
        let used = usage(mnt, group).unwrap().unwrap();
        assert!((20 << 20..=33 << 20).contains(&used.exclusive), "{used:?}");
        let members = members(mnt, group).unwrap();
        assert_eq!(members.len(), 2, "{members:?}");
        assert_eq!(level1_groups(mnt).unwrap(), vec![group]);
        // Lifting the limit lets the write through.
        limit_exclusive(mnt, group, None).unwrap();
        write_mib(&a.join("g"), 20).unwrap();
        destroy_qgroup(mnt, group).unwrap();
        destroy_qgroup(mnt, group).unwrap();
        assert_eq!(usage(mnt, group).unwrap(), None);
        assert_eq!(level1_groups(mnt).unwrap(), Vec::<u64>::new());
    }

    /// A subvolume in a fresh group limited to `mib` on a new volume with simple quotas.
    fn limited(img: &BtrfsImage, mib: u64) -> std::path::PathBuf {
        let mnt = img.mountpoint();
        enable_simple_quotas(mnt).unwrap();
        create_subvolume(mnt, "a").unwrap();
        let a = mnt.join("a");
        let group = level1(subvolume_info(&a).unwrap().tree_id);
        create_qgroup(mnt, group).unwrap();
        join(&a, group).unwrap();
        limit_exclusive(mnt, group, Some(mib << 20)).unwrap();
        a
    }

    /// Metadata is charged too: a flood of empty files (no data extent at all) stops at the
    /// limit with EDQUOT, long before the volume is full.
    #[test]
    fn an_inode_flood_stops_at_the_limit() {
        let img = BtrfsImage::new().expect("btrfs test image (root, btrfs-progs)");
        let a = limited(&img, 4);
        let mut made = 0u32;
        let err = loop {
            assert!(made < 1_000_000, "a million empty files and no EDQUOT");
            match std::fs::File::create(a.join(made.to_string())) {
                Ok(_) => made += 1,
                Err(e) => break e,
            }
            if made.is_multiple_of(5_000) {
                sync(&a);
            }
        };
        assert!(is_quota_exceeded(&err), "{err} after {made} files");
        assert!(made > 1_000, "only {made} files in 4 MiB");
    }

    /// Reflinks copy no data but each one copies the source's extent items: clones of a file
    /// of many extents stop at the limit with EDQUOT.
    #[test]
    fn a_reflink_flood_stops_at_the_limit() {
        use std::os::unix::fs::FileExt;
        let img = BtrfsImage::new().expect("btrfs test image (root, btrfs-progs)");
        let a = limited(&img, 4);
        let src = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(a.join("frag"))
            .unwrap();
        // 256 extents: 4 KiB written every 8 KiB, each made its own extent by an fsync.
        for i in 0..256u64 {
            src.write_at(&[0x5a; 4096], i * 8192).unwrap();
            src.sync_data().unwrap();
        }
        let mut clones = 0u32;
        let err = loop {
            assert!(clones < 100_000, "100,000 clones and no EDQUOT");
            let dst = match std::fs::File::create(a.join(format!("c{clones}"))) {
                Ok(f) => f,
                Err(e) => break e,
            };
            match rustix::fs::ioctl_ficlone(&dst, &src) {
                Ok(()) => clones += 1,
                Err(e) => break e.into(),
            }
            if clones.is_multiple_of(50) {
                sync(&a);
            }
        };
        assert!(is_quota_exceeded(&err), "{err} after {clones} clones");
        assert!(clones > 10, "only {clones} clones in 4 MiB");
    }

    #[test]
    fn reads_on_a_volume_without_quotas_are_empty() {
        let img = BtrfsImage::new().expect("btrfs test image (root, btrfs-progs)");
        let mnt = img.mountpoint();
        assert_eq!(usage(mnt, level1(5)).unwrap(), None);
        assert_eq!(members(mnt, level1(5)).unwrap(), Vec::<u64>::new());
    }

    /// Issue 15's "measure both": the same work on a fresh 256 MiB volume with quotas off,
    /// simple quotas, and full qgroups (`btrfs quota enable`): 40 times, snapshot a
    /// subvolume of 2,000 small files, write 1 MiB into the snapshot and sync, then delete
    /// every snapshot and commit (the cleaner drops them later, on its own interval in
    /// every mode, so it is not timed). Modes rotate between rounds;
    /// `SPACE_BENCH_ROUNDS` rounds (default 5).
    #[test]
    #[ignore = "benchmark; prints figures for decision 0043"]
    fn bench_quota_modes() {
        use std::time::Instant;
        let rounds: usize = std::env::var("SPACE_BENCH_ROUNDS").map_or(5, |v| v.parse().unwrap());
        let modes = ["off", "simple", "full"];
        let mut times: std::collections::BTreeMap<&str, (Vec<f64>, Vec<f64>)> = Default::default();
        for r in 0..rounds {
            for k in 0..modes.len() {
                let mode = modes[(r + k) % modes.len()];
                let img = BtrfsImage::new().expect("btrfs test image (root, btrfs-progs)");
                let mnt = img.mountpoint();
                match mode {
                    "simple" => {
                        enable_simple_quotas(mnt).unwrap();
                    }
                    "full" => {
                        let st = std::process::Command::new("btrfs")
                            .args(["quota", "enable"])
                            .arg(mnt)
                            .status()
                            .unwrap();
                        assert!(st.success());
                        assert_eq!(quota_mode(mnt).unwrap(), QuotaMode::Full);
                    }
                    _ => {}
                }
                create_subvolume(mnt, "base").unwrap();
                for i in 0..2000 {
                    std::fs::write(mnt.join(format!("base/f{i}")), i.to_string()).unwrap();
                }
                sync(mnt);
                let t = Instant::now();
                for i in 0..40 {
                    snapshot(&mnt.join("base"), mnt, &format!("s{i}"), false).unwrap();
                    write_mib(&mnt.join(format!("s{i}/w")), 1).unwrap();
                }
                sync(mnt);
                let made = t.elapsed().as_secs_f64() * 1e3;
                let t = Instant::now();
                for i in 0..40 {
                    crate::btrfs::delete_subvolume(&mnt.join(format!("s{i}"))).unwrap();
                }
                sync(mnt);
                let gone = t.elapsed().as_secs_f64() * 1e3;
                let e = times.entry(mode).or_default();
                e.0.push(made);
                e.1.push(gone);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        for (mode, (made, gone)) in &mut times {
            eprintln!(
                "quotas {mode}: 40 snapshots + writes {:.0} ms, 40 deletes + commit {:.0} ms \
                 (medians of {rounds} rounds)",
                median(made),
                median(gone)
            );
        }
    }
}
