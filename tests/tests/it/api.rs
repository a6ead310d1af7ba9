//! The REST API with good and bad input: every entry point answers wrong ids, bad paths,
//! missing or invalid fields, oversized payloads, wrong keys and wrong lifecycle states with a
//! clear JSON error, and disturbs nothing else.

use base64::Engine;
use reqwest::Method;
use serde_json::{Value, json};
use space_tests::{Spaced, on_each_runtime};

/// Assert an error response: status and `error.code`, with a non-empty message.
async fn expect_error(resp: reqwest::Response, status: u16, code: &str) {
    let got = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    assert_eq!(got, status, "status; body {body}");
    assert_eq!(body["error"]["code"], code, "code; body {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "message; body {body}"
    );
}

async fn exec_lines(s: &Spaced, id: &str, body: Value) -> Vec<Value> {
    let r = s
        .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "exec status");
    let text = r.text().await.unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn stdout_of(events: &[Value]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    events
        .iter()
        .filter(|e| e["type"] == "stdout")
        .map(|e| String::from_utf8(b64.decode(e["data"].as_str().unwrap()).unwrap()).unwrap())
        .collect()
}

on_each_runtime! {
async fn api_happy_path_and_files(rt) {
    let s = tokio::task::block_in_place(|| Spaced::start_on(rt).unwrap());
    let r = s.req_anon(Method::GET, "/healthz").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);

    let r = s
        .req(Method::POST, "/v1/sandboxes")
        .json(&json!({"cpu": 0.5, "memory_mib": 128, "pids": 64, "env": {"A": "b"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let sb: Value = r.json().await.unwrap();
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(sb["state"], "running");
    assert_eq!(sb["pids"], 64);

    let ev = exec_lines(&s, &id, json!({"cmd": ["sh", "-c", "echo $A; exit 3"]})).await;
    assert_eq!(ev.first().unwrap()["type"], "started");
    assert_eq!(ev.last().unwrap()["type"], "exit");
    assert_eq!(ev.last().unwrap()["code"], 3);
    assert_eq!(stdout_of(&ev), "b\n");

    // Files: put, stat, list, get, mkdir, rename, delete.
    let r = s
        .req(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/a.txt"),
        )
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (st, stat) = s
        .get_json(&format!("/v1/sandboxes/{id}/files/stat?path=/tmp/a.txt"))
        .await
        .unwrap();
    assert_eq!(
        (st, stat["size"].as_u64(), stat["type"].as_str()),
        (200, Some(7), Some("file"))
    );
    let r = s
        .req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/a.txt"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "payload");
    let r = s
        .req(Method::POST, &format!("/v1/sandboxes/{id}/files/mkdir"))
        .json(&json!({"path": "/tmp/d/e", "parents": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let r = s
        .req(Method::POST, &format!("/v1/sandboxes/{id}/files/rename"))
        .json(&json!({"from": "/tmp/a.txt", "to": "/tmp/d/e/b.txt"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (_, list) = s
        .get_json(&format!("/v1/sandboxes/{id}/files/list?path=/tmp/d/e"))
        .await
        .unwrap();
    let names: Vec<&str> = list["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["b.txt"]);
    let r = s
        .req(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/d&recursive=true"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    expect_error(
        s.req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files/stat?path=/tmp/d"),
        )
        .send()
        .await
        .unwrap(),
        404,
        "not_found",
    )
    .await;

    // A symlink that points "outside" resolves inside the sandbox's own root: the host's
    // file is never read. The marker exists only on the host.
    let marker = s.dir.path().join("host-secret");
    std::fs::write(&marker, "host secret").unwrap();
    let link = format!("ln -s ../../../../../../..{} /tmp/escape", marker.display());
    let ev = exec_lines(&s, &id, json!({"cmd": ["sh", "-c", link]})).await;
    assert_eq!(ev.last().unwrap()["code"], 0);
    let r = s
        .req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/escape"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        404,
        "the symlink must not reach the host file"
    );
    let r = s
        .req(
            Method::GET,
            &format!(
                "/v1/sandboxes/{id}/files?path=/../../../../..{}",
                marker.display()
            ),
        )
        .send()
        .await
        .unwrap();
    assert_ne!(r.status().as_u16(), 200);
    // Writing through the link lands inside the sandbox, not on the host.
    let _ = s
        .req(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/escape"),
        )
        .body("overwritten")
        .send()
        .await
        .unwrap();
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "host secret");

    let r = s
        .req(Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_bad_input() {
    let s = tokio::task::block_in_place(|| Spaced::start().unwrap());
    let id = tokio::task::block_in_place(|| s.create(&[]));
    let ghost = "zzzzzzzzzzzzzzzzzzzz";

    // Keys: none, wrong, malformed header.
    expect_error(
        s.req_anon(Method::GET, "/v1/sandboxes")
            .send()
            .await
            .unwrap(),
        401,
        "unauthorized",
    )
    .await;
    expect_error(
        s.req_anon(Method::GET, "/v1/sandboxes")
            .bearer_auth("sk_wrong")
            .send()
            .await
            .unwrap(),
        401,
        "unauthorized",
    )
    .await;
    expect_error(
        s.req_anon(Method::DELETE, &format!("/v1/sandboxes/{id}"))
            .header("Authorization", "Basic abc")
            .send()
            .await
            .unwrap(),
        401,
        "unauthorized",
    )
    .await;

    // Unknown ids and malformed ids, on every resource.
    for (m, p) in [
        (Method::GET, format!("/v1/sandboxes/{ghost}")),
        (Method::DELETE, format!("/v1/sandboxes/{ghost}")),
        (Method::GET, format!("/v1/sandboxes/{ghost}/processes")),
        (
            Method::GET,
            format!("/v1/sandboxes/{ghost}/files?path=/etc/passwd"),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{ghost}/files/list?path=/"),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{id}/processes/99999/output"),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{id}/files?path=/no/such/file"),
        ),
        (Method::GET, "/v1/no-such-route".to_string()),
    ] {
        expect_error(s.req(m, &p).send().await.unwrap(), 404, "not_found").await;
    }
    expect_error(
        s.req(Method::POST, &format!("/v1/sandboxes/{ghost}/exec"))
            .json(&json!({"cmd": ["true"]}))
            .send()
            .await
            .unwrap(),
        404,
        "not_found",
    )
    .await;
    expect_error(
        s.req(
            Method::POST,
            &format!("/v1/sandboxes/{id}/processes/99999/signal"),
        )
        .json(&json!({"signal": "KILL"}))
        .send()
        .await
        .unwrap(),
        404,
        "not_found",
    )
    .await;
    expect_error(
        s.req(Method::GET, "/v1/sandboxes/NOT-AN-ID!")
            .send()
            .await
            .unwrap(),
        400,
        "invalid_argument",
    )
    .await;

    // Unknown template.
    expect_error(
        s.req(Method::POST, "/v1/sandboxes")
            .json(&json!({"template": "nope"}))
            .send()
            .await
            .unwrap(),
        404,
        "not_found",
    )
    .await;

    // Missing and invalid fields, unknown fields, broken JSON.
    for body in [
        json!({"cpu": -1}),
        json!({"memory_mib": 1}),
        json!({"pids": 0}),
        json!({"env": {"BAD=KEY": "x"}}),
        json!({"env": {"": "x"}}),
        json!({"template": "../../etc"}),
        json!({"bogus_field": 1}),
        json!({"cpu": "two"}),
    ] {
        expect_error(
            s.req(Method::POST, "/v1/sandboxes")
                .json(&body)
                .send()
                .await
                .unwrap(),
            400,
            "invalid_argument",
        )
        .await;
    }
    expect_error(
        s.req(Method::POST, "/v1/sandboxes")
            .header("Content-Type", "application/json")
            .body("{not json")
            .send()
            .await
            .unwrap(),
        400,
        "invalid_argument",
    )
    .await;
    for body in [
        json!({}),
        json!({"cmd": []}),
        json!({"cmd": "true"}),
        json!({"cmd": ["true"], "stdin_data": "%%%"}),
    ] {
        expect_error(
            s.req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
                .json(&body)
                .send()
                .await
                .unwrap(),
            400,
            "invalid_argument",
        )
        .await;
    }

    // Bad paths: relative, empty, missing query.
    for p in ["relative/x", ""] {
        expect_error(
            s.req(Method::GET, &format!("/v1/sandboxes/{id}/files?path={p}"))
                .send()
                .await
                .unwrap(),
            400,
            "invalid_argument",
        )
        .await;
    }
    expect_error(
        s.req(Method::GET, &format!("/v1/sandboxes/{id}/files"))
            .send()
            .await
            .unwrap(),
        400,
        "invalid_argument",
    )
    .await;
    expect_error(
        s.req(Method::GET, &format!("/v1/sandboxes/{id}/files?path=/etc"))
            .send()
            .await
            .unwrap(),
        412,
        "failed_precondition",
    )
    .await;

    // Oversized JSON body.
    let huge = "x".repeat(2 * 1024 * 1024);
    expect_error(
        s.req(Method::POST, "/v1/sandboxes")
            .json(&json!({"env": {"BIG": huge}}))
            .send()
            .await
            .unwrap(),
        413,
        "payload_too_large",
    )
    .await;

    // Offsets beyond the end of a process's output.
    let r = s
        .req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": ["echo", "hi"], "background": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let pid = r.json::<Value>().await.unwrap()["pid"].as_u64().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    expect_error(
        s.req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?offset=1000000"),
        )
        .send()
        .await
        .unwrap(),
        416,
        "out_of_range",
    )
    .await;

    // None of that disturbed the sandbox.
    let ev = exec_lines(&s, &id, json!({"cmd": ["echo", "still fine"]})).await;
    assert_eq!(stdout_of(&ev), "still fine\n");

    // Wrong lifecycle state: exec in a removed sandbox.
    let r = s
        .req(Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    expect_error(
        s.req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
            .json(&json!({"cmd": ["true"]}))
            .send()
            .await
            .unwrap(),
        404,
        "not_found",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_during_removal_is_refused() {
    // Start a removal and race execs against it: each exec either completes before the
    // removal or gets a clear conflict / not_found; never a 500 or a hang.
    let s = tokio::task::block_in_place(|| Spaced::start().unwrap());
    let id = tokio::task::block_in_place(|| s.create(&[]));
    let del = s.req(Method::DELETE, &format!("/v1/sandboxes/{id}")).send();
    let mut execs = Vec::new();
    for _ in 0..10 {
        execs.push(
            s.req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
                .json(&json!({"cmd": ["true"]}))
                .send(),
        );
    }
    let (d, results) = tokio::join!(del, futures::future::join_all(execs));
    assert_eq!(d.unwrap().status().as_u16(), 204);
    for r in results {
        let r = r.unwrap();
        let st = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert!(
            st == 200 || st == 404 || st == 409,
            "exec during removal: {st} {body}"
        );
        if st != 200 {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert!(v["error"]["code"] == "conflict" || v["error"]["code"] == "not_found");
        }
    }
}
