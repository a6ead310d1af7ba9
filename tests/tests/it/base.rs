//! The Debian `base` template (issue 12, decision 0016): a real userland whose default user
//! is `user`, where an agent's first commands work. Needs the machine's base rootfs cache
//! (scripts/test builds it; SPACE_REQUIRE_BASE=1 there makes its absence a failure).

use space_tests::Spaced;

fn sh_ok(s: &Spaced, args: &[&str], script: &str) -> String {
    let mut all = vec!["exec"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "bash", "-c", script]);
    s.space_ok(&all)
}

#[test]
fn base_is_debian_with_user_python_node_and_git() {
    let Some(s) = Spaced::start_with_base(&["--warm-pool", "1:2"]) else {
        return;
    };
    // How long the import of the cache into this fresh data dir took (spaced's own log).
    let log = std::fs::read_to_string(s.log_path()).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("imported the Debian base template"))
        .unwrap_or_else(|| panic!("no import in the log:\n{}", s.log_tail()));
    eprintln!("base import: {line}");

    let id = s.create(&[]);
    let info = s.inspect(&id);
    assert_eq!(info["template"], "base");
    assert!(
        s.space_ok(&["exec", &id, "--", "cat", "/etc/debian_version"])
            .starts_with("12.")
    );

    // `user` by default, with a login shell's environment; root on request.
    let out = sh_ok(
        &s,
        &[&id],
        "id -un; id -u; echo $HOME; echo $LANG; echo $PATH; pwd",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..4],
        ["user", "1000", "/home/user", "C.UTF-8"],
        "{out}"
    );
    assert!(lines[4].starts_with("/home/user/.local/bin:"), "{out}");
    assert_eq!(lines[5], "/home/user", "{out}");
    assert_eq!(
        s.space_ok(&["exec", &id, "--user", "root", "--", "id", "-u"]),
        "0\n"
    );

    // The tools an agent reaches for first, and passwordless sudo (isolation.rs tries to
    // break out through it).
    let tools = sh_ok(
        &s,
        &[&id],
        "set -e; bash --version | head -1; python3 -V; pip --version; python3 -m venv --help >/dev/null; \
         node --version; npm --version; git --version; curl --version | head -1; less --version | head -1; \
         unzip -v | head -1; tar --version | head -1; ip -V; ps --version; \
         test \"$(sudo -n id -un)\" = root && echo sudo-works",
    );
    for want in [
        "GNU bash",
        "Python 3.11",
        "pip ",
        "v18",
        "git version",
        "curl ",
        "iproute2",
        "procps",
        "sudo-works",
    ] {
        assert!(tools.contains(want), "{want} missing from:\n{tools}");
    }

    // pip and npm install for the default user, without root and without an "externally
    // managed environment" refusal (offline: local packages; the sandbox has no internet here).
    let out = sh_ok(
        &s,
        &[&id],
        "set -e; mkdir -p /tmp/pkg/hello_space && cd /tmp/pkg && \
         printf 'X = 42\\n' > hello_space/__init__.py && \
         printf '[project]\\nname = \"hello-space\"\\nversion = \"1.0\"\\n[build-system]\\nrequires = [\"setuptools\"]\\nbuild-backend = \"setuptools.build_meta\"\\n' > pyproject.toml && \
         pip install -q --no-index --no-build-isolation /tmp/pkg 2>&1 && python3 -c 'import hello_space; print(hello_space.X)'",
    );
    assert!(out.ends_with("42\n"), "{out}");
    let out = sh_ok(
        &s,
        &[&id],
        "set -e; mkdir -p /tmp/npkg && cd /tmp/npkg && \
         printf '{\"name\":\"hello-space\",\"version\":\"1.0.0\",\"bin\":{\"hello-space\":\"cli.js\"}}' > package.json && \
         printf '#!/usr/bin/env node\\nconsole.log(\"hi from npm\")\\n' > cli.js && \
         npm install -g --offline --no-audit --no-fund --no-update-notifier /tmp/npkg >/dev/null 2>&1 && hello-space",
    );
    assert_eq!(out, "hi from npm\n");

    // dpkg, as root through sudo, installs a package under the namespace boundary's
    // capabilities and syscalls (decision 0041): chown, set-id bits, renames, fsync.
    let out = sh_ok(
        &s,
        &[&id],
        "set -e; d=/tmp/deb; mkdir -p $d/DEBIAN $d/usr/local/bin; \
         printf 'Package: hello-deb\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: t <t@t>\\nDescription: t\\n' > $d/DEBIAN/control; \
         printf '#!/bin/sh\\necho hi from dpkg\\n' > $d/usr/local/bin/hello-deb; chmod 755 $d/usr/local/bin/hello-deb; \
         dpkg-deb --root-owner-group --build $d /tmp/hello.deb >/dev/null; \
         sudo -n dpkg -i /tmp/hello.deb >/dev/null; hello-deb; dpkg-query -W -f='${Status}' hello-deb",
    );
    assert_eq!(out, "hi from dpkg\ninstall ok installed");

    // Files written through the API belong to the default user.
    let work = tempfile::tempdir().unwrap();
    let f = work.path().join("in.txt");
    std::fs::write(&f, "x").unwrap();
    s.space_ok(&[
        "cp",
        f.to_str().unwrap(),
        &format!("{id}:/home/user/in.txt"),
    ]);
    assert_eq!(sh_ok(&s, &[&id], "stat -c %U /home/user/in.txt"), "user\n");

    // A template made of a snapshot of this sandbox keeps base's defaults and the files.
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    s.space_ok(&["template", "from-snapshot", "mybase", &id, &snap]);
    let child = s.create(&["--template", "mybase"]);
    assert_eq!(
        sh_ok(&s, &[&child], "id -un; cat /home/user/in.txt; hello-space"),
        "user\nxhi from npm\n"
    );

    // `minimal` is still there by name.
    let small = s.create(&["--template", "minimal"]);
    assert!(
        s.space_ok(&["exec", &small, "--", "ls", "-l", "/bin/sh"])
            .contains("busybox")
    );
    assert_eq!(s.space_ok(&["exec", &small, "--", "id", "-u"]), "0\n");
}

#[test]
fn a_node_without_the_cache_says_how_to_build_base() {
    // The harness's default: no cache; creates name `minimal` unless told otherwise.
    let s = Spaced::start().unwrap();
    let out = s.space(&["create", "--template", "base"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("scripts/up") && err.contains("mmdebstrap"),
        "{err}"
    );
    // Nothing was left behind.
    assert!(s.user_sandbox_dirs().is_empty());
}
