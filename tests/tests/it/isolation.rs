//! Isolation, shown from inside: a probe run in a sandbox tries to break out and must fail;
//! fork bombs and memory hogs stay inside their limits; sandboxes cannot reach each other.

use std::time::{Duration, Instant};

use serde_json::Value;
use space_tests::Spaced;

/// Processes on the host whose real uid lies in [base, base + 65536).
fn host_processes_in_range(base: u32) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse::<u32>().ok());
        if uid.is_some_and(|u| u >= base && u - base < 65536) {
            n += 1;
        }
    }
    n
}

/// Every check of the probe's battery held in `report` (a namespace sandbox: each one is an
/// attempt the boundary must stop), and the battery is the whole of it.
fn assert_contained(report: &Value) {
    let checks = report.as_object().expect("probe report is an object");
    assert!(checks.len() >= 60, "only {} probes ran", checks.len());
    let failed: Vec<String> = checks
        .iter()
        .filter(|(_, c)| c["ok"] != Value::Bool(true))
        .map(|(name, c)| format!("{name} ({}): {}", c["class"], c["detail"]))
        .collect();
    assert!(
        failed.is_empty(),
        "isolation checks failed:\n{}",
        failed.join("\n")
    );
}

#[test]
fn probe_cannot_break_out() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    // The volume is nosuid and nodev on the host: nothing set-id or a device node in a
    // template or sandbox tree works there (the sandbox's own mount clears nosuid for sudo).
    let volume = s.data_dir().join("volume");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let opts = mountinfo
        .lines()
        .rfind(|l| l.split(' ').nth(4) == volume.to_str())
        .and_then(|l| l.split(' ').nth(5))
        .unwrap_or_else(|| panic!("{} is not a mount point", volume.display()))
        .to_owned();
    assert!(
        opts.split(',').any(|o| o == "nosuid") && opts.split(',').any(|o| o == "nodev"),
        "volume mount options: {opts}"
    );
    // Host things the probe must not reach: a file, a process, an abstract socket.
    let (args, _listener) = s.host_references();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let before = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();
    let report = s.probe(&id, &args);
    assert_contained(&report);
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap(),
        before
    );
    // Root inside is an unprivileged uid outside: the uid_map names this sandbox's range.
    let (_, map, _) = s.sh(&id, "cat /proc/self/uid_map");
    let fields: Vec<u64> = map.split_whitespace().map(|f| f.parse().unwrap()).collect();
    assert_eq!(fields[0], 0);
    assert!(fields[1] >= s.uid_base as u64, "uid_map {map}");
    assert!(fields[2] <= 65536);
    // Files the sandbox creates are owned by that uid on the host side view of the process.
    let (_, status, _) = s.sh(&id, "sleep 5 & echo $!");
    let inner_pid = status.trim();
    assert!(!inner_pid.is_empty());
}

#[test]
fn fork_bomb_and_memory_hog_are_contained() {
    let s = Spaced::start().unwrap();
    let id = s.create(&["--pids", "64", "--memory", "64"]);
    let other = s.create(&[]);

    // Fork bomb: an endless spawner in the background. Count, from the host, the processes
    // running under the sandbox's uid range: never more than pids.max.
    let info: Value = serde_json::from_str(&s.space_ok(&["inspect", &id])).unwrap();
    let base = info["uid_base"].as_u64().expect("inspect shows uid_base") as u32;
    let bomb = s.space_ok(&[
        "exec",
        "-d",
        &id,
        "--",
        "sh",
        "-c",
        "while true; do sleep 3 & done 2>/dev/null",
    ]);
    let mut peak = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        peak = peak.max(host_processes_in_range(base));
        // The node and other sandboxes stay usable during the bomb.
        assert_eq!(s.space_ok(&["exec", &other, "--", "echo", "ok"]), "ok\n");
    }
    assert!(peak > 20, "the bomb never got going: peak {peak}");
    assert!(peak <= 64, "pids limit breached: {peak} processes");
    // The spawner may already have died of a failed fork; kill it if not.
    let _ = s.space(&["kill", &id, bomb.trim()]);
    std::thread::sleep(Duration::from_secs(4));

    // Memory hog: killed by the sandbox's own OOM limit, not the host's.
    let (code, _, _) = s.sh(&id, "x=a; while true; do x=$x$x; done");
    assert_ne!(code, 0, "the memory hog must be killed");
    // Neither the sandbox's daemon nor the node died.
    assert_eq!(s.space_ok(&["exec", &id, "--", "echo", "alive"]), "alive\n");
    assert_eq!(s.space_ok(&["exec", &other, "--", "echo", "ok"]), "ok\n");
    let info: Value = serde_json::from_str(&s.space_ok(&["inspect", &id])).unwrap();
    assert_eq!(info["state"], "running");
}

