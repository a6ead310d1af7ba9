//! space-control: the control plane. An axum REST API ([`app`]), the desired-state store
//! (sqlx; SQLite embedded by default, PostgreSQL-compatible SQL), API-key auth, and a
//! level-triggered reconciler that drives a [`NodeApi`] until observed == desired.
//!
//! Layers: `http` (parse, respond) -> `engine` (one method per action, lifecycle checks) ->
//! `NodeApi` / guest gRPC. The reconciler heals whatever the fast path left behind.

pub mod auth;
pub mod build;
pub mod checkpoints;
pub mod cluster;
pub mod cluster_nodes;
pub mod convert;
pub mod diff;
pub mod dockerfile;
pub mod e2b;
pub mod engine;
pub mod error;
pub mod events;
pub mod http;
pub mod idempotency;
pub mod leases;
pub mod lifecycle;
pub mod metrics;
pub mod migrations;
pub mod moves;
pub mod net;
pub mod nodes;
pub mod pools;
pub mod port_proxy;
pub mod reconcile;
pub mod recovery;
pub mod replicas;
pub mod scheduler;
pub mod secrets;
pub mod shared_files;
pub mod snapshot_policy;
pub mod snapshots;
pub mod store;
pub mod template_settings;
pub mod templates;
pub mod tenants;
pub mod tls;
pub mod usage;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use space_node_api::NodeApi;

pub use auth::Auth;
pub use engine::{ControlConfig, Engine};
pub use error::{ControlError, ControlResult, ErrorKind};
pub use http::{ROUTES, app};
pub use store::Store;

/// What every handler gets: the engine (store + node) and the key cache.
#[derive(Clone)]
pub struct AppState {
    pub engine: Arc<Engine>,
    pub auth: Arc<Auth>,
    /// Per-key request rates (see `tenants`).
    pub limiter: Arc<tenants::RateLimiter>,
}

impl AppState {
    pub fn new(engine: Arc<Engine>, auth: Arc<Auth>) -> Self {
        Self {
            engine,
            auth,
            limiter: Default::default(),
        }
    }

