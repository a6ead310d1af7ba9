//! Networking, egress policy and the credential layer (decision 0012), from the outside and
//! from inside a sandbox, against a fake internet (`space_tests::netlab`): every address here
//! lives in namespaces the test makes; nothing leaves the machine.
//!
//! The probe (`space-probe net ...`) runs inside sandboxes and prints JSON; the lab records
//! what its servers received.

use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use space_tests::netlab::{
    DNS_IP, ECHO_PORT, FAR_IP, META_IP, METADATA_IPS, METADATA_IPS6, NODE_IP, NetLab, PRIVATE_IPS,
    RAW_IP, WEB_IP,
};
use space_tests::{NodeNet, Spaced, eventually, on_each_runtime, probe_binary, random_hex};

const PROBE: &str = "/tmp/space-probe";

/// Copy the probe into a sandbox (once per sandbox).
fn install_probe(s: &Spaced, id: &str) {
    s.space_ok(&[
        "cp",
        probe_binary().to_str().unwrap(),
        &format!("{id}:{PROBE}"),
    ]);
}

fn parse_report(stdout: &[u8], stderr: &[u8], what: &str) -> Value {
    serde_json::from_slice(stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: probe output is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(stdout),
            String::from_utf8_lossy(stderr)
        )
    })
}

/// `space-probe net ARGS` inside the sandbox.
fn net(s: &Spaced, id: &str, args: &[&str]) -> Value {
    let mut all = vec!["exec", id, "--", PROBE, "net"];
    all.extend_from_slice(args);
    let out = s.space(&all);
    parse_report(&out.stdout, &out.stderr, &format!("net {args:?}"))
}

/// `space-probe net ...` through `sh -c` inside the sandbox (for `$VAR` expansion).
fn net_sh(s: &Spaced, id: &str, script: &str) -> Value {
    let (_, out, err) = s.sh(id, &format!("{PROBE} net {script}"));
    parse_report(out.as_bytes(), err.as_bytes(), script)
}

/// `space-probe net ARGS` in a network namespace on the host side (no sandbox, no policy).
fn net_in_ns(node: &NodeNet, args: &[&str]) -> Value {
    let out = node
        .command(probe_binary())
        .arg("net")
        .args(args)
        .output()
        .unwrap();
    parse_report(&out.stdout, &out.stderr, &format!("node-side net {args:?}"))
}

fn addr(ip: Ipv4Addr, port: u16) -> String {
    format!("{ip}:{port}")
}

fn assert_ok(v: &Value, what: &str) {
    assert_eq!(v["ok"], true, "{what} should succeed: {v}");
}

fn assert_blocked(v: &Value, what: &str) {
    assert_eq!(v["ok"], false, "{what} should be blocked: {v}");
}

/// An HTTP attempt was refused: it failed, or the proxy answered 403 itself.
fn assert_http_refused(v: &Value, what: &str) {
    assert!(
        v["ok"] == false || v["status"] == 403,
        "{what} should be refused: {v}"
    );
}

fn dns_rcode(v: &Value) -> Option<u64> {
    v["rcode"].as_u64()
}

fn sandbox_network(s: &Spaced, id: &str) -> Value {
    s.inspect(id)["network"].clone()
}

fn sandbox_ip(s: &Spaced, id: &str) -> Ipv4Addr {
    let n = sandbox_network(s, id);
    n["address"]
        .as_str()
        .unwrap_or_else(|| panic!("sandbox {id} has no address: {n}"))
        .parse()
        .unwrap()
}

/// A TCP echo listener on `ip:port` inside the namespace at `ns` (None: this process's).
fn echo_listener(ns: Option<&NodeNet>, ip: Ipv4Addr, port: u16) -> std::net::TcpListener {
    let bind = move || std::net::TcpListener::bind((ip, port)).unwrap();
    let l = match ns {
        Some(n) => {
            let f = std::fs::File::open(n.path()).unwrap();
            space_sys::netns::run_in(f.as_fd(), bind).unwrap()
        }
        None => bind(),
    };
    let l2 = l.try_clone().unwrap();
    std::thread::spawn(move || {
        for c in l2.incoming().flatten() {
            std::thread::spawn(move || {
                let mut r = c.try_clone().unwrap();
                let mut w = c;
                let _ = std::io::copy(&mut r, &mut w);
            });
        }
    });
    l
}

fn set_secret(s: &Spaced, name: &str, value: &str, hosts: &[&str], header: &str) -> (bool, String) {
    set_secret_as(s, &s.key, name, value, hosts, header)
}

