//! Conversions between the public DTOs (space-api), the guest protocol (space-proto) and the
//! node API, and the API's view of a sandbox's row and a template. Pure functions.

use space_api::{
    EntryInfo, ExecEvent, FileType, ProcessInfo, Sandbox, SandboxState, Template,
    rfc3339_from_unix_ms,
};
use space_node_api::{SandboxStatus, TemplateInfo};
use space_proto as pb;
use space_proto::process_event::Event;

use crate::engine::RUNTIME_NAME;
use crate::store::SandboxRow;

/// A guest process event as a public exec event. `None` for an empty oneof.
pub fn exec_event(ev: pb::ProcessEvent) -> Option<ExecEvent> {
    Some(match ev.event? {
        Event::Started(s) => ExecEvent::Started { pid: s.pid },
        Event::Output(o) => match pb::Stream::try_from(o.stream).unwrap_or(pb::Stream::Stdout) {
            pb::Stream::Stderr => ExecEvent::Stderr {
                offset: o.offset,
                data: o.data,
            },
            pb::Stream::Pty => ExecEvent::Pty {
                offset: o.offset,
                data: o.data,
            },
            pb::Stream::Stdout | pb::Stream::Unspecified => ExecEvent::Stdout {
                offset: o.offset,
                data: o.data,
            },
        },
        Event::Gap(g) => ExecEvent::Gap {
            from: g.from,
            to: g.to,
        },
        Event::Exit(e) => exit_event(&e),
    })
}

pub fn exit_event(e: &pb::Exit) -> ExecEvent {
    if e.signaled {
        ExecEvent::Exit {
            code: None,
            signal: Some(e.signal),
        }
    } else {
        ExecEvent::Exit {
            code: Some(e.code),
            signal: None,
        }
    }
}

pub fn entry_info(e: pb::EntryInfo) -> EntryInfo {
    let file_type = match pb::FileType::try_from(e.r#type).unwrap_or(pb::FileType::Other) {
        pb::FileType::File => FileType::File,
        pb::FileType::Dir => FileType::Dir,
        pb::FileType::Symlink => FileType::Symlink,
        pb::FileType::Other | pb::FileType::Unspecified => FileType::Other,
    };
    EntryInfo {
        name: e.name,
        path: e.path,
        file_type,
        size: e.size,
        mode: e.mode & 0o7777,
        uid: e.uid,
        gid: e.gid,
        owner: Some(e.owner).filter(|o| !o.is_empty()),
        group: Some(e.group).filter(|g| !g.is_empty()),
        modified_at: rfc3339_from_unix_ms(e.modified_unix_ms),
        symlink_target: (!e.symlink_target.is_empty()).then_some(e.symlink_target),
        mount_point: e.mount_point,
        metadata: e.metadata.into_iter().collect(),
    }
}

/// A daemon watch event, or `None` for an unknown kind.
pub fn watch_event(e: pb::WatchEvent) -> Option<space_api::WatchEvent> {
    use space_api::WatchKind as K;
    let kind = match pb::WatchKind::try_from(e.kind).ok()? {
        pb::WatchKind::Started => K::Started,
        pb::WatchKind::Create => K::Create,
        pb::WatchKind::Write => K::Write,
        pb::WatchKind::Remove => K::Remove,
        pb::WatchKind::Rename => K::Rename,
        pb::WatchKind::Chmod => K::Chmod,
        pb::WatchKind::Overflow => K::Overflow,
        pb::WatchKind::Unspecified => return None,
    };
    Some(space_api::WatchEvent {
        kind,
        name: e.name,
        is_dir: e.is_dir,
    })
}

pub fn process_info(p: pb::ProcessInfo) -> ProcessInfo {
    let (exit_code, signal) = match (&p.exit, p.running) {
        (Some(e), false) if e.signaled => (None, Some(e.signal)),
        (Some(e), false) => (Some(e.code), None),
        _ => (None, None),
    };
    ProcessInfo {
        pid: p.pid,
        cmd: p.argv,
        tag: p.tag,
        tty: p.tty,
        running: p.running,
        exit_code,
        signal,
        started_at: rfc3339_from_unix_ms(p.started_unix_ms as i64),
        output_bytes: p.output_bytes,
    }
}

pub fn exec_request(r: space_api::ExecRequest) -> pb::ExecRequest {
    pb::ExecRequest {
        argv: r.cmd,
        env: r.env.into_iter().collect(),
        cwd: r.cwd.unwrap_or_default(),
        user: r.user.unwrap_or_default(),
        tty: r.tty,
        rows: r.rows.map(u32::from).unwrap_or(if r.tty { 24 } else { 0 }),
        cols: r.cols.map(u32::from).unwrap_or(if r.tty { 80 } else { 0 }),
        stdin: r.stdin,
        tag: r.tag.unwrap_or_default(),
        stdin_data: r.stdin_data.unwrap_or_default(),
    }
}

/// Whether a sandbox in state `s` has a status on its node worth asking for.
pub(crate) fn asks_node(s: SandboxState) -> bool {
    matches!(
        s,
        SandboxState::Running | SandboxState::Stopped | SandboxState::Paused
    )
}

