//! Template versions: show and remove (issue 12 item 6), refused while sandboxes or a warm
//! pool use them.

use space_tests::Spaced;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn versions_are_shown_and_removed_unless_in_use() {
    let s = Spaced::start().unwrap();
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/cat")).unwrap();
    let r = root.to_str().unwrap();
    s.space_ok(&["template", "import", "t", r]);
    std::fs::write(root.join("v2"), "two\n").unwrap();
    s.space_ok(&["template", "import", "t", r, "--replace"]);

    let show: serde_json::Value =
        serde_json::from_str(&s.space_ok(&["template", "show", "t", "--json"])).unwrap();
    let versions = show["versions"].as_array().unwrap();
    assert_eq!(versions.len(), 2, "{show}");
    assert!(
        versions[0]["source"].as_str().unwrap().starts_with("tar:"),
        "{show}"
    );
    let table = s.space_ok(&["template", "show", "t"]);
    assert!(
        table.contains("VERSION") && table.lines().count() == 4,
        "{table}"
    );

    // In use: refused, naming the sandbox; the old version is not in use.
    let id = s.create(&["--template", "t"]);
    let out = s.space(&["template", "rm", "t"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("used by 1 sandbox") && err.contains(&id),
        "{err}"
    );
    assert_eq!(
        s.space_ok(&["template", "rm", "t", "--version", "1"])
            .trim(),
        "removed t version 1"
    );
    assert_eq!(
        s.sh(&id, "cat /v2").1,
        "two\n",
        "the sandbox is undisturbed"
    );
    s.space_ok(&["rm", &id]);
    assert_eq!(
        s.space_ok(&["template", "rm", "t"]).trim(),
        "removed t version 2"
    );
    let out = s.space(&["template", "show", "t"]);
    assert!(
        text(&out.stderr).contains("not_found"),
        "{}",
        text(&out.stderr)
    );
    assert!(!s.data_dir().join("volume/templates/t").exists());

    // A template with a warm pool keeps its newest version.
    let out = s.space(&["template", "rm", "minimal"]);
    assert!(
        text(&out.stderr).contains("warm pool"),
        "{}",
        text(&out.stderr)
    );
    // Bad input.
    for (args, want) in [
        (vec!["template", "rm", "nope"], "not_found"),
        (
            vec!["template", "rm", "minimal", "--version", "99"],
            "not_found",
        ),
        (vec!["template", "rm", "space-build-x"], "builder's own"),
        (vec!["template", "show", "space-build-x"], "not_found"),
    ] {
        let out = s.space(&args);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains(want),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn start_and_ready_commands_run_before_a_create_answers() {
    let s = Spaced::start().unwrap();
    // A server (busybox httpd) that takes a second to come up.
    let out = s.space_ok(&[
        "template",
        "set",
        "minimal",
        "--start-cmd",
        "mkdir -p /srv && echo served > /srv/index.html && sleep 1 && exec httpd -f -p 8000 -h /srv",
        "--ready-cmd",
        "wget -q -O /dev/null http://127.0.0.1:8000/",
    ]);
    assert!(out.contains("minimal version 2"), "{out}");
    let show: serde_json::Value =
        serde_json::from_str(&s.space_ok(&["template", "show", "minimal", "--json"])).unwrap();
    assert_eq!(show["versions"].as_array().unwrap().len(), 2, "{show}");

    // Cold and pooled creates alike answer with the server up.
    for _ in 0..3 {
        let id = s.create(&["--template", "minimal"]);
        let (code, out, err) = s.sh(&id, "wget -q -O- http://127.0.0.1:8000/");
        assert_eq!((code, out.as_str()), (0, "served\n"), "{err}");
        let ps = s.space_ok(&["ps", &id]);
        assert!(
            ps.contains("start"),
            "the start command is a process of the sandbox: {ps}"
        );
    }

    // A ready command that never succeeds fails the create, saying so.
    s.space_ok(&[
        "template",
        "set",
        "minimal",
        "--start-cmd",
        "none",
        "--ready-cmd",
        "echo not yet; false",
        "--ready-timeout",
        "2",
    ]);
    let out = s.space(&["create", "--template", "minimal"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("ready command") && err.contains("within 2 s") && err.contains("not yet"),
        "{err}"
    );
    // Clearing both makes a plain template again.
    s.space_ok(&[
        "template",
        "set",
        "minimal",
        "--start-cmd",
        "none",
        "--ready-cmd",
        "none",
    ]);
    let id = s.create(&["--template", "minimal"]);
    assert_eq!(s.sh(&id, "echo ok").1, "ok\n");
}
