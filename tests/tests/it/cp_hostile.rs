//! Host-side copies against a sandbox that plants a hostile tree (docs/THREAT_MODEL.md,
//! "Host-side copies"). Every CLI call runs in a bwrap root where the whole host is read-only
//! except the test's scratch directory, so that a regression fails the test instead of writing
//! into this machine's `/`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use space_tests::Spaced;

/// A scratch directory (the only writable place in the jail) and a file outside every copy.
struct Jail {
    dir: tempfile::TempDir,
}

impl Jail {
    fn new() -> Jail {
        let dir = tempfile::Builder::new()
            .prefix("space-cp-")
            .tempdir_in("/var/tmp")
            .unwrap();
        std::fs::create_dir(dir.path().join("outside")).unwrap();
        std::fs::write(dir.path().join("outside/precious"), "untouched\n").unwrap();
        Jail { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// `space ARGS` with the host's root read-only.
    fn space(&self, s: &Spaced, args: &[&str]) -> Output {
        let scratch = self.dir.path().to_str().unwrap();
        let cli = space_tests::bin_dir().join("space");
        let mut cmd = Command::new("bwrap");
        cmd.args(["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"])
            .args([
                "--bind",
                scratch,
                scratch,
                "--chdir",
                scratch,
                "--die-with-parent",
            ])
            .arg("--")
            .arg(cli)
            .args(args)
            .env("SPACE_URL", &s.url)
            .env("SPACE_API_KEY", &s.key)
            .stdin(Stdio::null());
        cmd.output().expect("run bwrap")
    }

    fn space_ok(&self, s: &Spaced, args: &[&str]) -> String {
        let out = self.space(s, args);
        assert!(
            out.status.success(),
            "space {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    fn space_err(&self, s: &Spaced, args: &[&str]) -> String {
        let out = self.space(s, args);
        assert!(!out.status.success(), "space {args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    fn outside_unchanged(&self) {
        let names: Vec<_> = std::fs::read_dir(self.path("outside"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["precious"]);
        assert_eq!(
            std::fs::read_to_string(self.path("outside/precious")).unwrap(),
            "untouched\n"
        );
    }

    /// Names in `dir` (a staging directory left behind would show here).
    fn names(&self, dir: &str) -> Vec<String> {
        let mut v: Vec<_> = std::fs::read_dir(self.path(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

fn sh_ok(s: &Spaced, id: &str, script: &str) {
    let (code, _, err) = s.sh(id, script);
    assert_eq!(code, 0, "{script}: {err}");
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_jail_keeps_the_hosts_root_read_only() {
    // The safety net itself: a write to / from inside the jail fails.
    let jail = Jail::new();
    let out = Command::new("bwrap")
        .args(["--ro-bind", "/", "/", "--dev", "/dev", "--"])
        .args(["sh", "-c", "echo x > /zz_jail_probe"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!Path::new("/zz_jail_probe").exists());
    drop(jail);
}

#[test]
fn downloads_stay_inside_the_destination() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let jail = Jail::new();
    sh_ok(
        &s,
        &id,
        "echo marker > /zz_marker; mkdir -p /w/sub; echo a > /w/sub/a; \
         ln -s / /w/root; ln -s /etc/passwd /w/pw; ln -s ../../../../../../tmp /w/up; \
         echo one > /w/h1; ln /w/h1 /w/h2; \
         printf x > \"$(printf '/w/new\\nline')\"; printf x > \"$(printf '/w/bad\\377name')\"",
    );

    // The reported case: ID:/ onto a directory copies the sandbox's root *into* it. The
    // pseudo filesystems (/proc, /sys, /dev) are mount points: skipped, with a note.
    std::fs::create_dir(jail.path("rootcopy")).unwrap();
    let err = jail.space_ok(&s, &["cp", &format!("{id}:/"), "rootcopy"]);
    assert_eq!(
        std::fs::read_to_string(jail.path("rootcopy/zz_marker")).unwrap(),
        "marker\n"
    );
    assert!(jail.path("rootcopy/w/sub/a").exists());
    assert!(!Path::new("/zz_marker").exists());
    assert!(err.contains("skipped /proc: a mount point"), "{err}");
    assert!(!jail.path("rootcopy/proc/self").exists());
    // The other spellings of the root, and a relative one.
    for (src, dst) in [("/.", "r2"), ("/w/..", "r3")] {
        std::fs::create_dir(jail.path(dst)).unwrap();
        jail.space_ok(&s, &["cp", &format!("{id}:{src}"), dst]);
        assert!(jail.path(dst).join("zz_marker").exists(), "{src}");
    }
    let err = jail.space_err(&s, &["cp", &format!("{id}:.."), "r4"]);
    assert!(err.contains("absolute"), "{err}");
    assert!(!jail.path("r4").exists());

    // Symlinks arrive as links and are not followed; hardlinks arrive as separate files; a
    // newline in a name is kept, a name that is not UTF-8 is skipped with a note.
    let err = jail.space_ok(&s, &["cp", &format!("{id}:/w"), "."]);
    assert_eq!(
        std::fs::read_link(jail.path("w/root")).unwrap(),
        Path::new("/")
    );
    assert_eq!(
        std::fs::read_link(jail.path("w/up")).unwrap(),
        Path::new("../../../../../../tmp")
    );
    for h in ["w/h1", "w/h2"] {
        let md = std::fs::metadata(jail.path(h)).unwrap();
        assert_eq!(md.nlink(), 1, "{h}");
    }
    assert!(jail.path("w/new\nline").exists());
    assert!(err.contains("not UTF-8"), "{err}");

    // A destination that is a symlink is refused, and so is merging a directory through one.
    std::os::unix::fs::symlink(jail.path("outside"), jail.path("dstlink")).unwrap();
    let err = jail.space_err(&s, &["cp", &format!("{id}:/w"), "dstlink"]);
    assert!(err.contains("symlink"), "{err}");
    std::fs::create_dir(jail.path("d2")).unwrap();
    std::os::unix::fs::symlink(jail.path("outside"), jail.path("d2/sub")).unwrap();
    let err = jail.space_err(&s, &["cp", &format!("{id}:/w/sub"), "d2"]);
    assert!(err.contains("cannot overwrite symlink"), "{err}");
    // A host hardlink (or symlink) where a file lands is replaced, not written through.
    std::fs::remove_file(jail.path("w/h1")).unwrap();
    std::fs::hard_link(jail.path("outside/precious"), jail.path("w/h1")).unwrap();
    std::fs::remove_file(jail.path("w/pw")).unwrap();
    std::fs::write(jail.path("w/pw"), "host file\n").unwrap();
    std::fs::remove_file(jail.path("w/h2")).unwrap();
    std::os::unix::fs::symlink(jail.path("outside/precious"), jail.path("w/h2")).unwrap();
    jail.space_ok(&s, &["cp", &format!("{id}:/w"), "."]);
    assert_eq!(std::fs::read_to_string(jail.path("w/h1")).unwrap(), "one\n");
    assert_eq!(std::fs::read_to_string(jail.path("w/h2")).unwrap(), "one\n");
    assert_eq!(
        std::fs::read_link(jail.path("w/pw")).unwrap(),
        Path::new("/etc/passwd")
    );
    jail.outside_unchanged();
}

#[test]
fn downloads_mask_modes_refuse_specials_and_are_bounded() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let jail = Jail::new();
    sh_ok(
        &s,
        &id,
        "mkdir -p /m/sg && echo x > /m/suid && chmod 4755 /m/suid && chmod 2775 /m/sg && \
         mkfifo /m/fifo && mkdir -p /big && echo a > /big/a && truncate -s 1099511627776 /big/huge",
    );

    // Set-id bits and the FIFO do not arrive; --preserve keeps the permission bits, never set-id.
    let err = jail.space_ok(&s, &["cp", &format!("{id}:/m"), "plain"]);
    let umask = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .map(|v| u32::from_str_radix(v.trim(), 8).unwrap())
        .unwrap();
    assert_eq!(mode(&jail.path("plain/suid")), 0o755 & !umask);
    assert_eq!(mode(&jail.path("plain/sg")), 0o775 & !umask);
    assert!(!jail.path("plain/fifo").exists());
    assert!(
        err.contains("skipped /m/fifo: a device, FIFO or socket"),
        "{err}"
    );
    jail.space_ok(&s, &["cp", "-p", &format!("{id}:/m"), "kept"]);
    assert_eq!(mode(&jail.path("kept/suid")), 0o755);
    assert_eq!(mode(&jail.path("kept/sg")), 0o775);

    // A FIFO or a device named directly is refused with a clear error, quickly.
    for special in ["/m/fifo", "/dev/zero"] {
        let t = Instant::now();
        let err = jail.space_err(&s, &["cp", &format!("{id}:{special}"), "sp"]);
        assert!(err.contains("device, FIFO or socket"), "{special}: {err}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{special} took {:?}",
            t.elapsed()
        );
        assert!(!jail.path("sp").exists());
    }
    // The daemon itself refuses to read one, rather than blocking on the FIFO.
    let t = Instant::now();
    let resp = s
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/m/fifo"),
        )
        .send();
    let resp = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(resp)
        .unwrap();
    assert_eq!(resp.status(), 412, "{resp:?}");
    assert!(t.elapsed() < Duration::from_secs(10));

    // A file that (nearly) never ends stops at --max-bytes; nothing is left behind, and a
    // file already there stays as it was.
    let err = jail.space_err(&s, &["cp", "--max-bytes", "8M", &format!("{id}:/big"), "."]);
    assert!(
        err.contains("larger than its bound of 8388608 bytes"),
        "{err}"
    );
    std::fs::write(jail.path("huge"), "old").unwrap();
    jail.space_err(
        &s,
        &[
            "cp",
            "--max-bytes",
            "8M",
            &format!("{id}:/big/huge"),
            "huge",
        ],
    );
    assert_eq!(std::fs::read_to_string(jail.path("huge")).unwrap(), "old");
    assert_eq!(
        jail.names("."),
        ["huge", "kept", "outside", "plain"],
        "a failed copy left something"
    );
    // A bad size is refused before anything happens.
    let err = jail.space_err(
        &s,
        &["cp", "--max-bytes", "lots", &format!("{id}:/big"), "."],
    );
    assert!(err.contains("not a size"), "{err}");
    jail.outside_unchanged();
}

#[test]
fn uploads_do_not_follow_symlinks_out_of_the_source() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let jail = Jail::new();
    let tree = jail.path("tree");
    std::fs::create_dir(&tree).unwrap();
    std::fs::write(tree.join("f"), "in the tree\n").unwrap();
    std::os::unix::fs::symlink(jail.path("outside"), tree.join("out_dir")).unwrap();
    std::os::unix::fs::symlink(jail.path("outside/precious"), tree.join("out_file")).unwrap();
    std::os::unix::fs::symlink(".", tree.join("loop")).unwrap();

    let err = jail.space_ok(&s, &["cp", "tree", &format!("{id}:/up")]);
    assert!(
        err.contains("out_file: a symlink (-L follows them)"),
        "{err}"
    );
    let (_, out, _) = s.sh(&id, "ls -a /up");
    assert_eq!(out, ".\n..\nf\n");
    // -L follows them when asked; a loop is entered once, not forever.
    let err = jail.space_ok(&s, &["cp", "-L", "tree", &format!("{id}:/up2")]);
    assert!(err.contains("a symlink loop"), "{err}");
    let (_, out, _) = s.sh(&id, "cat /up2/out_file /up2/out_dir/precious");
    assert_eq!(out, "untouched\n".repeat(2));
    // A FIFO named as the source is refused before any byte moves.
    let st = Command::new("mkfifo")
        .arg(jail.path("fifo"))
        .status()
        .unwrap();
    assert!(st.success());
    let err = jail.space_err(&s, &["cp", "fifo", &format!("{id}:/fifo")]);
    assert!(err.contains("not a regular file or directory"), "{err}");
}
