//! `space top` against a real spaced: CPU % from the sandboxes' cgroups, memory, bad input.

use serde_json::Value;
use space_tests::Spaced;

fn row<'a>(rows: &'a [Value], id: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["id"] == id)
        .unwrap_or_else(|| panic!("no row for {id} in {rows:?}"))
}

#[test]
fn top_shows_the_busy_sandbox_busy_and_the_idle_one_idle() {
    let s = Spaced::start().unwrap();
    let busy = s.create(&[]);
    let idle = s.create(&[]);
    s.space_ok(&["exec", "-d", &busy, "--", "sh", "-c", "while :; do :; done"]);

    // The API reports CPU time that grows while the loop runs.
    let before = s.inspect(&busy)["cpu_usage_usec"].as_u64().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let after = s.inspect(&busy)["cpu_usage_usec"].as_u64().unwrap();
    assert!(
        after > before + 50_000,
        "cpu_usage_usec {before} -> {after}"
    );

    let out = s.space_ok(&["top", "--once", "--json", "--interval", "1"]);
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    let (b, i) = (row(&rows, &busy), row(&rows, &idle));
    let cpu = |r: &Value| r["cpu_percent"].as_f64().unwrap();
    assert!(cpu(b) > 20.0, "busy sandbox: {b}");
    assert!(cpu(i) < 20.0, "idle sandbox: {i}");
    for r in [b, i] {
        assert_eq!(r["state"], "running");
        assert!(r["memory_bytes"].as_u64().unwrap() > 0, "{r}");
    }
    // Busiest first.
    assert_eq!(rows[0]["id"], busy.as_str());

    // The table lists both, the busy one first.
    let table = s.space_ok(&["top", "--once", "--interval", "1"]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("CPU%"),
        "{table}"
    );
    assert!(lines[1].starts_with(&busy), "{table}");
    assert!(table.contains(&idle), "{table}");

    // A paused sandbox uses no CPU.
    s.space_ok(&["pause", &busy]);
    let out = s.space_ok(&["top", "--once", "--json", "--interval", "1"]);
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    let b = row(&rows, &busy);
    assert_eq!(b["state"], "paused");
    assert!(
        b["cpu_percent"].as_f64().is_none_or(|c| c < 5.0),
        "paused sandbox: {b}"
    );
    s.space_ok(&["rm", &busy, &idle]);
}

#[test]
fn top_refuses_bad_intervals() {
    let s = Spaced::start().unwrap();
    for bad in ["0", "3601", "soon"] {
        let out = s.space(&["top", "--once", "--interval", bad]);
        assert!(!out.status.success(), "--interval {bad} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--interval"), "--interval {bad}: {err}");
        assert!(out.stdout.is_empty());
    }
    let out = s.space(&["top", "--interval", "0"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 to 3600"));
}
