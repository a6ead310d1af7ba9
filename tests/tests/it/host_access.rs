//! The node's trees are root's alone (issue 15, host side): another host user can list
//! nothing and read nothing of the data dir, the volume image, the store, the templates, the
//! sandboxes and their snapshots, or the run dir, even by a path it guessed; and a data dir
//! left with looser modes by an older spaced is tightened at the next start.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use space_tests::Spaced;

/// Runs `argv` as `nobody` (uid and gid 65534, no groups): (succeeded, stderr).
fn as_nobody(argv: &[&str]) -> (bool, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(argv)
        .output()
        .expect("setpriv (util-linux)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

fn first_entry(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .next()
        .unwrap_or_else(|| panic!("{} is empty", dir.display()))
        .path()
}

#[test]
fn another_host_user_reads_nothing_of_the_node() {
    let mut s = Spaced::start().unwrap();
    // The test's own temporary directory is 0700: open it up, so that only the node's modes
    // stand between `nobody` and its files.
    let data = s.data_dir();
    chmod(data.parent().unwrap(), 0o755);

    let id = s.create(&[]);
    assert_eq!(s.sh(&id, "echo secret > /root/secret").0, 0);
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    let vol = data.join("volume");
    let sandbox = vol.join("sandboxes").join(&id);
    let template = first_entry(&vol.join("templates/minimal"));
    let run = s.run_dir();
    let daemon_log = first_entry(&run.join("sandboxes")).join("daemon.log");
    let p = |p: &Path| p.to_str().unwrap().to_owned();
    let attempts: Vec<(&str, Vec<String>)> = vec![
        ("list the data dir", vec!["ls".into(), p(&data)]),
        (
            "read the store",
            vec!["cat".into(), p(&data.join("space.db"))],
        ),
        (
            "read the store's log",
            vec!["cat".into(), p(&data.join("space.db-wal"))],
        ),
        (
            "read the admin key",
            vec!["cat".into(), p(&data.join("admin.key"))],
        ),
        (
            "read the volume image",
            vec![
                "head".into(),
                "-c1".into(),
                p(&data.join("space-btrfs.img")),
            ],
        ),
        ("list the volume", vec!["ls".into(), p(&vol)]),
        (
            "list the templates",
            vec!["ls".into(), p(&vol.join("templates"))],
        ),
        (
            "read a template's file by its path",
            vec!["cat".into(), p(&template.join("rootfs/etc/passwd"))],
        ),
        (
            "list the sandboxes",
            vec!["ls".into(), p(&vol.join("sandboxes"))],
        ),
        (
            "read a sandbox's file by its path",
            vec!["cat".into(), p(&sandbox.join("rootfs/root/secret"))],
        ),
        (
            "read a snapshot's file by its path",
            vec![
                "cat".into(),
                p(&sandbox.join(format!("snapshots/{snap}/rootfs/root/secret"))),
            ],
        ),
        ("list the run dir", vec!["ls".into(), p(&run)]),
        ("read a daemon's log", vec!["cat".into(), p(&daemon_log)]),
    ];
    for (what, argv) in &attempts {
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        // Root can: the path is right, so nobody's failure is the modes' doing.
        let out = Command::new(argv[0]).args(&argv[1..]).output().unwrap();
        assert!(out.status.success(), "root could not {what}: {argv:?}");
        let (ok, err) = as_nobody(&argv);
        assert!(!ok, "another host user could {what}: {argv:?}");
        assert!(err.contains("Permission denied"), "{what}: {err}");
    }

    // An older spaced left them readable: the next start makes them private again, and the
    // sandbox runs on.
    s.stop().unwrap();
    for (path, m) in [
        (data.clone(), 0o755),
        (data.join("space.db"), 0o644),
        (data.join("space-btrfs.img"), 0o644),
        (vol.join("templates"), 0o755),
        (vol.join("sandboxes"), 0o755),
    ] {
        chmod(&path, m);
    }
    s.spawn().unwrap();
    assert_eq!(mode(&data), 0o711);
    assert_eq!(mode(&data.join("space.db")), 0o600);
    assert_eq!(mode(&data.join("space-btrfs.img")), 0o600);
    assert_eq!(mode(&vol), 0o711);
    assert_eq!(mode(&vol.join("templates")), 0o700);
    assert_eq!(mode(&vol.join("sandboxes")), 0o711);
    assert_eq!(s.sh(&id, "cat /root/secret").1, "secret\n");
    let (ok, _) = as_nobody(&["cat", &p(&data.join("space.db"))]);
    assert!(!ok);
}
