//! The intercepting half of the egress proxy: HTTP/1.1 between the sandbox (TLS terminated
//! with a leaf of the node CA) and the real host (TLS verified against the upstream roots),
//! request by request, with secret placeholders replaced in the bound header only, and the
//! headers a sandbox's `secret_headers` name set with their secret's value.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{Entry, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::LogLimiter;
use crate::net::policy::matches_host;
use crate::net::{SandboxNet, SecretBinding, Secrets};

type Body = BoxBody<Bytes, hyper::Error>;

/// What one intercepted connection needs.
pub(super) struct Ctx {
    /// The verified upstream name (the client's SNI): secrets bound to it may be sent.
    pub host: String,
    /// The port the sandbox connected to (a Host header naming a port must name this one).
    pub port: u16,
    pub sandbox: Arc<SandboxNet>,
    pub secrets: Arc<Secrets>,
    pub cancel: CancellationToken,
    pub warn: Arc<LogLimiter>,
}

/// Serves HTTP/1.1 on `client`, forwarding each request to `upstream` (or answering 502 with
/// `upstream`'s error when the upstream could not be reached), until either side closes.
pub(super) async fn serve<C, U>(client: C, upstream: Result<U, String>, ctx: Ctx)
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let ctx = Arc::new(ctx);
    let server = hyper::server::conn::http1::Builder::new();
    match upstream {
        Err(reason) => {
            let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let reason = reason.clone();
                async move { Ok::<_, Infallible>(bad_gateway(&reason)) }
            });
            let _ = server.serve_connection(TokioIo::new(client), svc).await;
        }
        Ok(upstream) => {
            let (sender, conn) = match hyper::client::conn::http1::Builder::new()
                .handshake::<_, Incoming>(TokioIo::new(upstream))
                .await
            {
                Ok(x) => x,
                Err(_) => return,
            };
            let sender = Arc::new(Mutex::new(sender));
            let svc_ctx = ctx.clone();
            let svc = hyper::service::service_fn(move |req| {
                forward(svc_ctx.clone(), sender.clone(), req)
            });
            let serving = server
                .serve_connection(TokioIo::new(client), svc)
                .with_upgrades();
            // The upstream connection ends once the service (and its sender) is dropped.
            let upstream = async {
                let _ = conn.with_upgrades().await;
            };
            let _ = tokio::join!(serving, upstream);
        }
    }
}

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(msg)).map_err(|e| match e {}).boxed());
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

fn bad_gateway(reason: &str) -> Response<Body> {
    text(
        StatusCode::BAD_GATEWAY,
        format!("space egress proxy: {reason}\n"),
    )
}

