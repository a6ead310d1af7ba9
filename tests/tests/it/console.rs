//! The web console (issue 17, decision 0058): its files at `/ui` and their headers, the
//! terminal's WebSocket tried with good and bad callers, and the whole console driven in
//! Debian's chromium by `console/e2e/run.mjs`.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use space_tests::*;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_under_a_strict_policy_without_a_key() {
    let s = Spaced::start().unwrap();
    let get = |path: &str| s.req_anon(reqwest::Method::GET, path).send();
    let r = get("/ui").await.unwrap();
    assert_eq!(r.status(), 200);
    let csp = r.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(
        !csp.contains("unsafe-eval") && !csp.contains("http"),
        "{csp}"
    );
    assert_eq!(r.headers()["x-content-type-options"], "nosniff");
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let index = r.text().await.unwrap();
    assert!(
        index.contains("/ui/app.js"),
        "the console was not built into spaced (scripts/lib.sh build_console): {index}"
    );
    // No inline script and no other origin in the page.
    assert!(!index.contains("<script>"), "{index}");
    assert!(
        !index.contains("http://") && !index.contains("https://"),
        "{index}"
    );

    let js = get("/ui/app.js").await.unwrap();
    assert_eq!(js.status(), 200);
    assert!(
        js.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/javascript")
    );
    assert!(js.headers().contains_key("content-security-policy"));
    let css = get("/ui/app.css").await.unwrap();
    assert!(
        css.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/css")
    );
    // A deep link is the page; an unknown file is 404, not the page.
    let deep = get("/ui/sandboxes/abc").await.unwrap();
    assert_eq!(deep.status(), 200);
    assert_eq!(deep.text().await.unwrap(), index);
    assert_eq!(get("/ui/nope.js").await.unwrap().status(), 404);
    assert_eq!(get("/ui/../v1/sandboxes").await.unwrap().status(), 401);
    // The files are public; the API is not.
    assert_eq!(get("/v1/sandboxes").await.unwrap().status(), 401);
}

/// Opens the terminal of `pid` with `key` (as a browser does: the subprotocols), from
/// `origin` when given. Err: the handshake's HTTP status.
async fn open(
    s: &Spaced,
    id: &str,
    pid: u64,
    offset: u64,
    key: &str,
    origin: Option<&str>,
) -> Result<Ws, u16> {
    let url = format!(
        "{}/v1/sandboxes/{id}/processes/{pid}/terminal?offset={offset}",
        s.url.replacen("http", "ws", 1)
    );
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "sec-websocket-protocol",
        format!("space.v1, space-key.{key}").parse().unwrap(),
    );
    if let Some(o) = origin {
        req.headers_mut().insert("origin", o.parse().unwrap());
    }
    match tokio::time::timeout(
        Duration::from_secs(20),
        tokio_tungstenite::connect_async(req),
    )
    .await
    {
        Ok(Ok((ws, resp))) => {
            assert_eq!(resp.headers()["sec-websocket-protocol"], "space.v1");
            Ok(ws)
        }
        Ok(Err(tokio_tungstenite::tungstenite::Error::Http(resp))) => Err(resp.status().as_u16()),
        Ok(Err(e)) => panic!("handshake: {e}"),
        Err(_) => panic!("handshake timed out"),
    }
}

/// What came until `pred` holds on the output text: (text, the end offset). Every frame's
/// offset must continue the one before.
async fn read_until(
    ws: &mut Ws,
    mut end: Option<u64>,
    pred: impl Fn(&str) -> bool,
) -> (String, u64, Vec<Value>) {
    let mut text = String::new();
    let mut controls = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if pred(&text) {
            return (text, end.unwrap_or(0), controls);
        }
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("no {text:?} in time"));
        match msg {
            Some(Ok(Message::Binary(b))) => {
                let offset = u64::from_be_bytes(b[..8].try_into().unwrap());
                if let Some(e) = end {
                    assert_eq!(offset, e, "frames continue one another");
                }
                end = Some(offset + b.len() as u64 - 8);
                text.push_str(&String::from_utf8_lossy(&b[8..]));
            }
            Some(Ok(Message::Text(t))) => controls.push(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Close(c))) => {
                controls.push(json!({"close": c.map(|c| u16::from(c.code))}));
                return (text, end.unwrap_or(0), controls);
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => panic!("{e}"),
            None => return (text, end.unwrap_or(0), controls),
        }
    }
}

