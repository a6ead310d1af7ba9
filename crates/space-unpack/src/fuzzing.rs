//! The `layer` fuzz target's way in (fuzz/, docs/FUZZING.md): a tar stream applied to a fresh
//! rootfs, beside a directory it must not touch. What must hold: nothing panics; nothing
//! outside the rootfs is created, removed or written through (a planted `..`, absolute name,
//! symlink or hardlink included); and no device node is created inside it.
//!
//! Compressed streams are left to flate2's and zstd's own fuzzing, and tars whose entries would
//! write more than [`MAX_ENTRY`] (or are sparse) are skipped, so that a run stays within its
//! disk: the target is the tar handling, not the size of the files.

use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest entry an input may hold to be applied.
pub const MAX_ENTRY: u64 = 1 << 20;
const SENTINEL: &[u8] = b"outside the rootfs";

fn small_enough(data: &[u8]) -> bool {
    let mut ar = tar::Archive::new(data);
    let Ok(entries) = ar.entries() else {
        return true;
    };
    for e in entries {
        let Ok(e) = e else {
            return true; // malformed from here: apply stops there too
        };
        let h = e.header();
        if h.entry_type().is_gnu_sparse() || h.size().map_or(true, |s| s > MAX_ENTRY) {
            return false;
        }
    }
    true
}

fn no_devices(dir: &Path, depth: usize) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let Ok(t) = e.file_type() else { continue };
        assert!(
            !(t.is_block_device() || t.is_char_device()),
            "a device node at {}",
            e.path().display()
        );
        if t.is_dir() && depth < 64 {
            no_devices(&e.path(), depth + 1);
        }
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .expect("the scratch directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    v.sort();
    v
}

fn scratch() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "space-fuzz-layer-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Runs one input (see the module's doc).
pub fn layer(data: &[u8]) {
    if data.starts_with(&[0x1f, 0x8b]) || data.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return;
    }
    if !small_enough(data) {
        return;
    }
    let base = scratch();
    let (root, outside) = (base.join("root"), base.join("outside"));
    fs::create_dir_all(&root).expect("the rootfs");
    fs::create_dir(&outside).expect("the outside directory");
    fs::write(outside.join("file"), SENTINEL).expect("the sentinel");
    let _ = crate::apply_layer(&root, data);
    assert_eq!(
        names(&base),
        ["outside", "root"],
        "written beside the rootfs"
    );
    assert_eq!(names(&outside), ["file"], "written outside the rootfs");
    let md = fs::symlink_metadata(outside.join("file")).expect("the sentinel");
    assert!(md.is_file());
    assert_eq!(
        fs::read(outside.join("file")).expect("the sentinel"),
        SENTINEL
    );
    assert!(fs::symlink_metadata(&root).expect("the rootfs").is_dir());
    no_devices(&root, 0);
    fs::remove_dir_all(&base).expect("the scratch directory is removed");
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_layer_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("layer", super::layer);
        assert!(n >= 4, "only {n} inputs in fuzz/corpus/layer");
    }
}
