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

/// QEMUs of template checkpoint builders (`warm-*` runtime names) under this spaced's run dir.
fn builder_qemus(s: &Spaced) -> Vec<String> {
    let run = s.run_dir().join("sandboxes").join("warm-");
    let run = run.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains("qemu-system") && c.contains(&run))
        .collect()
}

/// Polls `done` every `every` until it holds; fails with `what` (and the log) after `limit`.
fn wait_until(s: &Spaced, limit: Duration, every: Duration, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}:\n{}", s.log_tail());
        std::thread::sleep(every);
    }
}

/// Calls the API, checks the answer is a 400, and returns its message.
fn refused(s: &Spaced, method: Method, path: &str, body: serde_json::Value) -> String {
    let (code, reply) = s.call(method, path, Some(body));
    assert_eq!(code, 400, "{reply}");
    reply["error"]["message"].as_str().unwrap().to_owned()
}

/// Writes `kib` KiB to the guest's serial console, as the guest's root.
fn flood_console(s: &Spaced, id: &str, kib: u32) {
    let script = format!(
        "head -c {} /dev/zero | tr '\\0' x > /dev/console",
        kib << 10
    );
    out(s, id, &script);
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

    // The escape battery at the VM boundary: the guest's root owns its kernel, so what must
    // hold is everything that faces the host (docs/THREAT_MODEL.md, "Escape battery").
    let (args, _listener) = s.host_references();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report = s.probe(&id, &args);
    let checks = report.as_object().expect("a probe report");
    for (name, c) in checks {
        if c["class"] == "host" || name == "host_processes_invisible" {
            assert_eq!(c["ok"], true, "{name} failed in a microvm: {c}");
        }
    }
    // The guest's root rewrites the guest's core_pattern; the host's stays as it was.
    let host_pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();
    assert_eq!(
        out(
            &s,
            &id,
            "echo '|/bin/false %p' > /proc/sys/kernel/core_pattern && cat /proc/sys/kernel/core_pattern"
        ),
        "|/bin/false %p"
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap(),
        host_pattern
    );

    // The guest's root floods its serial console: the node keeps 1 MiB and the 1 MiB before
    // it, and nothing more reaches the host's run dir (decision 0045).
    flood_console(&s, &id, 2560);
    let run = s.run_dir().join("sandboxes").join(&id);
    assert!(run.join("console.sock").exists(), "{}", run.display());
    let consoles = || -> (u64, bool) {
        let mut total = 0;
        let mut rotated = false;
        for (name, is_rotated) in [("console.log", false), ("console.log.1", true)] {
            if let Ok(m) = std::fs::metadata(run.join(name)) {
                assert!(m.len() <= 1 << 20, "{name} holds {} bytes", m.len());
                total += m.len();
                rotated |= is_rotated;
            }
        }
        (total, rotated)
    };
    // What the guest wrote reaches the files a little later: wait until they stop growing.
    let mut last = consoles();
    let settle = Instant::now() + Duration::from_secs(20);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = consoles();
        if now == last || Instant::now() > settle {
            break;
        }
        last = now;
    }
    let (kept, rotated) = consoles();
    assert!(
        rotated,
        "2.5 MiB written, and the console was never rotated"
    );
    assert_eq!(out(&s, &id, "echo alive"), "alive");

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
    // A template checkpoint's builder the crash caught mid-way does not outlive it.
    assert_eq!(builder_qemus(&s), Vec::<String>::new());
    assert_eq!(out(&s, &id, "echo after"), "after");
    let procs = s.space_ok(&["ps", &id]);
    assert!(procs.contains(&pid), "{procs}");
    // Nobody reads the console after the restart: QEMU drops what the guest writes.
    flood_console(&s, &id, 512);
    assert_eq!(consoles().0, kept);

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
    let msg = refused(
        &s,
        Method::POST,
        "/v1/sandboxes",
        json!({"runtime": "firecracker"}),
    );
    assert!(
        msg.contains("namespace") && msg.contains("microvm"),
        "{msg}"
    );
    let msg = refused(
        &s,
        Method::POST,
        "/v1/sandboxes",
        json!({"runtime": "microvm"}),
    );
    assert!(msg.contains("--microvm off"), "{msg}");
    // Resource limits are the namespace runtime's (decision 0041); unknown ones are refused.
    let msg = refused(
        &s,
        Method::POST,
        "/v1/sandboxes",
        json!({"runtime": "microvm", "rlimits": {"nofile": 4096}}),
    );
    assert!(
        msg.contains("rlimits are set only in namespace sandboxes"),
        "{msg}"
    );
    let msg = refused(
        &s,
        Method::POST,
        "/v1/sandboxes",
        json!({"rlimits": {"stack": 1}}),
    );
    assert!(msg.contains("stack"), "{msg}");
    // A microvm pool on a node without the runtime: refused, the pool left as it was.
    let msg = refused(
        &s,
        Method::PUT,
        "/v1/templates/minimal/pool",
        json!({"min": 1, "runtime": "microvm"}),
    );
    assert!(msg.contains("--microvm off"), "{msg}");
    let (code, pool) = s.call(Method::GET, "/v1/templates/minimal/pool", None);
    assert_eq!(
        (code, pool["runtime"].as_str()),
        (200, Some("namespace")),
        "{pool}"
    );
    // Nothing was left behind, and namespace sandboxes are unaffected.
    let (code, list) = s.call(Method::GET, "/v1/sandboxes", None);
    assert_eq!(code, 200);
    assert_eq!(list["sandboxes"], json!([]), "{list}");
    let id = s.create(&[]);
    assert_eq!(s.inspect(&id)["runtime"], "namespace");
    s.space_ok(&["rm", &id]);
}

