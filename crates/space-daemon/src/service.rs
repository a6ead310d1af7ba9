//! The `Guest` gRPC service: parses requests, delegates to [`Procs`] and [`files`], and maps
//! errors to gRPC status codes. Thin on purpose.

use std::io;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use space_proto::guest_server::Guest;
use space_proto::*;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::config::Config;
use crate::exec::ExecError;
use crate::files::{self, FilesError, WriteMsg};
use crate::procs::{ProcError, Procs, events};

/// The daemon's service state.
pub struct GuestService {
    cfg: Arc<Config>,
    procs: Arc<Procs>,
    started_unix_ms: u64,
}

impl GuestService {
    pub fn new(cfg: Arc<Config>, procs: Arc<Procs>, started_unix_ms: u64) -> Self {
        Self {
            cfg,
            procs,
            started_unix_ms,
        }
    }

    /// Owner and group names for entries, read from the sandbox's files now (a user added
    /// a moment ago has its name).
    fn names(&self) -> crate::users::Names {
        crate::users::Names::read(&self.cfg.root)
    }
}

/// "outer: cause: cause" — the whole error chain, for the status message.
fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        cur = s.source();
    }
    msg
}

fn io_code(e: &io::Error) -> Code {
    use io::ErrorKind as K;
    match e.kind() {
        K::NotFound => Code::NotFound,
        K::PermissionDenied => Code::PermissionDenied,
        K::AlreadyExists => Code::AlreadyExists,
        K::InvalidInput | K::InvalidFilename => Code::InvalidArgument,
        K::IsADirectory
        | K::NotADirectory
        | K::DirectoryNotEmpty
        | K::ReadOnlyFilesystem
        | K::CrossesDevices
        | K::ResourceBusy => Code::FailedPrecondition,
        K::StorageFull | K::QuotaExceeded | K::FileTooLarge => Code::ResourceExhausted,
        _ => match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENAMETOOLONG) => Code::InvalidArgument,
            Some(libc::EPERM) => Code::PermissionDenied,
            _ => Code::Internal,
        },
    }
}

impl From<FilesError> for Status {
    fn from(e: FilesError) -> Self {
        let code = match &e {
            FilesError::InvalidPath { .. }
            | FilesError::Protocol(_)
            | FilesError::User(_)
            | FilesError::Metadata(_) => Code::InvalidArgument,
            FilesError::Io { source, .. } => io_code(source),
            FilesError::IsDir(_)
            | FilesError::NotDir(_)
            | FilesError::NotRegular(_)
            | FilesError::Root => Code::FailedPrecondition,
            FilesError::Exists(_) => Code::AlreadyExists,
            FilesError::OutOfRange { .. } => Code::OutOfRange,
            FilesError::Task(_) => Code::Internal,
        };
        Status::new(code, chain(&e))
    }
}

impl From<ExecError> for Status {
    fn from(e: ExecError) -> Self {
        let code = match &e {
            ExecError::Invalid(_) | ExecError::User(_) | ExecError::CwdNotDir(_) => {
                Code::InvalidArgument
            }
            ExecError::NotFound(_) | ExecError::CwdNotFound(_) => Code::NotFound,
            ExecError::NotExecutable(_) => Code::PermissionDenied,
            ExecError::Pty(_) => Code::ResourceExhausted,
            ExecError::Spawn { source, .. } => io_code(source),
        };
        Status::new(code, chain(&e))
    }
}

impl From<ProcError> for Status {
    fn from(e: ProcError) -> Self {
        let code = match &e {
            ProcError::NotFound(_) => Code::NotFound,
            ProcError::OutOfRange { .. } => Code::OutOfRange,
            ProcError::BadSignal(_) => Code::InvalidArgument,
            ProcError::Exited(_)
            | ProcError::NoStdin(_)
            | ProcError::StdinClosed(_)
            | ProcError::NoTty(_)
            | ProcError::TtyStdin(_) => Code::FailedPrecondition,
            ProcError::Signal { source, .. }
            | ProcError::Stdin { source, .. }
            | ProcError::Resize { source, .. } => io_code(source),
        };
        Status::new(code, chain(&e))
    }
}

type EventResultStream = Pin<Box<dyn Stream<Item = Result<ProcessEvent, Status>> + Send>>;
type ChunkStream = Pin<Box<dyn Stream<Item = Result<FileChunk, Status>> + Send>>;
type WatchResultStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