/// [`set_secret`] with the API key `key`.
fn set_secret_as(
    s: &Spaced,
    key: &str,
    name: &str,
    value: &str,
    hosts: &[&str],
    header: &str,
) -> (bool, String) {
    let mut args = vec!["secret", "set", name];
    for h in hosts {
        args.extend_from_slice(&["--host", h]);
    }
    args.extend_from_slice(&["--header", header]);
    let mut child = s
        .cli()
        .env("SPACE_API_KEY", key)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{value}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The lab itself, from a bare node namespace: names resolve, the web server speaks HTTP and
/// HTTPS with the lab CA, echo answers everywhere. (No spaced: this checks the test rig.)
#[test]
fn lab_answers_from_the_node_side() {
    let lab = NetLab::new().unwrap();
    let node = NodeNet::create_fresh().unwrap();
    lab.attach(&node).unwrap();
    let dns = DNS_IP.to_string();

    let r = net_in_ns(&node, &["dns", "api.example.test", "--server", &dns]);
    assert_ok(&r, "dns api");
    assert_eq!(r["addrs"], json!([WEB_IP.to_string()]));
    let r = net_in_ns(&node, &["dns", "far.example.test", "--server", &dns]);
    assert_eq!(r["addrs"], json!([FAR_IP.to_string()]));
    let r = net_in_ns(&node, &["dns", "nope.example.test", "--server", &dns]);
    assert_eq!(dns_rcode(&r), Some(3), "NXDOMAIN: {r}");

    let ca = lab.ca_path();
    let ip = WEB_IP.to_string();
    let r = net_in_ns(
        &node,
        &[
            "https",
            "https://api.example.test/hello",
            "--ip",
            &ip,
            "--ca",
            ca.to_str().unwrap(),
            "-H",
            "X-Test: one",
        ],
    );
    assert_ok(&r, "https api");
    assert_eq!(r["status"], 200);
    let body: Value = serde_json::from_str(r["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["sni"], "api.example.test");
    assert_eq!(body["headers"]["x-test"], json!(["one"]));
    let hits = lab.http_hits();
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0].header("x-test"), Some("one"));
    assert!(lab.received("X-Test: one"), "raw bytes are recorded");

    let r = net_in_ns(&node, &["http", "http://echo.example.test/x", "--ip", &ip]);
    assert_eq!(r["status"], 200, "{r}");
    let r = net_in_ns(
        &node,
        &[
            "https",
            "https://api.example.test/bytes/100000",
            "--ip",
            &ip,
            "--ca",
            ca.to_str().unwrap(),
            "--discard",
        ],
    );
    assert_eq!(r["bytes"], 100000, "{r}");
    // A name the certificate does not carry fails verification.
    let r = net_in_ns(
        &node,
        &[
            "https",
            "https://nope.example.test/",
            "--ip",
            &ip,
            "--ca",
            ca.to_str().unwrap(),
        ],
    );
    assert_blocked(&r, "https with a wrong name");

    for ip in [RAW_IP, FAR_IP, META_IP].into_iter().chain(PRIVATE_IPS) {
        let r = net_in_ns(&node, &["connect", &addr(ip, ECHO_PORT)]);
        assert_ok(&r, &format!("echo at {ip}"));
    }
}

on_each_runtime! {
fn egress_none_blocks_everything(rt) {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(rt.spaced_args()).unwrap();
    let id = s.create(&["--egress", "none"]);
    install_probe(&s, &id);
    assert_eq!(sandbox_network(&s, &id)["egress"], "none");
    // The CLI shows the sandbox's address (and accepts --json: its output is JSON anyway).
    let shown: serde_json::Value =
        serde_json::from_str(&s.space_ok(&["inspect", &id, "--json"])).unwrap();
    let address: Ipv4Addr = shown["network"]["address"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(address, sandbox_ip(&s, &id));

    let r = net(&s, &id, &["dns", "api.example.test"]);
    assert_eq!(dns_rcode(&r), Some(5), "DNS must be REFUSED: {r}");
    for (ip, port) in [
        (WEB_IP, 443),
        (WEB_IP, 80),
        (RAW_IP, ECHO_PORT),
        (FAR_IP, ECHO_PORT),
    ] {
        let r = net(&s, &id, &["connect", &addr(ip, port)]);
        assert_blocked(&r, &format!("connect {ip}:{port}"));
    }
    let web = WEB_IP.to_string();
    let r = net(
        &s,
        &id,
        &["https", "https://api.example.test/", "--ip", &web],
    );
    assert_blocked(&r, "https api");
    let r = net(&s, &id, &["http", "http://api.example.test/", "--ip", &web]);
    assert_http_refused(&r, "http api");
    // A direct query to the upstream resolver is not a way out either.
    let r = net(
        &s,
        &id,
        &["dns", "api.example.test", "--server", &DNS_IP.to_string()],
    );
    assert_ne!(r["addrs"], json!([web]), "{r}");

    assert!(lab.http_hits().is_empty(), "{:?}", lab.http_hits());
    assert!(lab.tcp_hits().is_empty(), "{:?}", lab.tcp_hits());
}
}

on_each_runtime! {
fn allowlist_admits_exactly_allowed_names_and_cidrs(rt) {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(rt.spaced_args()).unwrap();
    let id = s.create(&[
        "--egress",
        "allowlist",
        "--allow",
        "api.example.test",
        "--allow",
        "203.0.113.11/32",
    ]);
    install_probe(&s, &id);
    let n = sandbox_network(&s, &id);
    assert_eq!(n["egress"], "allowlist");
    assert_eq!(n["allow"], json!(["api.example.test", "203.0.113.11/32"]));
    let web = WEB_IP.to_string();

    // Names: DNS answers allowed names and refuses the rest.
    let r = net(&s, &id, &["dns", "api.example.test"]);
    assert_eq!(r["addrs"], json!([web]), "{r}");
    for name in [
        "other.example.test",
        "raw.example.test",
        "nope.example.test",
    ] {
        let r = net(&s, &id, &["dns", name]);
        assert_eq!(dns_rcode(&r), Some(5), "{name}: {r}");
    }
    // HTTPS and HTTP to the allowed name reach the real server (pass-through: the sandbox
    // checks the server's own certificate, from the lab CA).
    s.space_ok(&[
        "cp",
        lab.ca_path().to_str().unwrap(),
        &format!("{id}:/tmp/lab-ca.pem"),
    ]);
    let r = net(
        &s,
        &id,
        &[
            "https",
            "https://api.example.test/a",
            "--ca",
            "/tmp/lab-ca.pem",
        ],
    );
    assert_eq!(r["status"], 200, "{r}");
    let r = net(&s, &id, &["http", "http://api.example.test/b"]);
    assert_eq!(r["status"], 200, "{r}");
    // Another name on the same address does not, whatever the sandbox puts in SNI/Host.
    let r = net(
        &s,
        &id,
        &[
            "https",
            "https://other.example.test/c",
            "--ip",
            &web,
            "--ca",
            "/tmp/lab-ca.pem",
        ],
    );
    assert_blocked(&r, "https other.example.test");
    let r = net(
        &s,
        &id,
        &["http", "http://other.example.test/d", "--ip", &web],
    );
    assert_http_refused(&r, "http other.example.test");
    let paths: Vec<String> = lab.http_hits().iter().map(|h| h.path.clone()).collect();
    assert_eq!(paths, vec!["/a", "/b"], "only allowed requests arrive");

    // CIDRs: 203.0.113.11/32 yes, on 80 and 443 only (a rule without ports); 198.51.100.20
    // no. Each of these listens.
    let raw = RAW_IP.to_string();
    let r = net(&s, &id, &["http", &format!("http://{raw}/raw"), "--ip", &raw]);
    assert_eq!(r["status"], 200, "{r}");
    assert_blocked(
        &net(&s, &id, &["connect", &addr(RAW_IP, ECHO_PORT), "--no-echo"]),
        "raw .11 on a port no rule names",
    );
    assert_blocked(&net(&s, &id, &["connect", &addr(FAR_IP, ECHO_PORT)]), "far");
    // A rule that names the port opens it, and only it.
    s.space_ok(&[
        "net",
        &id,
        "--egress",
        "allowlist",
        "--allow",
        "203.0.113.11/32:7000",
    ]);
    assert_ok(
        &net(&s, &id, &["connect", &addr(RAW_IP, ECHO_PORT)]),
        "raw .11:7000",
    );
    let r = net(&s, &id, &["http", &format!("http://{raw}/raw2"), "--ip", &raw]);
    assert_http_refused(&r, "raw .11:80 once the rule names 7000 only");

    // Wildcards; addresses learnt through DNS are reachable on the name's ports.
    s.space_ok(&[
        "net",
        &id,
        "--egress",
        "allowlist",
        "--allow",
        "*.example.test",
    ]);
    let r = net(&s, &id, &["dns", "far.example.test"]);
    assert_eq!(r["addrs"], json!([FAR_IP.to_string()]), "{r}");
    assert_blocked(
        &net(&s, &id, &["connect", &addr(FAR_IP, ECHO_PORT), "--no-echo"]),
        "far after DNS, on a port the rule does not name",
    );
    s.space_ok(&[
        "net",
        &id,
        "--egress",
        "allowlist",
        "--allow",
        "*.example.test:7000",
    ]);
    let r = net(&s, &id, &["dns", "far.example.test"]);
    assert_eq!(r["addrs"], json!([FAR_IP.to_string()]), "{r}");
    assert_ok(
        &net(&s, &id, &["connect", &addr(FAR_IP, ECHO_PORT)]),
        "far after DNS",
    );
    assert_blocked(
        &net(&s, &id, &["connect", &addr(RAW_IP, ECHO_PORT)]),
        "raw: no longer allowed",
    );
    let r = net(&s, &id, &["dns", "example.test"]);
    assert_eq!(
        dns_rcode(&r),
        Some(5),
        "the apex is not under *.example.test: {r}"
    );
}
}

on_each_runtime! {
fn open_reaches_the_internet_but_not_the_node_or_neighbours(rt) {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(rt.spaced_args()).unwrap();
    let node = s.net.as_ref().unwrap();
    let a = s.create(&[]);
    let b = s.create(&[]);
    install_probe(&s, &a);
    assert_eq!(sandbox_network(&s, &a)["egress"], "open");
    let gw: Ipv4Addr = sandbox_network(&s, &a)["gateway"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let b_ip = sandbox_ip(&s, &b);

    // The fake internet.
    let r = net(&s, &a, &["dns", "other.example.test"]);
    assert_eq!(r["addrs"], json!([WEB_IP.to_string()]), "{r}");
    assert_eq!(
        net(&s, &a, &["http", "http://other.example.test/"])["status"],
        200
    );
    assert_ok(&net(&s, &a, &["connect", &addr(RAW_IP, ECHO_PORT)]), "raw");
    assert_ok(&net(&s, &a, &["connect", &addr(FAR_IP, ECHO_PORT)]), "far");

    // Things that listen but must stay out of reach.
    let port = 7777;
    let _node_any = echo_listener(Some(node), Ipv4Addr::UNSPECIFIED, port);
    let _host = echo_listener(None, node.host_ip, port);
    // busybox httpd daemonizes, so it outlives the exec.
    let (code, _, err) = s.sh(&b, "busybox httpd -p 7000 -h /tmp");
    assert_eq!(code, 0, "{err}");
    let mut targets = vec![
        (NODE_IP, port, "the node's lab address"),
        (node.node_ip, port, "the node's API-side address"),
        (node.node_ip, 7070, "the API itself"),
        (gw, port, "the sandbox's gateway"),
        (node.host_ip, port, "the harness host side"),
        (b_ip, 7000, "another sandbox"),
        (META_IP, ECHO_PORT, "the metadata address"),
    ];
    for ip in PRIVATE_IPS {
        targets.push((ip, ECHO_PORT, "a private range"));
    }
    for ip in METADATA_IPS {
        targets.push((ip, ECHO_PORT, "a cloud metadata address"));
    }
    // Each of these listens; a TCP handshake alone would be a breach (--no-echo).
    for (ip, p, what) in &targets {
        let r = net(&s, &a, &["connect", &addr(*ip, *p), "--no-echo"]);
        assert_blocked(&r, &format!("{what} ({ip}:{p})"));
    }
    install_probe(&s, &b);
    assert_ok(
        &net(&s, &b, &["connect", "127.0.0.1:7000", "--no-echo"]),
        "the neighbour's server is up",
    );
    for ip in [META_IP].into_iter().chain(METADATA_IPS) {
        let r = net(
            &s,
            &a,
            &["http", &format!("http://{ip}/latest/meta-data/")],
        );
        assert_http_refused(&r, &format!("metadata over HTTP ({ip})"));
    }
    // IPv6: the metadata addresses, and IPv4 metadata written as IPv4-mapped IPv6.
    let mut v6 = METADATA_IPS6
        .iter()
        .map(|ip| format!("[{ip}]:{ECHO_PORT}"))
        .collect::<Vec<_>>();
    v6.push(format!("[::ffff:{META_IP}]:{ECHO_PORT}"));
    v6.push(format!("[::ffff:{}]:{ECHO_PORT}", METADATA_IPS[0]));
    for target in &v6 {
        let r = net(&s, &a, &["connect", target, "--no-echo"]);
        assert_blocked(&r, &format!("IPv6 metadata ({target})"));
    }
    let hits = lab.tcp_hits();
    let reserved = |ip: std::net::IpAddr| {
        ip == META_IP
            || PRIVATE_IPS.iter().chain(&METADATA_IPS).any(|p| ip == *p)
            || METADATA_IPS6.iter().any(|p| ip == *p)
    };
    assert!(hits.iter().all(|h| !reserved(h.local.ip())), "{hits:?}");
    assert!(
        lab.http_hits()
            .iter()
            .all(|h| !h.path.starts_with("/latest")),
        "{:?}",
        lab.http_hits()
    );
    // The same targets answer from the node's namespace: blocked by policy, not by routing.
    for (ip, what) in [(META_IP, "metadata"), (PRIVATE_IPS[0], "private")]
        .into_iter()
        .chain(METADATA_IPS.map(|ip| (ip, "metadata")))
    {
        assert_ok(&net_in_ns(node, &["connect", &addr(ip, ECHO_PORT)]), what);
    }
    for ip in METADATA_IPS6 {
        let target = format!("[{ip}]:{ECHO_PORT}");
        assert_ok(&net_in_ns(node, &["connect", &target]), "IPv6 metadata");
    }
    // A rule that contains a metadata address opens its range, never the address.
    s.space_ok(&[
        "net",
        &a,
        "--egress",
        "allowlist",
        "--allow",
        "100.64.0.0/10:*",
        "--allow",
        "168.63.0.0/16:*",
        "--allow",
        "192.0.0.0/24:*",
    ]);
    assert_ok(
        &net(&s, &a, &["connect", &addr(PRIVATE_IPS[3], ECHO_PORT)]),
        "100.64.0.1 by its rule",
    );
    for ip in METADATA_IPS {
        let r = net(&s, &a, &["connect", &addr(ip, ECHO_PORT), "--no-echo"]);
        assert_blocked(&r, &format!("{ip} inside an allowed range"));
        let r = net(&s, &a, &["http", &format!("http://{ip}/latest/meta-data/")]);
        assert_http_refused(&r, &format!("{ip} over HTTP inside an allowed range"));
    }
    assert_ok(
        &net_in_ns(node, &["connect", &addr(NODE_IP, port)]),
        "node listener",
    );
}
}

/// The MAC the node gives the guest NIC of sandbox `id` (`runtime::microvm::mac_for`).
fn vm_mac(id: &str) -> String {
    use sha2::Digest;
    let h = sha2::Sha256::digest(id.as_bytes());
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        h[0], h[1], h[2], h[3], h[4]
    )
}

/// The interfaces in the network namespace of process `pid`.
fn interfaces_of(pid: u64) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/net/dev"))
        .unwrap()
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(|n| n.trim().to_owned())
        .collect()
}

/// What is specific to a microvm: its link, its MAC, a restored guest's network, QEMU's
/// place in the slot, and a guest root that re-addresses its NIC to get around the policy.
#[test]
fn a_microvm_is_networked_through_its_slot_and_cannot_spoof_its_way_out() {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(&["--default-runtime", "microvm"]).unwrap();
    let a = s.create(&[]);
    // A restored VM (the template's warm checkpoint, made in the background after the first
    // create) must be networked too: its link came from the checkpoint's builder.
    let deadline = Instant::now() + Duration::from_secs(180);
    let b = loop {
        let b = s.create(&[]);
        if s.inspect(&b)["restored"] == true {
            break b;
        }
        s.space_ok(&["rm", &b]);
        assert!(Instant::now() < deadline, "no create restored a checkpoint");
        std::thread::sleep(Duration::from_secs(2));
    };
    for id in [&a, &b] {
        install_probe(&s, id);
        let (code, o, e) = s.sh(
            id,
            "cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0; ip route; \
             cat /etc/resolv.conf; test -s /etc/space/ca.pem && echo ca",
        );
        assert_eq!(code, 0, "{e}");
        assert!(o.starts_with(&vm_mac(id)), "{id}: {o}");
        assert!(o.contains("inet 169.254.0.2/30"), "{o}");
        assert!(o.contains("default via 169.254.0.1"), "{o}");
        assert!(o.contains("nameserver 169.254.0.1"), "{o}");
        assert!(o.trim_end().ends_with("ca"), "{o}");
        // The sandbox's address outside is its slot's, as for a namespace sandbox.
        assert!(sandbox_ip(&s, id).to_string().starts_with("10."), "{id}");
        let r = net(&s, id, &["dns", "api.example.test"]);
        assert_eq!(r["addrs"], json!([WEB_IP.to_string()]), "{r}");
        assert_ok(&net(&s, id, &["connect", &addr(RAW_IP, ECHO_PORT)]), "raw");
        // QEMU lives in the slot: the tap and the slot's veth, nothing of the node's.
        let qemu = s.inspect(id)["init_pid"].as_u64().unwrap();
        let mut ifaces = interfaces_of(qemu);
        ifaces.sort();
        assert_eq!(ifaces, ["eth0", "lo", "tap0"], "{id}");
    }
    assert_ne!(vm_mac(&a), vm_mac(&b));
    // The template's pool, of namespace sandboxes, builds on a node whose default runtime
    // is microvm (its members were once built as microvm disks and every launch failed).
    let log = std::fs::read_to_string(s.log_path()).unwrap_or_default();
    assert!(
        !log.contains("building a pool sandbox failed"),
        "{}",
        s.log_tail()
    );

    // The node's end of the link answers only the redirected DNS and HTTP(S).
    for port in [22, 53_000, 15001, 7070] {
        let r = net(
            &s,
            &b,
            &[
                "connect",
                &addr(Ipv4Addr::new(169, 254, 0, 1), port),
                "--no-echo",
            ],
        );
        assert_blocked(&r, &format!("the gateway's port {port}"));
    }

    // Root in the guest re-addresses its NIC: whatever leaves with another source address
    // is dropped in the slot, so the policy cannot be sidestepped that way.
    let hits = lab.tcp_hits().len();
    let (code, _, e) = s.sh(
        &b,
        "ip addr flush dev eth0 && ip addr add 169.254.0.3/30 dev eth0 && \
         ip route add default via 169.254.0.1",
    );
    assert_eq!(code, 0, "{e}");
    let r = net(&s, &b, &["connect", &addr(RAW_IP, ECHO_PORT)]);
    assert_blocked(&r, "a spoofed source address");
    assert_eq!(lab.tcp_hits().len(), hits, "a spoofed packet got out");
    let (code, _, e) = s.sh(
        &b,
        "ip addr flush dev eth0 && ip addr add 169.254.0.2/30 dev eth0 && \
         ip route add default via 169.254.0.1",
    );
    assert_eq!(code, 0, "{e}");
    assert_ok(&net(&s, &b, &["connect", &addr(RAW_IP, ECHO_PORT)]), "back");

    // The policy applies to a VM as to any sandbox, at once.
    let (code, body) = s.call(
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{b}/network"),
        Some(json!({"egress": "none"})),
    );
    assert_eq!(code, 200, "{body}");
    assert_blocked(&net(&s, &b, &["connect", &addr(RAW_IP, ECHO_PORT)]), "none");
    for id in [&a, &b] {
        s.space_ok(&["rm", id]);
    }
}

on_each_runtime! {
fn policy_changes_apply_at_once_and_cut_held_connections(rt) {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(rt.spaced_args()).unwrap();
    let id = s.create(&[]);
    install_probe(&s, &id);

    // An open connection, cut when the policy stops allowing it.
    let hold = s
        .cli()
        .args([
            "exec",
            &id,
            "--",
            PROBE,
            "net",
            "hold",
            &addr(RAW_IP, ECHO_PORT),
            "20",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || lab.received("ping\n")),
        "the held connection never reached the echo server"
    );
    std::thread::sleep(Duration::from_millis(300));
    let changed_at = started.elapsed();
    let out = s.space_ok(&["net", &id, "--egress", "none"]);
    assert!(out.contains("none"), "{out}");
    let out = hold.wait_with_output().unwrap();
    let r = parse_report(&out.stdout, &out.stderr, "hold");
    assert_eq!(
        r["cut"], true,
        "the connection survived the new policy: {r}"
    );
    let cut_ms = r["cut_after_ms"].as_f64().unwrap();
    assert!(
        cut_ms < changed_at.as_millis() as f64 + 5000.0,
        "cut {cut_ms} ms after start, policy changed at {changed_at:?}"
    );
    assert_eq!(sandbox_network(&s, &id)["egress"], "none");
    assert_blocked(
        &net(&s, &id, &["connect", &addr(RAW_IP, ECHO_PORT)]),
        "raw after none",
    );

    // Back to an allowlist: new connections to the allowed CIDR work at once...
    s.space_ok(&[
        "net",
        &id,
        "--egress",
        "allowlist",
        "--allow",
        "203.0.113.11/32:7000",
    ]);
    assert_ok(
        &net(&s, &id, &["connect", &addr(RAW_IP, ECHO_PORT)]),
        "raw allowed again",
    );
    // ...and a change that still allows a held connection does not cut it.
    let hold = s
        .cli()
        .args([
            "exec",
            &id,
            "--",
            PROBE,
            "net",
            "hold",
            &addr(RAW_IP, ECHO_PORT),
            "3",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    s.space_ok(&[
        "net",
        &id,
        "--egress",
        "allowlist",
        "--allow",
        "203.0.113.11/32:7000",
        "--allow",
        "api.example.test",
    ]);
    let out = hold.wait_with_output().unwrap();
    let r = parse_report(&out.stdout, &out.stderr, "hold 2");
    assert_eq!(r["cut"], false, "a still-allowed connection was cut: {r}");
    let n = sandbox_network(&s, &id);
    assert_eq!(
        n["allow"],
        json!(["203.0.113.11/32:7000", "api.example.test"]),
        "{n}"
    );
}
}

on_each_runtime! {
fn secrets_reach_only_the_bound_host_and_never_the_sandbox(rt) {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(rt.spaced_args()).unwrap();
    let secret = format!("real-secret-{}", random_hex(16));
    let (ok, out) = set_secret(
        &s,
        "TOKEN",
        &secret,
        &["api.example.test"],
        "Authorization: Bearer {}",
    );
    assert!(ok, "{out}");
    assert!(!out.contains(&secret), "set echoed the value: {out}");
    let ls = s.space_ok(&["secret", "ls"]);
    assert!(ls.contains("TOKEN") && !ls.contains(&secret), "{ls}");
    let (code, v) = s.call(reqwest::Method::GET, "/v1/secrets/TOKEN", None);
    assert_eq!(code, 200, "{v}");
    assert!(!v.to_string().contains(&secret), "{v}");

    let id = s.create(&["--secret", "TOKEN"]);
    install_probe(&s, &id);
    assert_eq!(s.inspect(&id)["secrets"], json!(["TOKEN"]));

    // Inside: a placeholder, never the value.
    let env = net(&s, &id, &["env"]);
    let ph = env["env"]["TOKEN"]
        .as_str()
        .expect("TOKEN is set")
        .to_string();
    assert!(
        ph.starts_with("spc_ph_")
            && ph.len() == 39
            && ph[7..].chars().all(|c| c.is_ascii_hexdigit()),
        "placeholder {ph:?}"
    );
    assert!(!env.to_string().contains(&secret));

    // The bound host gets the real value, in the bound header only; the sandbox trusts the
    // node CA through SSL_CERT_FILE.
    let r = net_sh(
        &s,
        &id,
        r#"https https://api.example.test/quiet -H "Authorization: Bearer $TOKEN" -H "X-Copy: $TOKEN""#,
    );
    assert_eq!(r["status"], 200, "{r}");
    assert_eq!(r["body"], "ok");
    let hit = lab
        .http_hits()
        .into_iter()
        .find(|h| h.path == "/quiet")
        .expect("the request arrived");
    assert!(hit.tls);
    assert_eq!(hit.sni.as_deref(), Some("api.example.test"));
    assert_eq!(
        hit.header("authorization"),
        Some(format!("Bearer {secret}").as_str())
    );
    assert_eq!(
        hit.header("x-copy"),
        Some(ph.as_str()),
        "other headers are not substituted"
    );

    // Reflection: an unbound host and plain HTTP to the bound host see the placeholder only.
    // echo.example.test is not intercepted: the sandbox checks the lab's own certificate.
    s.space_ok(&[
        "cp",
        lab.ca_path().to_str().unwrap(),
        &format!("{id}:/tmp/lab-ca.pem"),
    ]);
    let r = net_sh(
        &s,
        &id,
        r#"https https://echo.example.test/reflect --ca /tmp/lab-ca.pem -H "Authorization: Bearer $TOKEN""#,
    );
    assert_eq!(r["status"], 200, "{r}");
    let body = r["body"].as_str().unwrap();
    assert!(body.contains(&ph) && !body.contains(&secret), "{body}");
    let r = net_sh(
        &s,
        &id,
        r#"http http://api.example.test/plain -H "Authorization: Bearer $TOKEN""#,
    );
    assert_eq!(r["status"], 200, "{r}");
    let body = r["body"].as_str().unwrap();
    assert!(body.contains(&ph) && !body.contains(&secret), "{body}");
    for h in lab.http_hits() {
        let carries = h.headers.values().flatten().any(|v| v.contains(&secret));
        assert_eq!(
            carries,
            h.path == "/quiet",
            "the secret reached {} {} (sni {:?})",
            h.path,
            h.header("host").unwrap_or(""),
            h.sni
        );
    }

    // Nowhere inside: environment and command line of every process, files, DNS answers.
    let g = net(
        &s,
        &id,
        &[
            "grep-proc",
            &format!(
                "hex:{}",
                secret
                    .bytes()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            ),
            "/etc",
            "/root",
            "/tmp",
            "/run",
            "/var",
            "/home",
            "/opt",
        ],
    );
    assert_eq!(g["found"], json!([]), "{g}");
    assert!(g["pids"].as_u64().unwrap() >= 2, "{g}");
    let g = net(&s, &id, &["grep-proc", &ph, "/etc"]);
    assert!(
        !g["found"].as_array().unwrap().is_empty(),
        "the search itself works (the placeholder is in the environment): {g}"
    );
    let r = net(&s, &id, &["dns", "api.example.test"]);
    assert!(!r.to_string().contains(&secret));

    // Not in spaced's log, not in the store in clear.
    assert!(
        !std::fs::read_to_string(s.log_path())
            .unwrap()
            .contains(&secret)
    );
    for e in std::fs::read_dir(s.data_dir()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("space.db") {
            let b = std::fs::read(e.path()).unwrap();
            assert!(
                !b.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{name} holds the secret in clear"
            );
        }
    }
    // Not in a snapshot (its files are the sandbox's), not in the events.
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    let snap_dir = s
        .data_dir()
        .join("volume/sandboxes")
        .join(&id)
        .join("snapshots")
        .join(&snap);
    let grep = std::process::Command::new("grep")
        .args(["-r", "-F", "-l", "-s", &secret])
        .arg(&snap_dir)
        .output()
        .unwrap();
    assert!(snap_dir.is_dir(), "{}", snap_dir.display());
    assert_eq!(
        grep.status.code(),
        Some(1),
        "grep found the secret in the snapshot: {}",
        String::from_utf8_lossy(&grep.stdout)
    );
    let events = s.space_ok(&["events", &id]);
    assert!(
        events.contains("create") && !events.contains(&secret),
        "{events}"
    );
}
}

#[test]
fn bad_network_input_gives_clear_errors() {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(&[]).unwrap();
    let fails = |args: &[&str], needle: &str| {
        let out = s.space(args);
        let err = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "space {args:?} succeeded: {err}");
        assert!(
            err.contains(needle),
            "space {args:?}: {err:?} lacks {needle:?}"
        );
    };
    fails(
        &["create", "--egress", "allowlist", "--allow", "10.0.0.0/33"],
        "10.0.0.0/33",
    );
    fails(
        &["create", "--egress", "allowlist", "--allow", "300.1.2.3"],
        "300.1.2.3",
    );
    fails(
        &[
            "create",
            "--egress",
            "allowlist",
            "--allow",
            "bad_domain!.com",
        ],
        "bad_domain!.com",
    );
    fails(&["create", "--egress", "sideways"], "sideways");
    fails(&["create", "--secret", "MISSING"], "MISSING");

    for (hosts, header, needle) in [
        (&["*"][..], "Authorization: Bearer {}", "*"),
        (&["*.com"][..], "Authorization: Bearer {}", "*.com"),
        (&["api.example.test"][..], "Authorization: Bearer", "{}"),
        (&["api.example.test"][..], "Authorization: {} {}", "{}"),
    ] {
        let (ok, out) = set_secret(&s, "BAD", "v", hosts, header);
        assert!(!ok, "{hosts:?} {header:?} accepted: {out}");
        assert!(
            out.contains(needle),
            "{hosts:?} {header:?}: {out:?} lacks {needle:?}"
        );
    }
    let (ok, _) = set_secret(&s, "9BAD", "v", &["api.example.test"], "X: {}");
    assert!(!ok, "a name starting with a digit");

    let id = s.create(&["--egress", "allowlist", "--allow", "api.example.test"]);
    fails(&["net", &id, "--allow", "1.2.3.4/40"], "1.2.3.4/40");
    // A refused update changes nothing.
    assert_eq!(
        sandbox_network(&s, &id)["allow"],
        json!(["api.example.test"])
    );
    let (code, v) = s.call(
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "allowlist", "allow": ["*"]})),
    );
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["code"], "invalid_argument", "{v}");

    s.space_ok(&["rm", &id]);
    fails(&["net", &id, "--egress", "none"], "not_found");
    let (code, _) = s.call(
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{id}/network"),
        Some(json!({"egress": "none", "allow": []})),
    );
    assert_eq!(code, 404);
}

