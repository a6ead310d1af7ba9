//! Reconnect: clients that drop mid-stream come back with a byte offset and receive exactly
//! the bytes they missed, or an explicit gap marker when the bounded buffer was overrun.

use base64::Engine;
use futures::StreamExt;
use reqwest::Method;
use serde_json::{Value, json};
use space_tests::{Spaced, on_each_runtime};

fn b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// The bytes `seq 1 n` prints.
fn seq_bytes(n: u32) -> Vec<u8> {
    (1..=n)
        .flat_map(|i| format!("{i}\n").into_bytes())
        .collect()
}

async fn start_bg(s: &Spaced, id: &str, script: &str) -> u64 {
    let r = s
        .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": ["sh", "-c", script], "background": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    r.json::<Value>().await.unwrap()["pid"].as_u64().unwrap()
}

/// Reads the output stream from `offset` until `limit` data bytes arrived (then drops the
/// connection) or the stream ended. Returns (data, gap events, exit event seen).
async fn read_output(
    s: &Spaced,
    id: &str,
    pid: u64,
    offset: u64,
    limit: usize,
) -> (Vec<u8>, Vec<Value>, bool) {
    let r = s
        .req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?offset={offset}&follow=true"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut body = r.bytes_stream();
    let (mut data, mut gaps, mut pending) = (Vec::new(), Vec::new(), Vec::new());
    let mut next_offset = offset;
    while let Some(chunk) = body.next().await {
        pending.extend_from_slice(&chunk.unwrap());
        while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let ev: Value = serde_json::from_slice(&line).unwrap();
            match ev["type"].as_str().unwrap() {
                "stdout" | "stderr" | "pty" => {
                    // Offsets are contiguous: each event starts where the last one ended.
                    assert_eq!(
                        ev["offset"].as_u64().unwrap(),
                        next_offset,
                        "offset jump: {ev}"
                    );
                    let d = b64(ev["data"].as_str().unwrap());
                    next_offset += d.len() as u64;
                    data.extend_from_slice(&d);
                    if data.len() >= limit {
                        return (data, gaps, false); // drop the connection mid-stream
                    }
                }
                "gap" => {
                    next_offset = ev["to"].as_u64().unwrap();
                    gaps.push(ev);
                }
                "exit" => return (data, gaps, true),
                other => panic!("unexpected event {other}: {ev}"),
            }
        }
    }
    (data, gaps, false)
}

on_each_runtime! {
async fn dropped_clients_get_exactly_the_missed_bytes(rt) {
    let s = tokio::task::block_in_place(|| Spaced::start_on(rt).unwrap());
    let id = tokio::task::block_in_place(|| s.create(&[]));
    // ~490 KB of output, produced in bursts while clients come and go.
    let n = 80_000;
    let pid = start_bg(&s, &id, "i=0; while [ $i -lt 8 ]; do seq $((i*10000+1)) $(((i+1)*10000)); i=$((i+1)); sleep 0.05; done").await;
    let expected = seq_bytes(n);

    let mut got = Vec::new();
    let mut drops = 0;
    loop {
        let (data, gaps, ended) = read_output(&s, &id, pid, got.len() as u64, 37_000).await;
        assert!(
            gaps.is_empty(),
            "no gap expected within the buffer: {gaps:?}"
        );
        got.extend_from_slice(&data);
        if ended {
            break;
        }
        drops += 1;
        assert!(drops < 100, "too many reconnects");
    }
    assert!(
        drops >= 5,
        "the test should have dropped mid-stream several times ({drops})"
    );
    assert_eq!(got.len(), expected.len());
    assert!(
        got == expected,
        "reassembled output differs from what the process printed"
    );

    // A finished process stays attachable, from any offset inside its buffer.
    let (tail, _, ended) = read_output(&s, &id, pid, (expected.len() - 6) as u64, usize::MAX).await;
    assert!(ended);
    assert_eq!(tail, b"80000\n");
}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrun_buffer_reports_an_explicit_gap() {
    let s = tokio::task::block_in_place(|| Spaced::start().unwrap());
    let id = tokio::task::block_in_place(|| s.create(&[]));
    // ~2.4 MB: more than the 1 MiB per-process buffer.
    let n = 350_000;
    let pid = start_bg(&s, &id, &format!("seq 1 {n}")).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let (data, gaps, ended) = read_output(&s, &id, pid, 0, usize::MAX).await;
    assert!(ended);
    assert_eq!(gaps.len(), 1, "exactly one gap marker: {gaps:?}");
    let expected = seq_bytes(n);
    let from = gaps[0]["from"].as_u64().unwrap();
    let to = gaps[0]["to"].as_u64().unwrap() as usize;
    assert_eq!(from, 0);
    assert!(to > 0 && to < expected.len());
    // After the gap: exactly the retained tail, byte for byte.
    assert!(data == expected[to..], "bytes after the gap differ");
}

/// Reconnect latency: attach to a running process's output and receive the first byte.
/// A benchmark, not a timed test: run against release binaries with
/// `--ignored --nocapture` (see docs/decisions/0007-snapshots.md for the command pattern).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn bench_reconnect_first_byte() {
    let s = tokio::task::block_in_place(|| Spaced::start().unwrap());
    let id = tokio::task::block_in_place(|| s.create(&[]));
    let pid = start_bg(&s, &id, "echo ready; sleep 1000").await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut samples = Vec::new();
    for _ in 0..300 {
        let t = std::time::Instant::now();
        let r = s
            .req(
                Method::GET,
                &format!("/v1/sandboxes/{id}/processes/{pid}/output?offset=0&follow=true"),
            )
            .send()
            .await
            .unwrap();
        let mut body = r.bytes_stream();
        let first = body.next().await.unwrap().unwrap();
        samples.push(t.elapsed());
        assert!(
            String::from_utf8_lossy(&first).contains("\"stdout\""),
            "{first:?}"
        );
        drop(body);
    }
    samples.sort();
    let p = |q: f64| space_tests::percentile(&samples, q).as_secs_f64() * 1e3;
    println!(
        "reconnect (attach + first byte), {} runs: p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
        samples.len(),
        p(50.0),
        p(90.0),
        p(99.0),
        samples.last().unwrap().as_secs_f64() * 1e3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffer_size_and_retention_are_configurable() {
    let s = tokio::task::block_in_place(|| {
        Spaced::start_with(&["--output-buffer", "64K", "--exited-retention", "2"]).unwrap()
    });
    let id = tokio::task::block_in_place(|| s.create(&[]));
    // 100 KB of output overruns a 64 KiB buffer.
    let pid = start_bg(&s, &id, "seq 1 20000").await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (data, gaps, ended) = read_output(&s, &id, pid, 0, usize::MAX).await;
    assert!(ended);
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(
        data.len(),
        64 * 1024,
        "exactly the configured buffer is retained"
    );
    // The finished process is forgotten after the configured retention.
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let r = s
        .req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/processes/{pid}/output"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // The daemon's settings never reach the processes it starts.
    let env = tokio::task::block_in_place(|| s.space_ok(&["exec", &id, "--", "env"]));
    assert!(
        !env.contains("SPACE_OUTPUT_BUFFER") && !env.contains("SPACE_EXITED"),
        "{env}"
    );
    assert!(env.contains("SPACE_SANDBOX_ID="), "{env}");
    // A nonsensical size is refused at start with a clear message.
    let err = tokio::task::block_in_place(|| Spaced::start_with(&["--output-buffer", "1"]))
        .err()
        .expect("spaced must refuse a 1-byte buffer");
    assert!(format!("{err:#}").contains("--output-buffer"), "{err:#}");
}
