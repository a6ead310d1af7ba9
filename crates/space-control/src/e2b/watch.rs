//! envd's watches, over the daemon's inotify watch (`Engine::watch`): `WatchDir` (a stream,
//! which the async SDKs use) and the watcher triplet the sync SDKs poll (`CreateWatcher`,
//! `GetWatcherEvents`, `RemoveWatcher`).
//!
//! A watcher made by `CreateWatcher` is a task in spaced that keeps the daemon's stream and
//! buffers its events until they are fetched. Bounds: [`MAX_WATCHERS`] per sandbox,
//! [`MAX_BUFFERED`] events per watcher (the oldest go first), and a watcher nobody polled
//! for [`IDLE`] is removed. A watcher ends with its sandbox or its directory; the next poll
//! then says so.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::stream::{BoxStream, StreamExt};
use space_api::{WatchEvent, WatchKind};

use super::connect::{Code, ConnectError};
use super::envd::{EnvdCtx, stream_call, unary_call};
use super::files::resolve;
use super::pb::filesystem as pb;
use crate::AppState;

/// Watchers one sandbox may hold at once.
pub const MAX_WATCHERS: usize = 64;
/// Events a watcher keeps until they are fetched.
pub const MAX_BUFFERED: usize = 10_000;
/// How long a watcher lives without a poll.
pub const IDLE: Duration = Duration::from_secs(600);

/// A daemon event as envd's, or `None` for those envd has no word for.
fn fs_event(e: WatchEvent) -> Option<pb::FilesystemEvent> {
    let t = match e.kind {
        WatchKind::Create => pb::EventType::Create,
        WatchKind::Write => pb::EventType::Write,
        WatchKind::Remove => pb::EventType::Remove,
        WatchKind::Rename => pb::EventType::Rename,
        WatchKind::Chmod => pb::EventType::Chmod,
        WatchKind::Started | WatchKind::Overflow => return None,
    };
    Some(pb::FilesystemEvent {
        name: e.name,
        r#type: t as i32,
        entry: None,
    })
}

/// Opens the daemon's watch and waits until it has started: every change after this returns
/// is reported. With `include_entry` (envd 0.6.3), each event but a removal carries the entry
/// as it is when the event is passed on (none when it is already gone again).
async fn open(
    s: &AppState,
    ctx: &EnvdCtx,
    path: &str,
    recursive: bool,
    include_entry: bool,
) -> Result<BoxStream<'static, pb::FilesystemEvent>, ConnectError> {
    let path = resolve(path, ctx.user.as_deref())?;
    let mut events = s.engine.watch(&ctx.id, &path, recursive).await?;
    match events.next().await {
        Some(e) if e.kind == WatchKind::Started => {}
        _ => {
            return Err(ConnectError::new(
                Code::Unavailable,
                format!("the watch of {path} ended before it started"),
            ));
        }
    }
    if !include_entry {
        return Ok(events
            .filter_map(|e| std::future::ready(fs_event(e)))
            .boxed());
    }
    let (s, id) = (s.clone(), ctx.id.clone());
    Ok(events
        .filter_map(move |e| {
            let (s, id) = (s.clone(), id.clone());
            let full = format!("{}/{}", path.trim_end_matches('/'), e.name);
            let removed = e.kind == WatchKind::Remove;
            async move {
                let mut ev = fs_event(e)?;
                if !removed {
                    ev.entry = s
                        .engine
                        .stat(&id, &full)
                        .await
                        .ok()
                        .map(super::files::entry);
                }
                Some(ev)
            }
        })
        .boxed())
}

pub(crate) async fn watch_dir(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    stream_call(
        &headers,
        body,
        |req: pb::WatchDirRequest, limits| async move {
            let events = open(&s, &ctx, &req.path, req.recursive, req.include_entry).await?;
            let start = futures::stream::once(std::future::ready(Ok(response(
                pb::watch_dir_response::Event::Start(pb::watch_dir_response::StartEvent {}),
            ))));
            let changes =
                events.map(|f| Ok(response(pb::watch_dir_response::Event::Filesystem(f))));
            Ok(limits.with(
                start.chain(changes).boxed(),
                || {
                    response(pb::watch_dir_response::Event::Keepalive(
                        pb::watch_dir_response::KeepAlive {},
                    ))
                },
                "the call's Connect-Timeout-Ms passed",
            ))
        },
    )
    .await
}

fn response(e: pb::watch_dir_response::Event) -> pb::WatchDirResponse {
    pb::WatchDirResponse { event: Some(e) }
}

/// The watchers of every sandbox, by id.
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Watcher>>,
}

struct Watcher {
    sandbox: String,
    buf: Arc<Mutex<Buffer>>,
    task: tokio::task::AbortHandle,
    last_poll: Instant,
}

