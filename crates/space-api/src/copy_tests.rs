//! Downloads against a fake sandbox that plays a hostile daemon: whatever it sends, nothing is
//! written outside the destination, nothing is followed, and a failed copy leaves nothing.

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use super::*;

#[derive(Clone)]
enum Data {
    Bytes(Vec<u8>),
    Endless,
    Stall,
}

#[derive(Clone)]
enum Node {
    Dir(u32, Vec<(String, Node)>),
    File(u32, Data),
    Link(String),
    Special,
    Mount,
}

fn dir(mode: u32, children: Vec<(&str, Node)>) -> Node {
    Node::Dir(
        mode,
        children
            .into_iter()
            .map(|(n, c)| (n.to_owned(), c))
            .collect(),
    )
}

/// A sandbox whose `/w` (mode 0755) holds `children`.
fn in_w(children: Vec<(&str, Node)>) -> Fake {
    Fake {
        root: dir(0o755, vec![("w", dir(0o755, children))]),
    }
}

fn file(data: &str) -> Node {
    Node::File(0o644, Data::Bytes(data.as_bytes().to_vec()))
}

/// A sandbox whose daemon answers from `root`, names and all, as it likes.
struct Fake {
    root: Node,
}

fn info(name: &str, path: &str, n: &Node) -> EntryInfo {
    let (file_type, mode, target, mount_point) = match n {
        Node::Dir(m, _) => (FileType::Dir, *m, None, false),
        Node::Mount => (FileType::Dir, 0o555, None, true),
        Node::File(m, _) => (FileType::File, *m, None, false),
        Node::Link(t) => (FileType::Symlink, 0o777, Some(t.clone()), false),
        Node::Special => (FileType::Other, 0o666, None, false),
    };
    EntryInfo {
        name: name.to_owned(),
        path: path.to_owned(),
        file_type,
        size: 0,
        mode,
        uid: 0,
        gid: 0,
        owner: None,
        group: None,
        modified_at: "2024-05-01T12:00:00.000Z".to_owned(),
        symlink_target: target,
        mount_point,
        metadata: Default::default(),
    }
}

fn not_found() -> ClientError {
    ClientError::Api {
        status: 404,
        code: "not_found".into(),
        message: "no such file".into(),
    }
}

impl Fake {
    fn find(&self, path: &str) -> Result<&Node, ClientError> {
        let mut n = &self.root;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            let Node::Dir(_, children) = n else {
                return Err(not_found());
            };
            n = children
                .iter()
                .find(|(name, _)| name == part)
                .map(|(_, c)| c)
                .ok_or_else(not_found)?;
        }
        Ok(n)
    }
}

impl RemoteFiles for Fake {
    fn stat(&self, path: &str) -> impl Future<Output = Result<EntryInfo, ClientError>> + Send {
        let r = self.find(path).map(|n| info("ignored", path, n));
        async move { r }
    }
    fn list(&self, path: &str) -> impl Future<Output = Result<Vec<EntryInfo>, ClientError>> + Send {
        let r = self.find(path).and_then(|n| match n {
            Node::Dir(_, children) => Ok(children
                .iter()
                .map(|(name, c)| info(name, &format!("{path}/{name}"), c))
                .collect()),
            _ => Err(not_found()),
        });
        async move { r }
    }
    fn read(&self, path: &str) -> impl Future<Output = Result<ByteStream, ClientError>> + Send {
        let r = self.find(path).and_then(|n| match n {
            Node::File(_, Data::Bytes(b)) => {
                let chunk = bytes::Bytes::from(b.clone());
                Ok(Box::pin(futures::stream::iter([Ok(chunk)])) as ByteStream)
            }
            Node::File(_, Data::Endless) => Ok(Box::pin(futures::stream::repeat_with(|| {
                Ok(bytes::Bytes::from(vec![0u8; 64 * 1024]))
            })) as ByteStream),
            Node::File(_, Data::Stall) => Ok(Box::pin(futures::stream::pending()) as ByteStream),
            _ => Err(not_found()),
        });
        async move { r }
    }
}

/// A scratch area: `dst` (the destination directory, empty) and `outside` (a directory with
/// one file that no copy may touch).
struct Scratch {
    _tmp: tempfile::TempDir,
    dst: PathBuf,
    outside: PathBuf,
}

fn scratch() -> Scratch {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("dst");
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&dst).unwrap();
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("precious"), "untouched\n").unwrap();
    Scratch {
        _tmp: tmp,
        dst,
        outside,
    }
}

