//! envd's filesystem service (`filesystem.Filesystem`) and its HTTP `/files`, over the
//! engine's file calls on the sandbox's daemon channel (decision 0022).
//!
//! - A relative path is taken from the user's home, as envd does: `/home/<user>`, `/root`
//!   for root (the user of the call, else the sandbox's default, `user` on `base`).
//! - `/files` downloads stream; uploads take `multipart/form-data` (each part's file name is
//!   its path, or `?path=` for a single part) and `application/octet-stream` with `?path=`,
//!   gzip-encoded or not. Files are written as the call's user.
//! - A `/files` URL signed by the SDK (`?signature=v1_...`, decision 0022) stands in for the
//!   access token: SHA-256 over path, operation, user, the token and the expiry.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Extension, FromRequest, Request, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures::TryStreamExt;
use serde::Deserialize;
use space_api::{FileType, MakeDirRequest, PathQuery, RenameRequest, WriteFileQuery};

use super::connect::{Code, ConnectError};
use super::envd::{EnvdCtx, unary_call};
use super::pb::filesystem as pb;
use crate::AppState;
use crate::error::{ControlError, ErrorKind};

/// `path` as the engine takes it: absolute, a relative one joined to the user's home.
pub(crate) fn resolve(path: &str, user: Option<&str>) -> Result<String, ControlError> {
    if path.starts_with('/') {
        return Ok(path.to_string());
    }
    if path.contains('\0') {
        return Err(ControlError::invalid("path contains a NUL byte"));
    }
    let home = match user.unwrap_or(DEFAULT_USER) {
        "root" => "/root".to_string(),
        u if !u.is_empty() && !u.contains(['/', '\0']) => format!("/home/{u}"),
        u => return Err(ControlError::invalid(format!("invalid user {u:?}"))),
    };
    Ok(if path.is_empty() || path == "." {
        home
    } else {
        format!("{home}/{path}")
    })
}

/// The user E2B code runs as when it names none (`base`'s default user).
const DEFAULT_USER: &str = "user";

/// Go's `fs.FileMode` bits, which envd reports as `mode`.
const GO_MODE_DIR: u32 = 1 << 31;
const GO_MODE_SYMLINK: u32 = 1 << 27;
const GO_MODE_SETUID: u32 = 1 << 23;
const GO_MODE_SETGID: u32 = 1 << 22;
const GO_MODE_STICKY: u32 = 1 << 20;

/// envd's `mode` (Go's FileMode) and `permissions` (its String()) of an entry.
fn go_mode(e: &space_api::EntryInfo) -> (u32, String) {
    let mut mode = e.mode & 0o777;
    let mut text = String::new();
    match e.file_type {
        FileType::Dir => {
            mode |= GO_MODE_DIR;
            text.push('d');
        }
        FileType::Symlink => {
            mode |= GO_MODE_SYMLINK;
            text.push('L');
        }
        _ => {}
    }
    for (bit, go, c) in [
        (0o4000, GO_MODE_SETUID, 'u'),
        (0o2000, GO_MODE_SETGID, 'g'),
        (0o1000, GO_MODE_STICKY, 't'),
    ] {
        if e.mode & bit != 0 {
            mode |= go;
            text.push(c);
        }
    }
    if text.is_empty() {
        text.push('-');
    }
    for shift in [6, 3, 0] {
        let bits = (e.mode >> shift) & 7;
        text.push(if bits & 4 != 0 { 'r' } else { '-' });
        text.push(if bits & 2 != 0 { 'w' } else { '-' });
        text.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    (mode, text)
}

/// The range of a protobuf Timestamp (0001-01-01 to 9999-12-31, as its JSON form is defined).
/// A sandbox may give a file any mtime its filesystem holds; one outside the range would fail
/// the reply's encoding, so it is clamped (found by the `guest_node` fuzz target).
const TIMESTAMP_MIN_SECS: i64 = -62_135_596_800;
const TIMESTAMP_MAX_SECS: i64 = 253_402_300_799;

/// An entry as envd describes it.
pub(crate) fn entry(e: space_api::EntryInfo) -> pb::EntryInfo {
    let (mode, permissions) = go_mode(&e);
    let file_type = match e.file_type {
        FileType::File => pb::FileType::File,
        FileType::Dir => pb::FileType::Directory,
        FileType::Symlink => pb::FileType::Symlink,
        FileType::Other => pb::FileType::Unspecified,
    };
    let modified_time =
        space_api::unix_ms_from_rfc3339(&e.modified_at).map(|ms| pbjson_types::Timestamp {
            seconds: ms
                .div_euclid(1000)
                .clamp(TIMESTAMP_MIN_SECS, TIMESTAMP_MAX_SECS),
            nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
        });
    pb::EntryInfo {
        name: e.name,
        r#type: file_type as i32,
        path: e.path,
        size: i64::try_from(e.size).unwrap_or(i64::MAX),
        mode,
        permissions,
        owner: e.owner.unwrap_or_else(|| e.uid.to_string()),
        group: e.group.unwrap_or_else(|| e.gid.to_string()),
        modified_time,
        is_symlink: e.file_type == FileType::Symlink,
        symlink_target: e.symlink_target,
        metadata: e.metadata.into_iter().collect(),
    }
}

// ---- filesystem.Filesystem ----

pub(crate) async fn stat(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::StatRequest| async move {
        let path = resolve(&req.path, ctx.user.as_deref())?;
        let e = s.engine.stat(&ctx.id, &path).await?;
        Ok(pb::StatResponse {
            entry: Some(entry(e)),
        })
    })
    .await
}

