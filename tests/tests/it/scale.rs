//! A node full of idle sandboxes survives restarts (issue 16): every sandbox is re-adopted,
//! not restarted, after a graceful stop and after kill -9, and the time it takes is printed.
//! CI runs it at 500 sandboxes; `SPACE_SCALE_N=10000` takes the figure BENCHMARKS.md records
//! (`cargo test -p space-tests --test it scale:: -- --nocapture`).

use std::time::{Duration, Instant};

use futures::StreamExt;
use space_tests::Spaced;

/// Creates in flight at once.
const CONCURRENCY: usize = 8;

fn count() -> usize {
    std::env::var("SPACE_SCALE_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

/// The sandboxes' states, by id.
fn states(s: &Spaced) -> Vec<(String, String)> {
    let (code, v) = s.call(reqwest::Method::GET, "/v1/sandboxes", None);
    assert_eq!(code, 200, "{v}");
    v.as_array()
        .or_else(|| v["sandboxes"].as_array())
        .expect("a list")
        .iter()
        .map(|sb| {
            (
                sb["id"].as_str().unwrap().to_owned(),
                sb["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn mem_available_mib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        / 1024
}

#[test]
fn a_full_node_is_readopted_after_a_restart_and_a_kill9() {
    let n = count();
    // 2 MiB each (measured 1.1 to 1.7) within MemAvailable less a GiB, as `space bench
    // scale` budgets.
    if n as u64 * 2 + 1024 > mem_available_mib() {
        panic!(
            "{n} sandboxes need about {} MiB and a GiB to spare: more than MemAvailable ({} MiB)",
            n * 2,
            mem_available_mib()
        );
    }
    let mut s = Spaced::start().unwrap();
    s.space_ok(&["pool", "set", "minimal", "--min", "0", "--max", "0"]);
    let t0 = Instant::now();
    // One runtime for the concurrent creates: the harness's client must not hand a
    // connection from one runtime to another.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ids: Vec<String> = rt.block_on(async {
        futures::stream::iter(0..n)
            .map(|i| {
                let rb = s
                    .req(reqwest::Method::POST, "/v1/sandboxes")
                    .json(&serde_json::json!({"template": "minimal"}));
                async move {
                    let r = rb.send().await.expect("send");
                    let code = r.status().as_u16();
                    let v: serde_json::Value = r.json().await.unwrap_or_default();
                    assert_eq!(code, 201, "create #{i}: {v}");
                    v["id"].as_str().unwrap().to_owned()
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await
    });
    drop(rt);
    assert_eq!(ids.len(), n);
    println!(
        "{n} sandboxes created in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    // State that only an adopted (not restarted) sandbox still has: a process and a file.
    let (first, last) = (&ids[0], &ids[n - 1]);
    let pid = s.space_ok(&["exec", "-d", first, "--", "sleep", "100000"]);
    let pid = pid.trim().to_owned();
    s.sh(last, "echo kept > /tmp/state");

    for crash in [false, true] {
        let what = if crash { "kill -9" } else { "graceful stop" };
        if crash {
            s.kill9();
        } else {
            let st = s.stop().unwrap();
            assert!(st.success(), "spaced exit status {st}");
        }
        let t0 = Instant::now();
        s.spawn().unwrap();
        let ready = t0.elapsed();
        // Every sandbox is running again, none lost or stopped (bounded wait).
        let deadline = Instant::now() + Duration::from_secs(120);
        let all = loop {
            let st = states(&s);
            let running = st.iter().filter(|(_, state)| state == "running").count();
            if running == n && st.len() == n {
                break t0.elapsed();
            }
            assert!(
                Instant::now() < deadline,
                "after {what}: {running} of {n} running: {:?}",
                st.iter()
                    .filter(|(_, state)| state != "running")
                    .take(5)
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        println!(
            "re-adoption of {n} sandboxes after {what}: spaced answering in {:.2} s, \
             all listed running in {:.2} s",
            ready.as_secs_f64(),
            all.as_secs_f64()
        );
        let ps = s.space_ok(&["ps", first]);
        assert!(
            ps.lines()
                .any(|l| l.split_whitespace().next() == Some(pid.as_str())),
            "after {what}, pid {pid} is gone: the sandbox was restarted, not adopted:\n{ps}"
        );
        assert_eq!(
            s.space_ok(&["exec", last, "--", "cat", "/tmp/state"]),
            "kept\n"
        );
        // A spread of the others answers too.
        for id in ids.iter().step_by((n / 10).max(1)) {
            let (code, _, _) = s.sh(id, "true");
            assert_eq!(code, 0, "{id} after {what}");
        }
    }
}
