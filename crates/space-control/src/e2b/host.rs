//! E2B's host form (decision 0030): with `spaced --e2b-domain DOMAIN`, a request for
//! `PORT-ID.DOMAIN` is one for port PORT of sandbox ID (envd's 49983, or a port the sandbox
//! serves), as E2B's edge routes them, and `DOMAIN` and `api.DOMAIN` are the API.
//!
//! [`route`] runs before [`super::dispatch`]: it turns the host into the `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` headers that the SDKs send in the header form, replacing any the client
//! sent, so both forms take one path from there (the same access checks included).

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::AppState;

/// What a request's host names.
#[derive(Debug, PartialEq, Eq)]
pub enum HostRoute {
    /// Not under the domain (an address, `localhost`, another name): routed as before.
    Elsewhere,
    /// `DOMAIN` or `api.DOMAIN`: the API, routed by path.
    Api,
    /// `PORT-ID.DOMAIN`.
    Sandbox { port: u16, id: String },
    /// Under the domain, but in no form above.
    Unknown(String),
}

/// Routes `host` (a Host header or an HTTP/2 authority, with or without a port) for `domain`
/// (lowercase, no trailing dot).
pub fn route_host(host: &str, domain: &str) -> HostRoute {
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    if name == domain {
        return HostRoute::Api;
    }
    let Some(label) = name
        .strip_suffix(domain)
        .and_then(|rest| rest.strip_suffix('.'))
    else {
        return HostRoute::Elsewhere;
    };
    if label == "api" {
        return HostRoute::Api;
    }
    let parsed = label
        .split_once('-')
        .and_then(|(port, id)| Some((port.parse::<u16>().ok()?, id)))
        .filter(|(port, id)| *port != 0 && !id.is_empty() && !id.contains('.'));
    match parsed {
        Some((port, id)) => HostRoute::Sandbox {
            port,
            id: id.to_owned(),
        },
        None => HostRoute::Unknown(name),
    }
}

/// The middleware: see the module docs. Without `--e2b-domain` it passes every request on.
pub async fn route(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(domain) = state.engine.config().e2b_domain.as_deref() else {
        return next.run(req).await;
    };
    let host = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        });
    let Some(host) = host else {
        return next.run(req).await;
    };
    match route_host(&host, domain) {
        HostRoute::Elsewhere | HostRoute::Api => next.run(req).await,
        HostRoute::Sandbox { port, id } => {
            let headers = req.headers_mut();
            match HeaderValue::from_str(&id) {
                Ok(v) => headers.insert(super::SANDBOX_ID_HEADER, v),
                Err(_) => return super::sandbox_gone(&id),
            };
            headers.insert(super::SANDBOX_PORT_HEADER, HeaderValue::from(port));
            next.run(req).await
        }
        HostRoute::Unknown(name) => {
            let body = serde_json::json!({
                "code": 400,
                "message": format!(
                    "{name} is not a host of this server: use api.{domain} or PORT-SANDBOXID.{domain}"
                ),
            });
            (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_route_as_e2b_names_them() {
        let d = "sb.example.test";
        let sandbox = |port, id: &str| HostRoute::Sandbox {
            port,
            id: id.into(),
        };
        assert_eq!(route_host("sb.example.test", d), HostRoute::Api);
        assert_eq!(route_host("API.sb.example.test:443", d), HostRoute::Api);
        assert_eq!(
            route_host("49983-abc123.sb.example.test", d),
            sandbox(49983, "abc123")
        );
        assert_eq!(
            route_host("8000-abc123.sb.example.test.:8443", d),
            sandbox(8000, "abc123")
        );
        for elsewhere in [
            "10.0.0.1:7070",
            "localhost",
            "[::1]:7070",
            "xsb.example.test",
            "example.test",
        ] {
            assert_eq!(
                route_host(elsewhere, d),
                HostRoute::Elsewhere,
                "{elsewhere}"
            );
        }
        for unknown in [
            "www.sb.example.test",
            "0-abc.sb.example.test",
            "70000-abc.sb.example.test",
            "49983-.sb.example.test",
            "49983-a.b.sb.example.test",
        ] {
            assert!(
                matches!(route_host(unknown, d), HostRoute::Unknown(_)),
                "{unknown}"
            );
        }
    }
}