#[test]
fn sandboxes_cannot_reach_each_other() {
    let s = Spaced::start().unwrap();
    let a = s.create(&[]);
    let b = s.create(&[]);
    s.sh(
        &a,
        "echo secret-of-a > /root/secret; sleep 1000 >/dev/null 2>&1 &",
    );
    // B sees neither A's files nor its processes, and has its own network stack and uid range.
    let (_, out, _) = s.sh(&b, "cat /root/secret 2>&1; ls /proc | grep -c '^[0-9]'; ps 2>/dev/null | grep -c '[s]leep 1000'");
    assert!(out.contains("No such file"), "B read A's file? {out}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[1].parse::<u32>().unwrap() < 10,
        "B sees many processes: {out}"
    );
    assert_eq!(lines[2].trim(), "0", "B sees A's sleep: {out}");
    let (_, map_a, _) = s.sh(&a, "cat /proc/self/uid_map");
    let (_, map_b, _) = s.sh(&b, "cat /proc/self/uid_map");
    assert_ne!(map_a, map_b, "two sandboxes share a uid range");
    // B's network namespace is its own slot: loopback and its own eth0, none of the host's or
    // the node's interfaces, and an address that is not A's.
    let (_, ifs, _) = s.sh(&b, "cat /proc/net/dev");
    let mut names: Vec<&str> = ifs
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    names.sort();
    assert_eq!(names, ["eth0", "lo"], "B's interfaces: {ifs}");
    let addr = |id: &str| s.inspect(id)["network"]["address"].clone();
    assert!(addr(&a).is_string(), "{}", s.inspect(&a));
    assert_ne!(addr(&a), addr(&b), "two sandboxes share an address");
    // The guest channel sockets live on the host, out of every sandbox's sight.
    let (_, out, _) = s.sh(&b, "ls / ; ls /run 2>&1");
    assert!(!out.contains("guest.sock"));
}

/// sudo works for the default user of `base` in a namespace sandbox (decision 0021), and the
/// root it gives is the sandbox's own: the probe, run through sudo, still cannot break out,
/// and its capabilities are the sandbox's trimmed set.
#[test]
fn sudo_gives_the_sandboxes_own_root_and_no_more() {
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    let id = s.create(&[]);
    assert_eq!(s.space_ok(&["exec", &id, "--", "id", "-u"]), "1000\n");
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "sudo", "-n", "id", "-u"]),
        "0\n"
    );
    // Root through sudo can do what the sandbox's root can: write where only root may.
    s.space_ok(&[
        "exec",
        &id,
        "--",
        "sudo",
        "-n",
        "touch",
        "/etc/written-by-sudo",
    ]);
    let (args, _listener) = s.host_references();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report = s.probe_via(&id, &["sudo", "-n"], &args);
    assert_contained(&report);
    // And as the default user, without sudo.
    assert_contained(&s.probe(&id, &args));
    // The same uid map as without sudo: root inside is the sandbox's first uid outside.
    let (_, map, _) = s.sh(&id, "sudo -n cat /proc/self/uid_map");
    let fields: Vec<u64> = map.split_whitespace().map(|f| f.parse().unwrap()).collect();
    assert_eq!(fields[0], 0);
    assert!(fields[1] >= s.uid_base as u64, "uid_map {map}");
}

/// `(soft, hard)` of a line of /proc/self/limits inside the sandbox.
fn limit(s: &Spaced, id: &str, name: &str) -> (String, String) {
    let (_, out, _) = s.sh(id, &format!("grep '^{name}' /proc/self/limits"));
    let f: Vec<&str> = out[name.len()..].split_whitespace().collect();
    (f[0].to_owned(), f[1].to_owned())
}

/// Resource limits (decision 0041): the defaults, a create's own (both through the warm pool
/// and cold), and clear refusals.
#[test]
fn resource_limits_are_sane_by_default_and_set_per_sandbox() {
    let s = Spaced::start().unwrap();
    let own_hard = std::fs::read_to_string("/proc/self/limits")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
        .unwrap();
    let own_hard: u64 = own_hard.parse().unwrap_or(u64::MAX);
    let id = s.create(&[]);
    assert_eq!(
        limit(&s, &id, "Max open files"),
        ("1024".to_owned(), own_hard.min(524_288).to_string())
    );
    assert_eq!(
        limit(&s, &id, "Max core file size"),
        ("0".into(), "0".into())
    );
    assert_eq!(
        limit(&s, &id, "Max locked memory"),
        ("8388608".into(), "8388608".into())
    );
    // The daemon's children are first in line for the OOM killer.
    let (_, adj, _) = s.sh(&id, "cat /proc/self/oom_score_adj");
    assert_eq!(adj.trim(), "500");

    // A create's own limits, with and without other limits changed (the pool path is
    // pool::a_pooled_sandbox_carries_nothing_from_one_user_to_the_next).
    for extra in [&[][..], &["--memory", "300"][..]] {
        let mut args = vec!["--rlimit", "nofile=4096", "--rlimit", "core=1048576"];
        args.extend_from_slice(extra);
        let id = s.create(&args);
        assert_eq!(
            limit(&s, &id, "Max open files"),
            ("4096".into(), "4096".into())
        );
        assert_eq!(
            limit(&s, &id, "Max core file size"),
            ("1048576".into(), "1048576".into())
        );
        assert_eq!(s.inspect(&id)["rlimits"]["nofile"], 4096);
    }

    // Clear refusals, and nothing made.
    let ids = || -> Vec<String> {
        let v: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
        let mut ids: Vec<String> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let before = ids();
    for (args, needle) in [
        (
            &["--rlimit", "nofile=8"][..],
            "rlimits.nofile must be between 16",
        ),
        (&["--rlimit", "stack=1"][..], "unknown rlimit \"stack\""),
        (
            &["--memory", "64", "--rlimit", "memlock=1000000000"][..],
            "rlimits.memlock must be at most",
        ),
    ] {
        let mut all = vec!["create"];
        all.extend_from_slice(args);
        let out = s.space(&all);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    assert_eq!(ids(), before, "a refused create left a sandbox");
}