/// Whether the host a request names (its absolute URI's authority, else its Host header) is
/// the connection's verified name and port. A request on an intercepted connection that names
/// another host is refused: a server or CDN that routes by Host would otherwise hand the
/// secrets bound to the SNI to whatever the sandbox named (domain fronting).
fn names_host<B>(req: &Request<B>, host: &str, port: u16) -> bool {
    let named = match req.uri().authority() {
        Some(a) => Some(a.as_str().to_owned()),
        None => req
            .headers()
            .get(http::header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    };
    let Some(named) = named else {
        return false;
    };
    let Ok(authority) = named.parse::<http::uri::Authority>() else {
        return false;
    };
    authority
        .host()
        .trim_end_matches('.')
        .eq_ignore_ascii_case(host.trim_end_matches('.'))
        && authority.port_u16().is_none_or(|p| p == port)
}

async fn forward(
    ctx: Arc<Ctx>,
    sender: Arc<Mutex<hyper::client::conn::http1::SendRequest<Incoming>>>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    if !names_host(&req, &ctx.host, ctx.port) {
        return Ok(text(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "space egress proxy: this connection is to {}; a request on it must name that \
                 host (Host header)\n",
                ctx.host
            ),
        ));
    }
    let bindings = ctx.sandbox.secrets();
    substitute(
        req.headers_mut(),
        &ctx.host,
        &bindings,
        &ctx.secrets,
        &ctx.sandbox.id(),
        &ctx.warn,
    )
    .await;
    let client_upgrade = req
        .headers()
        .contains_key(http::header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let result = {
        let mut sender = sender.lock().await;
        match sender.ready().await {
            Ok(()) => sender.send_request(req).await,
            Err(e) => Err(e),
        }
    };
    let mut resp = match result {
        Ok(resp) => resp,
        Err(e) => {
            tracing::debug!(sandbox = %ctx.sandbox.id(), host = %ctx.host, error = %e, "upstream request failed");
            return Ok(bad_gateway(&format!("request to {} failed", ctx.host)));
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let cancel = ctx.cancel.clone();
        tokio::spawn(async move {
            let (Ok(client), Ok(upstream)) = tokio::join!(client_upgrade, upstream_upgrade) else {
                return;
            };
            let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
            }
        });
    }
    Ok(resp.map(|b| b.boxed()))
}

/// The bindings that apply to a request to `host`: their host patterns match it, they have a
/// placeholder or set their header themselves, and their header is a valid header name.
fn applicable<'a>(
    bindings: &'a [SecretBinding],
    host: &str,
) -> impl Iterator<Item = (&'a SecretBinding, HeaderName)> + 'a {
    let host = host.to_owned();
    bindings.iter().filter_map(move |b| {
        if (b.placeholder.is_empty() && !b.inject) || !matches_host(&b.hosts, &host) {
            return None;
        }
        let name = HeaderName::from_bytes(b.header_name().as_bytes()).ok()?;
        Some((b, name))
    })
}

/// Whether a value of header `name` contains `placeholder`.
fn header_holds(headers: &HeaderMap, name: &HeaderName, placeholder: &[u8]) -> bool {
    headers
        .get_all(name)
        .iter()
        .any(|v| find(v.as_bytes(), placeholder).is_some())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn replace_all(haystack: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len() + with.len());
    let mut rest = haystack;
    while let Some(i) = find(rest, needle) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(with);
        rest = &rest[i + needle.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// Replaces every occurrence of `placeholder` by `value` in every value of header `name`
/// (and nowhere else). Returns how many header values changed. A value that would not be a
/// valid header value is left as it was.
pub(super) fn substitute_header(
    headers: &mut HeaderMap,
    name: &HeaderName,
    placeholder: &[u8],
    value: &[u8],
) -> usize {
    let Entry::Occupied(mut entry) = headers.entry(name) else {
        return 0;
    };
    let mut changed = 0;
    for v in entry.iter_mut() {
        if find(v.as_bytes(), placeholder).is_none() {
            continue;
        }
        let replaced = replace_all(v.as_bytes(), placeholder, value);
        if let Ok(mut new) = HeaderValue::from_bytes(&replaced) {
            new.set_sensitive(true);
            *v = new;
            changed += 1;
        }
    }
    changed
}

/// Sets header `name` to `template` with `{}` replaced by `value`, in place of whatever the
/// sandbox sent under that name. Returns 1, or 0 (headers unchanged) when the result would not
/// be a valid header value.
fn inject_header(headers: &mut HeaderMap, name: HeaderName, template: &str, value: &[u8]) -> usize {
    let Some((before, after)) = template.split_once("{}") else {
        return 0;
    };
    let filled = [before.as_bytes(), value, after.as_bytes()].concat();
    match HeaderValue::from_bytes(&filled) {
        Ok(mut v) => {
            v.set_sensitive(true);
            headers.insert(name, v);
            1
        }
        Err(_) => 0,
    }
}

/// Puts the secret values in place of their placeholders in the headers of a request to
/// `host`, and sets the headers of the bindings that inject theirs, for each binding that
/// applies. A secret without a value leaves the request as it is (and logs a warning naming
/// the secret, never a value).
pub(super) async fn substitute(
    headers: &mut HeaderMap,
    host: &str,
    bindings: &[SecretBinding],
    secrets: &Secrets,
    sandbox: &str,
    warn: &LogLimiter,
) -> usize {
    let mut changed = 0;
    for (binding, name) in applicable(bindings, host) {
        let placeholder = binding.placeholder.as_bytes();
        if !binding.inject && !header_holds(headers, &name, placeholder) {
            continue;
        }
        match secrets.value(binding.source_name()).await {
            Some(value) => {
                let n = if binding.inject {
                    inject_header(headers, name, binding.header_template(), value.as_bytes())
                } else {
                    substitute_header(headers, &name, placeholder, value.as_bytes())
                };
                changed += n;
                if n == 0 && warn.allow() {
                    tracing::warn!(sandbox, secret = %binding.name, host,
                        "secret value cannot go in a header; request left unchanged");
                }
            }
            None => {
                if warn.allow() {
                    tracing::warn!(sandbox, secret = %binding.name, host,
                        "secret has no value; request left unchanged");
                }
            }
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::SecretSource;
    use std::collections::HashMap;

    struct Fake(HashMap<String, String>);

    #[async_trait::async_trait]
    impl SecretSource for Fake {
        async fn secret_value(&self, name: &str) -> Option<String> {
            self.0.get(name).cloned()
        }
    }

    const PH: &str = "spc_ph_0123456789abcdef0123456789abcdef";
    const PH2: &str = "spc_ph_ffffffffffffffffffffffffffffffff";

    fn bindings() -> Vec<SecretBinding> {
        vec![
            SecretBinding {
                name: "TOKEN".into(),
                placeholder: PH.into(),
                hosts: vec!["api.example.com".into(), "*.example.org".into()],
                header: "Authorization: Bearer {}".into(),
                inject: false,
                secret: String::new(),
            },
            SecretBinding {
                name: "OTHER".into(),
                placeholder: PH2.into(),
                hosts: vec!["other.example.net".into()],
                header: "X-Api-Key: {}".into(),
                inject: false,
                secret: String::new(),
            },
        ]
    }

    fn secrets(pairs: &[(&str, &str)]) -> Secrets {
        let s = Secrets::default();
        s.set(Arc::new(Fake(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )));
        s
    }

    fn headers(pairs: &[(&str, String)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    async fn run(h: &mut HeaderMap, host: &str, s: &Secrets) -> usize {
        substitute(h, host, &bindings(), s, "sb", &LogLimiter::new()).await
    }

    #[tokio::test]
    async fn only_the_bound_header_of_a_bound_host_gets_the_value() {
        let s = secrets(&[("TOKEN", "s3cr3t"), ("OTHER", "k3y")]);
        let mut h = headers(&[
            ("authorization", format!("Bearer {PH}")),
            ("x-other", PH.to_string()),
            ("cookie", format!("a={PH}")),
            ("x-api-key", PH2.to_string()),
        ]);
        assert_eq!(run(&mut h, "api.example.com", &s).await, 1);
        assert_eq!(h["authorization"], "Bearer s3cr3t");
        assert!(h["authorization"].is_sensitive());
        assert_eq!(h["x-other"], PH);
        assert_eq!(h["cookie"], format!("a={PH}").as_str());
        // OTHER's header, but OTHER is not bound to this host.
        assert_eq!(h["x-api-key"], PH2);
    }

    #[tokio::test]
    async fn every_occurrence_and_every_value_of_the_header() {
        let s = secrets(&[("TOKEN", "v")]);
        let mut h = headers(&[
            ("authorization", format!("{PH} and {PH}")),
            ("authorization", format!("Basic {PH}")),
        ]);
        assert_eq!(run(&mut h, "deep.sub.example.org", &s).await, 2);
        let all: Vec<_> = h.get_all("authorization").iter().collect();
        assert_eq!(all, ["v and v", "Basic v"]);
    }

    #[tokio::test]
    async fn other_hosts_and_missing_values_leave_requests_unchanged() {
        let s = secrets(&[("TOKEN", "s3cr3t")]);
        for host in ["example.org", "api.example.com.evil.com", "evil.com"] {
            let mut h = headers(&[("authorization", format!("Bearer {PH}"))]);
            assert_eq!(run(&mut h, host, &s).await, 0, "{host}");
            assert_eq!(h["authorization"], format!("Bearer {PH}").as_str());
        }
        // Bound host, but the secret has no value.
        let empty = secrets(&[]);
        let mut h = headers(&[("authorization", format!("Bearer {PH}"))]);
        assert_eq!(run(&mut h, "api.example.com", &empty).await, 0);
        assert_eq!(h["authorization"], format!("Bearer {PH}").as_str());
        // A value that cannot be a header value is not put in.
        let bad = secrets(&[("TOKEN", "a\r\nInjected: 1")]);
        let mut h = headers(&[("authorization", format!("Bearer {PH}"))]);
        assert_eq!(run(&mut h, "api.example.com", &bad).await, 0);
        assert_eq!(h["authorization"], format!("Bearer {PH}").as_str());
        assert!(!h.contains_key("injected"));
    }

    #[tokio::test]
    async fn injected_headers_are_set_for_their_hosts_only_and_replace_the_sandboxs() {
        let inject = vec![SecretBinding {
            name: "openai-key".into(),
            placeholder: String::new(),
            hosts: vec!["api.openai.test".into()],
            header: "Authorization: Bearer {} (space)".into(),
            inject: true,
            secret: String::new(),
        }];
        let s = secrets(&[("openai-key", "sk-real")]);
        let b = &inject;
        // Set where the sandbox sent nothing, and over whatever it sent.
        let mut h = HeaderMap::new();
        assert_eq!(
            substitute(&mut h, "api.openai.test", b, &s, "sb", &LogLimiter::new()).await,
            1
        );
        assert_eq!(h["authorization"], "Bearer sk-real (space)");
        assert!(h["authorization"].is_sensitive());
        let mut h = headers(&[
            ("authorization", "Bearer mine".into()),
            ("authorization", "x".into()),
        ]);
        assert_eq!(
            substitute(&mut h, "api.openai.test", b, &s, "sb", &LogLimiter::new()).await,
            1
        );
        assert_eq!(h.get_all("authorization").iter().count(), 1);
        assert_eq!(h["authorization"], "Bearer sk-real (space)");
        // Another host, a missing value, a value that cannot be a header: untouched.
        let mut h = headers(&[("authorization", "Bearer mine".into())]);
        assert_eq!(
            substitute(&mut h, "evil.test", b, &s, "sb", &LogLimiter::new()).await,
            0
        );
        assert_eq!(h["authorization"], "Bearer mine");
        for s in [
            secrets(&[]),
            secrets(&[("openai-key", "a\r\nX-Injected: 1")]),
        ] {
            let mut h = HeaderMap::new();
            assert_eq!(
                substitute(&mut h, "api.openai.test", b, &s, "sb", &LogLimiter::new()).await,
                0
            );
            assert!(h.is_empty());
        }
    }

    #[test]
    fn replace_all_handles_edges() {
        assert_eq!(replace_all(b"aXbXc", b"X", b"yy"), b"ayybyyc");
        assert_eq!(replace_all(b"XX", b"X", b""), b"");
        assert_eq!(replace_all(b"abc", b"", b"z"), b"abc");
        assert_eq!(replace_all(b"abc", b"abcd", b"z"), b"abc");
    }
}
