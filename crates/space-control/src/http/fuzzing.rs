//! The fuzz targets' ways into space-control (fuzz/, docs/FUZZING.md).
//!
//! [`rest`]: every JSON body and query string the REST API and its E2B facade take, through
//! the same extractors the handlers use, and the checks a handler runs on the decoded value
//! before it touches the engine; the Connect envelopes of E2B's envd API. The first byte picks
//! the type, the rest is the body or the query string. What must hold: nothing panics, and a
//! body or query that does not decode is an invalid-argument error (a 400), never anything
//! else. [`guest_reply`]: the daemon's replies as the control plane converts them.
//! [`dockerfile`]: the Dockerfile parser of template builds.
//!
//! Unit tests replay the committed corpus (`fuzz/corpus/<target>`).

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use serde::de::DeserializeOwned;

use super::{ApiJson, ApiQuery};
use crate::e2b::control as e2b;
use crate::error::{ControlError, ErrorKind};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime")
    })
}

fn must_be_invalid(e: ControlError) {
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
}

/// A body through [`ApiJson`], as a handler receives it.
fn body<T: DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let req = Request::builder()
        .method("POST")
        .uri("/fuzz")
        .body(Body::from(bytes.to_vec()))
        .expect("a request");
    match runtime().block_on(ApiJson::<T>::from_request(req, &())) {
        Ok(ApiJson(v)) => Some(v),
        Err(e) => {
            must_be_invalid(e);
            None
        }
    }
}

/// A query string through [`ApiQuery`]; None also when the bytes make no URI at all (hyper
/// refuses those before any handler).
fn query<T: DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let q = std::str::from_utf8(bytes).ok()?;
    let req = Request::builder()
        .uri(format!("/fuzz?{q}"))
        .body(Body::empty())
        .ok()?;
    let (mut parts, _) = req.into_parts();
    match runtime().block_on(ApiQuery::<T>::from_request_parts(&mut parts, &())) {
        Ok(ApiQuery(v)) => Some(v),
        Err(e) => {
            must_be_invalid(e);
            None
        }
    }
}

/// Runs one input (see the module's doc).
pub fn rest(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    // Checks may refuse (an error); they must not panic.
    match which % 43 {
        0 => {
            if let Some(r) = body::<space_api::CreateSandbox>(rest) {
                let _ = crate::engine::validate_create(r, "fuzz0000000000000000");
            }
        }
        1 => drop(body::<space_api::SetTimeout>(rest)),
        2 => {
            if let Some(p) = body::<space_api::SnapshotPolicy>(rest) {
                let _ = crate::snapshot_policy::validate(&p);
            }
        }
        3 => {
            if let Some(r) = body::<space_api::ExecRequest>(rest) {
                drop(crate::convert::exec_request(r));
            }
        }
        4 => drop(body::<space_api::SignalRequest>(rest)),
        5 => drop(body::<space_api::ResizeRequest>(rest)),
        6 => drop(body::<space_api::MakeDirRequest>(rest)),
        7 => drop(body::<space_api::RenameRequest>(rest)),
        8 => drop(body::<space_api::NetworkPolicy>(rest)),
        9 => drop(body::<space_api::PortRequest>(rest)),
        10 => drop(body::<space_api::CreateJoinToken>(rest)),
        11 => {
            if let Some(p) = body::<space_api::SetPool>(rest) {
                let _ = crate::pools::validate_set_pool(&p, "namespace");
            }
        }
        12 => {
            if let Some(s) = body::<space_api::PutSecret>(rest) {
                let _ = crate::secrets::validate_put("fuzz", &s);
            }
        }
        13 => drop(body::<space_api::RollbackRequest>(rest)),
        14 => drop(body::<space_api::SetTemplateSettings>(rest)),
        15 => drop(body::<space_api::SetTemplateStart>(rest)),
        16 => drop(body::<space_api::PullTemplate>(rest)),
        17 => drop(body::<space_api::TemplateFromSnapshot>(rest)),
        18 => drop(body::<space_api::tenant::CreateTenant>(rest)),
        19 => drop(body::<space_api::tenant::SetTenant>(rest)),
        20 => drop(body::<space_api::tenant::CreateKey>(rest)),
        21 => {
            if let Some(r) = body::<e2b::NewSandbox>(rest) {
                e2b::check_new_sandbox(&r);
            }
        }
        22 => drop(body::<e2b::TimeoutBody>(rest)),
        23 => {
            if let Some(n) = body::<e2b::E2bNetwork>(rest) {
                let _ = e2b::network_policy(&n, None);
            }
        }
        24 => drop(body::<crate::e2b::secrets::NewSecret>(rest)),
        25 => drop(body::<crate::e2b::secrets::SecretUpdate>(rest)),
        26 => drop(query::<super::extract::PathOnly>(rest)),
        27 => drop(query::<space_api::WriteFileQuery>(rest)),
        28 => drop(query::<space_api::PathQuery>(rest)),
        29 => drop(query::<space_api::WatchQuery>(rest)),
        30 => drop(query::<space_api::OutputQuery>(rest)),
        31 => drop(query::<space_api::EventQuery>(rest)),
        32 => drop(query::<space_api::MetricsQuery>(rest)),
        33 => drop(query::<super::snapshots::DiffQuery>(rest)),
        34 => drop(query::<super::templates::ImportQuery>(rest)),
        35 => drop(query::<super::templates::RemoveQuery>(rest)),
        36 => drop(query::<super::tenants::KeyQuery>(rest)),
        37 => drop(query::<e2b::MetricsQuery>(rest)),
        38 => drop(query::<e2b::SnapshotQuery>(rest)),
        39 => drop(query::<e2b::ListQuery>(rest)),
        40 => drop(query::<crate::e2b::secrets::SecretQuery>(rest)),
        41 => connect_stream(rest),
        _ => {
            // Header values and paths the handlers check as text.
            if let Ok(k) = std::str::from_utf8(rest) {
                let _ = crate::idempotency::check_key(k);
                let _ = crate::templates::check_template_name(k);
                let (user, path) = k.split_once('\n').unwrap_or((k, k));
                if let Ok(p) = crate::e2b::files::resolve(path, Some(user)) {
                    assert!(p.starts_with('/'), "{path:?} as {user:?} -> {p:?}");
                }
            }
        }
    }
}

