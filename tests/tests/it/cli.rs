//! The CLI end to end against a real spaced: create, exec, ls, inspect, cp, rm.

use std::io::Write;
use std::process::Stdio;

use serde_json::Value;
use sha2::{Digest, Sha256};
use space_tests::{Runtime, Spaced, on_each_runtime};

on_each_runtime! {
fn create_exec_inspect_rm(rt) {
    let s = Spaced::start_on(rt).unwrap();
    let id = s.create(&["--env", "GREETING=hi there", "--memory", "256"]);

    // stdout, stderr and exit codes come through unchanged.
    assert_eq!(s.space_ok(&["exec", &id, "--", "echo", "hello"]), "hello\n");
    let (code, out, err) = s.sh(&id, "echo out; echo err >&2; exit 7");
    assert_eq!((code, out.as_str(), err.as_str()), (7, "out\n", "err\n"));
    // A command killed by a signal exits 128+N, as a shell would report it.
    let (code, _, _) = s.sh(&id, "kill -9 $$");
    assert_eq!(code, 137);

    // Environment from create and from exec, cwd and user.
    let (_, out, _) = s.sh(&id, "echo $GREETING");
    assert_eq!(out, "hi there\n");
    let out = s.space_ok(&[
        "exec",
        &id,
        "--env",
        "X=1",
        "--cwd",
        "/tmp",
        "--",
        "sh",
        "-c",
        "echo $X; pwd",
    ]);
    assert_eq!(out, "1\n/tmp\n");
    let out = s.space_ok(&["exec", &id, "--user", "user", "--", "id", "-u"]);
    assert_eq!(out, "1000\n");
    // Root inside, PID 1 is the daemon, hostname is set.
    let (_, out, _) = s.sh(
        &id,
        "id -u; cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "0");
    // (A microvm's daemon is the initramfs's /init, decision 0014.)
    let daemon = match rt {
        Runtime::Namespace => "space-daemon",
        Runtime::Microvm => "/init",
    };
    assert!(lines[1].contains(daemon), "pid 1 is {}", lines[1]);
    assert!(!lines[2].is_empty());

    // ls and inspect agree.
    let ls: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    let list = ls
        .as_array()
        .or_else(|| ls["sandboxes"].as_array())
        .unwrap()
        .clone();
    assert!(list.iter().any(|sb| sb["id"] == id.as_str()));
    let plain = s.space_ok(&["ls"]);
    assert!(plain.contains(&id));
    let info: Value = serde_json::from_str(&s.space_ok(&["inspect", &id])).unwrap();
    assert_eq!(info["id"], id.as_str());
    assert_eq!(info["state"], "running");
    assert_eq!(info["template"], "minimal");
    assert_eq!(info["memory_mib"], 256);

    // --json create prints the whole sandbox.
    let created: Value = serde_json::from_str(&s.space_ok(&["create", "--json"])).unwrap();
    let id2 = created["id"].as_str().unwrap().to_string();
    assert_eq!(created["state"], "running");

    s.space_ok(&["rm", &id, &id2]);
    let out = s.space(&["exec", &id, "--", "true"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
    let out = s.space(&["inspect", &id]);
    assert_eq!(out.status.code(), Some(1));
}
}

on_each_runtime! {
fn cp_files_and_directories(rt) {
    let s = Spaced::start_on(rt).unwrap();
    let id = s.create(&[]);
    let work = tempfile::tempdir().unwrap();

    // A file in, then out again, byte-identical (larger than any chunk).
    let big: Vec<u8> = (0..24 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let src = work.path().join("big.bin");
    std::fs::write(&src, &big).unwrap();
    s.space_ok(&["cp", src.to_str().unwrap(), &format!("{id}:/tmp/big.bin")]);
    let (_, out, _) = s.sh(&id, "wc -c < /tmp/big.bin");
    assert_eq!(out.trim(), big.len().to_string());
    let back = work.path().join("back.bin");
    s.space_ok(&["cp", &format!("{id}:/tmp/big.bin"), back.to_str().unwrap()]);
    assert_eq!(
        Sha256::digest(std::fs::read(&back).unwrap()),
        Sha256::digest(&big),
        "file changed on the round trip"
    );

    // A directory tree in and out, with modes.
    let tree = work.path().join("tree");
    std::fs::create_dir_all(tree.join("a/b")).unwrap();
    std::fs::write(tree.join("top.txt"), "top\n").unwrap();
    std::fs::write(tree.join("a/b/deep.sh"), "#!/bin/sh\necho deep\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        tree.join("a/b/deep.sh"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    s.space_ok(&["cp", tree.to_str().unwrap(), &format!("{id}:/work")]);
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "/work/a/b/deep.sh"]),
        "deep\n"
    );
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "cat", "/work/top.txt"]),
        "top\n"
    );
    s.sh(&id, "echo made-inside > /work/a/new.txt");
    let out_dir = work.path().join("out");
    s.space_ok(&["cp", &format!("{id}:/work"), out_dir.to_str().unwrap()]);
    assert_eq!(
        std::fs::read_to_string(out_dir.join("a/new.txt")).unwrap(),
        "made-inside\n"
    );
    let mode = std::fs::metadata(out_dir.join("a/b/deep.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);

    // Bad paths: relative, missing, and a missing sandbox, each a clear error.
    let out = s.space(&["cp", src.to_str().unwrap(), &format!("{id}:relative/path")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("absolute"),
        "{:?}",
        out
    );
    let out = s.space(&[
        "cp",
        &format!("{id}:/nope/missing"),
        work.path().join("x").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
    let out = s.space(&["cp", src.to_str().unwrap(), "aaaaaaaaaaaaaaaaaaaa:/tmp/x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
}
}

on_each_runtime! {
fn stdin_tty_background_and_attach(rt) {
    let s = Spaced::start_on(rt).unwrap();
    let id = s.create(&[]);

    // -i forwards stdin until EOF.
    let mut child = s
        .cli()
        .args(["exec", "-i", &id, "--", "sh", "-c", "cat | tr a-z A-Z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"piped input\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "PIPED INPUT\n");

    // -t runs under a pseudo-terminal in the sandbox.
    let out = s.space_ok(&["exec", "-t", &id, "--", "sh", "-c", "tty; stty size"]);
    assert!(out.contains("/dev/pts/"), "tty output {out:?}");

    // -d starts in the background and prints the pid; the output stays attachable.
    let pid = s.space_ok(&[
        "exec",
        "-d",
        &id,
        "--",
        "sh",
        "-c",
        "echo one; sleep 0.3; echo two",
    ]);
    let pid = pid.trim().to_string();
    assert!(pid.parse::<u32>().is_ok(), "pid {pid:?}");
    let out = s.space_ok(&["attach", &id, &pid]);
    assert_eq!(out, "one\ntwo\n");
    // From an offset: exactly the bytes after it.
    let out = s.space_ok(&["attach", &id, &pid, "--offset", "4"]);
    assert_eq!(out, "two\n");
    let ps = s.space_ok(&["ps", &id]);
    assert!(ps.contains(&pid), "ps: {ps}");

    // kill stops a long-running background process.
    let pid = s
        .space_ok(&["exec", "-d", &id, "--", "sleep", "1000"])
        .trim()
        .to_string();
    s.space_ok(&["kill", &id, &pid]);
    let out = s.space(&["attach", &id, &pid]);
    assert_eq!(out.status.code(), Some(137), "{out:?}");

    // A command that is not there.
    let out = s.space(&["exec", &id, "--", "/no/such/binary"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{out:?}"
    );
}
}

#[test]
fn template_import_and_use() {
    let s = Spaced::start().unwrap();
    // A rootfs directory: the base template's busybox plus a marker file.
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/cat")).unwrap();
    std::fs::write(root.join("etc/marker"), "from my template\n").unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();

    s.space_ok(&["template", "import", "mytpl", root.to_str().unwrap()]);
    let ls = s.space_ok(&["template", "ls"]);
    assert!(
        ls.contains("mytpl") && ls.contains("minimal"),
        "template ls: {ls}"
    );
    let id = s.create(&["--template", "mytpl"]);
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "cat", "/etc/marker"]),
        "from my template\n"
    );

    // A tarball works too, and a second import is a new version (a taken name needs
    // --replace).
    let tarball = work.path().join("t.tar.gz");
    let st = std::process::Command::new("tar")
        .arg("-czf")
        .arg(&tarball)
        .arg("-C")
        .arg(&root)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    let out = s.space(&["template", "import", "mytpl", tarball.to_str().unwrap()]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--replace"),
        "{out:?}"
    );
    s.space_ok(&[
        "template",
        "import",
        "mytpl",
        tarball.to_str().unwrap(),
        "--replace",
    ]);
    let ls: Value = serde_json::from_str(&s.space_ok(&["template", "ls", "--json"])).unwrap();
    let list = ls
        .as_array()
        .or_else(|| ls["templates"].as_array())
        .unwrap()
        .clone();
    let mine = list.iter().find(|t| t["name"] == "mytpl").unwrap();
    assert_eq!(mine["version"], 2);

    // Bad input: a bad name, a missing path, a file that is not a tar archive.
    let out = s.space(&["template", "import", "Bad/Name", root.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let out = s.space(&["template", "import", "ok", "/no/such/dir"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let junk = work.path().join("junk.tar");
    std::fs::write(&junk, b"this is not a tar archive at all").unwrap();
    let out = s.space(&["template", "import", "junk", junk.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let out = s.space(&["create", "--template", "junk"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{out:?}"
    );
    // The sandbox made from the template is undisturbed.
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "cat", "/etc/marker"]),
        "from my template\n"
    );
}

/// `space node ls` and `space cluster status` (issue 14) against a real spaced: its one node
/// is this host, with this host's CPUs, and counts what it holds.
#[test]
fn node_ls_and_cluster_status_show_this_host() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let nodes: serde_json::Value =
        serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
    let node = &nodes["nodes"][0];
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    assert_eq!(node["name"], host.as_str());
    assert_eq!(node["state"], "ready");
    let cpus = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(node["cpus"].as_u64(), Some(cpus));
    assert!(node["memory_available_bytes"].as_u64().unwrap() > 0);
    assert_eq!(node["sandboxes"].as_u64(), Some(1));
    let sb: serde_json::Value = serde_json::from_str(&s.space_ok(&["inspect", &id])).unwrap();
    assert_eq!(node["allocated_memory_mib"], sb["memory_mib"]);
    let table = s.space_ok(&["node", "ls"]);
    assert!(
        table.starts_with("NAME") && table.contains(&host),
        "{table}"
    );
    let status = s.space_ok(&["cluster", "status"]);
    assert!(
        status.contains("nodes:      1 (1 ready)") && status.contains("1 running"),
        "{status}"
    );
}

/// `space template ls | head -0`: a reader that has gone away ends the command quietly with
/// the shell's SIGPIPE status, not a panic and a backtrace.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let s = Spaced::start().unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = s
        .cli()
        .args(["template", "ls"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(141), "{err}");
}