/// A base environment `Personalize` may set: names non-empty, without `=` or NUL, and no NUL
/// in the values.
pub(crate) fn check_env(env: &std::collections::HashMap<String, String>) -> Result<(), Status> {
    match env
        .iter()
        .find(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        Some((k, _)) => Err(Status::invalid_argument(format!(
            "invalid environment variable {k:?}"
        ))),
        None => Ok(()),
    }
}

fn uname_field(f: &std::ffi::CStr) -> String {
    f.to_string_lossy().into_owned()
}

#[tonic::async_trait]
impl Guest for GuestService {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoReply>, Status> {
        let uts = rustix::system::uname();
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        let (disk_total_bytes, disk_used_bytes) = rustix::fs::statvfs("/")
            .map(|v| {
                let total = v.f_blocks.saturating_mul(v.f_frsize);
                (
                    total,
                    total.saturating_sub(v.f_bfree.saturating_mul(v.f_frsize)),
                )
            })
            .unwrap_or_default();
        Ok(Response::new(InfoReply {
            version: PROTOCOL_VERSION.to_owned(),
            hostname: uname_field(uts.nodename()),
            pid: std::process::id(),
            started_unix_ms: self.started_unix_ms,
            kernel_release: uname_field(uts.release()),
            boot_id,
            disk_total_bytes,
            disk_used_bytes,
        }))
    }

    type ExecStream = EventResultStream;

    async fn exec(&self, req: Request<ExecRequest>) -> Result<Response<Self::ExecStream>, Status> {
        let proc = self.procs.spawn(req.into_inner())?;
        Ok(Response::new(Box::pin(
            events(proc, 0, true, true, true).map(Ok),
        )))
    }

    async fn start(&self, req: Request<ExecRequest>) -> Result<Response<StartReply>, Status> {
        let proc = self.procs.spawn(req.into_inner())?;
        Ok(Response::new(StartReply { pid: proc.pid }))
    }

    type AttachStream = EventResultStream;

    async fn attach(
        &self,
        req: Request<AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let r = req.into_inner();
        let stream = self.procs.attach(r.pid, r.offset, r.follow)?;
        Ok(Response::new(Box::pin(stream.map(Ok))))
    }

    async fn list_processes(
        &self,
        _: Request<ListProcessesRequest>,
    ) -> Result<Response<ListProcessesReply>, Status> {
        Ok(Response::new(ListProcessesReply {
            processes: self.procs.list(),
        }))
    }

    async fn signal(&self, req: Request<SignalRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        self.procs.signal(r.pid, r.signal, r.group)?;
        Ok(Response::new(Empty {}))
    }

    async fn write_stdin(&self, req: Request<StdinRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        self.procs.write_stdin(r.pid, &r.data).await?;
        Ok(Response::new(Empty {}))
    }

    async fn close_stdin(&self, req: Request<PidRequest>) -> Result<Response<Empty>, Status> {
        self.procs.close_stdin(req.into_inner().pid).await?;
        Ok(Response::new(Empty {}))
    }

    async fn resize(&self, req: Request<ResizeRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        self.procs.resize(r.pid, r.rows, r.cols)?;
        Ok(Response::new(Empty {}))
    }

    type ReadFileStream = ChunkStream;

    async fn read_file(
        &self,
        req: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let r = req.into_inner();
        let rx = files::read_file(&r.path, r.offset, r.length, CHUNK_BYTES).await?;
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|c| c.map(|data| FileChunk { data }).map_err(Status::from));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn write_file(
        &self,
        req: Request<Streaming<WriteFileRequest>>,
    ) -> Result<Response<EntryInfo>, Status> {
        let mut stream = req.into_inner();
        let open = match stream.message().await? {
            Some(WriteFileRequest {
                msg: Some(write_file_request::Msg::Open(open)),
            }) => open,
            _ => return Err(FilesError::Protocol("the first message must be `open`").into()),
        };
        let open = WriteFileOpen {
            user: self.cfg.base_env.user_or_default(&open.user),
            ..open
        };
        let (tx, task) = files::write_file(self.cfg.root.clone(), open).await?;
        let outcome: Result<(), Status> = async {
            loop {
                match stream.message().await? {
                    Some(WriteFileRequest {
                        msg: Some(write_file_request::Msg::Data(d)),
                    }) => {
                        if tx.send(WriteMsg::Data(d)).await.is_err() {
                            return Ok(()); // the writer failed; its error is reported below
                        }
                    }
                    Some(WriteFileRequest {
                        msg: Some(write_file_request::Msg::Open(_)),
                    }) => return Err(FilesError::Protocol("`open` sent twice").into()),
                    Some(WriteFileRequest { msg: None }) => {}
                    None => {
                        // hyper reports a client's RST_STREAM(CANCEL) as a clean end of the
                        // request body. Yield once first: hyper checks for a reset whenever
                        // this future is pending and drops it on one, so a cancelled upload
                        // never reaches Commit (dropping `tx` discards the temp file).
                        tokio::task::yield_now().await;
                        let _ = tx.send(WriteMsg::Commit).await;
                        return Ok(());
                    }
                }
            }
        }
        .await;
        drop(tx);
        let written = task.await.map_err(|e| Status::from(FilesError::Task(e)));
        outcome?;
        let mut e = written??;
        self.names().name(&mut e);
        Ok(Response::new(e))
    }