pub fn sandbox_dto(row: &SandboxRow, status: Option<&SandboxStatus>) -> Sandbox {
    let live = status.filter(|_| {
        matches!(
            row.state,
            SandboxState::Running
                | SandboxState::Stopped
                | SandboxState::Creating
                | SandboxState::Paused
        )
    });
    Sandbox {
        id: row.id.clone(),
        tenant: row.tenant.clone(),
        template: row.spec.template.clone(),
        runtime: live.map(|s| s.runtime.to_string()).unwrap_or_else(|| {
            row.spec
                .runtime
                .clone()
                .unwrap_or_else(|| RUNTIME_NAME.to_string())
        }),
        state: row.state,
        created_at: rfc3339_from_unix_ms(row.created_at),
        cpu: row.spec.cpu,
        memory_mib: row.spec.memory_mib,
        pids: row.spec.pids,
        disk_mib: row.spec.disk_mib,
        rlimits: row.spec.rlimits,
        env: row.spec.env.clone(),
        metadata: row.spec.metadata.clone(),
        hostname: row.spec.hostname.clone(),
        error: row.error.clone(),
        init_pid: live
            .filter(|_| row.state == SandboxState::Running)
            .and_then(|s| s.init_pid),
        uid_base: live.map(|s| s.uid_base),
        memory_bytes: live.and_then(|s| s.memory_bytes),
        cpu_usage_usec: live.and_then(|s| s.cpu_usage_usec),
        disk_bytes: live.and_then(|s| s.disk_bytes),
        // Filled by `lifecycle::decorate`.
        timeout_at: None,
        on_timeout: None,
        auto_pause_secs: None,
        paused_at: None,
        // Filled by `snapshot_policy::decorate`.
        snapshot_policy: None,
        network: Some(crate::net::network_dto(
            &row.spec.network,
            live.and_then(|s| s.network.as_ref()),
        )),
        secrets: {
            // A secret can be bound more than once (a placeholder and headers).
            let mut names: Vec<String> = Vec::new();
            for b in &row.spec.secrets {
                if !names.contains(&b.name) {
                    names.push(b.name.clone());
                }
            }
            names
        },
        pooled: live.is_some_and(|s| s.pooled),
        restored: live.is_some_and(|s| s.restored),
        replicas: row.spec.replicas,
        // Filled by `replicas::replica_of`.
        replica: None,
        // Set by the listing or lookup that asked the node.
        node_unreachable: false,
    }
}

pub fn template_dto(t: &TemplateInfo) -> Template {
    Template {
        name: t.name.clone(),
        version: t.version,
        created_at: rfc3339_from_unix_ms(t.created_unix_ms as i64),
        path: Some(t.path.display().to_string()),
        source: Some(t.source.clone()).filter(|s| !s.is_empty()),
        start_cmd: t.defaults.start_cmd.clone(),
        ready_cmd: t.defaults.ready_cmd.clone(),
        runtime: None,
        replicas: None,
        tenant: space_api::tenant::DEFAULT_TENANT.to_owned(),
        shared: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events() {
        let out = pb::ProcessEvent {
            event: Some(Event::Output(pb::Output {
                stream: pb::Stream::Stderr as i32,
                offset: 5,
                data: b"x".to_vec(),
            })),
        };
        assert_eq!(
            exec_event(out),
            Some(ExecEvent::Stderr {
                offset: 5,
                data: b"x".to_vec()
            })
        );
        let exit = pb::Exit {
            code: 0,
            signal: 9,
            signaled: true,
            end_offset: 0,
        };
        assert_eq!(
            exit_event(&exit),
            ExecEvent::Exit {
                code: None,
                signal: Some(9)
            }
        );
        assert_eq!(exec_event(pb::ProcessEvent { event: None }), None);
    }

    #[test]
    fn entries_and_processes() {
        let e = entry_info(pb::EntryInfo {
            name: "a".into(),
            path: "/a".into(),
            r#type: pb::FileType::Dir as i32,
            size: 4096,
            mode: 0o40755,
            uid: 0,
            gid: 0,
            modified_unix_ms: 0,
            symlink_target: String::new(),
            mount_point: false,
            owner: "root".into(),
            group: String::new(),
            metadata: [("k".to_owned(), "v".to_owned())].into(),
        });
        assert_eq!(e.file_type, FileType::Dir);
        assert_eq!(e.metadata, [("k".to_owned(), "v".to_owned())].into());
        assert_eq!(
            (e.owner.as_deref(), e.group.as_deref()),
            (Some("root"), None)
        );
        assert_eq!(e.mode, 0o755);
        assert_eq!(e.symlink_target, None);
        let p = process_info(pb::ProcessInfo {
            pid: 3,
            argv: vec!["sleep".into()],
            running: false,
            exit: Some(pb::Exit {
                code: 2,
                ..Default::default()
            }),
            ..Default::default()
        });
        assert_eq!(p.exit_code, Some(2));
        assert_eq!(p.signal, None);
    }
}