on_each_runtime! {
fn inbound_port_serves_a_server_inside_the_sandbox(rt) {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(rt.spaced_args()).unwrap();
    // Inbound works whatever the egress policy.
    let id = s.create(&["--egress", "none"]);
    let (code, _, err) = s.sh(
        &id,
        "mkdir -p /www && echo hello-from-sandbox > /www/index.html && busybox httpd -p 8080 -h /www",
    );
    assert_eq!(code, 0, "{err}");
    let url = s.space_ok(&["port", &id, "8080"]).trim().to_string();
    assert!(url.starts_with(&s.url) && url.contains("/p/"), "{url}");

    let get = |u: &str| {
        let out = std::process::Command::new("curl")
            .args(["-sS", "-o", "-", "-w", "\n%{http_code}", u])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "000"));
        (code.parse::<u16>().unwrap_or(0), body.to_string())
    };
    assert!(
        eventually(Duration::from_secs(5), || get(&format!("{url}index.html"))
            .0
            == 200),
        "httpd never answered through {url}"
    );
    let (code, body) = get(&format!("{url}index.html"));
    assert_eq!((code, body.trim()), (200, "hello-from-sandbox"));

    // The token is the credential: a tampered one is a plain 404.
    let token = url
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let mut bad = token.clone();
    let last = bad.pop().unwrap();
    bad.push(if last == '0' { '1' } else { '0' });
    let (code, _) = get(&url.replace(&token, &bad));
    assert_eq!(code, 404);
    let (code, _) = get(&url.replace(&token, &token.replace(".8080.", ".8081.")));
    assert_eq!(code, 404, "a token is bound to its port");
    // An upgraded connection (as for a WebSocket) is piped both ways.
    install_probe(&s, &id);
    s.space_ok(&[
        "exec",
        "-d",
        &id,
        "--",
        PROBE,
        "net",
        "upgrade-echo",
        "8081",
    ]);
    let ws = s.space_ok(&["port", &id, "8081"]).trim().to_string();
    let (host, path) = ws
        .strip_prefix("http://")
        .and_then(|r| r.split_once('/'))
        .expect("http URL");
    let upgraded = eventually(Duration::from_secs(5), || {
        use std::io::{Read, Write};
        let Ok(mut c) = std::net::TcpStream::connect(host) else {
            return false;
        };
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let req = format!(
            "GET /{path}chat HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        );
        if c.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && c.read(&mut b).is_ok_and(|n| n == 1) {
            head.push(b[0]);
        }
        if !String::from_utf8_lossy(&head).starts_with("HTTP/1.1 101") {
            return false;
        }
        let frame = b"\x81\x05hello, both ways";
        c.write_all(frame).unwrap();
        let mut back = vec![0u8; frame.len()];
        c.read_exact(&mut back).is_ok() && back == frame
    });
    assert!(upgraded, "no upgraded, echoing connection through {ws}");

    // The node's DNS resolver and egress proxy share a namespace sandbox's loopback: no port
    // URL leads to them (the proxy would carry a stranger's requests out as the sandbox).
    for (port, what) in [("53", "DNS resolver"), ("15001", "egress proxy")] {
        let out = s.space(&["port", &id, port]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(what), "port {port}: {err}");
    }

    // A port nobody listens on: 502.
    let url2 = s.space_ok(&["port", &id, "9999"]).trim().to_string();
    let (code, body) = get(&url2);
    assert_eq!(code, 502, "{body}");
    assert!(body.contains("unavailable"), "{body}");
}
}