#[derive(Default)]
struct Buffer {
    events: VecDeque<pb::FilesystemEvent>,
    /// Set when the daemon's stream ended.
    ended: bool,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watcher>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops watchers nobody polled for [`IDLE`]; refuses a sandbox's watcher past
    /// [`MAX_WATCHERS`].
    fn admit(&self, sandbox: &str) -> Result<(), ConnectError> {
        let mut map = self.lock();
        map.retain(|_, w| w.last_poll.elapsed() < IDLE);
        if map.values().filter(|w| w.sandbox == sandbox).count() >= MAX_WATCHERS {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("sandbox {sandbox} has {MAX_WATCHERS} watchers: remove one first"),
            ));
        }
        Ok(())
    }

    fn insert(&self, sandbox: &str, events: BoxStream<'static, pb::FilesystemEvent>) -> String {
        let buf = Arc::new(Mutex::new(Buffer::default()));
        let task = tokio::spawn({
            let buf = buf.clone();
            let mut events = events;
            async move {
                while let Some(e) = events.next().await {
                    let mut b = buf.lock().unwrap_or_else(|e| e.into_inner());
                    if b.events.len() >= MAX_BUFFERED {
                        b.events.pop_front();
                    }
                    b.events.push_back(e);
                }
                buf.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
            }
        })
        .abort_handle();
        let id = crate::auth::to_hex(&rand::random::<[u8; 12]>());
        self.lock().insert(
            id.clone(),
            Watcher {
                sandbox: sandbox.to_string(),
                buf,
                task,
                last_poll: Instant::now(),
            },
        );
        id
    }

    /// The events buffered since the last poll. A watcher of another sandbox is unknown here.
    fn poll(&self, sandbox: &str, id: &str) -> Result<Vec<pb::FilesystemEvent>, ConnectError> {
        let mut map = self.lock();
        let unknown = || ConnectError::new(Code::NotFound, format!("watcher {id:?} not found"));
        let w = map
            .get_mut(id)
            .filter(|w| w.sandbox == sandbox)
            .ok_or_else(unknown)?;
        w.last_poll = Instant::now();
        let (events, ended) = {
            let mut b = w.buf.lock().unwrap_or_else(|e| e.into_inner());
            (b.events.drain(..).collect::<Vec<_>>(), b.ended)
        };
        if ended && events.is_empty() {
            map.remove(id);
            return Err(ConnectError::new(
                Code::NotFound,
                format!("watcher {id:?} ended: its directory or its sandbox went away"),
            ));
        }
        Ok(events)
    }

    fn remove(&self, sandbox: &str, id: &str) -> Result<(), ConnectError> {
        let mut map = self.lock();
        if map.get(id).is_none_or(|w| w.sandbox != sandbox) {
            return Err(ConnectError::new(
                Code::NotFound,
                format!("watcher {id:?} not found"),
            ));
        }
        map.remove(id);
        Ok(())
    }
}

pub(crate) async fn create_watcher(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    Extension(watchers): Extension<Arc<Watchers>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::CreateWatcherRequest| async move {
        watchers.admit(&ctx.id)?;
        let events = open(&s, &ctx, &req.path, req.recursive, req.include_entry).await?;
        Ok(pb::CreateWatcherResponse {
            watcher_id: watchers.insert(&ctx.id, events),
        })
    })
    .await
}

pub(crate) async fn get_watcher_events(
    Extension(ctx): Extension<EnvdCtx>,
    Extension(watchers): Extension<Arc<Watchers>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(
        &headers,
        body,
        |req: pb::GetWatcherEventsRequest| async move {
            let events = watchers.poll(&ctx.id, &req.watcher_id)?;
            Ok(pb::GetWatcherEventsResponse { events })
        },
    )
    .await
}

pub(crate) async fn remove_watcher(
    Extension(ctx): Extension<EnvdCtx>,
    Extension(watchers): Extension<Arc<Watchers>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::RemoveWatcherRequest| async move {
        watchers.remove(&ctx.id, &req.watcher_id)?;
        Ok(pb::RemoveWatcherResponse {})
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: WatchKind, name: &str) -> WatchEvent {
        WatchEvent {
            kind,
            name: name.into(),
            is_dir: false,
        }
    }

    #[tokio::test]
    async fn watchers_buffer_until_polled_and_belong_to_their_sandbox() {
        let w = Watchers::default();
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let id = w.insert(
            "a",
            rx.filter_map(|e| std::future::ready(fs_event(e))).boxed(),
        );
        tx.unbounded_send(ev(WatchKind::Create, "x")).unwrap();
        tx.unbounded_send(ev(WatchKind::Overflow, "")).unwrap();
        tx.unbounded_send(ev(WatchKind::Remove, "x")).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(w.poll("b", &id).unwrap_err().code, Code::NotFound);
        let got: Vec<(String, i32)> = w
            .poll("a", &id)
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.r#type))
            .collect();
        assert_eq!(
            got,
            [
                ("x".to_string(), pb::EventType::Create as i32),
                ("x".to_string(), pb::EventType::Remove as i32)
            ]
        );
        assert!(w.poll("a", &id).unwrap().is_empty());
        // The daemon's stream ends: the next poll says so, and the watcher is gone.
        drop(tx);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(w.poll("a", &id).unwrap_err().code, Code::NotFound);
        assert_eq!(w.remove("a", &id).unwrap_err().code, Code::NotFound);
    }

    #[tokio::test]
    async fn a_sandbox_holds_a_bounded_number_of_watchers() {
        let w = Watchers::default();
        for _ in 0..MAX_WATCHERS {
            w.admit("a").unwrap();
            w.insert("a", futures::stream::pending().boxed());
        }
        assert_eq!(w.admit("a").unwrap_err().code, Code::ResourceExhausted);
        w.admit("b").unwrap();
        let id = w.lock().keys().next().unwrap().clone();
        w.remove("a", &id).unwrap();
        w.admit("a").unwrap();
    }
}
