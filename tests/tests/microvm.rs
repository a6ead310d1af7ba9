//! The microvm runtime against a real spaced (decision 0014): a QEMU microvm per sandbox with
//! Debian's cloud kernel (under TCG on this machine), space-daemon as its init, the same API.
//! Needs QEMU and the guest kernel, which `scripts/test` installs (`ensure_guest_kernel`).

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use space_tests::Spaced;

fn guest_kernel_version() -> String {
    std::fs::read_to_string("/usr/local/lib/space/vm/version")
        .expect("guest kernel missing: run scripts/up (or scripts/test)")
        .trim()
        .to_string()
}

fn out(s: &Spaced, id: &str, script: &str) -> String {
    let (code, stdout, stderr) = s.sh(id, script);
    assert_eq!(code, 0, "{script}: {stderr}");
    stdout.trim().to_string()
}

fn pid_alive(pid: u64) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_microvm_sandbox_runs_its_own_kernel_behind_the_same_api() {
    let mut s = Spaced::start().unwrap();
    let t0 = Instant::now();
    let id = s.create(&[
        "--runtime",
        "microvm",
        "--env",
        "FOO=bar",
        "--hostname",
        "vm-one",
        "--memory",
        "256",
    ]);
    let boot = t0.elapsed();
    eprintln!("microvm create -> running: {boot:?}");
    let v = s.inspect(&id);
    assert_eq!(v["runtime"], "microvm", "{v}");
    assert_eq!(v["state"], "running", "{v}");
    let qemu = v["init_pid"].as_u64().expect("the VMM's pid");

    // Its own kernel: the guest's release and boot id, not the host's.
    assert_eq!(out(&s, &id, "uname -r"), guest_kernel_version());
    let host_boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let guest_boot = out(&s, &id, "cat /proc/sys/kernel/random/boot_id");
    assert_ne!(guest_boot, host_boot.trim(), "same boot id as the host");
    // The create's environment and hostname.
    assert_eq!(
        out(&s, &id, "echo $FOO:$SPACE_SANDBOX_ID"),
        format!("bar:{id}")
    );
    assert_eq!(out(&s, &id, "hostname"), "vm-one");

    // Files both ways through the same API.
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("in.txt");
    std::fs::write(&local, "hello microvm\n").unwrap();
    s.space_ok(&["cp", local.to_str().unwrap(), &format!("{id}:/root/in.txt")]);
    assert_eq!(out(&s, &id, "cat /root/in.txt"), "hello microvm");
    let back = dir.path().join("back.txt");
    s.space_ok(&["cp", &format!("{id}:/root/in.txt"), back.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "hello microvm\n");

    // A background process survives a node crash; the VM is re-adopted.
    let pid = s.space_ok(&[
        "exec",
        "-d",
        &id,
        "--",
        "sh",
        "-c",
        "sleep 1; echo tick; sleep 600",
    ]);
    let pid = pid.trim().to_string();
    s.kill9();
    assert!(pid_alive(qemu), "the VM died with spaced");
    s.spawn().unwrap();
    assert_eq!(out(&s, &id, "echo after"), "after");
    let procs = s.space_ok(&["ps", &id]);
    assert!(procs.contains(&pid), "{procs}");

    // Pause and resume (the VM is stopped, not its processes one by one).
    s.space_ok(&["pause", &id]);
    assert_eq!(s.inspect(&id)["state"], "paused");
    let o = s.space(&["exec", &id, "--", "true"]);
    assert!(!o.status.success(), "exec in a paused VM");
    s.space_ok(&["resume", &id]);
    assert_eq!(out(&s, &id, "echo resumed"), "resumed");

    // Disk snapshots, rollback and fork: reflinks of the disk image.
    out(&s, &id, "echo one > /root/a");
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    out(&s, &id, "echo two > /root/a && echo new > /root/b");
    s.space_ok(&["rollback", &id, &snap]);
    assert_eq!(
        out(&s, &id, "cat /root/a; ls /root/b 2>&1 | grep -c 'No such'"),
        "one\n1"
    );
    assert_eq!(out(&s, &id, "uname -r"), guest_kernel_version());
    let child = s
        .space_ok(&["fork", &id, "--snapshot", &snap])
        .trim()
        .to_string();
    assert_eq!(s.inspect(&child)["runtime"], "microvm");
    assert_eq!(
        out(&s, &child, "cat /root/a; hostname"),
        format!("one\n{child}")
    );
    let child_pid = s.inspect(&child)["init_pid"].as_u64().unwrap();
    assert_ne!(child_pid, s.inspect(&id)["init_pid"].as_u64().unwrap());
    s.space_ok(&["rm", &child]);
    // Not there yet for microvm: diff, a clear conflict.
    let (code, body) = s.call(
        Method::GET,
        &format!("/v1/sandboxes/{id}/diff?from={snap}"),
        None,
    );
    assert_eq!(code, 409, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("microvm"),
        "{body}"
    );

    // Removing it stops the VMM and frees its disk.
    s.space_ok(&["rm", &id]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pid_alive(qemu) {
        assert!(Instant::now() < deadline, "QEMU {qemu} still runs after rm");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(s.user_sandbox_dirs().is_empty());
}

#[test]
fn bad_runtime_requests_get_clear_errors() {
    let s = Spaced::start_with(&["--microvm", "off"]).unwrap();
    let (code, body) = s.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"runtime": "firecracker"})),
    );
    assert_eq!(code, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("namespace") && msg.contains("microvm"),
        "{msg}"
    );
    let (code, body) = s.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"runtime": "microvm"})),
    );
    assert_eq!(code, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--microvm off"),
        "{body}"
    );
    // Nothing was left behind, and namespace sandboxes are unaffected.
    let (code, list) = s.call(Method::GET, "/v1/sandboxes", None);
    assert_eq!(code, 200);
    assert_eq!(list["sandboxes"], json!([]), "{list}");
    let id = s.create(&[]);
    assert_eq!(s.inspect(&id)["runtime"], "namespace");
    s.space_ok(&["rm", &id]);
}