    async fn stat(&self, req: Request<PathRequest>) -> Result<Response<EntryInfo>, Status> {
        let mut e = files::stat(&req.into_inner().path).await?;
        self.names().name(&mut e);
        Ok(Response::new(e))
    }

    async fn list_dir(
        &self,
        req: Request<ListDirRequest>,
    ) -> Result<Response<ListDirReply>, Status> {
        let r = req.into_inner();
        let mut entries = files::list_dir(&r.path, r.depth).await?;
        let names = self.names();
        entries.iter_mut().for_each(|e| names.name(e));
        Ok(Response::new(ListDirReply { entries }))
    }

    async fn make_dir(&self, req: Request<MakeDirRequest>) -> Result<Response<EntryInfo>, Status> {
        let r = req.into_inner();
        let user = self.cfg.base_env.user_or_default(&r.user);
        let mut e =
            files::make_dir(self.cfg.root.clone(), &r.path, r.mode, r.parents, &user).await?;
        self.names().name(&mut e);
        Ok(Response::new(e))
    }

    async fn remove(&self, req: Request<RemoveRequest>) -> Result<Response<Empty>, Status> {
        let r = req.into_inner();
        files::remove(&r.path, r.recursive).await?;
        Ok(Response::new(Empty {}))
    }

    async fn rename(&self, req: Request<RenameRequest>) -> Result<Response<EntryInfo>, Status> {
        let r = req.into_inner();
        let mut e = files::rename(&r.from, &r.to, r.overwrite).await?;
        self.names().name(&mut e);
        Ok(Response::new(e))
    }

    type WatchStream = WatchResultStream;

    async fn watch(
        &self,
        req: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let r = req.into_inner();
        let rx = crate::watch::watch(&r.path, r.recursive).await?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok),
        )))
    }

    async fn sync(&self, _: Request<Empty>) -> Result<Response<Empty>, Status> {
        files::sync().await?;
        Ok(Response::new(Empty {}))
    }

    async fn personalize(
        &self,
        req: Request<PersonalizeRequest>,
    ) -> Result<Response<Empty>, Status> {
        let PersonalizeRequest {
            env,
            hostname,
            entropy,
            machine_id,
            unix_time_ns,
            mac,
        } = req.into_inner();
        check_env(&env)?;
        let identity = crate::guest_init::Identity {
            entropy,
            machine_id,
            unix_time_ns,
            mac,
        };
        if !identity.is_empty() && !self.cfg.vm_guest {
            return Err(Status::failed_precondition(
                "entropy, machine id and clock belong to a microvm guest's own kernel",
            ));
        }
        identity.check().map_err(Status::invalid_argument)?;
        // Only a microvm's daemon owns its hostname (the node sets a namespace sandbox's).
        if self.cfg.vm_guest && !hostname.is_empty() {
            crate::guest_init::set_hostname(&hostname).map_err(|e| {
                Status::invalid_argument(format!("cannot set the hostname {hostname:?}: {e}"))
            })?;
        }
        if !identity.is_empty() {
            identity
                .apply(std::path::Path::new("/"))
                .map_err(|e| Status::internal(format!("cannot take a fresh identity: {e}")))?;
        }
        if self.cfg.vm_guest {
            // A VM's daemon learns the node's resolver and CA here (a namespace sandbox's
            // daemon took them from its own environment at start).
            let (dns, ca) = (env.get("SPACE_DNS"), env.get("SPACE_CA_PEM"));
            if dns.is_some() || ca.is_some() {
                crate::netsetup::apply(
                    std::path::Path::new("/"),
                    dns.map(String::as_str),
                    ca.map(String::as_str),
                )
                .map_err(|e| Status::internal(format!("cannot write the network settings: {e}")))?;
            }
        }
        self.cfg
            .base_env
            .set(env.into_iter().map(|(k, v)| (k.into(), v.into())).collect());
        // What ran before the hand-out (the node's warm-up) is not the user's.
        self.procs.forget_exited();
        Ok(Response::new(Empty {}))
    }
}
