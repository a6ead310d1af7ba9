//! The port proxy (decision 0012): `ANY /p/{token}/{rest}` reaches `127.0.0.1:PORT` inside a
//! sandbox as HTTP/1.1 `/{rest}?query`. No API key: the token (signed by `ports.key`, see
//! [`crate::net::PortSigner`]) is the credential. WebSocket (any `Upgrade`) requests are piped
//! both ways once the sandbox answers 101.
//!
//! Errors: a bad token is 404 (whatever is wrong with it); a sandbox that is gone is 404; one
//! that does not listen (or is not running) is 502 `unavailable`; a port the node itself
//! serves inside the sandbox's network (DNS, the egress proxy) is 400, whoever asks.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use space_node_api::NodeError;

use crate::AppState;
use crate::error::ControlError;

/// Paths the proxy serves, in OpenAPI form (registered with any method; not in `ROUTES`,
/// whose entries each name one method).
pub const PROXY_ROUTES: &[&str] = &["/p/{token}", "/p/{token}/{rest}"];
/// The same paths as the router writes them.
/// (A wildcard never matches an empty rest, hence `/p/{token}/` of its own.)
pub(crate) const PROXY_ROUTER_PATHS: &[&str] = &["/p/{token}", "/p/{token}/", "/p/{token}/{*rest}"];

/// Headers that belong to one hop (RFC 9110 7.6.1), never forwarded as they are.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn bad_token() -> Response {
    ControlError::not_found("no such port URL").into_response()
}

fn unavailable(msg: impl Into<String>) -> Response {
    crate::http::error::response(StatusCode::BAD_GATEWAY, "unavailable", msg)
}

/// Splits `/p/{token}[/{rest}]` into the token and the upstream path-and-query.
pub fn split_path(uri: &Uri) -> Option<(&str, String)> {
    let rest = uri.path().strip_prefix("/p/")?;
    let (token, tail) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut path = tail.to_string();
    if let Some(q) = uri.query() {
        path.push('?');
        path.push_str(q);
    }
    Some((token, path))
}

fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// The headers to send on: without hop-by-hop ones (and those `Connection` names), plus
/// `Connection: upgrade` + `Upgrade` again for an upgrade, plus X-Forwarded-*.
fn forward_headers(src: &HeaderMap, upgrade: bool, prefix: Option<&str>) -> HeaderMap {
    let named: Vec<String> = src
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::with_capacity(src.len() + 3);
    for (k, v) in src {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || named.iter().any(|n| n == name) {
            continue;
        }
        out.append(k.clone(), v.clone());
    }
    if upgrade {
        out.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Some(u) = src.get(header::UPGRADE) {
            out.insert(header::UPGRADE, u.clone());
        }
    }
    if let Some(host) = src.get(header::HOST) {
        out.insert(HeaderName::from_static("x-forwarded-host"), host.clone());
    }
    out.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if let Some(v) = prefix.and_then(|p| HeaderValue::from_str(p).ok()) {
        out.insert(HeaderName::from_static("x-forwarded-prefix"), v);
    }
    out
}

/// The handler of every [`PROXY_ROUTES`] path, any method.
pub(crate) async fn proxy(State(s): State<AppState>, req: Request) -> Response {
    let Some((token, path)) = split_path(req.uri()) else {
        return bad_token();
    };
    let Some((id, port)) = s.engine.ports.verify(token) else {
        return bad_token();
    };
    let prefix = format!("/p/{token}");
    forward(&s, &id, port, req, &path, Some(&prefix)).await
}

