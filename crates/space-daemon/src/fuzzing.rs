//! The `guest_daemon` fuzz target's way in (fuzz/, docs/FUZZING.md): every request of the
//! guest protocol as the daemon receives it off its channel (protobuf bytes, decoded as tonic
//! does), through the checks the service runs before it acts; and the byte stream a microvm's
//! session reads ([`crate::vport`]).
//!
//! The first byte picks the message, the rest is its encoding. Nothing here touches the files
//! or processes of the machine it runs on: paths are normalized and checked, commands prepared
//! and never spawned. What must hold: nothing panics; a normalized path is absolute and has no
//! `.` or `..` in it; a prepared command carries no NUL and no `=` in an environment name.

use std::path::{Component, Path};
use std::sync::OnceLock;

use prost::Message;
use space_proto as pb;

use crate::Config;

/// A root with its own passwd and group (users root and `user`), so that execs naming a user
/// resolve without reading the host's.
fn config() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| {
        // The same content from every fuzzing process, so they may share it.
        let root = std::env::temp_dir().join("space-fuzz-guest-root");
        let etc = root.join("etc");
        std::fs::create_dir_all(&etc).expect("etc");
        std::fs::write(
            etc.join("passwd"),
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
        )
        .expect("passwd");
        std::fs::write(etc.join("group"), "root:x:0:\nuser:x:1000:\n").expect("group");
        Config {
            root,
            ..Config::default()
        }
    })
}

fn path(p: &str) {
    if let Ok(n) = crate::files::normalize(p) {
        assert!(n.is_absolute(), "{p:?} -> {n:?}");
        assert!(
            n.components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_))),
            "{p:?} -> {n:?}"
        );
        assert!(!n.as_os_str().as_encoded_bytes().contains(&0));
    }
}

fn exec(req: &pb::ExecRequest) {
    let Ok(p) = crate::exec::prepare(config(), req) else {
        return;
    };
    for (k, v) in p.cmd.get_envs() {
        let k = k.as_encoded_bytes();
        assert!(
            !k.is_empty() && !k.contains(&b'=') && !k.contains(&0),
            "{k:?}"
        );
        assert!(!v.is_some_and(|v| v.as_encoded_bytes().contains(&0)));
    }
    assert!(Path::new(&p.cwd).is_absolute(), "{:?}", p.cwd);
}

fn decode<M: Message + Default>(bytes: &[u8]) -> Option<M> {
    M::decode(bytes).ok()
}

/// Runs one input (see the module's doc).
pub fn guest(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 16 {
        0 => {
            if let Some(r) = decode::<pb::ExecRequest>(rest) {
                exec(&r);
            }
        }
        1 => {
            if let Some(r) = decode::<pb::PathRequest>(rest) {
                path(&r.path);
            }
        }
        2 => {
            if let Some(r) = decode::<pb::ReadFileRequest>(rest) {
                path(&r.path);
            }
        }
        3 => {
            if let Some(pb::WriteFileRequest {
                msg: Some(pb::write_file_request::Msg::Open(open)),
            }) = decode(rest)
            {
                path(&open.path);
                let _ = crate::files::check_metadata(&open.metadata);
            }
        }
        4 => {
            if let Some(r) = decode::<pb::ListDirRequest>(rest) {
                path(&r.path);
            }
        }
        5 => {
            if let Some(r) = decode::<pb::MakeDirRequest>(rest) {
                path(&r.path);
            }
        }
        6 => {
            if let Some(r) = decode::<pb::RemoveRequest>(rest) {
                path(&r.path);
            }
        }
        7 => {
            if let Some(r) = decode::<pb::RenameRequest>(rest) {
                path(&r.from);
                path(&r.to);
            }
        }
        8 => {
            if let Some(r) = decode::<pb::WatchRequest>(rest) {
                path(&r.path);
            }
        }
        9 => {
            if let Some(r) = decode::<pb::PersonalizeRequest>(rest) {
                let _ = crate::service::check_env(&r.env);
                let id = crate::guest_init::Identity {
                    entropy: r.entropy,
                    machine_id: r.machine_id,
                    unix_time_ns: r.unix_time_ns,
                    mac: r.mac,
                };
                let _ = id.check();
            }
        }
        10 => drop(decode::<pb::AttachRequest>(rest)),
        11 => drop(decode::<pb::SignalRequest>(rest)),
        12 => drop(decode::<pb::StdinRequest>(rest)),
        13 => drop(decode::<pb::ResizeRequest>(rest)),
        14 => drop(decode::<pb::PidRequest>(rest)),
        _ => crate::vport::check_chunking(rest),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_guest_daemon_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("guest_daemon", super::guest);
        assert!(n >= 16, "only {n} inputs in fuzz/corpus/guest_daemon");
    }
}
