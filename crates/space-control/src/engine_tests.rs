//! Unit tests of the engine (a child of `engine`).

use super::*;
use crate::store::tests::row;

#[test]
fn create_validation() {
    let id = "abcdefghij0123456789";
    let ok = validate_create(CreateSandbox::default(), id).unwrap();
    assert_eq!(ok.template, "base");
    assert_eq!(ok.cpu, 1.0);
    assert_eq!(ok.memory_mib, 512);
    assert_eq!(ok.pids, 512);
    assert_eq!(ok.hostname, id);
    assert_eq!(ok.rlimits, None);
    let limited = validate_create(
        CreateSandbox {
            rlimits: Some(space_api::Rlimits {
                nofile: Some(65_536),
                core: Some(1 << 20),
                memlock: None,
            }),
            ..Default::default()
        },
        id,
    )
    .unwrap();
    assert_eq!(limited.rlimits.unwrap().nofile, Some(65_536));
    // An empty rlimits object is the defaults, stored as none.
    let empty = CreateSandbox {
        rlimits: Some(space_api::Rlimits::default()),
        ..Default::default()
    };
    assert_eq!(validate_create(empty, id).unwrap().rlimits, None);

    let bad: Vec<CreateSandbox> = vec![
        CreateSandbox {
            cpu: Some(0.0),
            ..Default::default()
        },
        CreateSandbox {
            cpu: Some(65.0),
            ..Default::default()
        },
        CreateSandbox {
            cpu: Some(f64::NAN),
            ..Default::default()
        },
        CreateSandbox {
            memory_mib: Some(15),
            ..Default::default()
        },
        CreateSandbox {
            memory_mib: Some(1_048_577),
            ..Default::default()
        },
        CreateSandbox {
            pids: Some(7),
            ..Default::default()
        },
        CreateSandbox {
            rlimits: Some(space_api::Rlimits {
                nofile: Some(8),
                ..Default::default()
            }),
            ..Default::default()
        },
        CreateSandbox {
            rlimits: Some(space_api::Rlimits {
                nofile: Some(2_000_000),
                ..Default::default()
            }),
            ..Default::default()
        },
        CreateSandbox {
            memory_mib: Some(64),
            rlimits: Some(space_api::Rlimits {
                memlock: Some(65 << 20),
                ..Default::default()
            }),
            ..Default::default()
        },
        CreateSandbox {
            rlimits: Some(space_api::Rlimits {
                core: Some(u64::MAX),
                ..Default::default()
            }),
            ..Default::default()
        },
        CreateSandbox {
            template: Some("../etc".into()),
            ..Default::default()
        },
        CreateSandbox {
            env: [("1BAD".to_string(), "x".to_string())].into(),
            ..Default::default()
        },
        CreateSandbox {
            env: [("A=B".to_string(), "x".to_string())].into(),
            ..Default::default()
        },
        CreateSandbox {
            env: [("OK".to_string(), "a\0b".to_string())].into(),
            ..Default::default()
        },
        // The platform's own names (the daemon's default user, DNS, CA, ...).
        CreateSandbox {
            env: [("SPACE_DEFAULT_USER".to_string(), "root".to_string())].into(),
            ..Default::default()
        },
        CreateSandbox {
            env: [("space_dns".to_string(), "1.1.1.1".to_string())].into(),
            ..Default::default()
        },
        CreateSandbox {
            hostname: Some("-x".into()),
            ..Default::default()
        },
        CreateSandbox {
            hostname: Some("a".repeat(64)),
            ..Default::default()
        },
    ];
    for req in bad {
        let e = validate_create(req.clone(), id).unwrap_err();
        assert_eq!(e.http_status().as_u16(), 400, "{req:?}");
        assert_eq!(e.code(), "invalid_argument");
    }
}

#[test]
fn lifecycle_table() {
    for state in [
        SandboxState::Creating,
        SandboxState::Stopped,
        SandboxState::Failed,
        SandboxState::Deleting,
    ] {
        let r = row("abcdefghij0123456789", state, 0);
        let e = check_lifecycle(&r, Action::Guest).unwrap_err();
        assert_eq!(e.http_status().as_u16(), 409, "{state}");
        assert!(check_lifecycle(&r, Action::Delete).is_ok());
    }
    let r = row("abcdefghij0123456789", SandboxState::Running, 0);
    assert!(check_lifecycle(&r, Action::Guest).is_ok());
}

#[test]
fn modes_and_limits() {
    assert_eq!(parse_mode(None).unwrap(), 0);
    assert_eq!(parse_mode(Some("644")).unwrap(), 0o644);
    assert_eq!(parse_mode(Some("0755")).unwrap(), 0o755);
    assert!(parse_mode(Some("999")).is_err());
    assert!(parse_mode(Some("77777")).is_err());
    let spec = node_spec(
        "x",
        &validate_create(CreateSandbox::default(), "x").unwrap(),
    );
    assert_eq!(spec.limits.cpu_millis, 1000);
    let mut tiny = validate_create(CreateSandbox::default(), "x").unwrap();
    tiny.cpu = 0.001;
    assert_eq!(node_spec("x", &tiny).limits.cpu_millis, 10);
    assert!(check_path("path", "rel").is_err());
    assert!(check_path("path", "").is_err());
    assert!(check_path("path", "/a\0").is_err());
    assert!(check_path("path", "/a").is_ok());
    assert!(check_id("short").is_err());
    assert!(new_sandbox_id().len() == 20 && is_valid_sandbox_id(&new_sandbox_id()));
}

#[tokio::test]
async fn upload_chunks_rechunks_and_aborts_past_limit() {
    let big = Bytes::from(vec![7u8; pb::CHUNK_BYTES * 2 + 5]);
    let body = futures::stream::iter(vec![Ok::<_, std::io::Error>(big)]);
    let (tx, _rx) = tokio::sync::oneshot::channel();
    let chunks: Vec<Bytes> = upload_chunks(body, u64::MAX, tx).collect().await;
    assert_eq!(
        chunks.iter().map(Bytes::len).collect::<Vec<_>>(),
        [pb::CHUNK_BYTES, pb::CHUNK_BYTES, 5]
    );

    let body = futures::stream::iter(vec![
        Ok::<_, std::io::Error>(Bytes::from_static(b"1234")),
        Ok(Bytes::from_static(b"5678")),
    ]);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut s = Box::pin(upload_chunks(body, 6, tx));
    // The stream never ends once the limit is passed; the abort channel reports 413.
    let next = tokio::time::timeout(Duration::from_millis(50), s.next()).await;
    assert!(next.is_err(), "stream must not end");
    assert_eq!(rx.await.unwrap().http_status().as_u16(), 413);
}