/// Sends `req` to `127.0.0.1:port` in sandbox `id` as `path` (path and query), once the
/// caller has checked its credential, and answers with what the sandbox answers; `prefix`
/// is the path the client sees it under (`X-Forwarded-Prefix`), if any. A sandbox
/// that is gone is 404, one that is not running or does not listen 502 `unavailable`.
pub(crate) async fn forward(
    s: &AppState,
    id: &str,
    port: u16,
    mut req: Request,
    path: &str,
    prefix: Option<&str>,
) -> Response {
    let id = id.to_owned();
    if let Some(what) = space_node_api::net::node_port(port) {
        return ControlError::invalid(format!(
            "port {port} in a sandbox's network is {what}, not a sandbox port"
        ))
        .into_response();
    }
    let Ok(upstream_uri) = path.parse::<Uri>() else {
        return ControlError::invalid("invalid request path").into_response();
    };
    match s.engine.store.get_sandbox(&id).await {
        Ok(Some(row)) if row.deleted_at.is_none() => {
            if row.state != space_api::SandboxState::Running {
                return unavailable(format!("sandbox {id} is {}", row.state));
            }
        }
        Ok(_) => return bad_token(),
        Err(e) => return ControlError::from(e).into_response(),
    }
    s.engine.activity.touch(&id);
    let stream = match s.engine.node.connect_port(&id, port).await {
        Ok(st) => st,
        Err(NodeError::NotFound { .. }) => return bad_token(),
        Err(NodeError::InvalidArgument(m)) => return ControlError::invalid(m).into_response(),
        Err(e) => {
            tracing::debug!(sandbox = %id, port, error = %e, "port connect failed");
            return unavailable(format!("nothing answers on port {port} in sandbox {id}"));
        }
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(v) => v,
        Err(e) => return unavailable(format!("port {port}: {e}")),
    };
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "port proxy connection ended");
        }
    });

    let upgrade = wants_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut up = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(upstream_uri)
        .version(http::Version::HTTP_11)
        .body(body)
        .expect("request parts are valid");
    *up.headers_mut() = forward_headers(&parts.headers, upgrade, prefix);

    let mut resp = match sender.send_request(up).await {
        Ok(r) => r,
        Err(e) => return unavailable(format!("port {port}: {e}")),
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return unavailable("the sandbox switched protocols without being asked");
        };
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (client, upstream) = match tokio::join!(client_upgrade, upstream_upgrade) {
                (Ok(c), Ok(u)) => (c, u),
                (c, u) => {
                    tracing::debug!(client = c.is_ok(), upstream = u.is_ok(), "upgrade failed");
                    return;
                }
            };
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        });
        let (parts, _) = resp.into_parts();
        let mut out = Response::from_parts(parts, Body::empty());
        *out.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        return out;
    }
    let (mut parts, body) = resp.into_parts();
    let named: Vec<String> = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    for h in HOP_BY_HOP
        .iter()
        .copied()
        .chain(named.iter().map(String::as_str))
    {
        parts.headers.remove(h);
    }
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_token_and_upstream_path() {
        let u: Uri = "/p/tok/a/b?x=1&y=2".parse().unwrap();
        assert_eq!(split_path(&u), Some(("tok", "/a/b?x=1&y=2".to_string())));
        let u: Uri = "/p/tok".parse().unwrap();
        assert_eq!(split_path(&u), Some(("tok", "/".to_string())));
        let u: Uri = "/p/tok/".parse().unwrap();
        assert_eq!(split_path(&u), Some(("tok", "/".to_string())));
        let u: Uri = "/p/tok?q".parse().unwrap();
        assert_eq!(split_path(&u), Some(("tok", "/?q".to_string())));
        let u: Uri = "/v1/x".parse().unwrap();
        assert_eq!(split_path(&u), None);
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("h:1"));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Drop"),
        );
        h.insert("x-drop", HeaderValue::from_static("1"));
        h.insert("x-keep", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        let out = forward_headers(&h, false, Some("/p/t"));
        assert!(out.get("x-drop").is_none());
        assert!(out.get(header::CONNECTION).is_none());
        assert!(out.get(header::TRANSFER_ENCODING).is_none());
        assert_eq!(out.get("x-keep").unwrap(), "1");
        assert_eq!(out.get(header::HOST).unwrap(), "h:1");
        assert_eq!(out.get("x-forwarded-host").unwrap(), "h:1");
        assert_eq!(out.get("x-forwarded-prefix").unwrap(), "/p/t");

        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(wants_upgrade(&h));
        let out = forward_headers(&h, true, Some("/p/t"));
        assert_eq!(out.get(header::CONNECTION).unwrap(), "upgrade");
        assert_eq!(out.get(header::UPGRADE).unwrap(), "websocket");
        h.remove(header::CONNECTION);
        assert!(!wants_upgrade(&h));
    }
}
