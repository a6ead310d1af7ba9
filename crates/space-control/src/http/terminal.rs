//! `GET /v1/sandboxes/{id}/processes/{pid}/terminal`: a process's output and input over a
//! WebSocket, for the console's terminal (issue 17, decision 0058).
//!
//! - Server to client: binary frames of an 8-byte big-endian output offset, then the bytes
//!   (PTY output, or stdout and stderr of a process without one); text frames
//!   `{"gap":{"from":F,"to":T}}`, `{"exit":{"code":C,"signal":S}}` (last; close code 1000)
//!   and `{"error":{"code":..,"message":..}}` (last; close code 4000 + the HTTP status, or
//!   1011 when the stream fails midway). A stream that ends without either (the guest went
//!   away) closes with 1012: reconnect from the offset.
//! - Client to server: binary frames are stdin; a text frame `{"resize":{"rows":R,"cols":C}}`
//!   resizes the PTY. Anything else ends the session with close code 4400.
//!
//! The key comes as the subprotocol `space-key.<key>` (a browser cannot set headers on a
//! WebSocket; [`crate::auth::presented_key`]), and the answer names `space.v1`.

use axum::Extension;
use axum::extract::State;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::http::{HeaderMap, header};
use axum::response::Response;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::Deserialize;
use space_api::ExecEvent;

use super::HResult;
use super::extract::*;
use crate::AppState;
use crate::error::{ControlError, ErrorKind};
use crate::tenants::Principal;
use space_api::tenant::KeyScope;

/// The subprotocol the console speaks; the server always answers with it.
pub const PROTOCOL: &str = "space.v1";
/// Stdin frames over this are refused (the REST stdin call has the same bound's spirit).
const MAX_STDIN_FRAME: usize = 64 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TerminalQuery {
    #[serde(default)]
    offset: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Control {
    resize: Size,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Size {
    rows: u16,
    cols: u16,
}

/// A browser's page from another origin may not open it even with a key it somehow has:
/// the `Origin` must be absent (not a browser) or this request's own host.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let (Ok(origin), Some(Ok(host))) = (
        origin.to_str(),
        headers.get(header::HOST).map(|h| h.to_str()),
    ) else {
        return false;
    };
    origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .is_some_and(|o| o.eq_ignore_ascii_case(host))
}

pub(crate) async fn terminal(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<PidPath>,
    ApiQuery(q): ApiQuery<TerminalQuery>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> HResult<Response> {
    let ws = ws.map_err(|e| {
        ControlError::invalid(format!(
            "this is a WebSocket (Upgrade: websocket, subprotocol {PROTOCOL}): {e}"
        ))
    })?;
    if !same_origin(&headers) {
        return Err(ControlError::new(
            ErrorKind::PermissionDenied,
            "a terminal is opened only from spaced's own origin",
        ));
    }
    // Errors before the upgrade (no such sandbox or process, an offset past the end) are
    // told in the session, so that a browser, which sees no HTTP status, can show them.
    let output = s.engine.process_output(&p.id, p.pid, q.offset, true).await;
    Ok(ws
        .protocols([PROTOCOL])
        .max_message_size(MAX_STDIN_FRAME + 1024)
        .on_upgrade(move |socket| async move {
            match output {
                Ok(events) => {
                    // A read-only key watches: its input is refused.
                    let writes = who.scope != KeyScope::ReadOnly;
                    session(s, p.id, p.pid, writes, events, socket).await
                }
                Err(e) => refuse(socket, &e).await,
            }
        }))
}

/// Ends the session: the last text frame `body`, then the close `code` with `reason`.
async fn finish(mut socket: WebSocket, body: serde_json::Value, code: u16, reason: &str) {
    let _ = socket.send(Message::Text(body.to_string().into())).await;
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code,
            reason: truncate(reason, 120).into(),
        })))
        .await;
}

