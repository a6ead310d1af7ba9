//! The roles apart (issue 14): `spaced node` serving the node contract over gRPC and `spaced
//! control --node` driving it, as two processes. The API behaves as all-in-one does, guest
//! calls (exec, files) and port connections stream through the node agent, and either
//! process can die and come back without losing a sandbox.

use std::time::{Duration, Instant};

use serde_json::Value;
use space_tests::{Spaced, eventually};

/// (HTTP status, body) of a GET with curl.
fn get(url: &str) -> (u16, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "-m", "10", "-o", "-", "-w", "\n%{http_code}", url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "000"));
    (code.parse().unwrap_or(0), body.to_string())
}

#[test]
fn split_roles_serve_the_api_as_all_in_one_does() {
    let mut s = Spaced::start_split(&[], &[]).unwrap();
    let nodes: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
    assert_eq!(nodes["nodes"][0]["state"], "ready", "{nodes}");

    // Lifecycle and guest calls (exec, files) through the node agent.
    let id = s.create(&["--env", "K=v", "--memory", "128"]);
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "sh", "-c", "echo $K"]),
        "v\n"
    );
    let work = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 253) as u8).collect();
    let src = work.path().join("big.bin");
    std::fs::write(&src, &big).unwrap();
    s.space_ok(&["cp", src.to_str().unwrap(), &format!("{id}:/root/big.bin")]);
    let back = work.path().join("back.bin");
    s.space_ok(&["cp", &format!("{id}:/root/big.bin"), back.to_str().unwrap()]);
    assert!(
        std::fs::read(&back).unwrap() == big,
        "the file came back changed"
    );
    let (code, out, _) = s.sh(&id, "exit 3");
    assert_eq!((code, out.as_str()), (3, ""));

    // Snapshots, rollback and fork.
    s.sh(&id, "echo one > /root/f");
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    s.sh(&id, "echo two > /root/f");
    s.space_ok(&["rollback", &id, &snap]);
    assert_eq!(s.space_ok(&["exec", &id, "--", "cat", "/root/f"]), "one\n");
    let fork = s.space_ok(&["fork", &id]).trim().to_string();
    assert_eq!(
        s.space_ok(&["exec", &fork, "--", "cat", "/root/f"]),
        "one\n"
    );

    // Pause: the node refuses guest calls with the sandbox's state, as all-in-one does.
    s.space_ok(&["pause", &id]);
    let out = s.space(&["exec", &id, "--", "true"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("paused"), "{err}");
    s.space_ok(&["resume", &id]);

    // A port inside the sandbox through the node agent's stream.
    let (code, _, err) = s.sh(
        &id,
        "mkdir -p /www && echo hello-over-the-node > /www/index.html && busybox httpd -p 8080 -h /www",
    );
    assert_eq!(code, 0, "{err}");
    let url = s.space_ok(&["port", &id, "8080"]).trim().to_string();
    let page = format!("{url}index.html");
    assert!(
        eventually(Duration::from_secs(10), || get(&page).0 == 200),
        "httpd never answered through {url}:\n{}",
        s.log_tail()
    );
    assert_eq!(get(&page).1.trim(), "hello-over-the-node");

    // A template uploaded to the node.
    let root = work.path().join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/cat")).unwrap();
    std::fs::write(root.join("etc/marker"), "uploaded\n").unwrap();
    s.space_ok(&["template", "import", "mine", root.to_str().unwrap()]);
    let t = s.create(&["--template", "mine"]);
    assert_eq!(
        s.space_ok(&["exec", &t, "--", "cat", "/etc/marker"]),
        "uploaded\n"
    );

    // Wrong ids answer as all-in-one does.
    let out = s.space(&["exec", "aaaaaaaaaaaaaaaaaaaa", "--", "true"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not found"),
        "{out:?}"
    );

    // The node agent dies: the store still answers, the node's work fails with a clear
    // error, and once it is back its sandboxes are as they were.
    s.kill9_node();
    assert!(s.space_ok(&["ls"]).contains(&id));
    let out = s.space(&["exec", &id, "--", "true"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains("unavailable"), "{err}");
    let out = s.space(&["snapshot", &id]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        err.contains("unreachable") && err.contains(space_tests::SPLIT_NODE_ADDR),
        "{err}"
    );
    s.spawn_node().unwrap();
    assert!(
        eventually(Duration::from_secs(30), || s
            .space(&["exec", &id, "--", "cat", "/root/f"])
            .stdout
            == b"one\n"),
        "the sandbox did not come back with the node:\n{}",
        s.log_tail()
    );
    // The restarted node got its warm pool again from the control plane.
    let ready = || {
        let (_, pools) = s.call(reqwest::Method::GET, "/v1/pools", None);
        pools["pools"][0]["ready"].as_u64().unwrap_or(0) > 0
    };
    assert!(
        eventually(Duration::from_secs(30), ready),
        "the node's warm pool did not come back:\n{}",
        s.log_tail()
    );

    // The control plane dies: a new one picks up the same store and node.
    s.kill9();
    s.spawn().unwrap();
    assert_eq!(
        s.space_ok(&["exec", &fork, "--", "cat", "/root/f"]),
        "one\n"
    );
    for sb in [&id, &fork, &t] {
        s.space_ok(&["rm", sb]);
    }
    assert!(
        eventually(Duration::from_secs(20), || s.user_sandbox_dirs().is_empty()),
        "sandbox dirs left on the node: {:?}",
        s.user_sandbox_dirs()
    );
}

/// Create → ready through a control plane driving a node agent over gRPC, against
/// all-in-one, in one run (issue 14's goal: ≤ 2 ms extra at p50): the node on loopback
/// without TLS (`--node`), and a node that joined (mTLS, and each create placed by the
/// scheduler with its claim in the store). Rounds alternate between the three so that the
/// machine's noise falls on all. Run it on a release build:
/// `cargo test --release -p space-tests --test it -- --ignored --nocapture bench_split`.
#[test]
#[ignore = "benchmark; prints figures for BENCHMARKS.md"]
fn bench_split_create_against_all_in_one() {
    let rounds: usize = std::env::var("SPACE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let n = std::env::var("SPACE_BENCH_N").unwrap_or_else(|_| "50".into());
    let all = Spaced::start_with(&["--network", "off"]).unwrap();
    let split = Spaced::start_split(&["--network", "off"], &[]).unwrap();
    let joined = Spaced::start_joined(&["--network", "off"], &[]).unwrap();
    // The joined node's first report (its capacity) is what placement needs.
    assert!(eventually(Duration::from_secs(20), || {
        let v: Value = serde_json::from_str(&joined.space_ok(&["node", "ls", "--json"])).unwrap();
        v["nodes"][0]["cpus"].as_u64().unwrap_or(0) > 0
    }));
    const MODES: [&str; 3] = ["all-in-one", "split", "joined (mTLS)"];
    // Per mode, per round: the p50s of create → ready, the create call and an exec.
    const KEYS: [&str; 3] = ["create_ready_ms", "create_ms", "exec_rtt_ms"];
    let mut p50s: [Vec<[f64; 3]>; 3] = Default::default();
    for round in 0..rounds {
        for (i, s) in [&all, &split, &joined].into_iter().enumerate() {
            let out = s.space_ok(&[
                "bench",
                "create",
                "-n",
                &n,
                "--exec-runs",
                "20",
                "--pool",
                "--json",
            ]);
            let r: Value = serde_json::from_str(&out).unwrap();
            let row = KEYS.map(|k| r[k]["p50"].as_f64().unwrap());
            eprintln!("round {round} {}: {KEYS:?} p50 {row:.2?} ms", MODES[i]);
            p50s[i].push(row);
        }
    }
    let median = |i: usize, k: usize| {
        let mut v: Vec<f64> = p50s[i].iter().map(|r| r[k]).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (k, what) in ["create → ready", "create call", "exec round trip"]
        .iter()
        .enumerate()
    {
        let (a, b, c) = (median(0, k), median(1, k), median(2, k));
        println!(
            "{what}: all-in-one {a:.2} ms, split {b:.2} ms (+{:.2}), joined {c:.2} ms (+{:.2}) (median of {rounds} rounds' p50)",
            b - a,
            c - a
        );
    }
}

/// A node joins a `spaced control` with a one-time token (decision 0033) and from then on
/// the two speak mTLS only: the API works through it as through all-in-one, a client without
/// the control plane's certificate cannot call the node, a token joins once and only the
/// control plane that made it, a restarted node needs no new token, and `space node rm`
/// cuts the node off.
#[test]
fn a_node_joins_with_a_token_and_speaks_mtls_only() {
    let mut s = Spaced::start_joined(&[], &[]).unwrap();
    let nodes: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
    let node = &nodes["nodes"][0];
    let node_id = node["id"]
        .as_str()
        .expect("a joined node has an id")
        .to_owned();
    assert_eq!(node["address"], space_tests::SPLIT_NODE_ADDR, "{nodes}");
    // Its first heartbeat fills in what it has.
    assert!(
        eventually(Duration::from_secs(15), || {
            let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
            v["nodes"][0]["cpus"].as_u64().unwrap_or(0) > 0 && v["nodes"][0]["state"] == "ready"
        }),
        "no heartbeat reached the control plane:\n{}",
        s.log_tail()
    );
    let membership = s.data_dir().join("cluster");
    assert_eq!(
        std::fs::read_to_string(membership.join("node_id"))
            .unwrap()
            .trim(),
        node_id
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(membership.join("key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // The API through the mTLS link: lifecycle, a guest call, a file, a port.
    let id = s.create(&[]);
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "echo", "over mtls"]),
        "over mtls\n"
    );
    let (code, _, err) = s.sh(
        &id,
        "mkdir -p /www && echo behind-mtls > /www/index.html && busybox httpd -p 8080 -h /www",
    );
    assert_eq!(code, 0, "{err}");
    let url = s.space_ok(&["port", &id, "8080"]).trim().to_string();
    let page = format!("{url}index.html");
    assert!(
        eventually(Duration::from_secs(10), || get(&page).0 == 200),
        "httpd never answered through {url}"
    );

    // Whoever reaches the node's port without the control plane's certificate gets no
    // further than the handshake; the cluster CA's certificate is no key either.
    let netns = s.net.as_ref().unwrap().path();
    let in_netns = |prog: &str| {
        let mut c = std::process::Command::new("nsenter");
        c.arg(format!("--net={}", netns.display()))
            .arg("--")
            .arg(prog);
        c
    };
    let probe = |extra: &[&str]| {
        let out = in_netns("curl")
            .args([
                "-sS",
                "-k",
                "-m",
                "5",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .args(extra)
            .arg("https://127.0.0.1:7071/space.node.v1.Node/Call")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, http) = probe(&[]);
    assert!(
        code != Some(0) && http == "000",
        "no certificate: {code:?} {http}"
    );
    // The node's own certificate names a node, not the control plane: refused too.
    let cert = membership.join("cert.pem");
    let key = membership.join("key.pem");
    let (code, http) = probe(&[
        "--cert",
        cert.to_str().unwrap(),
        "--key",
        key.to_str().unwrap(),
    ]);
    assert!(
        code != Some(0) && http == "000",
        "a node's certificate: {code:?} {http}"
    );

    let other = tempfile::tempdir().unwrap();
    // Bounded: a join that wrongly succeeded would go on to run a node.
    let join = |token: &str| {
        in_netns("timeout")
            .arg("30")
            .arg(space_tests::bin_dir().join("spaced"))
            .args(["node", "--listen", "127.0.0.1:7072", "--data-dir"])
            .arg(other.path())
            .args([
                "--control",
                space_tests::CLUSTER_ADDR,
                "--join-token",
                token,
            ])
            .output()
            .unwrap()
    };
    let token = s
        .space_ok(&["node", "token"])
        .lines()
        .next()
        .unwrap()
        .to_owned();
    // A token for another cluster's CA: the node notices before it sends anything.
    let mut forged = token.clone();
    forged.replace_range(forged.len() - 4.., "0000");
    let err = String::from_utf8_lossy(&join(&forged).stderr).to_string();
    assert!(err.contains("not the one that made this token"), "{err}");
    let err = String::from_utf8_lossy(&join("sj1.nope").stderr).to_string();
    assert!(err.contains("not one `space node token` printed"), "{err}");
    let out = s.space(&["node", "token", "--ttl", "0"]);
    assert!(!out.status.success());

    // The node restarts on its saved membership, with no token.
    s.kill9_node();
    s.spawn_node().unwrap();
    assert!(
        eventually(Duration::from_secs(30), || s
            .space(&["exec", &id, "--", "true"])
            .status
            .success()),
        "the restarted node was not driven again:\n{}",
        s.log_tail()
    );

    // Removed: its certificate is refused and the control plane drives nothing.
    s.space_ok(&["node", "rm", &node_id]);
    let out = s.space(&["node", "rm", &node_id]);
    assert_eq!(out.status.code(), Some(1));
    let out = s.space(&["exec", &id, "--", "true"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains("left the cluster"), "{err}");
    // The token the node joined with is spent.
    let used = s.join_token.clone().unwrap();
    let err = String::from_utf8_lossy(&join(&used).stderr).to_string();
    assert!(err.contains("invalid, used or expired join token"), "{err}");
    assert!(
        eventually(Duration::from_secs(15), || std::fs::read_to_string(
            s.node_log_path()
        )
        .unwrap_or_default()
        .contains("heartbeat refused")),
        "the removed node's heartbeats were not refused:\n{}",
        s.log_tail()
    );
}

/// Node `id`'s row of `space node ls --json`.
pub(crate) fn node_row(s: &Spaced, id: &str) -> Value {
    let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .cloned()
        .unwrap_or(Value::Null)
}

/// The cluster id of the node agent `x` runs.
pub(crate) fn node_id_of(x: &Spaced) -> String {
    std::fs::read_to_string(x.data_dir().join("cluster/node_id"))
        .unwrap()
        .trim()
        .to_owned()
}

/// Waits until node `id` has reported its capacity to `s` (its first heartbeat).
pub(crate) fn wait_reported(s: &Spaced, id: &str) {
    assert!(
        eventually(Duration::from_secs(30), || node_row(s, id)["cpus"]
            .as_u64()
            .unwrap_or(0)
            > 0),
        "node {id} did not report:\n{}",
        s.space_ok(&["node", "ls"])
    );
}

/// The node a sandbox was placed on, from its `place` event.
pub(crate) fn placed_on(s: &Spaced, id: &str) -> String {
    let events = s.space_ok(&["events", id]);
    let line = events
        .lines()
        .find(|l| l.contains("place") && l.contains("node="))
        .unwrap_or_else(|| panic!("no place event for {id}:\n{events}"));
    line.split("node=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

/// Three node agents, each in its own namespace with its own data dir, joined to one control
/// plane: creates spread over them by the scheduler (the reason in each sandbox's events),
/// each sandbox lives on the node it was placed on and is reached there, and a node that
/// stops reporting is marked unreachable with its sandboxes kept (not failed, not
/// recreated), and serves them again when it is back.
#[test]
fn sandboxes_spread_over_three_nodes_and_stay_on_theirs() {
    // No warm pools: ready members would come first in placement, whenever each node's fill.
    let s = Spaced::start_joined(&[], &["--warm-pool", "0:0"]).unwrap();
    let mut others = vec![s.join_node(&[]).unwrap(), s.join_node(&[]).unwrap()];
    let ready_nodes = || -> Vec<String> {
        let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["state"] == "ready" && n["cpus"].as_u64().unwrap_or(0) > 0)
            .map(|n| n["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(30), || ready_nodes().len() == 3),
        "three nodes did not all report:\n{}",
        s.space_ok(&["node", "ls"])
    );
    let nodes = ready_nodes();

    // Six creates: each placed by the scheduler, with its reason, and spread. 16 GiB limits
    // are a step (over 5%) of a node's claimable memory, so the freer nodes come first and
    // each of the three takes two, whatever the hash of the ids.
    const MEMORY: &str = "16384";
    let sandboxes: Vec<(String, String)> = (0..6)
        .map(|i| {
            let id = s.create(&["--env", &format!("I={i}"), "--memory", MEMORY]);
            let node = placed_on(&s, &id);
            assert!(nodes.contains(&node), "{node} not in {nodes:?}");
            (id, node)
        })
        .collect();
    for node in &nodes {
        let mine = sandboxes.iter().filter(|(_, n)| n == node).count();
        assert_eq!(mine, 2, "creates did not spread: {sandboxes:?}");
    }
    let events = s.space_ok(&["events", &sandboxes[0].0]);
    assert!(events.contains("claimable memory"), "{events}");

    // Each is reached on its node, and its files are on that node's disk only.
    let data_dir_of = |node: &str| -> std::path::PathBuf {
        std::iter::once(&s)
            .chain(others.iter())
            .find(|x| {
                std::fs::read_to_string(x.data_dir().join("cluster/node_id"))
                    .is_ok_and(|n| n.trim() == node)
            })
            .unwrap()
            .data_dir()
    };
    for (i, (id, node)) in sandboxes.iter().enumerate() {
        assert_eq!(
            s.space_ok(&["exec", id, "--", "sh", "-c", "echo $I"]),
            format!("{i}\n")
        );
        assert!(
            data_dir_of(node).join("volume/sandboxes").join(id).is_dir(),
            "{id} is not on {node}'s disk"
        );
        for other in nodes.iter().filter(|n| *n != node) {
            assert!(
                !data_dir_of(other)
                    .join("volume/sandboxes")
                    .join(id)
                    .exists()
            );
        }
    }
    // What each node's sandboxes claim adds up.
    for node in &nodes {
        let row = node_row(&s, node);
        let mine = sandboxes.iter().filter(|(_, n)| n == node).count() as u64;
        assert_eq!(
            row["allocated_memory_mib"].as_u64(),
            Some(16384 * mine),
            "{row}"
        );
    }

    // One node stops: once its heartbeats lapse it is unreachable, its sandboxes are kept as
    // they were (running in the store, never failed or recreated elsewhere), and new
    // sandboxes go to the others.
    let mut gone = others.pop().unwrap();
    let gone_id = std::fs::read_to_string(gone.data_dir().join("cluster/node_id"))
        .unwrap()
        .trim()
        .to_owned();
    gone.kill9_node();
    assert!(
        eventually(Duration::from_secs(40), || node_row(&s, &gone_id)["state"]
            == "unreachable"),
        "the stopped node was not marked unreachable:\n{}",
        s.space_ok(&["node", "ls"])
    );
    let stranded: Vec<&String> = sandboxes
        .iter()
        .filter(|(_, n)| *n == gone_id)
        .map(|(id, _)| id)
        .collect();
    assert!(!stranded.is_empty());
    // Two reconcile passes see the node gone.
    std::thread::sleep(Duration::from_secs(5));
    let listed: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    for id in &stranded {
        let sb = s.inspect(id);
        assert_eq!(sb["state"], "running", "{id}");
        assert_eq!(sb["node_unreachable"], true, "{sb}");
        let l = listed["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["id"] == **id)
            .unwrap();
        assert_eq!(l["node_unreachable"], true, "{l}");
    }
    assert!(s.space_ok(&["ls"]).contains("its node is unreachable"));
    for (id, _) in sandboxes.iter().filter(|(_, n)| *n != gone_id) {
        assert_eq!(s.inspect(id).get("node_unreachable"), None, "{id}");
    }
    for _ in 0..3 {
        let id = s.create(&[]);
        assert_ne!(placed_on(&s, &id), gone_id);
        s.space_ok(&["rm", &id]);
    }
    gone.spawn_node().unwrap();
    assert!(
        eventually(Duration::from_secs(30), || s
            .space(&["exec", stranded[0], "--", "true"])
            .status
            .success()),
        "the node's sandboxes did not come back with it:\n{}",
        gone.log_tail()
    );
    assert_eq!(s.inspect(stranded[0]).get("node_unreachable"), None);
    others.push(gone);
    for (id, _) in &sandboxes {
        s.space_ok(&["rm", id]);
    }
}

/// Cluster creates/s with one, two and three joined nodes (each in its own namespace, all on
/// this machine's cores): `space bench throughput` through the control plane after each join,
/// for 2 s (longer runs fill a 2-core node's claimable CPU: 128 one-core sandboxes).
/// `cargo test --release -p space-tests --test it -- --ignored --nocapture bench_cluster`
#[test]
#[ignore = "benchmark; prints figures for BENCHMARKS.md"]
fn bench_cluster_throughput() {
    let s = Spaced::start_joined(&["--network", "off"], &[]).unwrap();
    let mut nodes = Vec::new();
    for n in 1..=3 {
        if n > 1 {
            nodes.push(s.join_node(&["--network", "off"]).unwrap());
        }
        assert!(eventually(Duration::from_secs(30), || {
            let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
            v["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|x| x["cpus"].as_u64().unwrap_or(0) > 0 && x["state"] == "ready")
                .count()
                == n
        }));
        let out = s.space_ok(&[
            "bench",
            "throughput",
            "--duration",
            "2",
            "--concurrency",
            "8",
            "--prewarm",
            "60",
            "--json",
        ]);
        let r: Value = serde_json::from_str(&out).unwrap();
        println!(
            "{n} node(s): {:.1} creates/s ({} creates, {} errors, create p50 {:.1} ms, p99 {:.1} ms, {} pool hits)",
            r["creates_per_s"].as_f64().unwrap(),
            r["creates"],
            r["errors"],
            r["create_ms"]["p50"].as_f64().unwrap_or(0.0),
            r["create_ms"]["p99"].as_f64().unwrap_or(0.0),
            r["hits"]
        );
    }
}

/// A microvm behind a node that joined: guest calls reach its daemon through the node agent's
/// forwarding, over the VM's virtio-serial channel, as they reach a namespace sandbox's.
#[test]
fn a_microvm_runs_behind_a_joined_node() {
    let s = Spaced::start_joined(&[], &["--warm-pool", "0:0"]).unwrap();
    assert!(eventually(Duration::from_secs(30), || {
        let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
        v["nodes"][0]["cpus"].as_u64().unwrap_or(0) > 0
    }));
    let id = s.create(&["--runtime", "microvm", "--memory", "256"]);
    let kernel = s.space_ok(&["exec", &id, "--", "uname", "-r"]);
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(
        kernel.trim(),
        host.trim(),
        "the sandbox runs the host's kernel"
    );
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("f");
    std::fs::write(&src, b"through the node to the vm").unwrap();
    s.space_ok(&["cp", src.to_str().unwrap(), &format!("{id}:/root/f")]);
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "cat", "/root/f"]),
        "through the node to the vm"
    );
    s.space_ok(&["rm", &id]);
}

/// `space migrate` (decision 0035): a namespace sandbox moves to the other node with its id,
/// its files byte for byte and its snapshots (a rollback works there), and back again; a
/// stopped one stays stopped. Bad requests are refused with nothing moved. `space node
/// drain` moves every sandbox off a node, which then takes nothing new until `--undo`.
#[test]
fn a_sandbox_moves_between_nodes_with_its_files_and_snapshots() {
    let s = Spaced::start_joined(&[], &["--warm-pool", "0:0"]).unwrap();
    let other = s.join_node(&[]).unwrap();
    let ready = || {
        let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["state"] == "ready" && n["cpus"].as_u64().unwrap_or(0) > 0)
            .count()
    };
    assert!(
        eventually(Duration::from_secs(30), || ready() == 2),
        "two nodes did not report:\n{}",
        s.space_ok(&["node", "ls"])
    );
    let node_dir = |node: &str| -> std::path::PathBuf {
        [&s, &other]
            .into_iter()
            .find(|x| {
                std::fs::read_to_string(x.data_dir().join("cluster/node_id"))
                    .is_ok_and(|n| n.trim() == node)
            })
            .unwrap()
            .data_dir()
            .join("volume/sandboxes")
    };

    let id = s.create(&[]);
    let a = placed_on(&s, &id);
    let (rc, sum, err) = s.sh(
        &id,
        "head -c 8388608 /dev/urandom > /root/data && echo kept > /root/before && \
         sha256sum /root/data",
    );
    assert_eq!(rc, 0, "{err}");
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    let (rc, _, err) = s.sh(&id, "echo later > /root/after");
    assert_eq!(rc, 0, "{err}");

    // Refused, nothing moved: the node it is on, a node that is not, bad ids, no sandbox.
    for (args, says) in [
        (vec!["migrate", &id, "--to", &a], "already"),
        (vec!["migrate", &id, "--to", "nosuchnode"], "not found"),
        (vec!["migrate", &id, "--to", "../x"], "invalid node id"),
        (vec!["migrate", "aaaaaaaaaaaaaaaaaaaa"], "not found"),
        (vec!["migrate", "NOT-AN-ID"], "invalid"),
    ] {
        let out = s.space(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    assert_eq!(s.sh(&id, "cat /root/before").1, "kept\n");

    // The move: the other node, the same id, the same bytes, the snapshot with it.
    let m: Value = serde_json::from_str(&s.space_ok(&["migrate", &id, "--json"])).unwrap();
    let b = m["to"].as_str().unwrap().to_owned();
    assert_eq!(m["from"], a.as_str());
    assert_ne!(a, b);
    assert_eq!(m["sandbox"]["state"], "running", "{m}");
    assert_eq!(m["processes_restarted"], true);
    assert!(m["base_bytes"].as_u64().unwrap() > 8 << 20, "{m}");
    assert!(m["downtime_ms"].as_u64().unwrap() > 0, "{m}");
    assert!(node_dir(&b).join(&id).is_dir());
    assert!(!node_dir(&a).join(&id).exists(), "the old copy stayed");
    assert_eq!(s.sh(&id, "sha256sum /root/data").1, sum);
    assert_eq!(s.sh(&id, "cat /root/before /root/after").1, "kept\nlater\n");
    let events = s.space_ok(&["events", &id]);
    assert!(
        events.contains("migrate") && events.contains(&b),
        "{events}"
    );
    let snaps = s.space_ok(&["snapshots", &id]);
    assert!(snaps.contains(&snap), "{snaps}");
    s.space_ok(&["rollback", &id, &snap]);
    assert_eq!(s.sh(&id, "cat /root/before").1, "kept\n");
    assert_ne!(
        s.sh(&id, "test -e /root/after").0,
        0,
        "rollback kept a later file"
    );
    assert_eq!(s.sh(&id, "sha256sum /root/data").1, sum);

    // Stopped, it moves back and stays stopped; resumed, it has its files.
    s.space_ok(&["pause", &id, "--filesystem-only"]);
    let m: Value = serde_json::from_str(&s.space_ok(&["migrate", &id, "--json"])).unwrap();
    assert_eq!(m["to"], a.as_str());
    assert_eq!(m["sandbox"]["state"], "stopped", "{m}");
    assert_eq!(m["downtime_ms"], 0);
    s.space_ok(&["resume", &id]);
    assert_eq!(s.sh(&id, "sha256sum /root/data").1, sum);
    assert!(node_dir(&a).join(&id).is_dir());
    assert!(!node_dir(&b).join(&id).exists());

    // A drain moves everything off a node, and nothing new goes there until it is undone.
    let second = s.create(&["--env", "K=2"]);
    let moved_to = |sb: &str| -> String {
        let events = s.space_ok(&["events", sb]);
        events
            .lines()
            .rev()
            .find(|l| l.contains("migrate") && l.contains(" ok"))
            .map(|l| l.to_owned())
            .unwrap_or_default()
    };
    let out = s.space(&["node", "drain", &a]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("to move"), "{err}");
    for sb in [&id, &second] {
        assert!(node_dir(&b).join(sb).is_dir(), "{sb} not moved: {err}");
        assert!(!node_dir(&a).join(sb).exists());
    }
    assert!(
        moved_to(&id).contains(&b),
        "{}",
        s.space_ok(&["events", &id])
    );
    assert_eq!(s.sh(&second, "echo $K").1, "2\n");
    assert_eq!(node_row(&s, &a)["state"], "draining");
    let third = s.create(&[]);
    assert_eq!(placed_on(&s, &third), b, "a create went to a drained node");
    let out = s.space(&["migrate", &third, "--to", &a]);
    assert!(!out.status.success(), "a move went to a drained node");
    assert!(String::from_utf8_lossy(&out.stderr).contains("draining"));
    s.space_ok(&["node", "drain", &a, "--undo"]);
    assert_eq!(node_row(&s, &a)["state"], "ready");
    s.space_ok(&["migrate", &third, "--to", &a]);
    for sb in [&id, &second, &third] {
        s.space_ok(&["rm", sb]);
    }
    // Not a node: refused.
    let out = s.space(&["node", "drain", "nosuchnode"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
}

/// Migration figures (decision 0035): a sandbox with 1 GiB of its own data moves between two
/// nodes, back and forth, 16 MiB more written before each move. Downtime (pause on the old
/// node until it runs on the new one) and the whole move, p50/p90/p99; bytes sent while it
/// ran and while it was paused; how much each move's stream grew per 16 MiB written.
/// `cargo test --release -p space-tests --test it -- --ignored --nocapture bench_migration`
#[test]
#[ignore = "benchmark; prints figures for BENCHMARKS.md"]
fn bench_migration() {
    let runs: usize = std::env::var("SPACE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let s = Spaced::start_joined(&["--network", "off"], &["--warm-pool", "0:0"]).unwrap();
    let _other = s.join_node(&["--network", "off"]).unwrap();
    assert!(eventually(Duration::from_secs(30), || {
        let v: Value = serde_json::from_str(&s.space_ok(&["node", "ls", "--json"])).unwrap();
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["cpus"].as_u64().unwrap_or(0) > 0)
            .count()
            == 2
    }));
    let id = s.create(&[]);
    let (rc, _, err) = s.sh(&id, "head -c 1073741824 /dev/urandom > /root/gib && sync");
    assert_eq!(rc, 0, "{err}");
    let mut rows: Vec<[f64; 4]> = Vec::new();
    for i in 0..runs {
        let (rc, _, err) = s.sh(
            &id,
            &format!("head -c 16777216 /dev/urandom > /root/r{i} && sync"),
        );
        assert_eq!(rc, 0, "{err}");
        let m: Value = serde_json::from_str(&s.space_ok(&["migrate", &id, "--json"])).unwrap();
        let row = ["downtime_ms", "total_ms", "base_bytes", "final_bytes"]
            .map(|k| m[k].as_f64().unwrap());
        eprintln!(
            "move {i}: down {} ms, total {} ms, base {} B, final {} B",
            row[0], row[1], row[2], row[3]
        );
        rows.push(row);
    }
    let pct = |k: usize, p: f64| {
        let mut v: Vec<f64> = rows.iter().map(|r| r[k]).collect();
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    let mib = |b: f64| b / f64::from(1u32 << 20);
    println!(
        "downtime: p50 {:.0} ms, p90 {:.0} ms, p99 {:.0} ms; whole move p50 {:.0} ms, p90 {:.0} ms ({runs} moves of a 1 GiB sandbox)",
        pct(0, 0.5),
        pct(0, 0.9),
        pct(0, 0.99),
        pct(1, 0.5),
        pct(1, 0.9)
    );
    println!(
        "sent while running: p50 {:.1} MiB; while paused: p50 {:.3} MiB, p99 {:.3} MiB",
        mib(pct(2, 0.5)),
        mib(pct(3, 0.5)),
        mib(pct(3, 0.99))
    );
    let growth = (rows[runs - 1][2] - rows[0][2]) / (runs - 1) as f64;
    println!(
        "stream growth per move: {:.2} MiB for 16.00 MiB written ({:.3}x)",
        mib(growth),
        mib(growth) / 16.0
    );
    s.space_ok(&["rm", &id]);
}

/// Two control-plane replicas on one PostgreSQL, a node that heartbeats to either. A burst
/// of creates with idempotency keys goes to the first replica, which is killed (-9) in the
/// middle of it; the client retries each unanswered key through the second. Exactly one
/// sandbox per key, all running, none leaked on the node; a replayed key answers its
/// sandbox again, and a key reused for another request is refused.
#[test]
fn a_replica_killed_during_a_create_burst_doubles_and_loses_nothing() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const KEYS: usize = 12;

    let pg = space_tests::Postgres::start().unwrap();
    let mut s = Spaced::start_joined(
        &[],
        &["--database-url", &pg.socket_url, "--warm-pool", "0:0"],
    )
    .unwrap();
    let r = s.add_replica().unwrap();
    // Given only secrets.key, the replica took the files replicas share from the store
    // (decision 0054), byte for byte.
    for f in [
        "admin.key",
        "ports.key",
        "cluster-ca/ca.key",
        "cluster-ca/ca.pem",
    ] {
        assert_eq!(
            std::fs::read(s.data_dir().join(f)).unwrap(),
            std::fs::read(r.data_dir().join(f)).unwrap(),
            "{f}"
        );
    }
    assert_eq!(r.key, s.key);
    let n = s.join_node_via(&[&r], &[]).unwrap();
    let (own, nid) = (node_id_of(&s), node_id_of(&n));
    wait_reported(&r, &nid);
    // Creates go to the joined node only: the first replica's own node is drained (it
    // serves on the first replica's loopback, which the second cannot reach).
    s.space_ok(&["node", "drain", &own]);

    let answered = Arc::new(AtomicUsize::new(0));
    let burst = {
        let (urls, key) = ([s.url.clone(), r.url.clone()], s.key.clone());
        let answered = answered.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let http = reqwest::Client::new();
            rt.block_on(async {
                let one = |i: usize| {
                    let (http, urls, key, answered) =
                        (http.clone(), urls.clone(), key.clone(), answered.clone());
                    async move {
                        let mut log = Vec::new();
                        // Tries of at most 20 s each, for at most 90 s and 40 tries in all
                        // (a client rides out a failover, however slow the host): the first
                        // replica until it fails to answer, then the second.
                        let mut at = 0;
                        let deadline = Instant::now() + Duration::from_secs(90);
                        for _ in 0..40 {
                            if Instant::now() > deadline {
                                break;
                            }
                            let sent = http
                                .post(format!("{}/v1/sandboxes", urls[at]))
                                .bearer_auth(&key)
                                .header("Idempotency-Key", format!("burst-{i}"))
                                .json(&serde_json::json!({ "env": { "I": i.to_string() } }))
                                .timeout(Duration::from_secs(20))
                                .send()
                                .await;
                            match sent {
                                Ok(resp) if resp.status().is_success() => {
                                    let status = resp.status().as_u16();
                                    let v: Value = resp.json().await.unwrap();
                                    answered.fetch_add(1, Ordering::SeqCst);
                                    return (i, v["id"].as_str().unwrap().to_owned(), status, log);
                                }
                                Ok(resp) => log.push(format!(
                                    "{}: {} {}",
                                    urls[at],
                                    resp.status(),
                                    resp.text().await.unwrap_or_default()
                                )),
                                Err(e) => {
                                    log.push(format!("{}: {e}", urls[at]));
                                    at = 1;
                                }
                            }
                            tokio::time::sleep(Duration::from_millis(300)).await;
                        }
                        (i, String::new(), 0, log)
                    }
                };
                // Three at a time, so that creates are in flight when the replica dies.
                let mut out = Vec::new();
                for chunk in (0..KEYS).collect::<Vec<_>>().chunks(3) {
                    out.extend(futures::future::join_all(chunk.iter().map(|&i| one(i))).await);
                }
                out
            })
        })
    };
    assert!(eventually(Duration::from_secs(120), || answered
        .load(Ordering::SeqCst)
        >= 4));
    s.kill9();
    let results = burst.join().expect("the burst");
    assert_eq!(results.len(), KEYS);
    let unanswered: Vec<_> = results
        .iter()
        .filter(|(_, id, _, _)| id.is_empty())
        .collect();
    if !unanswered.is_empty() {
        // The cause first: CI shows only the head of a failure's output.
        eprintln!(
            "keys never answered: {unanswered:?}\nnodes:\n{}",
            r.space_ok(&["node", "ls"])
        );
        let v: Value = serde_json::from_str(&r.space_ok(&["ls", "--json"])).unwrap();
        for sb in v["sandboxes"].as_array().unwrap() {
            let id = sb["id"].as_str().unwrap();
            eprintln!("{id} {}:\n{}", sb["state"], r.space_ok(&["events", id]));
        }
        panic!("{} keys never answered (above)", unanswered.len());
    }
    let ids: std::collections::BTreeSet<String> =
        results.iter().map(|(_, id, _, _)| id.clone()).collect();
    assert_eq!(
        ids.len(),
        KEYS,
        "two keys answered one sandbox: {results:?}"
    );
    eprintln!(
        "retried keys: {:?}",
        results
            .iter()
            .filter(|(_, _, _, log)| !log.is_empty())
            .map(|(i, _, status, log)| (i, status, log.len()))
            .collect::<Vec<_>>()
    );

    // The second replica knows exactly those, each running with its own env, all on the node.
    let listed = || -> std::collections::BTreeSet<String> {
        let v: Value = serde_json::from_str(&r.space_ok(&["ls", "--json"])).unwrap();
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(listed(), ids);
    for (i, id, _, _) in &results {
        assert!(
            eventually(Duration::from_secs(30), || r.inspect(id)["state"]
                == "running"),
            "{id}: {}",
            r.inspect(id)
        );
        assert_eq!(r.sh(id, "echo $I").1, format!("{i}\n"));
    }
    assert_eq!(n.user_sandbox_dirs(), ids, "sandboxes leaked on the node");

    // A retry of an answered key replays its sandbox; the key for another request is refused.
    let (i, id, _, _) = &results[0];
    let again = |env: &str| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let resp = r
                .req(reqwest::Method::POST, "/v1/sandboxes")
                .header("Idempotency-Key", format!("burst-{i}"))
                .json(&serde_json::json!({ "env": { "I": env } }))
                .send()
                .await
                .unwrap();
            let replayed = resp.headers().get("idempotent-replayed").is_some();
            (
                resp.status().as_u16(),
                replayed,
                resp.json::<Value>().await.unwrap(),
            )
        })
    };
    let (status, replayed, v) = again(&i.to_string());
    assert_eq!((status, replayed), (200, true), "{v}");
    assert_eq!(v["id"], id.as_str());
    let (status, _, v) = again("other");
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("different")
    );
    // Bad keys are refused before anything is made.
    let out = r.space(&["create", "--idempotency-key", "has space"]);
    assert!(!out.status.success());
    assert_eq!(listed(), ids);
    for id in &ids {
        r.space_ok(&["rm", id]);
    }
}

/// A node cut off from the control plane (its namespace's link down) and brought back
/// (issue 14): it is marked unreachable with its sandboxes kept running, in the store and
/// on the host; creates meanwhile go elsewhere; back, it serves them again, and there is no
/// duplicate and no loss.
#[test]
fn a_node_cut_off_and_back_keeps_its_sandboxes_once() {
    let s = Spaced::start_joined(&[], &["--warm-pool", "0:0"]).unwrap();
    let n = s.join_node(&[]).unwrap();
    let (own, nid) = (node_id_of(&s), node_id_of(&n));
    wait_reported(&s, &nid);
    // Both on the node that will be cut.
    s.space_ok(&["node", "drain", &own]);
    let cut: Vec<String> = (0..2)
        .map(|i| s.create(&["--env", &format!("I={i}")]))
        .collect();
    for (i, id) in cut.iter().enumerate() {
        assert_eq!(placed_on(&s, id), nid);
        assert_eq!(s.sh(id, &format!("echo {i} > /root/f")).0, 0);
    }
    let pids: Vec<u64> = cut
        .iter()
        .map(|id| s.inspect(id)["init_pid"].as_u64().unwrap())
        .collect();
    s.space_ok(&["node", "drain", &own, "--undo"]);

    let link = &n.net.as_ref().unwrap().host_if;
    space_tests::run_cmd("ip", &["link", "set", link, "down"]).unwrap();
    assert!(
        eventually(Duration::from_secs(45), || node_row(&s, &nid)["state"]
            == "unreachable"),
        "the cut node was not marked unreachable:\n{}",
        s.space_ok(&["node", "ls"])
    );
    // Kept: running in the store and on the host; calls to them fail, naming the node.
    std::thread::sleep(Duration::from_secs(5));
    for (id, pid) in cut.iter().zip(&pids) {
        assert_eq!(s.inspect(id)["state"], "running", "{id}");
        assert!(
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "{id}'s init died"
        );
        let out = s.space(&["exec", id, "--", "true"]);
        assert!(!out.status.success());
    }
    let meanwhile = s.create(&[]);
    assert_eq!(
        placed_on(&s, &meanwhile),
        own,
        "a create went to the cut node"
    );

    space_tests::run_cmd("ip", &["link", "set", link, "up"]).unwrap();
    assert!(
        eventually(Duration::from_secs(45), || s
            .space(&["exec", &cut[0], "--", "true"])
            .status
            .success()),
        "the node's sandboxes did not come back:\n{}",
        n.log_tail()
    );
    for (i, id) in cut.iter().enumerate() {
        assert_eq!(s.sh(id, "cat /root/f").1, format!("{i}\n"));
        assert_eq!(
            s.inspect(id)["init_pid"].as_u64(),
            Some(pids[i]),
            "{id} restarted"
        );
    }
    let v: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    let mut listed: Vec<String> = v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    let mut want = vec![cut[0].clone(), cut[1].clone(), meanwhile.clone()];
    want.sort();
    assert_eq!(listed, want);
    assert_eq!(
        n.user_sandbox_dirs(),
        cut.iter().cloned().collect(),
        "the cut node's sandboxes were doubled or lost"
    );
    for id in &want {
        s.space_ok(&["rm", id]);
    }
}

/// Templates reach nodes on demand (decision 0035): a node that joined after a template was
/// imported gets it from a node that has it, by btrfs send, the first time a sandbox of it is
/// placed there (the reason says so); it keeps it, with the same version number, and the
/// next create there sends nothing.
#[test]
fn a_template_reaches_a_node_that_lacks_it_on_demand() {
    let s = Spaced::start_joined(&[], &["--warm-pool", "0:0"]).unwrap();
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("rootfs");
    for d in ["bin", "etc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for l in ["sh", "cat"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(l)).unwrap();
    }
    std::fs::write(root.join("etc/marker"), "sent on demand\n").unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    s.space_ok(&["template", "import", "late", root.to_str().unwrap()]);

    let n = s.join_node(&[]).unwrap();
    let (own, nid) = (node_id_of(&s), node_id_of(&n));
    wait_reported(&s, &nid);
    let versions = |x: &Spaced| -> Vec<String> {
        std::fs::read_dir(x.data_dir().join("volume/templates/late"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(
        versions(&n).is_empty(),
        "the late node has the template already"
    );
    s.space_ok(&["node", "drain", &own]);

    let a = s.create(&["--template", "late"]);
    assert_eq!(placed_on(&s, &a), nid);
    let events = s.space_ok(&["events", &a]);
    assert!(events.contains("template will be sent"), "{events}");
    assert_eq!(s.sh(&a, "cat /etc/marker").1, "sent on demand\n");
    assert_eq!(
        versions(&n),
        versions(&s),
        "not kept with its version number"
    );
    let b = s.create(&["--template", "late"]);
    assert_eq!(placed_on(&s, &b), nid);
    assert_eq!(s.sh(&b, "cat /etc/marker").1, "sent on demand\n");
    let log = std::fs::read_to_string(n.node_log_path()).unwrap();
    assert_eq!(log.matches("template received").count(), 1, "sent twice");

    // A move to a node without the template takes the template along.
    let m = s.join_node(&[]).unwrap();
    let mid = node_id_of(&m);
    wait_reported(&s, &mid);
    assert!(versions(&m).is_empty());
    s.space_ok(&["migrate", &a, "--to", &mid]);
    assert_eq!(s.sh(&a, "cat /etc/marker").1, "sent on demand\n");
    assert_eq!(versions(&m), versions(&s));
    for id in [&a, &b] {
        s.space_ok(&["rm", id]);
    }
}