/// The template's warm checkpoint of a microvm (`vm-<key>/` next to its rootfs), once made.
fn warm_checkpoint(s: &Spaced) -> Option<std::path::PathBuf> {
    let base = s.data_dir().join("volume/templates/minimal");
    std::fs::read_dir(base).ok()?.flatten().find_map(|v| {
        std::fs::read_dir(v.path()).ok()?.flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name.starts_with("vm-") && !name.contains('.')).then(|| e.path())
        })
    })
}

fn wait_warm_checkpoint(s: &Spaced) -> std::path::PathBuf {
    wait_until(
        s,
        Duration::from_secs(120),
        Duration::from_millis(200),
        "no template checkpoint was made",
        || warm_checkpoint(s).is_some(),
    );
    warm_checkpoint(s).unwrap()
}

/// Whether the sandbox says its VM was restored from the template checkpoint.
fn restored(s: &Spaced, id: &str) -> bool {
    s.inspect(id)["restored"] == true
}

#[test]
fn microvm_creates_restore_the_templates_warm_checkpoint_with_fresh_identities() {
    let mut s = Spaced::start().unwrap();
    // The first create boots and has the node make the template's checkpoint.
    let t0 = Instant::now();
    let first = s.create(&["--runtime", "microvm", "--memory", "256"]);
    eprintln!("first microvm create (boot): {:?}", t0.elapsed());
    assert!(!restored(&s, &first));
    // A crash while the builder VM may still be at work: none outlives the restart, and
    // the next create asks for the checkpoint again (if it was not made yet).
    s.kill9();
    s.spawn().unwrap();
    assert_eq!(builder_qemus(&s), Vec::<String>::new());
    let second = s.create(&["--runtime", "microvm", "--memory", "256"]);
    let ckpt = wait_warm_checkpoint(&s);
    for f in ["state", "state.sha256", "mem", "disk.ext4"] {
        let meta = std::fs::metadata(ckpt.join(f))
            .unwrap_or_else(|e| panic!("{} lacks {f}: {e}", ckpt.display()));
        use std::os::unix::fs::MetadataExt;
        // Nothing of it stays with the builder's (freed) uid range.
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "{f}");
    }

    // The next ones restore it: same boot (a copy of one running kernel), each its own
    // hostname, environment, machine-id, RNG and clock, and its own disk.
    let mut ids = Vec::new();
    for (i, host) in ["vm-a", "vm-b"].iter().enumerate() {
        let t = Instant::now();
        let id = s.create(&[
            "--runtime",
            "microvm",
            "--memory",
            "256",
            "--hostname",
            host,
            "--env",
            &format!("N={i}"),
        ]);
        eprintln!("microvm create from the warm checkpoint: {:?}", t.elapsed());
        assert!(restored(&s, &id), "{id} booted:\n{}", s.log_tail());
        ids.push(id);
    }
    let facts = |id: &str| -> Vec<String> {
        out(
            &s,
            id,
            "hostname; echo $N; cat /etc/machine-id; cat /proc/sys/kernel/random/boot_id; \
             head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s; uname -r",
        )
        .lines()
        .map(str::to_owned)
        .collect()
    };
    let (a, b) = (facts(&ids[0]), facts(&ids[1]));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!((a[0].as_str(), a[1].as_str()), ("vm-a", "0"), "{a:?}");
    assert_eq!((b[0].as_str(), b[1].as_str()), ("vm-b", "1"), "{b:?}");
    assert_eq!(a[2].len(), 32, "{a:?}");
    assert_ne!(a[2], b[2], "machine-ids");
    // The kernel makes its boot id on first read; nothing reads it before the checkpoint,
    // so each restored copy draws its own, from its reseeded RNG.
    assert_ne!(a[3], b[3], "boot ids");
    assert_ne!(a[4], b[4], "RNG output");
    for f in [&a, &b] {
        let t: u64 = f[5].parse().unwrap();
        assert!(t.abs_diff(now) < 60, "guest clock {t}, host {now}");
        assert_eq!(f[6], guest_kernel_version());
    }
    out(&s, &ids[0], "echo mine > /root/only-a; sync");
    assert_eq!(
        out(&s, &ids[1], "ls /root/only-a 2>&1 | grep -c 'No such'"),
        "1"
    );
    // A different size has no checkpoint yet: it boots.
    let other = s.create(&["--runtime", "microvm", "--memory", "320"]);
    assert!(!restored(&s, &other));

    // A corrupted checkpoint is refused whole: the create boots instead, and a new
    // checkpoint is made for the next one.
    let state = ckpt.join("state");
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 64] {
        *b ^= 0xff;
    }
    std::fs::write(&state, bytes).unwrap();
    let booted = s.create(&["--runtime", "microvm", "--memory", "256"]);
    assert!(!restored(&s, &booted));
    assert_eq!(out(&s, &booted, "echo ok"), "ok");
    let log = std::fs::read_to_string(s.log_path()).unwrap();
    assert!(
        log.contains("restore refused") && log.contains("is corrupted"),
        "{}",
        s.log_tail()
    );
    wait_until(
        &s,
        Duration::from_secs(120),
        Duration::from_millis(200),
        "not made again",
        || ckpt.join("state").is_file(),
    );
    let redone = s.create(&["--runtime", "microvm", "--memory", "256"]);
    assert!(restored(&s, &redone), "{}", s.log_tail());

    // Damaged memory (no checksum covers `mem`): the restored guest never answers; the
    // create still succeeds, booted on a fresh disk, and the checkpoint goes.
    let mem = ckpt.join("mem");
    let len = std::fs::metadata(&mem).unwrap().len();
    std::fs::write(&mem, vec![0u8; len as usize]).unwrap();
    let t = Instant::now();
    let damaged = s.create(&["--runtime", "microvm", "--memory", "256"]);
    eprintln!("create on a damaged checkpoint: {:?}", t.elapsed());
    assert!(!restored(&s, &damaged));
    assert_eq!(out(&s, &damaged, "echo fine; ls /root | wc -l"), "fine\n0");
    let log = std::fs::read_to_string(s.log_path()).unwrap();
    assert!(
        log.contains("the restored guest did not answer"),
        "{}",
        s.log_tail()
    );

    for id in ids
        .iter()
        .chain([&first, &second, &other, &booted, &redone, &damaged])
    {
        s.space_ok(&["rm", id]);
    }
    assert!(s.user_sandbox_dirs().is_empty());
}