    pub fn node(&self) -> &Arc<dyn NodeApi> {
        &self.engine.node
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("failed to create data directory {path}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    #[error(transparent)]
    KeyFile(#[from] secrets::KeyFileError),
    #[error("server failed")]
    Serve(#[source] std::io::Error),
    #[error(
        "{path} does not open the secrets in the database: every control-plane replica needs \
         the same secrets.key (copy it from the first replica's data dir; decisions 0036 and \
         0054)"
    )]
    SecretsKey { path: PathBuf },
    #[error(transparent)]
    SharedFiles(#[from] shared_files::SharedFileError),
    #[error("failed to open the cluster CA: {0}")]
    Cluster(String),
}

/// An opened control plane: state for [`app`] plus where the admin key is.
pub struct ControlPlane {
    pub state: AppState,
    pub admin_key_path: PathBuf,
}

impl ControlPlane {
    /// Where the node's egress proxy gets secret values (decrypted from the store when a
    /// request needs one). spaced hands it to `Node::set_secret_source` after `open`.
    pub fn secret_source(&self) -> Arc<dyn space_node_api::net::SecretSource> {
        self.state.engine.secret_source()
    }

    /// Opens the store (`database_url`, or SQLite at `data_dir/space.db`), makes sure an admin
    /// key exists, and builds the engine over `node`.
    pub async fn open(
        cfg: ControlConfig,
        database_url: Option<&str>,
        node: Arc<dyn NodeApi>,
    ) -> Result<Self, OpenError> {
        Self::open_with(cfg, database_url, Some(node), None).await
    }

    /// [`Self::open`] for a control plane that leads a cluster: its engine drives the nodes
    /// that joined it ([`cluster_nodes::ClusterNodes`]), with the cluster CA in
    /// `data_dir/cluster-ca` (shared with the other replicas through the store). `listen` is
    /// the cluster listener's address as join commands show it.
    pub async fn open_cluster(
        cfg: ControlConfig,
        database_url: Option<&str>,
        listen: String,
    ) -> Result<Self, OpenError> {
        Self::open_with(cfg, database_url, None, Some(listen)).await
    }

    /// The cluster this control plane leads, if it leads one.
    pub fn cluster(&self) -> Option<Arc<cluster::Cluster>> {
        self.state.engine.cluster.clone()
    }

    async fn open_with(
        cfg: ControlConfig,
        database_url: Option<&str>,
        node: Option<Arc<dyn NodeApi>>,
        cluster_listen: Option<String>,
    ) -> Result<Self, OpenError> {
        // 0711, as the node keeps it: other host users can neither list nor read it.
        dir_with_mode(&cfg.data_dir, 0o711).map_err(|source| OpenError::DataDir {
            path: cfg.data_dir.clone(),
            source,
        })?;
        let store = match database_url {
            Some(url) => Store::open(url).await?,
            None => Store::open_sqlite(&cfg.data_dir.join("space.db")).await?,
        };
        // The files replicas share are taken from the store before anything reads them, and
        // what this start made is put there, one replica's start at a time (decision 0054).
        let cipher = secrets::SecretCipher::new(&secrets::load_or_create_key(
            &cfg.data_dir.join(secrets::SECRETS_KEY_FILE),
        )?);
        // (SQLite is one spaced's own store: no other start to wait for, and a start killed
        // half-way must not hold up the next one for a lease's lifetime.)
        let start = if store.is_sqlite() {
            None
        } else {
            let holder = format!("start-{:016x}", rand::random::<u64>());
            Some(shared_files::StartLease::take(&store, &holder).await?)
        };
        let opened = Self::open_shared(cfg, store, &cipher, node, cluster_listen).await;
        if let Some(start) = start
            && let Err(e) = start.release().await
        {
            tracing::warn!(error = %e, "releasing the start lease failed; it lapses");
        }
        opened
    }

    async fn open_shared(
        cfg: ControlConfig,
        store: Store,
        cipher: &secrets::SecretCipher,
        node: Option<Arc<dyn NodeApi>>,
        cluster_listen: Option<String>,
    ) -> Result<Self, OpenError> {
        let pulled = shared_files::pull(&store, cipher, &cfg.data_dir).await?;
        if !pulled.is_empty() {
            tracing::info!(files = ?pulled, "took the files replicas share from the store");
        }
        let admin_key_path = auth::ensure_admin_key(&store, &cfg.data_dir).await?;
        // A revoked admin key on disk was replaced just now: the store keeps the new one.
        if shared_files::refresh(&store, cipher, &cfg.data_dir, auth::ADMIN_KEY_FILE).await? {
            tracing::info!("the admin key on disk is now the one the replicas share");
        }
        let auth = Arc::new(Auth::load(&store).await?);
        auth::spawn_reload(&auth, store.clone());
        if let Some(keep) = cfg.events_retention {
            events::spawn_retention(store.clone(), keep);
        }
        let cluster = match cluster_listen {
            Some(listen) => Some(Arc::new(
                cluster::Cluster::open(&cfg.data_dir.join(cluster::CA_DIR), listen)
                    .map_err(OpenError::Cluster)?,
            )),
            None => None,
        };
        let nodes = cluster.as_ref().map(|c| {
            Arc::new(cluster_nodes::ClusterNodes::new(
                store.clone(),
                c.tls.clone(),
                cfg.node_lost_after,
            ))
        });
        let node = match (&nodes, node) {
            (Some(n), _) => n.clone() as Arc<dyn NodeApi>,
            (None, Some(n)) => n,
            (None, None) => unreachable!("a control plane drives a node or a cluster"),
        };
        let secrets_key = cfg.data_dir.join(secrets::SECRETS_KEY_FILE);
        let data_dir = cfg.data_dir.clone();
        let mut engine = Engine::new(store.clone(), node, cfg)?;
        if !engine.vault.key_opens_stored().await? {
            return Err(OpenError::SecretsKey { path: secrets_key });
        }
        let pushed = shared_files::push(&store, cipher, &data_dir).await?;
        if !pushed.is_empty() {
            tracing::info!(files = ?pushed, "put the files replicas share into the store");
        }
        engine.cluster = cluster;
        engine.cluster_nodes = nodes;
        let engine = Arc::new(engine);
        Ok(Self {
            state: AppState::new(engine, auth),
            admin_key_path,
        })
    }
}

/// Serves [`app`] on `listener` with the reconciler running, until `shutdown` resolves.
/// Then it stops accepting, waits up to `shutdown_timeout` for open requests (exec streams)
/// and returns. Sandboxes are never stopped by a shutdown.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OpenError> {
    serve_with_tls(listener, None, state, shutdown).await
}

/// [`serve`], and the same API on `tls` too (spaced's HTTPS listener, decision 0030).
pub async fn serve_with_tls(
    listener: tokio::net::TcpListener,
    tls: Option<tls::TlsListener>,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OpenError> {
    let engine = state.engine.clone();
    let timeout = engine.config().shutdown_timeout;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Warm pools come back in the reconciler's first pass (and after each restart of the
    // node): the API answers meanwhile (a PUT of a pool waits until the restore is done).
    let reconciler = {
        let mut rx = stop_rx.clone();
        reconcile::spawn_reconciler(engine, async move {
            let _ = rx.wait_for(|s| *s).await;
        })
    };
    let server_shutdown = || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutting down (sandboxes keep running)");
        let _ = stop_tx.send(true);
    });
    // TCP_NODELAY: responses (ndjson exec events above all) are many small writes; with Nagle
    // on, each one after the first waits for the client's delayed ACK (~40 ms). The TLS
    // listener sets it itself.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    // One router for every connection. `axum::serve` given a `Router` calls `with_state(())`
    // on it for each connection it accepts, which deep-copies every route and its layers
    // (each holding an `AppState`) and drops them all when the connection closes: with ~150
    // routes that was most of what a short connection cost (a reconnect, a CLI command;
    // decision 0051). `app` has its state already, so a connection only clones an `Arc`.
    let app = app(state).into_make_service();
    let plain = axum::serve(listener, app.clone())
        .with_graceful_shutdown(server_shutdown())
        .into_future();
    let secure = {
        let stopped = server_shutdown();
        async move {
            match tls {
                Some(tls) => axum::serve(tls, app).with_graceful_shutdown(stopped).await,
                None => Ok(()),
            }
        }
    };
    let server = async { tokio::try_join!(plain, secure).map(|_| ()) };
    let mut stopped = stop_rx;
    let grace = async move {
        let _ = stopped.wait_for(|s| *s).await;
        tokio::time::sleep(timeout).await;
    };
    let result = tokio::select! {
        r = server => r.map_err(OpenError::Serve),
        _ = grace => {
            tracing::warn!(?timeout, "open requests did not finish in time; closing them");
            Ok(())
        }
    };
    // A reconcile pass stuck on the node must not hold the process: give it the same grace.
    let abort = reconciler.abort_handle();
    if tokio::time::timeout(timeout, reconciler).await.is_err() {
        tracing::warn!("the reconciler did not stop in time; abandoning it");
        abort.abort();
    }
    result
}

/// Creates `path` and its parents, and gives `path` itself `mode` even when it existed.
pub(crate) fn dir_with_mode(path: &std::path::Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Formats an error with its whole source chain ("a: b: c").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        s.push_str(": ");
        s.push_str(&src.to_string());
        cur = src.source();
    }
    s
}

#[cfg(test)]
mod tests;
