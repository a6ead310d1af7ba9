//! The web console's files at `/ui` (issue 17, decision 0058): embedded at build time from
//! `console/dist`, public (they hold no data; every call the page makes carries its key),
//! and served with a strict Content-Security-Policy.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// Every file of `console/dist`, by name; empty when spaced was built without the console.
const ASSETS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));

/// No inline script, no eval, nothing from another origin; styles may be inline because
/// xterm.js writes its cell metrics into `<style>` elements it makes (decision 0058).
pub const CSP: &str = "default-src 'none'; script-src 'self'; connect-src 'self'; \
    img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; font-src 'self'; \
    base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// What `/ui` answers on a spaced built without the console.
const NOT_BUILT: &str = "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
    <title>space console</title></head><body><h1>The console was not built</h1>\
    <p>This spaced was built without <code>console/dist</code>. Run <code>scripts/up</code>, \
    or <code>scripts/lib.sh build_console</code> and rebuild spaced.</p></body></html>";

fn content_type(name: &str) -> &'static str {
    match name.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("woff2") => "font/woff2",
        Some("json") | Some("map") => "application/json",
        _ => "application/octet-stream",
    }
}

fn with_headers(status: StatusCode, ctype: &'static str, body: &'static [u8]) -> Response {
    let mut resp = (status, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Small files that change with the binary: always revalidated.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn index() -> Response {
    match ASSETS.iter().find(|(n, _)| *n == "index.html") {
        Some((_, body)) => with_headers(StatusCode::OK, "text/html; charset=utf-8", body),
        None => with_headers(
            StatusCode::OK,
            "text/html; charset=utf-8",
            NOT_BUILT.as_bytes(),
        ),
    }
}

/// `GET /ui`.
pub(crate) async fn root() -> Response {
    index()
}

/// `GET /ui/{*path}`: a file of the console; a path without an extension is a page of the
/// console (a deep link) and gets `index.html`; anything else unknown is 404.
pub(crate) async fn asset(Path(path): Path<String>) -> Response {
    if let Some((name, body)) = ASSETS.iter().find(|(n, _)| *n == path) {
        return with_headers(StatusCode::OK, content_type(name), body);
    }
    let last = path.rsplit('/').next().unwrap_or("");
    if !last.contains('.') {
        return index();
    }
    with_headers(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        b"no such file in the console",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_allows_no_other_origin_and_no_inline_script() {
        let script = CSP
            .split(';')
            .map(str::trim)
            .find(|d| d.starts_with("script-src"))
            .unwrap();
        assert_eq!(script, "script-src 'self'");
        assert!(!CSP.contains("http"), "{CSP}");
        assert!(!CSP.contains('*'), "{CSP}");
        assert!(CSP.contains("frame-ancestors 'none'"));
    }

    #[test]
    fn files_get_their_types() {
        assert_eq!(content_type("app.js"), "text/javascript; charset=utf-8");
        assert_eq!(content_type("app.css"), "text/css; charset=utf-8");
        assert_eq!(content_type("x"), "application/octet-stream");
    }
}