/// `base`'s pool as the node reports it.
fn base_pool(s: &Spaced) -> serde_json::Value {
    let (code, body) = s.call(Method::GET, "/v1/templates/minimal/pool", None);
    assert_eq!(code, 200, "{body}");
    body
}

#[test]
fn a_microvm_pool_hands_out_restored_vms_with_fresh_identities() {
    let mut s = Spaced::start().unwrap();
    // Turning base's pool into a microvm pool retires its namespace members.
    let (code, body) = s.call(
        Method::PUT,
        "/v1/templates/minimal/pool",
        Some(json!({"min": 2, "max": 2, "runtime": "microvm"})),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["runtime"], "microvm", "{body}");
    wait_until(
        &s,
        Duration::from_secs(240),
        Duration::from_millis(250),
        "the microvm pool never filled",
        || base_pool(&s)["ready"].as_u64().unwrap() >= 2,
    );

    // Two creates are served by the pool: each its own hostname, env and identity.
    let mut facts = Vec::new();
    for (i, host) in ["pooled-a", "pooled-b"].iter().enumerate() {
        let t = Instant::now();
        let id = s.create(&[
            "--runtime",
            "microvm",
            "--hostname",
            host,
            "--env",
            &format!("N={i}"),
        ]);
        eprintln!("microvm create from the pool: {:?}", t.elapsed());
        let v = s.inspect(&id);
        assert_eq!(
            (v["pooled"].as_bool(), v["runtime"].as_str()),
            (Some(true), Some("microvm")),
            "{v}"
        );
        let f = out(
            &s,
            &id,
            "hostname; echo $N $SPACE_SANDBOX_ID; cat /etc/machine-id; \
             ls /root | wc -l; uname -r",
        );
        let f: Vec<String> = f.lines().map(str::to_owned).collect();
        assert_eq!(f[0], *host, "{f:?}");
        assert_eq!(f[1], format!("{i} {id}"), "{f:?}");
        assert_eq!(f[3], "0", "a member carries nothing: {f:?}");
        assert_eq!(f[4], guest_kernel_version());
        facts.push((id, f[2].clone()));
    }
    assert_ne!(facts[0].1, facts[1].1, "machine-ids");

    // Not served by the microvm pool: other limits, and namespace creates.
    let big = s.create(&["--runtime", "microvm", "--memory", "320"]);
    assert_eq!(s.inspect(&big)["pooled"], false);
    let ns = s.create(&["--runtime", "namespace"]);
    assert_eq!(s.inspect(&ns)["pooled"], false);

    // A pooled VM survives a node restart like any sandbox, and is removed like one.
    s.kill9();
    s.spawn().unwrap();
    assert_eq!(out(&s, &facts[0].0, "echo back"), "back");
    for id in [&facts[0].0, &facts[1].0, &big, &ns] {
        s.space_ok(&["rm", id]);
    }
    // The pool went back to refilling; turning it off destroys its members.
    let (code, body) = s.call(
        Method::PUT,
        "/v1/templates/minimal/pool",
        Some(json!({"min": 0, "runtime": "microvm"})),
    );
    assert_eq!(code, 200, "{body}");
    assert!(s.user_sandbox_dirs().is_empty());
}

