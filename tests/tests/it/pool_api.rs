//! Warm pools (decision 0013) against a real spaced, through the CLI and the REST API:
//! `--warm-pool`, set/get/ls round trips, sizes kept across a restart, a create served from
//! the pool, bad input and clamping to the node's capacity.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use space_tests::Spaced;

/// `space pool ls --json`: the pools, by template.
fn pools(s: &Spaced) -> Vec<Value> {
    let v: Value =
        serde_json::from_str(&s.space_ok(&["pool", "ls", "--json"])).expect("pool ls prints JSON");
    v["pools"].as_array().cloned().expect("a pools array")
}

fn pool_of<'a>(list: &'a [Value], template: &str) -> Option<&'a Value> {
    list.iter().find(|p| p["template"] == template)
}

/// Polls `space pool ls --json` until `ok` holds for the pool of `template` (the start-up
/// restore and the pool's refills run in the background).
fn wait_pool(s: &Spaced, template: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let list = pools(s);
        if let Some(p) = pool_of(&list, template)
            && ok(p)
        {
            return p.clone();
        }
        assert!(
            Instant::now() < deadline,
            "pool of {template}: {what} never held: {list:?}\nspaced log:\n{}",
            s.log_tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn sizes(p: &Value) -> (u64, u64) {
    (p["min"].as_u64().unwrap(), p["max"].as_u64().unwrap())
}

#[test]
fn pools_round_trip_through_cli_and_api_and_survive_a_restart() {
    let mut s = Spaced::start_with(&["--warm-pool", "1:2"]).unwrap();

    // The --warm-pool default reaches base at start.
    let p = wait_pool(&s, "minimal", "the default 1:2", |p| sizes(p) == (1, 2));
    assert_eq!(p["runtime"], "namespace");
    let got: Value =
        serde_json::from_str(&s.space_ok(&["pool", "get", "minimal", "--json"])).unwrap();
    assert_eq!(sizes(&got), (1, 2));

    // The pool fills, and a create takes a sandbox from it.
    wait_pool(&s, "minimal", "a ready sandbox", |p| {
        p["ready"].as_u64() >= Some(1)
    });
    let id = s.create(&[]);
    let sb = s.inspect(&id);
    assert_eq!(sb["pooled"], true, "{sb}");
    assert_eq!(sb["state"], "running");
    let (code, out, _) = s.sh(&id, "echo pooled-ok");
    assert_eq!((code, out.trim()), (0, "pooled-ok"));
    let p = wait_pool(&s, "minimal", "a hit", |p| p["hits"].as_u64() >= Some(1));
    assert!(p["misses"].as_u64().is_some(), "{p}");
    s.space_ok(&["rm", &id]);

    // Set through the CLI, read through the API.
    let out = s
        .cli()
        .args([
            "pool", "set", "minimal", "--min", "2", "--max", "3", "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "no warning expected: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let set: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(sizes(&set), (2, 3));
    assert!(set.get("warning").is_none(), "{set}");
    let (code, body) = s.call(Method::GET, "/v1/templates/minimal/pool", None);
    assert_eq!(code, 200, "{body}");
    assert_eq!(sizes(&body), (2, 3));

    // Set through the API (max defaults to min), read through the CLI table.
    let (code, body) = s.call(
        Method::PUT,
        "/v1/templates/minimal/pool",
        Some(json!({"min": 2})),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(sizes(&body), (2, 2));
    let table = s.space_ok(&["pool", "ls"]);
    let lines: Vec<&str> = table.lines().collect();
    let head: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        head,
        [
            "TEMPLATE", "RUNTIME", "MIN", "MAX", "TARGET", "READY", "STARTING", "HITS", "MISSES"
        ],
        "{table}"
    );
    let base: Vec<&str> = lines
        .iter()
        .find(|l| l.starts_with("minimal "))
        .unwrap_or_else(|| panic!("no minimal line: {table}"))
        .split_whitespace()
        .collect();
    assert_eq!(&base[..4], ["minimal", "namespace", "2", "2"], "{table}");
    let (code, body) = s.call(Method::GET, "/v1/pools", None);
    assert_eq!(code, 200);
    assert_eq!(
        sizes(pool_of(body["pools"].as_array().unwrap(), "minimal").unwrap()),
        (2, 2)
    );

    // The stored sizes beat the --warm-pool default after a restart.
    s.stop().unwrap();
    s.spawn().unwrap();
    wait_pool(&s, "minimal", "the stored 2:2", |p| sizes(p) == (2, 2));

    // Turned off, base stays off after a restart (the default is not applied again).
    let set: Value =
        serde_json::from_str(&s.space_ok(&["pool", "set", "minimal", "--min", "0", "--json"]))
            .unwrap();
    assert_eq!(sizes(&set), (0, 0));
    s.stop().unwrap();
    s.spawn().unwrap();
    // Give the start-up restore time to (wrongly) apply the default.
    std::thread::sleep(Duration::from_secs(2));
    let list = pools(&s);
    assert!(
        pool_of(&list, "minimal").is_none_or(|p| sizes(p) == (0, 0)),
        "minimal came back: {list:?}"
    );
}

#[test]
fn bad_pool_requests_get_clear_errors_and_big_ones_are_clamped() {
    let s = Spaced::start_with(&["--warm-pool", "0:0"]).unwrap();

    // 0:0 turns the default pool off.
    std::thread::sleep(Duration::from_secs(1));
    let list = pools(&s);
    assert!(
        pool_of(&list, "minimal").is_none_or(|p| sizes(p) == (0, 0)),
        "{list:?}"
    );
    let (code, body) = s.call(Method::GET, "/v1/templates/minimal/pool", None);
    assert_eq!(code, 404, "{body}");
    assert_eq!(body["error"]["code"], "not_found");

    let put = |template: &str, body: Value| {
        s.call(
            Method::PUT,
            &format!("/v1/templates/{template}/pool"),
            Some(body),
        )
    };
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("nope", json!({"min": 1}), 404, "template nope not found"),
        (
            "minimal",
            json!({"min": 5, "max": 3}),
            400,
            "min (5) must not exceed max (3)",
        ),
        (
            "minimal",
            json!({"min": 1, "size": 2}),
            400,
            "unknown field `size`",
        ),
        ("minimal", json!({"max": 2}), 400, "missing field `min`"),
        ("minimal", json!({"min": -1}), 400, "invalid JSON body"),
        (
            "minimal",
            json!({"min": 1, "runtime": "firecracker"}),
            400,
            "unknown runtime \"firecracker\"",
        ),
        ("Bad..Name", json!({"min": 1}), 400, "invalid template name"),
    ];
    for (template, body, status, needle) in cases {
        let (code, reply) = put(template, body.clone());
        assert_eq!(code, status, "{template} {body}: {reply}");
        let msg = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{template} {body}: {reply}");
    }

    // No key, no pools.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for (method, path) in [
            (Method::GET, "/v1/pools"),
            (Method::GET, "/v1/templates/minimal/pool"),
            (Method::PUT, "/v1/templates/minimal/pool"),
        ] {
            let r = s
                .req_anon(method.clone(), path)
                .json(&json!({"min": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 401, "{method} {path}");
        }
    });

    // The CLI prints the API's errors.
    let out = s.space(&["pool", "get", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: template nope not found (not_found)"
    );
    let out = s.space(&["pool", "set", "minimal", "--min", "5", "--max", "3"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("min (5) must not exceed max (3)"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = s.space(&["pool", "set", "minimal"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--min"));
    // Nothing above set a pool.
    let list = pools(&s);
    assert!(
        pool_of(&list, "minimal").is_none_or(|p| sizes(p) == (0, 0)),
        "{list:?}"
    );

    // Far beyond capacity: 200, clamped, with a warning that names the capacity.
    let (code, body) = put("minimal", json!({"min": 1_000_000, "max": 1_000_000}));
    assert_eq!(code, 200, "{body}");
    let (min, max) = sizes(&body);
    assert!(max < 1_000_000 && min <= max, "not clamped: {body}");
    let warning = body["warning"]
        .as_str()
        .unwrap_or_else(|| panic!("no warning: {body}"));
    assert!(warning.contains(&max.to_string()), "{warning}");
    // Turn it off again at once: the node need not build all of them.
    let (code, body) = put("minimal", json!({"min": 0}));
    assert_eq!((code, sizes(&body)), (200, (0, 0)), "{body}");

    // The CLI prints the warning on stderr, the pool on stdout.
    let out = s.space(&["pool", "set", "minimal", "--min", "1000000"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("warning: "), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("TEMPLATE"));
    s.space_ok(&["pool", "set", "minimal", "--min", "0"]);
}
