//! Conversions between the public DTOs (space-api), the guest protocol (space-proto) and the
//! node API. Pure functions.

use space_api::{EntryInfo, ExecEvent, FileType, ProcessInfo, rfc3339_from_unix_ms};
use space_proto as pb;
use space_proto::process_event::Event;

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
