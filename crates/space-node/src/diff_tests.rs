//! Real-kernel tests of the diff (root, loop-mounted btrfs).

use std::fs;
use std::path::Path;

use space_sys::btrfs;

use super::*;
use crate::storage;

fn set(changes: &[Change]) -> Vec<String> {
    changes
        .iter()
        .map(|c| {
            let k = match c.kind {
                ChangeKind::Added => 'A',
                ChangeKind::Modified => 'M',
                ChangeKind::Deleted => 'D',
            };
            format!("{k} {}{}", c.path, if c.is_dir { "/" } else { "" })
        })
        .collect()
}

fn snap(src: &Path, dir: &Path, name: &str) -> std::path::PathBuf {
    btrfs::snapshot(src, dir, name, true).unwrap();
    dir.join(name)
}

#[test]
fn real_btrfs_diff_classifies_and_prunes() {
    let tmp = tempfile::tempdir().unwrap();
    let vol = storage::prepare_volume(tmp.path(), 512 << 20).unwrap();
    let _unmount = crate::storage::tests::Unmount(vol.root.clone());
    btrfs::create_subvolume(&vol.root, "live").unwrap();
    let live = vol.root.join("live");
    // A big unchanged tree: 20 dirs x 1000 files.
    for d in 0..20 {
        let dir = live.join(format!("big/d{d}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..1000 {
            fs::write(dir.join(format!("f{f}")), b"x").unwrap();
        }
    }
    fs::create_dir_all(live.join("etc/sub")).unwrap();
    fs::write(live.join("etc/keep"), b"keep").unwrap();
    fs::write(live.join("etc/mod"), b"old").unwrap();
    fs::write(live.join("etc/del"), b"del").unwrap();
    fs::write(live.join("etc/ren"), b"ren").unwrap();
    fs::write(live.join("etc/sub/inner"), b"in").unwrap();
    fs::write(live.join("etc/linked"), b"l").unwrap();
    std::os::unix::fs::symlink("/etc/keep", live.join("etc/sym")).unwrap();
    let snaps = vol.root.join("snaps");
    fs::create_dir(&snaps).unwrap();
    let a = snap(&live, &snaps, "a");

    fs::write(live.join("etc/mod"), b"new content").unwrap();
    fs::remove_file(live.join("etc/del")).unwrap();
    fs::rename(live.join("etc/ren"), live.join("etc/renamed")).unwrap();
    fs::remove_dir_all(live.join("etc/sub")).unwrap();
    fs::create_dir_all(live.join("new/dir")).unwrap();
    fs::write(live.join("new/dir/file"), b"n").unwrap();
    fs::hard_link(live.join("etc/linked"), live.join("new/hard")).unwrap();
    fs::remove_file(live.join("etc/sym")).unwrap();
    std::os::unix::fs::symlink("/nowhere", live.join("etc/sym")).unwrap();
    std::os::unix::fs::symlink("/", live.join("escape")).unwrap();
    fs::write(live.join("big/d7/f7"), b"changed").unwrap();
    let b = snap(&live, &snaps, "b");

    let want = vec![
        "M /big/d7/f7",
        "A /escape",
        "D /etc/del",
        "M /etc/linked", // nlink moved its ctime
        "M /etc/mod",
        "D /etc/ren",
        "A /etc/renamed",
        "D /etc/sub/",
        "D /etc/sub/inner",
        "M /etc/sym",
        "A /new/",
        "A /new/dir/",
        "A /new/dir/file",
        "A /new/hard",
    ];
    let t0 = std::time::Instant::now();
    let (pruned, stats) = diff_trees(&a, &b).unwrap();
    let t_pruned = t0.elapsed();
    let t1 = std::time::Instant::now();
    let (full, fstats) = diff_trees_full(&a, &b).unwrap();
    let t_full = t1.elapsed();
    assert_eq!(set(&pruned), want);
    assert_eq!(set(&full), want);
    assert!(stats.pruned);
    assert!(
        stats.dirs_read < 20,
        "pruned diff read {} directories",
        stats.dirs_read
    );
    eprintln!(
        "diff of 20k-file snapshots, 14 changes: pruned {t_pruned:?} ({} dirs read), full walk {t_full:?} ({} dirs read)",
        stats.dirs_read, fstats.dirs_read
    );

    // Snapshot -> live, and the reverse order.
    let (to_live, st) = diff_trees(&a, &live).unwrap();
    assert!(st.pruned);
    assert_eq!(set(&to_live), want);
    let (rev, _) = diff_trees(&b, &a).unwrap();
    assert_eq!(rev.len(), want.len());
    assert!(
        rev.iter()
            .any(|c| c.path == "/etc/del" && c.kind == ChangeKind::Added)
    );
    // Unchanged: nothing.
    let c = snap(&live, &snaps, "c");
    assert!(diff_trees(&b, &c).unwrap().0.is_empty());
    for s in ["a", "b", "c"] {
        btrfs::delete_subvolume(&snaps.join(s)).unwrap();
    }
}

#[test]
fn small_text_files_get_their_unified_diff_and_nothing_else_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for d in [&a, &b] {
        std::fs::create_dir_all(d.join("etc")).unwrap();
    }
    std::fs::write(a.join("etc/conf"), "one\ntwo\nthree\n").unwrap();
    std::fs::write(b.join("etc/conf"), "one\n2\nthree\n").unwrap();
    std::fs::write(a.join("bin"), b"\0\x01").unwrap();
    std::fs::write(b.join("bin"), b"\0\x02").unwrap();
    let big = "x".repeat(TEXT_DIFF_MAX_FILE as usize + 1);
    std::fs::write(a.join("big"), &big).unwrap();
    std::fs::write(b.join("big"), format!("{big}y")).unwrap();
    // A symlink out of the tree is never followed, whatever it points at.
    std::fs::write(dir.path().join("secret"), "host secret\n").unwrap();
    std::fs::write(a.join("link"), "plain\n").unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret"), b.join("link")).unwrap();
    let change = |p: &str| Change {
        path: p.into(),
        kind: ChangeKind::Modified,
        is_dir: false,
        text_diff: None,
    };
    let mut changes = vec![
        change("/etc/conf"),
        change("/bin"),
        change("/big"),
        change("/link"),
        Change {
            kind: ChangeKind::Added,
            ..change("/new")
        },
    ];
    add_text_diffs(&a, &b, &mut changes);
    let conf = changes[0].text_diff.as_deref().unwrap();
    assert!(
        conf.contains("--- a/etc/conf") && conf.contains("+++ b/etc/conf"),
        "{conf}"
    );
    assert!(conf.contains("-two\n+2\n"), "{conf}");
    for c in &changes[1..] {
        assert_eq!(c.text_diff, None, "{}", c.path);
    }
}
