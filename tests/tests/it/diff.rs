//! Change tracking: `space diff` lists exactly what a step added, modified and deleted,
//! between two snapshots, or between the sandbox's creation and its live filesystem.

use serde_json::Value;
use space_tests::Spaced;

fn diff_lines(s: &Spaced, args: &[&str]) -> Vec<String> {
    let mut all = vec!["diff"];
    all.extend_from_slice(args);
    let mut lines: Vec<String> = s.space_ok(&all).lines().map(String::from).collect();
    lines.sort();
    lines
}

#[test]
fn diff_between_snapshots_and_live() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let (code, _, err) = s.sh(
        &id,
        "mkdir -p /root/proj/src /root/old && echo a > /root/proj/keep.txt && \
         echo b > /root/proj/change.txt && echo c > /root/proj/gone.txt && \
         echo d > /root/old/inner.txt && for i in $(seq 1 300); do echo $i > /root/proj/src/f$i; done",
    );
    assert_eq!(code, 0, "{err}");
    let a = s.space_ok(&["snapshot", &id]).trim().to_string();
    let (code, _, err) = s.sh(
        &id,
        "echo changed >> /root/proj/change.txt && rm /root/proj/gone.txt && \
         echo new > /root/proj/new.txt && rm -r /root/old && ln -s keep.txt /root/proj/link",
    );
    assert_eq!(code, 0, "{err}");
    let b = s.space_ok(&["snapshot", &id]).trim().to_string();

    let lines = diff_lines(&s, &[&id, &a, &b]);
    let expected = [
        "A /root/proj/link",
        "A /root/proj/new.txt",
        "D /root/old",
        "D /root/old/inner.txt",
        "M /root/proj/change.txt",
        "D /root/proj/gone.txt",
    ];
    // Exactly these: unchanged files never show up, however many there are, and a directory
    // is not listed just because its entries changed.
    let mut expected: Vec<&str> = expected.to_vec();
    expected.sort();
    assert_eq!(lines, expected);

    // The same pair through the API, as JSON.
    let json: Value = serde_json::from_str(&s.space_ok(&["diff", &id, &a, &b, "--json"])).unwrap();
    let changes = json
        .as_array()
        .or_else(|| json["changes"].as_array())
        .expect("a list of changes")
        .clone();
    assert_eq!(changes.len(), lines.len());

    // Creation -> live: everything written since the sandbox was made.
    s.sh(&id, "echo live > /root/live.txt");
    let lines = diff_lines(&s, &[&id]);
    assert!(lines.iter().any(|l| l == "A /root/live.txt"), "{lines:?}");
    assert!(
        lines.iter().any(|l| l == "A /root/proj/src/f300"),
        "{lines:?}"
    );
    // Snapshot -> live.
    let lines = diff_lines(&s, &[&id, &b]);
    assert!(lines.iter().any(|l| l == "A /root/live.txt"), "{lines:?}");
    assert!(
        !lines.iter().any(|l| l.contains("/root/proj/")),
        "{lines:?}"
    );

    // Bad input: unknown snapshot, another sandbox's snapshot, unknown sandbox.
    let other = s.create(&[]);
    let foreign = s.space_ok(&["snapshot", &other]).trim().to_string();
    let out = s.space(&["diff", &id, "zzzzzzzzzzzzzzzzzzzz"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{out:?}"
    );
    let out = s.space(&["diff", &id, &foreign]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid_argument"),
        "{out:?}"
    );
    let out = s.space(&["diff", "zzzzzzzzzzzzzzzzzzzz"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not_found"),
        "{out:?}"
    );
}
