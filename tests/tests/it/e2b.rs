//! E2B compatibility (issue 13, decision 0022): the official SDKs, unpatched, against a real
//! spaced. The SDK-side tests live in `tests/e2b/`; these drive them with the environment
//! `space e2b env` prints, inside the node's network namespace.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use space_tests::netlab::NetLab;
use space_tests::*;

/// The `export` lines `space e2b env ARGS` prints, as (name, value); their names must be
/// `names`.
fn e2b_env_of(s: &Spaced, args: &[&str], names: &[&str]) -> Vec<(String, String)> {
    let out = s.space_ok(&[&["e2b", "env"], args].concat());
    let vars: Vec<(String, String)> = out
        .lines()
        .map(|l| {
            let (k, v) = l
                .strip_prefix("export ")
                .and_then(|l| l.split_once('='))
                .unwrap_or_else(|| panic!("not an export line: {l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect();
    let got: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(got, names, "{out}");
    vars
}

/// The three `export` lines of `space e2b env`.
fn e2b_env(s: &Spaced) -> Vec<(String, String)> {
    let vars = e2b_env_of(s, &[], &["E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"]);
    assert_eq!(vars[1].1, s.url);
    vars
}

/// `cmd` run in `tests/e2b/<dir>` with `vars` and no proxy: the SDK talks to the test's
/// namespaces only.
fn in_sdk_dir(cmd: &mut Command, dir: &str, vars: Vec<(String, String)>) {
    cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b").join(dir))
        .envs(vars)
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env("NO_PROXY", "*");
}

/// `program` in `tests/e2b/<dir>` with `space e2b env`'s environment and the node's key.
fn sdk_command(s: &Spaced, program: &Path, dir: &str) -> Command {
    let mut cmd = Command::new(program);
    in_sdk_dir(&mut cmd, dir, e2b_env(s));
    cmd.env("SPACE_API_KEY", &s.key);
    cmd
}

/// Runs `cmd`; fails with its output and the node's log unless it succeeds. Returns stdout
/// (stderr is passed on).
fn run_sdk(s: &Spaced, mut cmd: Command) -> String {
    let out = cmd.output().expect("run the SDK's tests");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{stdout}{stderr}\nspaced log:\n{}",
        s.log_tail()
    );
    eprintln!("{stderr}");
    stdout
}

/// Runs `python ARGS` in `tests/e2b/python` with the SDK's Python. Returns stdout.
fn run_python(s: &Spaced, python: &Path, args: &[&str]) -> String {
    let mut cmd = sdk_command(s, python, "python");
    cmd.args(args);
    run_sdk(s, cmd)
}

#[test]
fn the_official_python_sdk_runs_against_space() {
    let Some(python) = e2b_python() else { return };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    run_python(
        &s,
        &python,
        &["-m", "unittest", "-v", "test_sdk", "test_files"],
    );
}

/// Tenant keys through the official Python SDK (decision 0040): each sees, reaches and
/// kills only its own sandboxes (`tests/e2b/python/test_tenants.py`).
#[test]
fn tenant_keys_reach_only_their_own_sandboxes_through_the_python_sdk() {
    let Some(python) = e2b_python() else { return };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    let mut keys = Vec::new();
    for t in ["team-a", "team-b"] {
        s.space_ok(&["tenant", "create", t]);
        let key = s.space_ok(&["key", "create", "--tenant", t]);
        keys.push(space_api::e2b_key(key.trim()));
    }
    let mut cmd = sdk_command(&s, &python, "python");
    cmd.args(["-m", "unittest", "-v", "test_tenants"])
        .env("KEY_A", &keys[0])
        .env("KEY_B", &keys[1]);
    run_sdk(&s, cmd);
}

/// Runs `tests/e2b/js/test_sdk.cjs` with node's test runner against the JS SDK in
/// `node_modules`.
fn run_js(s: &Spaced, node: &Path, node_modules: &Path) {
    let mut cmd = sdk_command(s, node, "js");
    cmd.args(["--test", "--test-reporter=spec", "test_sdk.cjs"])
        .env("SPACE_E2B_JS", node_modules);
    eprintln!("{}", run_sdk(s, cmd));
}

/// The official JavaScript SDK, newest (2.51, the v2 paths): commands, PTY, files, watches,
/// lifecycle and errors.
#[test]
fn the_official_js_sdk_runs_against_space() {
    let (Some(node), Some(js)) = (e2b_node(), e2b_js()) else {
        return;
    };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    run_js(&s, &node, &js);
}

/// The older JS SDK (2.50), which creates and connects through the pre-v2 paths.
#[test]
fn an_older_js_sdk_on_the_pre_v2_paths_runs_against_space() {
    let (Some(node), Some(js)) = (e2b_node(), e2b_old_js()) else {
        return;
    };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    run_js(&s, &node, &js);
}

/// An older SDK (2.50), which still creates and connects through `POST /sandboxes` and
/// `POST /sandboxes/{id}/connect`, runs the same commands and lifecycle tests.
#[test]
fn an_older_python_sdk_on_the_pre_v2_paths_runs_against_space() {
    let Some(python) = e2b_old_python() else {
        return;
    };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    run_python(&s, &python, &["-m", "unittest", "-v", "test_sdk"]);
}

/// Builds the `code-interpreter` template from `templates/code-interpreter` with its
/// kernel's wheels (offline: the node's namespace has no internet), as docs/E2B.md says.
fn build_code_interpreter(s: &Spaced, wheels: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../templates/code-interpreter");
    let ctx = tempfile::tempdir().unwrap();
    for f in ["Dockerfile", "server.py"] {
        std::fs::copy(src.join(f), ctx.path().join(f)).unwrap();
    }
    std::fs::create_dir(ctx.path().join("wheels")).unwrap();
    for w in std::fs::read_dir(wheels)
        .unwrap()
        .map(|e| e.unwrap().path())
    {
        if w.extension().is_some_and(|e| e == "whl") {
            std::fs::copy(&w, ctx.path().join("wheels").join(w.file_name().unwrap())).unwrap();
        }
    }
    let dir = ctx.path().to_str().unwrap();
    s.space_ok(&[
        "template",
        "build",
        "code-interpreter",
        "-f",
        &format!("{dir}/Dockerfile"),
        dir,
        "--build-arg",
        "OFFLINE=1",
    ]);
    s.space_ok(&[
        "template",
        "set",
        "code-interpreter",
        "--start-cmd",
        "image",
        "--ready-cmd",
        "curl -sf http://127.0.0.1:49999/health",
        "--ready-timeout",
        "180",
    ]);
}

/// The official `e2b-code-interpreter` SDK's `run_code` and contexts against the
/// `code-interpreter` template (decision 0025).
#[test]
fn the_code_interpreter_sdk_runs_code_in_kernels() {
    let Some(python) = e2b_python() else { return };
    let Some(wheels) = ci_wheels() else { return };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    build_code_interpreter(&s, &wheels);
    run_python(
        &s,
        &python,
        &["-m", "unittest", "-v", "test_code_interpreter"],
    );
}

/// `Sandbox.create()` -> first `run_code`, and `run_code` against `commands.run` in the same
/// run (BENCHMARKS.md).
#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn bench_code_interpreter() {
    let Some(python) = e2b_python() else { return };
    let Some(wheels) = ci_wheels() else { return };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    build_code_interpreter(&s, &wheels);
    println!(
        "{}",
        run_python(&s, &python, &["bench_code_interpreter.py"])
    );
}

/// `Sandbox.create()` -> first `commands.run`, `commands.run` and output streaming through
/// the official SDK, with the native API in the same run as the peer (BENCHMARKS.md).
#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn bench_e2b_sdk() {
    let Some(python) = e2b_python() else { return };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    println!("{}", run_python(&s, &python, &["bench_sdk.py"]));
}

/// `space watch` (the native side of the daemon's watch) prints changes as they happen.
#[test]
fn space_watch_prints_changes_as_they_happen() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    s.sh(&id, "mkdir -p /w/sub");
    let mut watch = s
        .cli()
        .args(["watch", &id, "/w", "--recursive"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = watch.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The watch is in place once `space watch` says so on stderr; poll for its first event
    // instead, with a bounded number of tries.
    let mut lines = Vec::new();
    for i in 0..50 {
        s.sh(&id, &format!("echo {i} > /w/sub/f{i}"));
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            lines.push(l);
            break;
        }
    }
    assert!(
        !lines.is_empty(),
        "no event from space watch:\n{}",
        s.log_tail()
    );
    s.sh(
        &id,
        "mv /w/sub/f0 /w/g && rm /w/g && mkdir /w/new && touch /w/new/h",
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !lines.iter().any(|l| l == "create new/h") && std::time::Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            lines.push(l);
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    for want in [
        "rename sub/f0",
        "create g",
        "remove g",
        "create new/",
        "create new/h",
    ] {
        assert!(lines.iter().any(|l| l == want), "no {want:?} in {lines:?}");
    }
    // Bad input: a missing directory and a file are refused before any event.
    let out = s.space(&["watch", &id, "/nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
    s.sh(&id, "touch /w/file");
    let out = s.space(&["watch", &id, "/w/file"]);
    assert!(!out.status.success());
}

/// A spaced on `lab` whose default template is the Debian `base` from `cache`.
fn start_on_lab_with_base(lab: &NetLab, cache: &Path, extra: &[&str]) -> Spaced {
    let cache = cache.to_str().expect("utf-8 path");
    let mut args = vec!["--default-template", "base", "--base-cache", cache];
    args.extend_from_slice(extra);
    lab.start_spaced(&args).unwrap()
}

/// E2B's secrets (decision 0027), through the official SDK against spaced on the test's fake
/// internet: secrets are made, versioned, listed and destroyed and never shown; a sandbox
/// created with a network rule reaches the rule's HTTPS host with the real value in the
/// header, while nothing inside it holds the value or a placeholder; plain HTTP and other
/// hosts never see it.
#[test]
fn e2b_secrets_reach_the_rule_host_and_never_the_sandbox() {
    let Some(python) = e2b_python() else { return };
    let Some(cache) = base_cache() else { return };
    let lab = NetLab::new().unwrap();
    let s = start_on_lab_with_base(&lab, &cache, &[]);
    let secret = format!("real-secret-{}", random_hex(16));
    let mut cmd = sdk_command(&s, &python, "python");
    cmd.args(["-m", "unittest", "-v", "test_secrets"])
        .env("LAB_SECRET", &secret);
    run_sdk(&s, cmd);

    let hits = lab.http_hits();
    let quiet = hits
        .iter()
        .find(|h| h.path == "/quiet")
        .expect("the HTTPS request arrived");
    assert!(quiet.tls);
    assert_eq!(quiet.sni.as_deref(), Some("api.example.test"));
    let auth = quiet
        .headers
        .get("authorization")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        auth,
        [format!("Bearer {secret}")],
        "the proxy's header, in place of the sandbox's own"
    );
    for h in hits.iter().filter(|h| h.path != "/quiet") {
        let carries = h.headers.values().flatten().any(|v| v.contains(&secret));
        assert!(!carries, "the secret reached {} {}", h.method, h.path);
    }
    assert!(
        hits.iter().any(|h| h.path == "/plain") && hits.iter().any(|h| h.path == "/other"),
        "the plain HTTP requests arrived: {hits:?}"
    );
    assert!(!s.log_tail().contains(&secret), "the log holds the secret");
}

/// E2B's host form over TLS (decision 0030): spaced with `--e2b-domain`, the SDKs given only
/// `space e2b env --domain` and the CA `space e2b ca` prints: the newest Python SDK, the
/// older one and the JS SDK. Each runs in the node's namespace with its own mount namespace
/// whose /etc/resolv.conf names the lab's DNS, which answers the domain and every name under
/// it with the node's address (a wildcard record).
#[test]
fn the_sdks_reach_space_by_domain_over_tls() {
    use space_tests::netlab::{DNS_IP, NODE_DOMAIN};
    let Some(python) = e2b_python() else { return };
    let Some(cache) = base_cache() else { return };
    let lab = NetLab::new().unwrap();
    let s = start_on_lab_with_base(&lab, &cache, &["--e2b-domain", NODE_DOMAIN]);
    let vars = e2b_env_of(&s, &["--domain"], &["E2B_API_KEY", "E2B_DOMAIN"]);
    assert_eq!(vars[1].1, NODE_DOMAIN);
    let ca = s.data_dir().join("e2b-ca.pem");
    std::fs::write(&ca, s.space_ok(&["e2b", "ca"])).unwrap();
    let resolv = s.data_dir().join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {DNS_IP}\n")).unwrap();
    let net = s.net.as_ref().expect("spaced has its own netns");

    // `program args` in tests/e2b/DIR, as a user of the domain would run it.
    let sdk = |program: &Path, dir: &str, args: &[&str]| {
        let mut cmd = net.command("unshare");
        cmd.args(["--mount", "--", "sh", "-c"])
            .arg(r#"mount --bind "$0" /etc/resolv.conf && exec "$@""#)
            .arg(&resolv)
            .arg(program)
            .args(args);
        in_sdk_dir(&mut cmd, dir, vars.clone());
        cmd.env("SSL_CERT_FILE", &ca)
            .env("NODE_EXTRA_CA_CERTS", &ca)
            .env_remove("E2B_API_URL")
            .env_remove("E2B_SANDBOX_URL");
        cmd
    };
    let unittest = ["-m", "unittest", "-v", "test_domain"];
    run_sdk(&s, sdk(&python, "python", &unittest));
    if let Some(old) = e2b_old_python() {
        run_sdk(&s, sdk(&old, "python", &unittest));
    }
    if let (Some(node), Some(js)) = (e2b_node(), e2b_js()) {
        let mut cmd = sdk(
            &node,
            "js",
            &["--test", "--test-reporter=spec", "test_domain.cjs"],
        );
        cmd.env("SPACE_E2B_JS", js);
        eprintln!("{}", run_sdk(&s, cmd));
    }

    // The certificate is the one spaced issued, for that name only: a name outside the
    // domain gets no certificate at all.
    let out = net
        .command("curl")
        .args(["-sS", "-o", "/dev/null", "--cacert"])
        .arg(&ca)
        .args([
            "--resolve",
            "evil.example.test:443:203.0.113.1",
            "https://evil.example.test/healthz",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a certificate for a foreign name");
    let out = net
        .command("curl")
        .args(["-fsS", "--cacert"])
        .arg(&ca)
        .args([
            "--resolve",
            &format!("api.{NODE_DOMAIN}:443:203.0.113.1"),
            &format!("https://api.{NODE_DOMAIN}/v1/e2b"),
            "-H",
            &format!("Authorization: Bearer {}", s.key),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let settings: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(settings["domain"], NODE_DOMAIN);
}