pub(crate) async fn make_dir(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::MakeDirRequest| async move {
        let path = resolve(&req.path, ctx.user.as_deref())?;
        match s.engine.stat(&ctx.id, &path).await {
            Ok(_) => {
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("{path} already exists"),
                ));
            }
            Err(e) if e.kind == ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        let e = s
            .engine
            .mkdir(
                &ctx.id,
                MakeDirRequest {
                    path,
                    user: ctx.user.clone(),
                    parents: true,
                    mode: None,
                },
            )
            .await?;
        Ok(pb::MakeDirResponse {
            entry: Some(entry(e)),
        })
    })
    .await
}

pub(crate) async fn move_entry(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::MoveRequest| async move {
        let user = ctx.user.as_deref();
        let req = RenameRequest {
            from: resolve(&req.source, user)?,
            to: resolve(&req.destination, user)?,
            overwrite: true,
        };
        let e = s.engine.rename(&ctx.id, req).await?;
        Ok(pb::MoveResponse {
            entry: Some(entry(e)),
        })
    })
    .await
}

pub(crate) async fn list_dir(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::ListDirRequest| async move {
        let path = resolve(&req.path, ctx.user.as_deref())?;
        let q = PathQuery {
            path,
            recursive: None,
            depth: Some(req.depth.max(1)),
        };
        let entries = s.engine.list_dir(&ctx.id, q).await?;
        Ok(pb::ListDirResponse {
            entries: entries.into_iter().map(entry).collect(),
        })
    })
    .await
}

/// Recursive, and a path that is not there is no error (envd's `os.RemoveAll`).
pub(crate) async fn remove(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::RemoveRequest| async move {
        let path = resolve(&req.path, ctx.user.as_deref())?;
        let q = PathQuery {
            path,
            recursive: Some(true),
            depth: None,
        };
        match s.engine.remove_file(&ctx.id, q).await {
            Ok(()) => Ok(pb::RemoveResponse {}),
            Err(e) if e.kind == ErrorKind::NotFound => Ok(pb::RemoveResponse {}),
            Err(e) => Err(e.into()),
        }
    })
    .await
}

// ---- HTTP /files ----

/// `/files` query.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct FilesQuery {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    signature: Option<String>,
    #[serde(default)]
    signature_expiration: Option<i64>,
}

impl FilesQuery {
    pub(crate) fn parse(query: Option<&str>) -> Result<Self, ControlError> {
        serde_urlencoded::from_str(query.unwrap_or(""))
            .map_err(|e| ControlError::invalid(format!("invalid query: {e}")))
    }

