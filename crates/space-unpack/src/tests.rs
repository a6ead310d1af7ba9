//! Layers built here byte by byte, hostile ones included (the tar crate's builder refuses to
//! write `..`, so names are set in the raw header).

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use super::*;

enum Kind<'a> {
    File(&'a [u8]),
    Dir,
    Symlink(&'a str),
    Hardlink(&'a str),
    CharDev,
    Fifo,
}

struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Self {
        Self(tar::Builder::new(Vec::new()))
    }

    fn add(mut self, name: &str, kind: Kind<'_>) -> Self {
        self.add_full(name, kind, 0o644, 0, &[]);
        self
    }

    fn add_full(
        &mut self,
        name: &str,
        kind: Kind<'_>,
        mode: u32,
        uid: u64,
        xattrs: &[(&str, &[u8])],
    ) {
        if !xattrs.is_empty() {
            let recs: Vec<(String, &[u8])> = xattrs
                .iter()
                .map(|(k, v)| (format!("SCHILY.xattr.{k}"), *v))
                .collect();
            self.0
                .append_pax_extensions(recs.iter().map(|(k, v)| (k.as_str(), *v)))
                .unwrap();
        }
        let mut h = tar::Header::new_gnu();
        // Raw bytes: the builder's set_path refuses `..` and absolute names.
        let gnu = h.as_gnu_mut().unwrap();
        gnu.name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_mtime(1_700_000_000);
        let data: &[u8] = match kind {
            Kind::File(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                d
            }
            Kind::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                &[]
            }
            Kind::Symlink(t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_link_name_literal(t).unwrap();
                &[]
            }
            Kind::Hardlink(t) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_link_name_literal(t).unwrap();
                &[]
            }
            Kind::CharDev => {
                h.set_entry_type(tar::EntryType::Char);
                &[]
            }
            Kind::Fifo => {
                h.set_entry_type(tar::EntryType::Fifo);
                &[]
            }
        };
        h.set_size(data.len() as u64);
        h.set_cksum();
        self.0.append(&h, data).unwrap();
    }

    fn bytes(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

/// A root to apply into, beside a sentinel directory nothing may touch.
struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("root")).unwrap();
        std::fs::create_dir(dir.path().join("outside")).unwrap();
        std::fs::write(dir.path().join("outside/file"), b"host").unwrap();
        Self { dir }
    }
    fn root(&self) -> std::path::PathBuf {
        self.dir.path().join("root")
    }
    fn apply(&self, layer: impl AsRef<[u8]>) -> Result<LayerStats, UnpackError> {
        apply_layer(&self.root(), layer.as_ref())
    }
    fn outside_untouched(&self) {
        let out = self.dir.path().join("outside");
        let names: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("file")]);
        assert_eq!(std::fs::read(out.join("file")).unwrap(), b"host");
        assert!(!Path::new("/etc/space-unpack-test").exists());
    }
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

#[test]
fn files_dirs_links_owners_modes_and_xattrs_are_kept() {
    let f = Fixture::new();
    let mut l = Layer::new();
    l.add_full("usr/", Kind::Dir, 0o755, 0, &[]);
    l.add_full(
        "usr/bin/tool",
        Kind::File(b"#!/bin/sh\n"),
        0o4755,
        1000,
        &[("trusted.space-test", b"v")],
    );
    l.add_full(
        "usr/bin/alias",
        Kind::Hardlink("usr/bin/tool"),
        0o644,
        0,
        &[],
    );
    l.add_full("bin", Kind::Symlink("usr/bin"), 0o777, 0, &[]);
    l.add_full("run/pipe", Kind::Fifo, 0o600, 0, &[]);
    let bytes = l.bytes();
    let stats = f.apply(&bytes).unwrap();
    assert_eq!(stats.entries, 5);
    let root = f.root();
    let tool = root.join("usr/bin/tool");
    let md = std::fs::metadata(&tool).unwrap();
    assert_eq!(std::fs::read(&tool).unwrap(), b"#!/bin/sh\n");
    assert_eq!(md.permissions().mode() & 0o7777, 0o4755, "set-uid is kept");
    assert_eq!(md.mtime(), 1_700_000_000);
    assert_eq!(
        std::fs::metadata(root.join("usr/bin/alias")).unwrap().ino(),
        md.ino(),
        "a hardlink shares its target's inode"
    );
    assert_eq!(
        std::fs::read_link(root.join("bin")).unwrap(),
        Path::new("usr/bin")
    );
    // Directories the layer did not name are made (tar's behaviour).
    assert!(root.join("run").is_dir());
    if is_root() {
        assert_eq!(md.uid(), 1000);
        let v = rustix::fs::getxattr(&tool, "trusted.space-test", &mut [0u8; 8]);
        assert_eq!(v, Ok(1), "the xattr is kept");
    }
    assert_eq!(
        stats.diff_id,
        format!("sha256:{:x}", sha2::Sha256::digest(&bytes)),
        "the diff id is the uncompressed stream's digest"
    );
}

