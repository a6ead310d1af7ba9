//! The microvm channel loop (`vport::sessions`) with the real service, over socket pairs
//! standing in for the virtio-serial port: a host goes away in the middle of a stream, the
//! next one connects and finds the process table as it was. (The real port, under QEMU, is
//! covered by `guest_vm.rs`.)

use std::io;
use std::net::Shutdown;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use hyper_util::rt::TokioIo;
use space_daemon::vport::{Port, sessions};
use space_proto::guest_client::GuestClient;
use space_proto::process_event::Event;
use space_proto::*;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};

/// Each host is the guest end of a socket pair.
struct PairPort {
    hosts: mpsc::UnboundedReceiver<UnixStream>,
}

impl Port for PairPort {
    type Io = UnixStream;

    async fn connect(&mut self) -> io::Result<UnixStream> {
        match self.hosts.recv().await {
            Some(s) => Ok(s),
            None => std::future::pending().await,
        }
    }
}

/// A host: a client over a fresh pair, plus a handle that cuts the connection.
async fn connect_host(
    hosts: &mpsc::UnboundedSender<UnixStream>,
) -> (GuestClient<Channel>, std::os::unix::net::UnixStream) {
    let (guest, host) = std::os::unix::net::UnixStream::pair().unwrap();
    guest.set_nonblocking(true).unwrap();
    host.set_nonblocking(true).unwrap();
    let cut = host.try_clone().unwrap();
    hosts.send(UnixStream::from_std(guest).unwrap()).unwrap();
    let slot = Arc::new(Mutex::new(Some(UnixStream::from_std(host).unwrap())));
    let channel = Endpoint::from_static("http://guest")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let s = slot.lock().unwrap().take();
            async move {
                s.map(TokioIo::new)
                    .ok_or(io::Error::other("one connection only"))
            }
        }))
        .await
        .unwrap();
    (GuestClient::new(channel), cut)
}

fn output_of(events: &[ProcessEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Event::Output(o)) => Some(String::from_utf8_lossy(&o.data).into_owned()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_outlive_the_host_connection() {
    let (hosts_tx, hosts) = mpsc::unbounded_channel();
    tokio::spawn(space_daemon::serve_incoming(
        space_daemon::Config::default(),
        sessions(PairPort { hosts }),
    ));

    // Host 1 starts a process and follows its output; then the connection is cut mid-stream.
    let (mut c1, cut1) = connect_host(&hosts_tx).await;
    c1.info(InfoRequest {}).await.unwrap();
    let pid = c1
        .start(ExecRequest {
            argv: vec!["sh".into(), "-c".into(), "echo first; exec sleep 30".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .pid;
    let mut follow = c1
        .attach(AttachRequest {
            pid,
            offset: 0,
            follow: true,
        })
        .await
        .unwrap()
        .into_inner();
    let first = follow.next().await.unwrap().unwrap();
    assert_eq!(output_of(&[first]), "first\n");
    cut1.shutdown(Shutdown::Both).unwrap();
    let after_cut = tokio::time::timeout(Duration::from_secs(5), follow.next())
        .await
        .expect("the cut stream ends");
    assert!(!matches!(after_cut, Some(Ok(_))), "{after_cut:?}");
    drop(c1);

    // Host 2 sees the same process, still running, with its output.
    let (mut c2, _cut2) = connect_host(&hosts_tx).await;
    let list = tokio::time::timeout(
        Duration::from_secs(5),
        c2.list_processes(ListProcessesRequest::default()),
    )
    .await
    .expect("host 2 is served")
    .unwrap()
    .into_inner();
    let p = list.processes.iter().find(|p| p.pid == pid).unwrap();
    assert!(p.running);
    c2.signal(SignalRequest {
        pid,
        signal: 9,
        group: false,
    })
    .await
    .unwrap();
    let events: Vec<ProcessEvent> = c2
        .attach(AttachRequest {
            pid,
            offset: 0,
            follow: true,
        })
        .await
        .unwrap()
        .into_inner()
        .map(|e| e.unwrap())
        .collect()
        .await;
    assert_eq!(output_of(&events), "first\n");
    assert!(matches!(
        events.last().and_then(|e| e.event.as_ref()),
        Some(Event::Exit(_))
    ));
}