    pub(crate) fn has_signature(&self) -> bool {
        self.signature.is_some()
    }

    /// Checks the SDK's `v1_` signature of this URL for `operation` ("read" or "write")
    /// against the sandbox's access token; `now` in unix seconds.
    pub(crate) fn verify(&self, operation: &str, token: &str, now: i64) -> Result<(), String> {
        let Some(sig) = self.signature.as_deref() else {
            return Err("no signature".into());
        };
        let path = self.path.as_deref().unwrap_or("");
        let user = self.username.as_deref().unwrap_or("");
        let raw = match self.signature_expiration {
            None => format!("{path}:{operation}:{user}:{token}"),
            Some(exp) => format!("{path}:{operation}:{user}:{token}:{exp}"),
        };
        let digest = ring::digest::digest(&ring::digest::SHA256, raw.as_bytes());
        let want = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest.as_ref())
        );
        let same = want.len() == sig.len()
            && want
                .bytes()
                .zip(sig.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !same {
            return Err(format!("invalid signature for {operation} of {path:?}"));
        }
        if self.signature_expiration.is_some_and(|exp| exp < now) {
            return Err("the signed URL has expired".into());
        }
        Ok(())
    }

    /// The user of the call: `username`, else the access token's caller's.
    fn user<'a>(&'a self, ctx: &'a EnvdCtx) -> Option<&'a str> {
        self.username
            .as_deref()
            .filter(|u| !u.is_empty())
            .or(ctx.user.as_deref())
    }
}

/// `/files` errors in envd's shape: `{"code": <status>, "message": ...}`.
fn files_error(e: ControlError) -> Response {
    super::E2bError(e).into_response()
}

pub(crate) async fn download(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    uri: axum::http::Uri,
) -> Response {
    let result = async move {
        let q = FilesQuery::parse(uri.query())?;
        let path = q
            .path
            .as_deref()
            .ok_or_else(|| ControlError::invalid("path is required"))?;
        let path = resolve(path, q.user(&ctx))?;
        let stream = s.engine.read_file(&ctx.id, &path).await?;
        let name = path.rsplit('/').next().unwrap_or("file").replace('"', "");
        Ok::<_, ControlError>(
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (
                        header::CONTENT_DISPOSITION,
                        format!("attachment; filename=\"{name}\""),
                    ),
                ],
                Body::from_stream(stream),
            )
                .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(files_error)
}

/// What an upload wrote: envd's `[{"name", "type", "path", "metadata"}]`.
#[derive(Debug, serde::Serialize)]
struct Written {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    metadata: std::collections::BTreeMap<String, String>,
}

/// The prefix of the upload headers that carry a file's metadata (envd 0.6.2).
const METADATA_HEADER_PREFIX: &str = "x-metadata-";

/// An upload's `X-Metadata-<key>: value` headers, by key (header names arrive lowercased,
/// as the daemon stores the keys). The daemon checks keys and values.
fn upload_metadata(headers: &HeaderMap) -> Result<HashMap<String, String>, ControlError> {
    let mut out = HashMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER_PREFIX) else {
            continue;
        };
        let value = value.to_str().map_err(|_| {
            ControlError::invalid(format!(
                "metadata {key:?}: the value must be printable ASCII"
            ))
        })?;
        out.insert(key.to_owned(), value.to_owned());
    }
    Ok(out)
}