/// Proxy cost, measured with the same client (the static probe) from two places:
/// - direct: in the node's namespace, straight to the lab server (no proxy, no policy);
/// - pass-through: inside a sandbox (egress open), via the egress proxy, TLS end to end;
/// - MITM: inside a sandbox with a secret bound to the host, TLS terminated by the proxy.
///
/// Each request is a fresh TCP+TLS connection (Connection: close), so the difference is what
/// a sandbox pays per new connection: nft redirect, peek, upstream connect, and for MITM a
/// second handshake with a leaf certificate. Throughput is a 64 MiB body, same three paths.
/// The probe runs `--repeat` inside one exec, so exec overhead is not counted.
#[test]
#[ignore]
fn bench_egress_proxy() {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(&[]).unwrap();
    let node = s.net.as_ref().unwrap();
    let (ok, out) = set_secret(
        &s,
        "TOKEN",
        "bench",
        &["api.example.test"],
        "Authorization: Bearer {}",
    );
    assert!(ok, "{out}");
    let plain = s.create(&[]);
    let mitm = s.create(&["--secret", "TOKEN"]);
    for id in [&plain, &mitm] {
        install_probe(&s, id);
    }
    s.space_ok(&[
        "cp",
        lab.ca_path().to_str().unwrap(),
        &format!("{plain}:/tmp/lab-ca.pem"),
    ]);
    let ca = lab.ca_path().display().to_string();
    let web = WEB_IP.to_string();
    let n = "300";
    let big = format!("https://api.example.test/bytes/{}", 64 << 20);

    let direct = net_in_ns(
        node,
        &[
            "https",
            "https://api.example.test/quiet",
            "--ip",
            &web,
            "--ca",
            &ca,
            "--repeat",
            n,
        ],
    );
    let pass = net(
        &s,
        &plain,
        &[
            "https",
            "https://api.example.test/quiet",
            "--ca",
            "/tmp/lab-ca.pem",
            "--repeat",
            n,
        ],
    );
    let mitm_r = net(
        &s,
        &mitm,
        &["https", "https://api.example.test/quiet", "--repeat", n],
    );
    let direct_big = net_in_ns(
        node,
        &["https", &big, "--ip", &web, "--ca", &ca, "--discard"],
    );
    let pass_big = net(
        &s,
        &plain,
        &["https", &big, "--ca", "/tmp/lab-ca.pem", "--discard"],
    );
    let mitm_big = net(&s, &mitm, &["https", &big, "--discard"]);

    println!("proxied HTTPS request, new connection each ({n} requests):");
    println!(
        "{:<14} {:>8} {:>8} {:>8}",
        "path", "p50 ms", "p90 ms", "p99 ms"
    );
    for (name, r) in [
        ("direct", &direct),
        ("pass-through", &pass),
        ("mitm", &mitm_r),
    ] {
        assert_ok(r, name);
        println!(
            "{name:<14} {:>8.2} {:>8.2} {:>8.2}",
            r["p50_ms"].as_f64().unwrap(),
            r["p90_ms"].as_f64().unwrap(),
            r["p99_ms"].as_f64().unwrap()
        );
    }
    println!("64 MiB download:");
    for (name, r) in [
        ("direct", &direct_big),
        ("pass-through", &pass_big),
        ("mitm", &mitm_big),
    ] {
        assert_ok(r, name);
        let bytes = r["bytes"].as_f64().unwrap();
        let ms = r["ms"].as_f64().unwrap();
        assert_eq!(bytes as u64, 64 << 20, "{name}: {r}");
        println!(
            "{name:<14} {:>8.1} MB/s ({ms:.0} ms)",
            bytes / 1e6 / (ms / 1e3)
        );
    }
}