async fn refuse(socket: WebSocket, e: &ControlError) {
    let status = super::error::status(e.kind).as_u16();
    let body = serde_json::json!({"error": {"code": e.code(), "message": e.message}});
    finish(socket, body, 4000 + status, &e.message).await;
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn frame(offset: u64, data: &[u8]) -> Message {
    let mut buf = Vec::with_capacity(8 + data.len());
    buf.extend_from_slice(&offset.to_be_bytes());
    buf.extend_from_slice(data);
    Message::Binary(buf.into())
}

async fn session(
    s: AppState,
    id: String,
    pid: u32,
    writes: bool,
    mut events: BoxStream<'static, ExecEvent>,
    mut socket: WebSocket,
) {
    loop {
        tokio::select! {
            ev = events.next() => {
                let msg = match ev {
                    Some(ExecEvent::Pty { offset, data })
                    | Some(ExecEvent::Stdout { offset, data })
                    | Some(ExecEvent::Stderr { offset, data }) => frame(offset, &data),
                    Some(ExecEvent::Gap { from, to }) => Message::Text(
                        serde_json::json!({"gap": {"from": from, "to": to}}).to_string().into(),
                    ),
                    Some(ExecEvent::Started { .. }) => continue,
                    Some(ExecEvent::Exit { code, signal }) => {
                        let body = serde_json::json!({"exit": {"code": code, "signal": signal}});
                        return finish(socket, body, 1000, "the process exited").await;
                    }
                    Some(ExecEvent::Error { code, message }) => {
                        let body = serde_json::json!({"error": {"code": code, "message": message}});
                        return finish(socket, body, 1011, "the output stream failed").await;
                    }
                    // The output stream ended without an exit: the guest went away (a
                    // restart or a move). The client reconnects from its offset.
                    None => {
                        let _ = socket.send(Message::Close(Some(CloseFrame {
                            code: 1012,
                            reason: "the output stream ended; reconnect".into(),
                        }))).await;
                        return;
                    }
                };
                if socket.send(msg).await.is_err() {
                    return;
                }
            }
            msg = socket.recv() => {
                let result = match msg {
                    Some(Ok(Message::Binary(_) | Message::Text(_))) if !writes => {
                        Err(ControlError::new(
                            ErrorKind::PermissionDenied,
                            "a read-only key cannot write to a process",
                        ))
                    }
                    Some(Ok(Message::Binary(data))) => {
                        if data.len() > MAX_STDIN_FRAME {
                            Err(ControlError::too_large(format!(
                                "a stdin frame is at most {MAX_STDIN_FRAME} bytes"
                            )))
                        } else {
                            s.engine.write_stdin(&id, pid, data).await
                        }
                    }
                    Some(Ok(Message::Text(text))) => match serde_json::from_str::<Control>(&text) {
                        Ok(c) => s.engine.resize(&id, pid, c.resize.rows, c.resize.cols).await,
                        Err(e) => Err(ControlError::invalid(format!(
                            "a text frame is {{\"resize\":{{\"rows\":R,\"cols\":C}}}}: {e}"
                        ))),
                    },
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => Ok(()),
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                };
                if let Err(e) = result {
                    refuse(socket, &e).await;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, host.parse().unwrap());
        if let Some(o) = origin {
            h.insert(header::ORIGIN, o.parse().unwrap());
        }
        h
    }

    #[test]
    fn only_the_own_origin_or_none_may_open_a_terminal() {
        assert!(same_origin(&headers(None, "127.0.0.1:7777")));
        assert!(same_origin(&headers(
            Some("http://127.0.0.1:7777"),
            "127.0.0.1:7777"
        )));
        assert!(!same_origin(&headers(
            Some("http://evil.example"),
            "127.0.0.1:7777"
        )));
        assert!(!same_origin(&headers(
            Some("http://127.0.0.1:7778"),
            "127.0.0.1:7777"
        )));
        assert!(!same_origin(&headers(Some("null"), "127.0.0.1:7777")));
    }

    #[test]
    fn frames_carry_their_offset() {
        let Message::Binary(b) = frame(7, b"hi") else {
            panic!()
        };
        assert_eq!(&b[..8], &7u64.to_be_bytes());
        assert_eq!(&b[8..], b"hi");
        assert_eq!(truncate("héllo", 2), "h");
    }
}