pub(crate) async fn upload(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    req: Request,
) -> Response {
    let result = async move {
        let q = FilesQuery::parse(req.uri().query())?;
        let user = q.user(&ctx).map(str::to_string);
        let metadata = upload_metadata(req.headers())?;
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let mut written = Vec::new();
        if content_type.starts_with("multipart/form-data") {
            let mut form = axum::extract::Multipart::from_request(req, &())
                .await
                .map_err(|e| ControlError::invalid(format!("invalid multipart body: {e}")))?;
            let mut parts = 0;
            while let Some(field) = form
                .next_field()
                .await
                .map_err(|e| ControlError::invalid(format!("invalid multipart body: {e}")))?
            {
                parts += 1;
                let name = match (&q.path, field.file_name()) {
                    (Some(p), _) if parts == 1 => p.clone(),
                    (_, Some(f)) => f.to_string(),
                    _ => {
                        return Err(ControlError::invalid(
                            "a part has no file name and no ?path=",
                        ));
                    }
                };
                let path = resolve(&name, user.as_deref())?;
                // A part borrows the form: it is pumped into the write as it arrives.
                let (tx, rx) = tokio::sync::mpsc::channel(4);
                let pump = async move {
                    let mut field = field;
                    while let Some(chunk) =
                        field.chunk().await.map_err(|e| e.to_string()).transpose()
                    {
                        if tx.send(chunk).await.is_err() {
                            break;
                        }
                    }
                };
                let rx = tokio_stream::wrappers::ReceiverStream::new(rx);
                let (entry, ()) = tokio::join!(
                    write(&s, &ctx.id, path, user.clone(), metadata.clone(), None, rx),
                    pump
                );
                written.push(entry?);
            }
            if written.is_empty() {
                return Err(ControlError::invalid("the multipart body has no file"));
            }
        } else if content_type.is_empty() || content_type.starts_with("application/octet-stream") {
            let path = q
                .path
                .as_deref()
                .ok_or_else(|| ControlError::invalid("an octet-stream upload needs ?path="))?;
            let path = resolve(path, user.as_deref())?;
            let gzipped = match req.headers().get(header::CONTENT_ENCODING) {
                None => false,
                Some(v) if v.as_bytes().eq_ignore_ascii_case(b"gzip") => true,
                Some(v) if v.as_bytes().eq_ignore_ascii_case(b"identity") => false,
                Some(v) => {
                    return Err(ControlError::invalid(format!(
                        "Content-Encoding {v:?} is not supported: gzip or identity"
                    )));
                }
            };
            let length = (!gzipped)
                .then(|| req.headers().get(header::CONTENT_LENGTH))
                .flatten()
                .and_then(|v| v.to_str().ok()?.parse().ok());
            let body = req.into_body().into_data_stream();
            let entry = if gzipped {
                let reader = tokio_util::io::StreamReader::new(
                    body.map_err(|e| std::io::Error::other(e.to_string())),
                );
                let decoder = async_compression::tokio::bufread::GzipDecoder::new(reader);
                let data = tokio_util::io::ReaderStream::new(decoder).map_err(|e| e.to_string());
                write(&s, &ctx.id, path, user, metadata, None, data).await?
            } else {
                write(
                    &s,
                    &ctx.id,
                    path,
                    user,
                    metadata,
                    length,
                    body.map_err(|e| e.to_string()),
                )
                .await?
            };
            written.push(entry);
        } else {
            return Err(ControlError::invalid(format!(
                "uploads take multipart/form-data or application/octet-stream, not {content_type:?}"
            )));
        }
        Ok(axum::Json(written).into_response())
    }
    .await;
    result.unwrap_or_else(files_error)
}