/// The error a refused session ends with: (its code, the close code).
async fn refused(mut ws: Ws) -> (String, u16) {
    let (_, _, controls) = read_until(&mut ws, None, |_| false).await;
    let code = controls
        .iter()
        .find_map(|c| c["error"]["code"].as_str())
        .unwrap_or_else(|| panic!("no error frame: {controls:?}"))
        .to_owned();
    let close = controls
        .iter()
        .find_map(|c| c["close"].as_u64())
        .unwrap_or_else(|| panic!("no close: {controls:?}"));
    (code, close as u16)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_terminal_echoes_resizes_reconnects_and_refuses_bad_callers() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let r = s
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({"cmd": ["/bin/sh"], "tty": true, "stdin": true, "background": true, "rows": 24, "cols": 80}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let started: Value = r.json().await.unwrap();
    let pid = started["pid"].as_u64().unwrap();

    // Echo, then a resize the shell sees.
    let mut ws = open(&s, &id, pid, 0, &s.key, None).await.unwrap();
    ws.send(Message::Binary(b"echo hi-$((40+2))\n".to_vec().into()))
        .await
        .unwrap();
    let (_, end, _) = read_until(&mut ws, None, |t| t.contains("hi-42")).await;
    ws.send(Message::Text(r#"{"resize":{"rows":33,"cols":111}}"#.into()))
        .await
        .unwrap();
    ws.send(Message::Binary(b"stty size\n".to_vec().into()))
        .await
        .unwrap();
    let (_, end, _) = read_until(&mut ws, Some(end), |t| t.contains("33 111")).await;
    drop(ws);

    // A dropped connection: what comes meanwhile is there on reconnect from the offset, and
    // nothing from before it comes again.
    let r = s
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/processes/{pid}/stdin"),
        )
        .body("echo while-away\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let mut ws = open(&s, &id, pid, end, &s.key, None).await.unwrap();
    let (again, _, _) = read_until(&mut ws, Some(end), |t| t.contains("\nwhile-away")).await;
    assert!(
        !again.contains("hi-42") && !again.contains("33 111"),
        "{again:?}"
    );
    // A bad text frame ends the session with the reason.
    ws.send(Message::Text(r#"{"rows":1}"#.into()))
        .await
        .unwrap();
    assert_eq!(refused(ws).await, ("invalid_argument".to_owned(), 4400));

    // Wrong and missing keys are refused at the handshake; so is another origin.
    assert_eq!(
        open(&s, &id, pid, 0, "sk_wrong", None).await.err(),
        Some(401)
    );
    assert_eq!(open(&s, &id, pid, 0, "", None).await.err(), Some(401));
    assert_eq!(
        open(&s, &id, pid, 0, &s.key, Some("http://evil.example"))
            .await
            .err(),
        Some(403)
    );
    // Another tenant's key does not see the sandbox.
    s.space_ok(&["tenant", "create", "team-b"]);
    let other = s.space_ok(&["key", "create", "--tenant", "team-b"]);
    assert_eq!(
        open(&s, &id, pid, 0, other.trim(), None).await.err(),
        Some(404)
    );
    // A read-only key of its tenant watches but cannot type.
    let ro = s.space_ok(&[
        "key",
        "create",
        "--tenant",
        "default",
        "--scope",
        "read-only",
    ]);
    let mut ws = open(&s, &id, pid, end, ro.trim(), None).await.unwrap();
    read_until(&mut ws, Some(end), |t| t.contains("while-away")).await;
    ws.send(Message::Binary(
        b"echo typed-by-read-only\n".to_vec().into(),
    ))
    .await
    .unwrap();
    assert_eq!(refused(ws).await, ("permission_denied".to_owned(), 4403));
    // Unknown process, unknown sandbox, an offset past the end: told in the session.
    let ws = open(&s, &id, 999_999, 0, &s.key, None).await.unwrap();
    assert_eq!(refused(ws).await.1, 4404);
    let ws = open(&s, "nosuchsandbox0000000", pid, 0, &s.key, None)
        .await
        .unwrap();
    assert_eq!(refused(ws).await.1, 4404);
    let ws = open(&s, &id, pid, 1 << 40, &s.key, None).await.unwrap();
    assert_eq!(refused(ws).await.0, "out_of_range");
    // A plain GET is told it is a WebSocket.
    let r = s
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/processes/{pid}/terminal"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("WebSocket"),
        "{body}"
    );

    // The process ends: the session says how, last.
    let mut ws = open(&s, &id, pid, 0, &s.key, None).await.unwrap();
    ws.send(Message::Binary(b"exit 3\n".to_vec().into()))
        .await
        .unwrap();
    let (_, _, controls) = read_until(&mut ws, None, |_| false).await;
    assert!(
        controls.iter().any(|c| c["exit"]["code"] == 3),
        "{controls:?}"
    );
    assert!(
        controls
            .iter()
            .any(|c| c["close"] == u16::from(CloseCode::Normal)),
        "{controls:?}"
    );
    // What the read-only key typed never reached the shell.
    let r = s
        .req(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/processes/{pid}/output?follow=false"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ndjson = r.text().await.unwrap();
    use base64::Engine as _;
    let all: Vec<u8> = ndjson
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|e| e["data"].as_str().map(str::to_owned))
        .flat_map(|d| base64::engine::general_purpose::STANDARD.decode(d).unwrap())
        .collect();
    let all = String::from_utf8_lossy(&all);
    assert!(all.contains("while-away"), "{all}");
    assert!(!all.contains("typed-by-read-only"), "{all}");
}

/// The console in a real browser: every step of issue 17's list, screenshots into
/// docs/console, and the console's figures (first load, keystroke echo).
#[test]
fn the_console_works_in_chromium() {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        std::path::Path::new(&chromium).exists(),
        "no {chromium}: scripts/test installs Debian's chromium (apt-get install chromium)"
    );
    let console = root().join("console");
    assert!(
        console.join("node_modules/puppeteer-core").is_dir(),
        "no console/node_modules: scripts/lib.sh build_console runs npm ci"
    );
    let (s, template) = match Spaced::start_with_base(&[]) {
        Some(s) => (s, "base"),
        None => (Spaced::start().unwrap(), "minimal"),
    };
    let shots = std::env::var("CONSOLE_SHOTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root().join("docs/console"));
    let out = std::process::Command::new("node")
        .arg("e2e/run.mjs")
        .current_dir(&console)
        .env("SPACE_URL", &s.url)
        .env("SPACE_KEY", &s.key)
        .env("SPACE_TEMPLATE", template)
        .env("SHOTS", &shots)
        .env("CHROMIUM", &chromium)
        .output()
        .expect("node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the console's browser test failed:\n{stderr}\n{stdout}\nspaced:\n{}",
        s.log_tail()
    );
    let figures: Value = serde_json::from_str(stdout.lines().last().unwrap_or("{}")).unwrap();
    println!("console figures: {figures}");
    for name in [
        "signin",
        "sandbox-terminal",
        "files",
        "snapshots",
        "timeline",
        "sandboxes",
    ] {
        assert!(
            shots.join(format!("{name}.png")).is_file(),
            "no screenshot {name}"
        );
    }
}