/// A Connect-protocol request body (E2B's envd API): envelopes split off as they arrive, in
/// chunks of the size the first byte gives, each message decoded as a process input.
fn connect_stream(data: &[u8]) {
    let Some((&k, stream)) = data.split_first() else {
        return;
    };
    let mut buf = bytes::BytesMut::new();
    let mut taken = 0;
    for chunk in stream.chunks(usize::from(k) + 1) {
        buf.extend_from_slice(chunk);
        loop {
            match crate::e2b::connect::split_envelope(&mut buf) {
                Ok(Some((_, msg))) => {
                    taken += 5 + msg.len();
                    let _ =
                        serde_json::from_slice::<crate::e2b::pb::process::StreamInputRequest>(&msg);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    assert_eq!(taken + buf.len(), stream.len());
}

/// What a client is sent must be what it can read back.
fn json_round_trip<T: serde::Serialize + DeserializeOwned>(v: &T) {
    let bytes = serde_json::to_vec(v).expect("a reply serializes");
    serde_json::from_slice::<T>(&bytes).expect("a reply reads back");
}

/// The `guest_node` target: every reply of the guest protocol as the control plane receives
/// it from a daemon (protobuf bytes, decoded as tonic does), converted as the API and the E2B
/// facade convert it, and serialized for the client. First byte: the message.
pub fn guest_reply(data: &[u8]) {
    use prost::Message;
    use space_proto as pb;
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 7 {
        0 => {
            if let Some(e) = pb::ProcessEvent::decode(rest)
                .ok()
                .and_then(crate::convert::exec_event)
            {
                json_round_trip(&e);
            }
        }
        1 => {
            if let Ok(e) = pb::EntryInfo::decode(rest) {
                entry(e);
            }
        }
        2 => {
            if let Ok(r) = pb::ListDirReply::decode(rest) {
                r.entries.into_iter().for_each(entry);
            }
        }
        3 => {
            if let Some(e) = pb::WatchEvent::decode(rest)
                .ok()
                .and_then(crate::convert::watch_event)
            {
                json_round_trip(&e);
            }
        }
        4 => {
            if let Ok(r) = pb::ListProcessesReply::decode(rest) {
                for p in r.processes {
                    json_round_trip(&crate::convert::process_info(p));
                }
            }
        }
        5 => drop(pb::InfoReply::decode(rest)),
        _ => {
            if let Ok(e) = pb::Exit::decode(rest) {
                json_round_trip(&crate::convert::exit_event(&e));
            }
        }
    }
}

/// The `dockerfile` target: a Dockerfile as `space template build` parses it, with two build
/// args. What must hold: nothing panics, an error names a line of the file, and a step's line
/// is one of the file's.
pub fn dockerfile(data: &[u8]) {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    let args = [("A", "x"), ("EMPTY", "")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lines = src.lines().count().max(1);
    match crate::dockerfile::parse(src, &args) {
        Ok(steps) => {
            for s in steps {
                assert!((1..=lines).contains(&s.line), "step at line {}", s.line);
            }
        }
        Err(e) => assert!(e.line <= lines, "error at line {} of {lines}", e.line),
    }
    let _ = crate::dockerfile::substitute(src, &args, 1);
}

fn entry(e: space_proto::EntryInfo) {
    let e = crate::convert::entry_info(e);
    assert_eq!(e.mode & !0o7777, 0);
    json_round_trip(&e);
    let envd = crate::e2b::files::entry(e);
    serde_json::to_vec(&envd).expect("an envd entry serializes");
}

#[cfg(test)]
mod tests {
    /// The committed corpus (and every crash the fuzzer found, kept there as a regression
    /// input) runs through the target on every `cargo test`.
    #[test]
    fn the_rest_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("rest", super::rest);
        assert!(n >= 43, "only {n} inputs in fuzz/corpus/rest");
    }

    #[test]
    fn the_dockerfile_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("dockerfile", super::dockerfile);
        assert!(n >= 4, "only {n} inputs in fuzz/corpus/dockerfile");
    }

    #[test]
    fn the_guest_node_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("guest_node", super::guest_reply);
        assert!(n >= 7, "only {n} inputs in fuzz/corpus/guest_node");
    }

    #[test]
    fn a_body_that_is_not_an_object_is_a_400_not_a_panic() {
        for input in [&b"\x00[1,2]"[..], b"\x00", b"\x00{\"template\":", b"\x15{}"] {
            super::rest(input);
        }
    }
}