impl Scratch {
    fn outside_unchanged(&self) {
        let names: BTreeSet<_> = std::fs::read_dir(&self.outside)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, BTreeSet::from(["precious".to_owned()]));
        assert_eq!(
            std::fs::read_to_string(self.outside.join("precious")).unwrap(),
            "untouched\n"
        );
    }

    /// Every path below `dst`, relative, sorted (staging directories would show here).
    fn dst_tree(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![self.dst.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                out.push(p.strip_prefix(&self.dst).unwrap().display().to_string());
                if e.file_type().unwrap().is_dir() {
                    stack.push(p);
                }
            }
        }
        out.sort();
        out
    }
}

fn opts() -> DownloadOptions {
    DownloadOptions::default()
}

async fn get(fake: &Fake, src: &str, dst: &Path) -> Result<CopyReport> {
    download(fake, src, dst, &opts()).await
}

fn sandbox_root() -> Fake {
    Fake {
        root: dir(
            0o755,
            vec![
                ("zz_marker", file("marker\n")),
                ("linuxrc", Node::Link("bin/busybox".into())),
                ("var", dir(0o755, vec![("log", dir(0o755, vec![]))])),
                ("proc", Node::Mount),
                ("dev", dir(0o755, vec![("zero", Node::Special)])),
            ],
        ),
    }
}

#[tokio::test]
async fn root_goes_into_the_destination_in_every_spelling() {
    for src in ["/", "/.", "/..", "//", "/var/.."] {
        let s = scratch();
        let r = get(&sandbox_root(), src, &s.dst).await.unwrap();
        assert_eq!(
            s.dst_tree(),
            ["dev", "linuxrc", "var", "var/log", "zz_marker"],
            "{src}"
        );
        assert_eq!(
            std::fs::read_to_string(s.dst.join("zz_marker")).unwrap(),
            "marker\n"
        );
        assert_eq!(
            r.skipped,
            [
                ("/proc".to_owned(), "a mount point (another filesystem)"),
                ("/dev/zero".to_owned(), "a device, FIFO or socket"),
            ]
        );
        s.outside_unchanged();
    }
}

#[tokio::test]
async fn a_directory_goes_inside_an_existing_one_under_the_name_the_user_wrote() {
    let fake = Fake {
        root: dir(0o755, vec![("work", dir(0o755, vec![("a", file("A"))]))]),
    };
    let s = scratch();
    get(&fake, "/work/", &s.dst).await.unwrap();
    get(&fake, "/tmp/../work", &s.dst).await.unwrap(); // again: merges
    assert_eq!(s.dst_tree(), ["work", "work/a"]);
    // Onto a new name.
    get(&fake, "/work", &s.dst.join("renamed")).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(s.dst.join("renamed/a")).unwrap(),
        "A"
    );
    // Relative sandbox paths are refused before anything is asked.
    for bad in ["..", "work", "", "./x"] {
        let e = get(&fake, bad, &s.dst).await.unwrap_err();
        assert!(matches!(e, CopyError::NotAbsolute(_)), "{bad}: {e}");
    }
}

#[tokio::test]
async fn names_that_are_not_one_component_are_refused_and_nothing_is_left() {
    let long = "n".repeat(256);
    for name in ["..", ".", "a/b", "/etc", "x\0y", "", long.as_str()] {
        let s = scratch();
        let fake = in_w(vec![("ok", file("fine")), (name, file("pwned"))]);
        let e = get(&fake, "/w", &s.dst).await.unwrap_err();
        assert!(matches!(e, CopyError::Hostile { .. }), "{name:?}: {e}");
        assert!(s.dst_tree().is_empty(), "{name:?} left {:?}", s.dst_tree());
        s.outside_unchanged();
    }
}

#[tokio::test]
async fn a_symlink_the_same_copy_made_is_never_written_through() {
    let s = scratch();
    let outside = s.outside.display().to_string();
    // The daemon sends `x` as a symlink to the outside, then `x` again as a directory whose
    // file would land in the outside if the link were followed.
    let fake = in_w(vec![
        ("x", Node::Link(outside.clone())),
        ("x", dir(0o755, vec![("pwn", file("pwned"))])),
    ]);
    let e = get(&fake, "/w", &s.dst).await.unwrap_err();
    assert!(matches!(e, CopyError::Hostile { .. }), "{e}");
    assert!(s.dst_tree().is_empty());
    s.outside_unchanged();

    // A file sent twice is refused the same way (O_EXCL), not overwritten.
    let fake = in_w(vec![("f", file("one")), ("f", file("two"))]);
    assert!(matches!(
        get(&fake, "/w", &s.dst).await.unwrap_err(),
        CopyError::Hostile { .. }
    ));
    assert!(s.dst_tree().is_empty());
}