#[test]
fn whiteouts_and_opaque_directories_remove_lower_layers() {
    let f = Fixture::new();
    f.apply(
        Layer::new()
            .add("a/", Kind::Dir)
            .add("a/x", Kind::File(b"x"))
            .add("a/sub/deep", Kind::File(b"d"))
            .add("b/", Kind::Dir)
            .add("b/y", Kind::File(b"y"))
            .add("c", Kind::File(b"c"))
            .bytes(),
    )
    .unwrap();
    f.apply(
        Layer::new()
            .add("a/new", Kind::File(b"n"))
            .add("a/.wh..wh..opq", Kind::File(b""))
            .add(".wh.b", Kind::File(b""))
            .add(".wh.missing", Kind::File(b""))
            .add("c/", Kind::Dir)
            .bytes(),
    )
    .unwrap();
    let root = f.root();
    let mut a: Vec<_> = std::fs::read_dir(root.join("a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    a.sort();
    assert_eq!(
        a,
        ["new"],
        "the opaque marker keeps only this layer's entries"
    );
    assert!(!root.join("b").exists(), "a whiteout removes a whole tree");
    assert!(root.join("c").is_dir(), "a directory replaces a file");
    assert!(!root.join(".wh.b").exists());
}

#[test]
fn entries_that_climb_out_are_refused_and_write_nothing_outside() {
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "dotdot",
            Layer::new()
                .add("../outside/evil", Kind::File(b"x"))
                .bytes(),
            "climbs out",
        ),
        (
            "absolute",
            Layer::new()
                .add("/etc/space-unpack-test", Kind::File(b"x"))
                .bytes(),
            "absolute",
        ),
        (
            "absolute symlink then through it",
            Layer::new()
                .add("etc2", Kind::Symlink("/etc"))
                .add("etc2/space-unpack-test", Kind::File(b"x"))
                .bytes(),
            "leads outside",
        ),
        (
            "relative symlink up then through it",
            Layer::new()
                .add("up", Kind::Symlink("../outside"))
                .add("up/evil", Kind::File(b"x"))
                .bytes(),
            "leads outside",
        ),
        (
            "hardlink out",
            Layer::new()
                .add("h", Kind::Hardlink("../outside/file"))
                .bytes(),
            "climbs out",
        ),
        (
            "whiteout through a symlink",
            Layer::new()
                .add("up", Kind::Symlink("../outside"))
                .add("up/.wh.file", Kind::File(b""))
                .bytes(),
            "leads outside",
        ),
    ];
    for (what, layer, want) in cases {
        let f = Fixture::new();
        let err = f.apply(layer).expect_err(what).to_string();
        assert!(err.contains(want), "{what}: {err}");
        f.outside_untouched();
    }
}

#[test]
fn a_planted_symlink_is_replaced_never_written_through() {
    let f = Fixture::new();
    f.apply(
        Layer::new()
            .add("f", Kind::Symlink("../outside/file"))
            .add("f", Kind::File(b"mine"))
            .bytes(),
    )
    .unwrap();
    f.outside_untouched();
    let md = std::fs::symlink_metadata(f.root().join("f")).unwrap();
    assert!(md.is_file());
    assert_eq!(std::fs::read(f.root().join("f")).unwrap(), b"mine");
    // A symlink inside the tree may be written through: it resolves beneath the root.
    f.apply(
        Layer::new()
            .add("real/", Kind::Dir)
            .add("alias", Kind::Symlink("real"))
            .add("alias/x", Kind::File(b"x"))
            .bytes(),
    )
    .unwrap();
    assert_eq!(std::fs::read(f.root().join("real/x")).unwrap(), b"x");
}

#[test]
fn device_nodes_are_dropped_with_a_note() {
    let f = Fixture::new();
    let stats = f
        .apply(
            Layer::new()
                .add("dev/null", Kind::CharDev)
                .add("etc/x", Kind::File(b""))
                .bytes(),
        )
        .unwrap();
    assert!(!f.root().join("dev/null").exists());
    assert_eq!(stats.notes.len(), 1, "{:?}", stats.notes);
    assert!(stats.notes[0].contains("/dev/null"), "{:?}", stats.notes);
}

#[test]
fn gzip_and_zstd_layers_are_read_and_hash_to_the_same_diff_id() {
    let plain = Layer::new().add("hello", Kind::File(b"world")).bytes();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&plain).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::encode_all(&plain[..], 3).unwrap();
    let want = format!("sha256:{:x}", sha2::Sha256::digest(&plain));
    for (what, bytes) in [("plain", plain.clone()), ("gzip", gz), ("zstd", zst)] {
        let f = Fixture::new();
        let stats = f.apply(bytes).unwrap();
        assert_eq!(stats.diff_id, want, "{what}");
        assert_eq!(std::fs::read(f.root().join("hello")).unwrap(), b"world");
    }
}

#[test]
fn a_truncated_or_corrupted_blob_fails_verification() {
    let data = b"0123456789".repeat(100);
    let digest = format!("sha256:{:x}", sha2::Sha256::digest(&data));
    let mut ok = Vec::new();
    Verifying::new(&data[..], &digest)
        .read_to_end(&mut ok)
        .unwrap();
    assert_eq!(ok, data);
    let err = Verifying::new(&data[..500], &digest)
        .read_to_end(&mut Vec::new())
        .unwrap_err();
    assert!(err.to_string().contains("truncated or corrupted"), "{err}");
    let f = Fixture::new();
    let layer = Layer::new().add("big", Kind::File(&data)).bytes();
    let err = f.apply(&layer[..layer.len() / 2]).unwrap_err().to_string();
    assert!(err.contains("cannot read the layer"), "{err}");
}