/// Secrets are per tenant (decision 0048): two tenants set a secret of the same name, each
/// binds its own, and each request leaves the node with its own tenant's value; a third
/// tenant cannot bind either.
#[test]
fn each_tenant_binds_its_own_secret_of_a_name() {
    let lab = NetLab::new().unwrap();
    let s = lab.start_spaced(&[]).unwrap();
    let mut keys = Vec::new();
    for t in ["team-a", "team-b", "team-c"] {
        s.space_ok(&["tenant", "create", t]);
        keys.push(
            s.space_ok(&["key", "create", "--tenant", t])
                .trim()
                .to_owned(),
        );
    }
    let values = [
        format!("a-secret-{}", random_hex(8)),
        format!("b-secret-{}", random_hex(8)),
    ];
    for (key, value) in keys.iter().zip(&values) {
        let (ok, out) = set_secret_as(
            &s,
            key,
            "TOKEN",
            value,
            &["api.example.test"],
            "Authorization: Bearer {}",
        );
        assert!(ok, "{out}");
    }
    let as_key = |key: &str, args: &[&str]| {
        s.cli()
            .env("SPACE_API_KEY", key)
            .args(args)
            .output()
            .unwrap()
    };
    // The admin key's tenant (default) has no such secret, and a third tenant neither.
    let ls = s.space_ok(&["secret", "ls"]);
    assert!(!ls.contains("TOKEN"), "{ls}");
    let out = as_key(&keys[2], &["create", "--secret", "TOKEN"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("secret TOKEN not found"),
        "{err}"
    );
    for (i, (key, value)) in keys.iter().zip(&values).enumerate() {
        let out = as_key(key, &["create", "--secret", "TOKEN"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        install_probe(&s, &id);
        let path = format!("/tenant-{i}");
        let r = net_sh(
            &s,
            &id,
            &format!(r#"https https://api.example.test{path} -H "Authorization: Bearer $TOKEN""#),
        );
        assert_eq!(r["status"], 200, "{r}");
        let hit = lab
            .http_hits()
            .into_iter()
            .find(|h| h.path == path)
            .expect("the request arrived");
        assert_eq!(
            hit.header("authorization"),
            Some(format!("Bearer {value}").as_str()),
            "tenant {i}'s request"
        );
    }
}