#[tokio::test]
async fn symlinks_are_recreated_as_links() {
    let s = scratch();
    let outside = s.outside.display().to_string();
    let fake = in_w(vec![
        ("abs", Node::Link(outside.clone())),
        ("up", Node::Link("../../../../etc".into())),
    ]);
    let r = get(&fake, "/w", &s.dst).await.unwrap();
    assert_eq!(r.symlinks, 2);
    assert_eq!(
        std::fs::read_link(s.dst.join("w/abs")).unwrap(),
        Path::new(&outside)
    );
    assert_eq!(
        std::fs::read_link(s.dst.join("w/up")).unwrap(),
        Path::new("../../../../etc")
    );
    // A top-level symlink is copied as a link too.
    get(&fake, "/w/abs", &s.dst.join("top")).await.unwrap();
    assert!(
        std::fs::symlink_metadata(s.dst.join("top"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    // A second copy merges: links there are replaced by the sandbox's, never followed.
    get(&fake, "/w", &s.dst).await.unwrap();
    s.outside_unchanged();
    // Empty or NUL link targets are refused.
    for t in ["", "a\0b"] {
        let fake = in_w(vec![("l", Node::Link(t.into()))]);
        let s = scratch();
        assert!(matches!(
            get(&fake, "/w", &s.dst).await.unwrap_err(),
            CopyError::Hostile { .. }
        ));
        assert!(s.dst_tree().is_empty());
    }
}

#[tokio::test]
async fn host_symlinks_at_the_destination_are_not_followed() {
    let s = scratch();
    let fake = Fake {
        root: dir(
            0o755,
            vec![
                ("w", dir(0o755, vec![("pwn", file("pwned"))])),
                ("f", file("new")),
            ],
        ),
    };
    // The destination itself is a symlink to a directory.
    let link = s.dst.join("link");
    std::os::unix::fs::symlink(&s.outside, &link).unwrap();
    for src in ["/w", "/f", "/."] {
        let e = get(&fake, src, &link).await.unwrap_err();
        assert!(matches!(e, CopyError::DestinationSymlink(_)), "{src}: {e}");
    }
    // The name the copy would take inside the destination is a symlink: a directory is not
    // merged through it.
    std::os::unix::fs::symlink(&s.outside, s.dst.join("w")).unwrap();
    let e = get(&fake, "/w", &s.dst).await.unwrap_err();
    assert!(matches!(e, CopyError::Conflict { .. }), "{e}");
    // A file replaces such a link (the link goes; its target stays as it was).
    std::os::unix::fs::symlink(s.outside.join("precious"), s.dst.join("f")).unwrap();
    get(&fake, "/f", &s.dst).await.unwrap();
    assert_eq!(std::fs::read_to_string(s.dst.join("f")).unwrap(), "new");
    assert!(
        !std::fs::symlink_metadata(s.dst.join("f"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    // And the same one level down, during a merge.
    std::fs::remove_file(s.dst.join("w")).unwrap();
    std::fs::create_dir(s.dst.join("w")).unwrap();
    std::os::unix::fs::symlink(s.outside.join("precious"), s.dst.join("w/pwn")).unwrap();
    get(&fake, "/w", &s.dst).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(s.dst.join("w/pwn")).unwrap(),
        "pwned"
    );
    s.outside_unchanged();
}

#[tokio::test]
async fn an_existing_hardlink_is_replaced_not_written_through() {
    let s = scratch();
    std::fs::create_dir(s.dst.join("w")).unwrap();
    std::fs::hard_link(s.outside.join("precious"), s.dst.join("w/f")).unwrap();
    std::fs::hard_link(s.outside.join("precious"), s.dst.join("g")).unwrap();
    let fake = Fake {
        root: dir(
            0o755,
            vec![
                ("w", dir(0o755, vec![("f", file("new"))])),
                ("g", file("new")),
            ],
        ),
    };
    get(&fake, "/w", &s.dst).await.unwrap();
    get(&fake, "/g", &s.dst).await.unwrap();
    get(&fake, "/g", &s.dst.join("g")).await.unwrap();
    for f in ["w/f", "g"] {
        let md = std::fs::metadata(s.dst.join(f)).unwrap();
        assert_eq!(
            (
                md.nlink(),
                std::fs::read_to_string(s.dst.join(f)).unwrap().as_str()
            ),
            (1, "new")
        );
    }
    s.outside_unchanged();
}

#[tokio::test]
async fn modes_are_masked_unless_preserved() {
    let fake = Fake {
        root: dir(
            0o755,
            vec![(
                "w",
                dir(
                    0o2775,
                    vec![
                        ("suid", Node::File(0o4755, Data::Bytes(b"x".to_vec()))),
                        ("sticky", dir(0o1777, vec![])),
                        (
                            "ro",
                            dir(0o555, vec![("inner", file("in a read-only dir"))]),
                        ),
                    ],
                ),
            )],
        ),
    };
    let mask = umask();
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
    let s = scratch();
    get(&fake, "/w", &s.dst).await.unwrap();
    assert_eq!(mode(&s.dst.join("w/suid")), 0o755 & !mask);
    assert_eq!(mode(&s.dst.join("w")), 0o775 & !mask);
    assert_eq!(mode(&s.dst.join("w/sticky")), 0o777 & !mask);
    assert_eq!(mode(&s.dst.join("w/ro")), 0o555 & !mask);
    assert_eq!(
        std::fs::read_to_string(s.dst.join("w/ro/inner")).unwrap(),
        "in a read-only dir"
    );

    let s = scratch();
    let preserve = DownloadOptions {
        preserve: true,
        ..opts()
    };
    download(&fake, "/w", &s.dst, &preserve).await.unwrap();
    // Permissions and sticky bits kept, set-id bits never.
    assert_eq!(mode(&s.dst.join("w/suid")), 0o755);
    assert_eq!(mode(&s.dst.join("w")), 0o775);
    assert_eq!(mode(&s.dst.join("w/sticky")), 0o1777);
    let mtime = std::fs::metadata(s.dst.join("w/suid")).unwrap().mtime();
    assert_eq!(mtime, 1_714_564_800);
}

#[tokio::test]
async fn special_files_are_refused_at_the_top_and_skipped_below() {
    let fake = Fake {
        root: dir(
            0o755,
            vec![
                ("fifo", Node::Special),
                (
                    "w",
                    dir(0o755, vec![("fifo", Node::Special), ("f", file("f"))]),
                ),
                ("sys", Node::Mount),
            ],
        ),
    };
    let s = scratch();
    let t = Instant::now();
    let e = get(&fake, "/fifo", &s.dst).await.unwrap_err();
    assert!(matches!(e, CopyError::Special(_)), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1));
    let r = get(&fake, "/w", &s.dst).await.unwrap();
    assert_eq!(s.dst_tree(), ["w", "w/f"]);
    // A mount point named as the source is copied (only those below it are skipped).
    let r2 = get(&fake, "/sys", &s.dst).await.unwrap();
    assert_eq!(s.dst_tree(), ["sys", "w", "w/f"]);
    assert_eq!(r2.dirs, 1);
    assert_eq!(
        r.skipped,
        [("/w/fifo".to_owned(), "a device, FIFO or socket")]
    );
    // A file onto a directory holding a directory of that name, and a tree onto a file.
    std::fs::create_dir(s.dst.join("f2")).unwrap();
    let fake2 = Fake {
        root: dir(0o755, vec![("f2", file("x")), ("d", dir(0o755, vec![]))]),
    };
    assert!(matches!(
        get(&fake2, "/f2", &s.dst).await.unwrap_err(),
        CopyError::Conflict { .. }
    ));
    assert!(matches!(
        get(&fake2, "/d", &s.dst.join("w/f")).await.unwrap_err(),
        CopyError::Conflict { .. }
    ));
    assert!(matches!(
        get(&fake2, "/f2/.", &s.dst).await.unwrap_err(),
        CopyError::NotADirectory(_)
    ));
}

#[tokio::test]
async fn a_file_that_never_ends_stops_at_the_bound_and_leaves_nothing() {
    let s = scratch();
    let fake = in_w(vec![
        ("a", file("first")),
        ("zero", Node::File(0o644, Data::Endless)),
    ]);
    let bounded = DownloadOptions {
        max_bytes: 4 << 20,
        ..opts()
    };
    let e = download(&fake, "/w", &s.dst, &bounded).await.unwrap_err();
    assert!(
        matches!(e, CopyError::TooLarge { max } if max == 4 << 20),
        "{e}"
    );
    assert!(s.dst_tree().is_empty(), "{:?}", s.dst_tree());
    // Onto an existing file: it stays as it was.
    std::fs::write(s.dst.join("keep"), "old").unwrap();
    let e = download(&fake, "/w/zero", &s.dst.join("keep"), &bounded)
        .await
        .unwrap_err();
    assert!(matches!(e, CopyError::TooLarge { .. }));
    assert_eq!(s.dst_tree(), ["keep"]);
    assert_eq!(std::fs::read_to_string(s.dst.join("keep")).unwrap(), "old");
}

#[tokio::test]
async fn many_empty_entries_count_against_the_bound() {
    let s = scratch();
    let children: Vec<(String, Node)> = (0..3000).map(|i| (format!("e{i}"), file(""))).collect();
    let fake = Fake {
        root: dir(0o755, vec![("w", Node::Dir(0o755, children))]),
    };
    let bounded = DownloadOptions {
        max_bytes: 1 << 20,
        ..opts()
    };
    let e = download(&fake, "/w", &s.dst, &bounded).await.unwrap_err();
    assert!(matches!(e, CopyError::TooLarge { .. }), "{e}");
    assert!(s.dst_tree().is_empty());
}

#[tokio::test]
async fn a_stalled_sandbox_is_given_up_on() {
    let s = scratch();
    let fake = in_w(vec![("slow", Node::File(0o644, Data::Stall))]);
    let quick = DownloadOptions {
        stall: Duration::from_millis(200),
        ..opts()
    };
    let e = download(&fake, "/w", &s.dst, &quick).await.unwrap_err();
    assert!(matches!(e, CopyError::Stalled { .. }), "{e}");
    assert!(s.dst_tree().is_empty());
}

#[tokio::test]
async fn a_tree_too_deep_is_refused() {
    let mut n = file("bottom");
    for _ in 0..MAX_DEPTH + 1 {
        n = Node::Dir(0o755, vec![("d".to_owned(), n)]);
    }
    let fake = Fake {
        root: dir(0o755, vec![("w", n)]),
    };
    let s = scratch();
    let e = get(&fake, "/w", &s.dst).await.unwrap_err();
    assert!(matches!(e, CopyError::TooDeep { .. }), "{e}");
    assert!(s.dst_tree().is_empty());
}

#[tokio::test]
async fn a_refused_merge_moves_nothing() {
    let s = scratch();
    std::fs::create_dir_all(s.dst.join("w")).unwrap();
    std::fs::write(s.dst.join("w/a"), "mine").unwrap();
    let fake = in_w(vec![
        ("a", dir(0o755, vec![])),
        ("b", file("new")),
        ("c", file("new")),
    ]);
    let e = get(&fake, "/w", &s.dst).await.unwrap_err();
    assert!(matches!(e, CopyError::Conflict { .. }), "{e}");
    assert_eq!(s.dst_tree(), ["w", "w/a"]);
    assert_eq!(std::fs::read_to_string(s.dst.join("w/a")).unwrap(), "mine");
}

/// A fake whose listing names an entry that is gone when it is read.
struct Vanishing(Fake);

impl RemoteFiles for Vanishing {
    fn stat(&self, path: &str) -> impl Future<Output = Result<EntryInfo, ClientError>> + Send {
        self.0.stat(path)
    }
    fn list(&self, path: &str) -> impl Future<Output = Result<Vec<EntryInfo>, ClientError>> + Send {
        let mut r = self.0.find(path).map(|_| Vec::new());
        if let Ok(v) = &mut r {
            v.push(info("gone", &format!("{path}/gone"), &file("")));
            v.push(info(
                "bad\u{fffd}name",
                &format!("{path}/bad"),
                &dir(0o755, vec![]),
            ));
            v.push(info("here", &format!("{path}/here"), &file("")));
        }
        async move { r }
    }
    fn read(&self, path: &str) -> impl Future<Output = Result<ByteStream, ClientError>> + Send {
        let r = if path.ends_with("/here") {
            Ok(
                Box::pin(futures::stream::iter([Ok(bytes::Bytes::from_static(
                    b"here",
                ))])) as ByteStream,
            )
        } else {
            Err(not_found())
        };
        async move { r }
    }
}

#[tokio::test]
async fn entries_gone_by_the_time_they_are_read_are_skipped_with_a_note() {
    let s = scratch();
    let fake = Vanishing(in_w(vec![]));
    let r = download(&fake, "/w", &s.dst, &opts()).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(s.dst.join("w/here")).unwrap(),
        "here"
    );
    assert!(!s.dst.join("w/gone").exists());
    assert_eq!(
        r.skipped,
        [
            ("/w/gone".to_owned(), "it vanished during the copy"),
            ("/w/bad\u{fffd}name".to_owned(), "its name is not UTF-8"),
        ]
    );
}