fn events(s: &Spaced, id: &str, action: &str) -> Vec<serde_json::Value> {
    let (code, ev) = s.call(Method::GET, &format!("/v1/sandboxes/{id}/events"), None);
    assert_eq!(code, 200, "{ev}");
    ev["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == action)
        .cloned()
        .collect()
}

/// A microvm checkpoint keeps memory: a rollback brings back the processes and the files in
/// the guest's RAM as they were; a fork of the running VM continues it in a child with a
/// fresh identity; a corrupted checkpoint is refused with the sandbox left as it is. With
/// restored VMs' RAM mapped either way (`spaced --microvm-ram`).
#[test]
fn a_microvm_checkpoint_keeps_memory_through_rollback_and_fork() {
    checkpoint_keeps_memory("private");
}

#[test]
fn a_microvm_checkpoint_keeps_memory_with_shared_ram() {
    checkpoint_keeps_memory("shared");
}

fn checkpoint_keeps_memory(ram: &str) {
    let s = Spaced::start_with(&["--microvm-ram", ram]).unwrap();
    let id = s.create(&["--runtime", "microvm"]);
    // State that lives only in the guest's memory: a file in its tmpfs /tmp and a process.
    out(&s, &id, "echo before > /tmp/mem");
    let pid = s
        .space_ok(&[
            "exec",
            "-d",
            &id,
            "--",
            "sh",
            "-c",
            "while :; do sleep 1; done",
        ])
        .trim()
        .to_string();
    let t = Instant::now();
    let cp = s
        .space_ok(&["snapshot", &id, "--checkpoint"])
        .trim()
        .to_string();
    eprintln!("microvm checkpoint ({ram}): {:?}", t.elapsed());
    let (code, list) = s.call(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"), None);
    assert_eq!(code, 200, "{list}");
    let snap = list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == cp.as_str())
        .cloned()
        .unwrap();
    assert_eq!(
        (snap["kind"].as_str(), snap["memory"].as_bool()),
        (Some("checkpoint"), Some(true)),
        "{snap}"
    );
    // The VM ran on after its checkpoint.
    out(&s, &id, "echo after > /tmp/mem; echo on-disk > /root/f");

    let t = Instant::now();
    s.space_ok(&["rollback", &id, &cp]);
    eprintln!(
        "microvm rollback to a checkpoint ({ram}): {:?}",
        t.elapsed()
    );
    assert_eq!(s.inspect(&id)["restored"], true);
    assert_eq!(
        out(&s, &id, "cat /tmp/mem; ls /root/f 2>&1 | grep -c 'No such'"),
        "before\n1"
    );
    let ps = s.space_ok(&["ps", &id]);
    assert!(ps.contains(&pid), "the process lives on: {ps}");
    assert_eq!(events(&s, &id, "memory_restored").len(), 1);
    assert!(
        events(&s, &id, "process_restarted").is_empty(),
        "nothing restarted"
    );

    // A fork of the running VM (no snapshot named) continues it: memory and processes.
    out(&s, &id, "echo parent-now > /tmp/mem");
    let parent_id = out(
        &s,
        &id,
        "cat /etc/machine-id; cat /sys/class/net/eth0/address",
    );
    let t = Instant::now();
    let child = s.space_ok(&["fork", &id]).trim().to_string();
    eprintln!("microvm fork of a running VM ({ram}): {:?}", t.elapsed());
    assert_eq!(s.inspect(&child)["restored"], true);
    let c = out(
        &s,
        &child,
        "cat /tmp/mem; hostname; cat /etc/machine-id; cat /sys/class/net/eth0/address",
    );
    let c: Vec<&str> = c.lines().collect();
    assert_eq!(c[..2], ["parent-now", child.as_str()], "{c:?}");
    let p: Vec<&str> = parent_id.lines().collect();
    assert_ne!(c[2], p[0], "the child's machine-id");
    assert_ne!(c[3], p[1], "the child's MAC");
    let ps = s.space_ok(&["ps", &child]);
    assert!(
        ps.contains(&pid),
        "the parent's process goes on in the child: {ps}"
    );
    // Each its own memory from there.
    out(&s, &child, "echo child > /tmp/mem");
    assert_eq!(out(&s, &id, "cat /tmp/mem"), "parent-now");
    s.space_ok(&["rm", &child]);

    // A corrupted checkpoint: refused; the sandbox keeps running as it was. (The snapshot
    // is a read-only subvolume: made writable for the damage.)
    let qemu = s.inspect(&id)["init_pid"].as_u64().unwrap();
    let sub = s
        .data_dir()
        .join(format!("volume/sandboxes/{id}/snapshots/{cp}/rootfs"));
    let rw = std::process::Command::new("btrfs")
        .args(["property", "set", "-ts"])
        .arg(&sub)
        .args(["ro", "false"])
        .status()
        .unwrap();
    assert!(rw.success());
    let state = sub.join("vm/state");
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&state, &bytes).unwrap();
    let o = s.space(&["rollback", &id, &cp]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot be restored") && err.contains("corrupted"),
        "{err}"
    );
    assert_eq!(s.inspect(&id)["init_pid"].as_u64(), Some(qemu));
    assert_eq!(out(&s, &id, "cat /tmp/mem"), "parent-now");

    // One that passes the check but that QEMU refuses (cut short, its checksum rewritten):
    // the snapshot's disk boots instead, and the checkpoint's process is started again.
    bytes[mid] ^= 0xff;
    bytes.truncate(mid);
    std::fs::write(&state, &bytes).unwrap();
    let sum: String = {
        use sha2::Digest;
        sha2::Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    std::fs::write(state.with_file_name("state.sha256"), format!("{sum}\n")).unwrap();
    s.space_ok(&["rollback", &id, &cp]);
    assert_eq!(s.inspect(&id)["restored"], false);
    assert_eq!(
        out(
            &s,
            &id,
            "ls /tmp/mem 2>&1 | grep -c 'No such'; ls /root/f 2>&1 | grep -c 'No such'"
        ),
        "1\n1",
        "a fresh boot of the snapshot's disk"
    );
    wait_until(
        &s,
        Duration::from_secs(30),
        Duration::from_millis(200),
        "the checkpoint's process was not started again",
        || !events(&s, &id, "process_restarted").is_empty(),
    );
    s.space_ok(&["rm", &id]);
}

/// A template's runtime setting is the default of its creates (and a create's own wins).
#[test]
fn a_templates_runtime_is_the_default_of_its_creates() {
    let s = Spaced::start().unwrap();
    let fails = |args: &[&str], needle: &str| {
        let o = s.space(args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    };
    fails(
        &["template", "set", "minimal", "--runtime", "firecracker"],
        "unknown runtime",
    );
    fails(
        &["template", "set", "nope", "--runtime", "microvm"],
        "not found",
    );
    fails(
        &["template", "set", "Bad..Name", "--runtime", "microvm"],
        "invalid template name",
    );
    let msg = refused(
        &s,
        Method::PUT,
        "/v1/templates/minimal/settings",
        json!({"runtime": "microvm", "cpu": 2}),
    );
    assert!(msg.contains("cpu"), "{msg}");

    s.space_ok(&["template", "set", "minimal", "--runtime", "microvm"]);
    let list: serde_json::Value =
        serde_json::from_str(&s.space_ok(&["template", "ls", "--json"])).unwrap();
    assert_eq!(list["templates"][0]["runtime"], "microvm", "{list}");
    let vm = s.create(&[]);
    assert_eq!(s.inspect(&vm)["runtime"], "microvm");
    let ns = s.create(&["--runtime", "namespace"]);
    assert_eq!(s.inspect(&ns)["runtime"], "namespace");
    s.space_ok(&["template", "set", "minimal", "--runtime", "default"]);
    let again = s.create(&[]);
    assert_eq!(s.inspect(&again)["runtime"], "namespace");
    for id in [&vm, &ns, &again] {
        s.space_ok(&["rm", id]);
    }
}

/// A microvm template that starts something is checkpointed once it is ready (issue 12 item
/// 4, decision 0019): a restored VM already runs what the template started (started once, in
/// the checkpoint's builder), and new commands (a new version) boot until theirs is made.
#[test]
fn a_microvm_template_is_checkpointed_after_its_start_command_is_ready() {
    let s = Spaced::start().unwrap();
    s.space_ok(&[
        "template",
        "set",
        "minimal",
        "--start-cmd",
        // A random token per run of the start command (busybox date has no %N: two boots
        // within one second would write the same time).
        "cat /proc/sys/kernel/random/uuid > /tmp/started; exec sleep 100000",
        "--ready-cmd",
        "test -s /tmp/started",
    ]);
    let running = "ps | grep -c '[s]leep 100000'";
    // A boot runs the start command itself; it asks for the checkpoint.
    let booted = s.create(&["--runtime", "microvm", "--memory", "256"]);
    assert!(!restored(&s, &booted));
    assert_eq!(out(&s, &booted, running), "1");
    let ckpt = wait_warm_checkpoint(&s);
    let name = ckpt.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.contains("-s"), "{name}: the start commands' hash");

    let restored_ids: Vec<String> = (0..2)
        .map(|_| s.create(&["--runtime", "microvm", "--memory", "256"]))
        .collect();
    let mut started = Vec::new();
    for id in &restored_ids {
        assert!(restored(&s, id), "{id} booted:\n{}", s.log_tail());
        // Running at once, and not started again: one process, the builder's file.
        assert_eq!(out(&s, id, running), "1");
        started.push(out(&s, id, "cat /tmp/started"));
    }
    assert_eq!(started[0], started[1], "both restored the builder's start");
    assert_ne!(started[0], out(&s, &booted, "cat /tmp/started"));

    // New commands are a new version, without a checkpoint yet: the next create boots.
    s.space_ok(&[
        "template",
        "set",
        "minimal",
        "--start-cmd",
        "echo two > /tmp/started; exec sleep 100000",
    ]);
    let next = s.create(&["--runtime", "microvm", "--memory", "256"]);
    assert!(!restored(&s, &next));
    assert_eq!(out(&s, &next, "cat /tmp/started"), "two");
    let mut all = restored_ids.clone();
    all.extend([booted, next]);
    for id in &all {
        s.space_ok(&["rm", id]);
    }
}
