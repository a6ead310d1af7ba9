use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use super::*;

fn fake_sys(ports: &[(&str, &str, &str)]) -> tempfile::TempDir {
    let sys = tempfile::tempdir().unwrap();
    for (dir, name, dev) in ports {
        let d = sys.path().join(dir);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("name"), format!("{name}\n")).unwrap();
        fs::write(d.join("dev"), format!("{dev}\n")).unwrap();
    }
    sys
}

#[test]
fn finds_the_port_by_name() {
    let sys = fake_sys(&[
        ("vport1p1", "org.qemu.guest_agent.0", "243:1"),
        ("vport1p2", "space.0", "243:2"),
    ]);
    // A port without a name file (not yet named) is passed over.
    fs::create_dir(sys.path().join("vport1p3")).unwrap();
    let loc = find_port(sys.path(), Path::new("/dev"), PORT_NAME)
        .unwrap()
        .unwrap();
    assert_eq!(
        loc,
        PortLocation {
            dev: PathBuf::from("/dev/vport1p2"),
            major: 243,
            minor: 2,
        }
    );
    assert_eq!(
        find_port(sys.path(), Path::new("/dev"), "space.1").unwrap(),
        None
    );
    // No virtio-ports class at all (virtio_console not loaded yet).
    assert_eq!(
        find_port(&sys.path().join("missing"), Path::new("/dev"), PORT_NAME).unwrap(),
        None
    );
}

#[test]
fn bad_dev_numbers_and_timeouts_are_explained() {
    let sys = fake_sys(&[("vport0p1", "space.0", "243")]);
    let e = find_port(sys.path(), Path::new("/dev"), PORT_NAME).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("vport0p1/dev holds \"243\\n\", not MAJOR:MINOR"),
        "{e}"
    );
    let empty = fake_sys(&[]);
    let e = wait_for_port(
        empty.path(),
        Path::new("/dev"),
        PORT_NAME,
        Duration::from_millis(20),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("no virtio-serial port named space.0 under"),
        "{e}"
    );
}

#[test]
fn creates_the_missing_device_node_needs_root() {
    let dev = tempfile::tempdir().unwrap();
    let loc = PortLocation {
        dev: dev.path().join("vport0p1"),
        major: 1,
        minor: 3, // /dev/null's numbers: harmless to open
    };
    // An existing node is left alone.
    fs::write(&loc.dev, "").unwrap();
    ensure_node(&loc).unwrap();
    assert!(fs::metadata(&loc.dev).unwrap().is_file());
    fs::remove_file(&loc.dev).unwrap();
    match ensure_node(&loc) {
        Ok(()) => {
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            let md = fs::metadata(&loc.dev).unwrap();
            assert!(md.file_type().is_char_device());
            assert_eq!(md.rdev(), rustix::fs::makedev(1, 3));
            // It opens and behaves like the device it names.
            let port = VirtioPort::open(&loc.dev).unwrap();
            assert!(port.host_connected().unwrap());
        }
        Err(e) => {
            assert!(!rustix::process::geteuid().is_root(), "as root: {e}");
            assert!(matches!(e, VportError::Mknod { .. }), "{e}");
        }
    }
}

/// Hosts connect by sending one end of a socket pair.
struct FakePort {
    hosts: mpsc::UnboundedReceiver<UnixStream>,
}

impl Port for FakePort {
    type Io = UnixStream;

    async fn connect(&mut self) -> io::Result<UnixStream> {
        match self.hosts.recv().await {
            Some(s) => Ok(s),
            None => std::future::pending().await,
        }
    }
}

#[test]
fn preface_is_found_across_reads_and_what_precedes_it_dropped() {
    let mut p = Preface::new();
    p.feed(b"old session's GOAWAY bytes PRI * HT");
    match &p {
        Preface::Seeking { tail, discarded } => {
            assert_eq!(tail.as_slice(), b"PRI * HT");
            assert_eq!(*discarded, 27);
        }
        other => panic!("{other:?}"),
    }
    p.feed(b"TP/2.0\r\n\r\nSM\r\n\r\n\x00\x00");
    match &p {
        Preface::Replay(b) => assert_eq!(b.as_slice(), [PREFACE, b"\x00\x00"].concat()),
        other => panic!("{other:?}"),
    }
    // A near miss is dropped, not kept forever.
    let mut p = Preface::new();
    p.feed(b"PRI * HTTP/1.1");
    assert!(matches!(&p, Preface::Seeking { tail, discarded: 14 } if tail.is_empty()));
}

#[tokio::test]
async fn one_session_at_a_time_each_from_its_preface() {
    let (tx, hosts) = mpsc::unbounded_channel();
    let mut sessions = Box::pin(sessions(FakePort { hosts }));

    // Session 1 until its host hangs up (EOF on the guest side).
    let (guest, mut host) = UnixStream::pair().unwrap();
    tx.send(guest).unwrap();
    let mut s1 = sessions.next().await.unwrap().unwrap();
    host.write_all(&[PREFACE, b"hello"].concat()).await.unwrap();
    let mut buf = vec![0u8; PREFACE.len() + 5];
    s1.read_exact(&mut buf).await.unwrap();
    assert_eq!(buf, [PREFACE, b"hello"].concat());
    drop(host);
    assert_eq!(s1.read(&mut buf).await.unwrap(), 0);
    assert!(s1.host_gone);

    // The next host is not handed out while session 1 lives.
    let (guest2, mut host2) = UnixStream::pair().unwrap();
    tx.send(guest2).unwrap();
    let next = tokio::time::timeout(Duration::from_millis(100), sessions.next()).await;
    assert!(next.is_err(), "a second session while the first lives");
    drop(s1);
    let mut s2 = sessions.next().await.unwrap().unwrap();
    // What the last session left in flight is skipped; the preface may arrive in pieces.
    host2
        .write_all(b"\x00\x00\x08\x07stale PRI * HTTP/2")
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        let mut b = vec![0u8; PREFACE.len() + 2];
        s2.read_exact(&mut b).await.unwrap();
        (s2, b)
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    host2.write_all(b".0\r\n\r\nSM\r\n\r\nhi").await.unwrap();
    let (mut s2, b) = reader.await.unwrap();
    assert_eq!(b, [PREFACE, b"hi"].concat());
    s2.write_all(b"ok").await.unwrap();
    let mut b2 = [0u8; 2];
    host2.read_exact(&mut b2).await.unwrap();
    assert_eq!(&b2, b"ok");
    assert!(!s2.host_gone);
}