async fn write<S>(
    s: &AppState,
    id: &str,
    path: String,
    user: Option<String>,
    metadata: HashMap<String, String>,
    length: Option<u64>,
    data: S,
) -> Result<Written, ControlError>
where
    S: futures::Stream<Item = Result<bytes::Bytes, String>> + Send + 'static,
{
    let q = WriteFileQuery {
        path,
        user,
        mode: None,
        parents: Some(true),
    };
    let e = s
        .engine
        .write_file(id, q, metadata, length, Box::pin(data))
        .await?;
    Ok(Written {
        name: e.name,
        kind: "file",
        path: e.path,
        metadata: e.metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(file_type: FileType, mode: u32) -> space_api::EntryInfo {
        space_api::EntryInfo {
            name: "x".into(),
            path: "/x".into(),
            file_type,
            size: 0,
            mode,
            uid: 1000,
            gid: 1000,
            owner: None,
            group: None,
            modified_at: "2026-12-01T18:00:00.250Z".into(),
            symlink_target: None,
            mount_point: false,
            metadata: Default::default(),
        }
    }

    #[test]
    fn modes_are_gos_as_envd_reports_them() {
        assert_eq!(
            go_mode(&info(FileType::File, 0o644)),
            (0o644, "-rw-r--r--".into())
        );
        assert_eq!(
            go_mode(&info(FileType::Dir, 0o755)),
            (GO_MODE_DIR | 0o755, "drwxr-xr-x".into())
        );
        assert_eq!(
            go_mode(&info(FileType::Symlink, 0o777)).1,
            "Lrwxrwxrwx".to_string()
        );
        assert_eq!(
            go_mode(&info(FileType::File, 0o4755)),
            (GO_MODE_SETUID | 0o755, "urwxr-xr-x".into())
        );
        let e = entry(info(FileType::File, 0o600));
        assert_eq!((e.owner.as_str(), e.group.as_str()), ("1000", "1000"));
        let t = e.modified_time.unwrap();
        assert_eq!(t.nanos, 250_000_000);
        let v = serde_json::to_value(entry(info(FileType::Dir, 0o700))).unwrap();
        assert_eq!(v["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(v["modifiedTime"], "2026-12-01T18:00:00.250+00:00");
    }

    #[test]
    fn an_mtime_beyond_what_a_timestamp_holds_is_clamped_not_a_failed_reply() {
        // btrfs keeps any 64-bit mtime: `touch -d @253402300800` (year 10000) in a sandbox.
        for (ms, want) in [
            (253_402_300_800_000_i64, "9999-12-31T23:59:59+00:00"),
            (i64::MAX / 2 / 1000 * 1000, "9999-12-31T23:59:59+00:00"),
            (-62_135_596_801_000, "0001-01-01T00:00:00+00:00"),
        ] {
            let mut e = info(FileType::File, 0o644);
            e.modified_at = space_api::rfc3339_from_unix_ms(ms);
            e.size = u64::MAX;
            let v = serde_json::to_value(entry(e)).expect("an entry serializes");
            assert_eq!(v["modifiedTime"], want, "{ms}");
            assert_eq!(v["size"], i64::MAX.to_string());
        }
    }

    #[test]
    fn relative_paths_start_at_the_users_home() {
        assert_eq!(resolve("/etc/x", None).unwrap(), "/etc/x");
        assert_eq!(resolve("a/b", None).unwrap(), "/home/user/a/b");
        assert_eq!(resolve("a", Some("root")).unwrap(), "/root/a");
        assert_eq!(resolve("", Some("dev")).unwrap(), "/home/dev");
        assert!(resolve("a", Some("../x")).is_err());
    }

    #[test]
    fn signatures_are_checked_like_the_sdk_makes_them() {
        // The SDK's get_signature("/home/user/s.txt", "read", None, "tok", None).
        let raw = "/home/user/s.txt:read::tok";
        let d = ring::digest::digest(&ring::digest::SHA256, raw.as_bytes());
        let sig = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(d.as_ref())
        );
        let q = FilesQuery {
            path: Some("/home/user/s.txt".into()),
            signature: Some(sig.clone()),
            ..Default::default()
        };
        assert_eq!(q.verify("read", "tok", 0), Ok(()));
        assert!(q.verify("write", "tok", 0).is_err());
        assert!(q.verify("read", "other", 0).is_err());
        let moved = FilesQuery {
            path: Some("/home/user/t.txt".into()),
            signature: Some(sig),
            ..Default::default()
        };
        assert!(moved.verify("read", "tok", 0).is_err());
        let raw = "/p:write:user:tok:100";
        let d = ring::digest::digest(&ring::digest::SHA256, raw.as_bytes());
        let q = FilesQuery {
            path: Some("/p".into()),
            username: Some("user".into()),
            signature: Some(format!(
                "v1_{}",
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(d.as_ref())
            )),
            signature_expiration: Some(100),
        };
        assert_eq!(q.verify("write", "tok", 99), Ok(()));
        assert!(q.verify("write", "tok", 101).is_err());
    }
}