/// A SETTINGS frame with an empty payload, and a DATA frame whose payload holds `P`s.
const SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];
const DATA_WITH_P: &[u8] = &[0, 0, 3, 0, 0, 0, 0, 0, 1, b'P', b'P', b'P'];

#[test]
fn a_new_preface_is_seen_only_where_a_frame_header_would_start() {
    let mut f = Frames::new();
    // The preface itself, then frames whose payload holds `P`: nothing.
    assert_eq!(f.scan(PREFACE), None);
    assert_eq!(f.scan(SETTINGS), None);
    assert_eq!(f.scan(DATA_WITH_P), None);
    // Byte by byte across a header, then a new preface at the boundary.
    let mut f2 = Frames::new();
    let all = [PREFACE, DATA_WITH_P, SETTINGS].concat();
    for b in all.chunks(1) {
        assert_eq!(f2.scan(b), None);
    }
    assert_eq!(f2.scan(&[SETTINGS, PREFACE].concat()), Some(SETTINGS.len()));
}

#[tokio::test]
async fn a_host_taking_over_mid_session_gets_a_fresh_session() {
    let (tx, hosts) = mpsc::unbounded_channel();
    let mut sessions = Box::pin(sessions(FakePort { hosts }));
    let (guest, mut host) = UnixStream::pair().unwrap();
    tx.send(guest).unwrap();
    let mut s1 = sessions.next().await.unwrap().unwrap();
    // The old client's frames, then (no hang-up seen) a new client's preface and frame.
    host.write_all(&[PREFACE, DATA_WITH_P, PREFACE, SETTINGS].concat())
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 64];
    loop {
        let n = s1.read(&mut b).await.unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&b[..n]);
    }
    assert_eq!(
        got,
        [PREFACE, DATA_WITH_P].concat(),
        "only the old client's bytes"
    );
    // What the old session still writes never reaches the new client.
    s1.write_all(b"old answer").await.unwrap();
    drop(s1);
    let (guest2, _host2) = UnixStream::pair().unwrap();
    tx.send(guest2).unwrap();
    let mut s2 = sessions.next().await.unwrap().unwrap();
    let mut b2 = vec![0u8; PREFACE.len() + SETTINGS.len()];
    s2.read_exact(&mut b2).await.unwrap();
    assert_eq!(
        b2,
        [PREFACE, SETTINGS].concat(),
        "the new client's, carried over"
    );
    // s1 is gone, so its end is closed: the host reads EOF and nothing before it.
    let mut leaked = Vec::new();
    host.read_to_end(&mut leaked).await.unwrap();
    assert!(leaked.is_empty(), "the old session wrote: {leaked:?}");
}

/// A client's GOAWAY (stream 0, no error, last stream 0).
const GOAWAY_FRAME: &[u8] = &[0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

#[tokio::test]
async fn nothing_is_written_after_the_clients_goaway() {
    let (tx, hosts) = mpsc::unbounded_channel();
    let mut sessions = Box::pin(sessions(FakePort { hosts }));
    let (guest, mut host) = UnixStream::pair().unwrap();
    tx.send(guest).unwrap();
    let mut s1 = sessions.next().await.unwrap().unwrap();
    host.write_all(&[PREFACE, SETTINGS].concat()).await.unwrap();
    let mut b = vec![0u8; PREFACE.len() + SETTINGS.len()];
    s1.read_exact(&mut b).await.unwrap();
    // Before the GOAWAY the server's frames reach the host.
    s1.write_all(SETTINGS).await.unwrap();
    let mut got = vec![0u8; SETTINGS.len()];
    host.read_exact(&mut got).await.unwrap();
    assert_eq!(got, SETTINGS);
    // The client leaves: the server still reads the GOAWAY, and what it answers (its own
    // GOAWAY) goes nowhere, so the next host cannot receive it.
    host.write_all(GOAWAY_FRAME).await.unwrap();
    let mut b = vec![0u8; GOAWAY_FRAME.len()];
    s1.read_exact(&mut b).await.unwrap();
    assert_eq!(b, GOAWAY_FRAME);
    s1.write_all(GOAWAY_FRAME).await.unwrap();
    drop(s1);
    let mut leaked = Vec::new();
    host.read_to_end(&mut leaked).await.unwrap();
    assert!(leaked.is_empty(), "written after the GOAWAY: {leaked:?}");
}

#[test]
fn a_goaway_is_seen_in_a_frame_header_only() {
    let mut f = Frames::new();
    assert_eq!(f.scan(PREFACE), None);
    // A 7 in a payload is no GOAWAY.
    f.scan(&[0, 0, 2, 0, 0, 0, 0, 0, 1, 7, 7]);
    assert!(!f.goaway);
    for b in GOAWAY_FRAME.chunks(1) {
        f.scan(b);
    }
    assert!(f.goaway);
}
