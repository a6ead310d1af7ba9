//! Pulls an image from a registry over the OCI distribution API with `oci-client`:
//! anonymous, bearer-token (the `WWW-Authenticate: Bearer realm=...` flow) and basic auth;
//! image indexes resolved to linux/amd64; every blob verified against its digest as it is
//! downloaded. Layers whose chain is already on the node are never fetched; the others are
//! fetched in parallel (at most [`PARALLEL_FETCHES`] at a time) while earlier ones unpack.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oci_client::client::{ClientConfig, ClientProtocol, linux_amd64_resolver};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use super::{
    Layer, LayerCache, Progress, Resolved, check_digest, check_layer_media_type, human_bytes,
    layer_done, parse_config, short,
};
use crate::api::PullSpec;
use crate::template::TemplateError;

/// Layers downloaded at once.
const PARALLEL_FETCHES: usize = 3;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// A registry that sends nothing for this long is given up on.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

fn client(spec: &PullSpec, reference: &Reference) -> Client {
    // reqwest's rustls comes without a crypto provider: ring is space's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let protocol = if spec.insecure {
        ClientProtocol::HttpsExcept(vec![reference.resolve_registry().to_string()])
    } else {
        ClientProtocol::Https
    };
    Client::new(ClientConfig {
        protocol,
        platform_resolver: Some(Box::new(linux_amd64_resolver)),
        connect_timeout: Some(CONNECT_TIMEOUT),
        read_timeout: Some(READ_TIMEOUT),
        ..ClientConfig::default()
    })
}

fn auth(spec: &PullSpec) -> RegistryAuth {
    match (&spec.username, &spec.password) {
        (Some(u), Some(p)) => RegistryAuth::Basic(u.clone(), p.clone()),
        (Some(u), None) => RegistryAuth::Basic(u.clone(), String::new()),
        _ => RegistryAuth::Anonymous,
    }
}

fn codes(env: &oci_client::errors::OciEnvelope) -> Vec<&OciErrorCode> {
    env.errors.iter().map(|e| &e.code).collect()
}

/// A registry's error in the words a user needs.
fn registry_error(reference: &str, e: OciDistributionError) -> TemplateError {
    use OciDistributionError as E;
    match e {
        E::AuthenticationFailure(reason) => TemplateError::Registry(format!(
            "the registry refused the credentials for {reference}: {}",
            reason.trim()
        )),
        E::UnauthorizedError { .. } => TemplateError::Registry(format!(
            "the registry refused access to {reference} (wrong or missing credentials: \
             --username and --password-stdin)"
        )),
        E::ImageManifestNotFoundError(_) => TemplateError::ImageNotFound(reference.to_string()),
        E::RegistryError { envelope, .. }
            if codes(&envelope).iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::NotFound
                )
            }) =>
        {
            TemplateError::ImageNotFound(reference.to_string())
        }
        E::RegistryError { envelope, .. }
            if codes(&envelope)
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied)) =>
        {
            TemplateError::Registry(format!(
                "the registry refused access to {reference} (wrong or missing credentials: \
                 --username and --password-stdin)"
            ))
        }
        E::ServerError { code: 404, .. } => TemplateError::ImageNotFound(reference.to_string()),
        E::ServerError {
            code: 401 | 403, ..
        } => TemplateError::Registry(format!("the registry refused access to {reference}")),
        E::DigestError(d) => TemplateError::Image(format!(
            "a blob of {reference} does not match its digest (truncated or corrupted): {d}"
        )),
        E::RequestError(r) => {
            let mut msg = format!("cannot reach the registry for {reference}: {r}");
            let mut src: Option<&dyn std::error::Error> = std::error::Error::source(&r);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            TemplateError::Registry(msg)
        }
        e => TemplateError::Registry(format!("pulling {reference} failed: {e}")),
    }
}

/// A pull in progress: the resolved image and the client that fetches its blobs.
pub struct Pull {
    client: Client,
    reference: Reference,
    pub resolved: Resolved,
    descriptors: Vec<OciDescriptor>,
}

/// Resolves `spec.reference` to a linux/amd64 manifest and its config.
pub async fn resolve(spec: &PullSpec) -> Result<Pull, TemplateError> {
    let reference: Reference = spec.reference.parse().map_err(|e| {
        TemplateError::Source(format!(
            "{:?} is not an image reference (NAME[:TAG][@sha256:DIGEST]): {e}",
            spec.reference
        ))
    })?;
    let shown = reference.whole();
    let client = client(spec, &reference);
    let (manifest, digest, config) = client
        .pull_manifest_and_config(&reference, &auth(spec))
        .await
        .map_err(|e| registry_error(&shown, e))?;
    if let Some(want) = reference.digest()
        && want != digest
    {
        return Err(TemplateError::Image(format!(
            "the registry sent manifest {digest} for {shown}"
        )));
    }
    let config = parse_config(config.as_bytes(), manifest.layers.len())?;
    let mut layers = Vec::new();
    for (l, diff_id) in manifest.layers.iter().zip(config.rootfs().diff_ids()) {
        check_layer_media_type(&l.media_type)?;
        check_digest(&l.digest)?;
        layers.push(Layer {
            digest: l.digest.clone(),
            diff_id: diff_id.clone(),
            size: l.size.max(0) as u64,
        });
    }
    Ok(Pull {
        client,
        resolved: Resolved {
            config,
            layers,
            source: format!("oci:{shown}@{digest}"),
        },
        reference,
        descriptors: manifest.layers,
    })
}

/// Removes a file when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Pull {
    /// Fetches every layer not already in `cache` and applies it there, in order.
    pub async fn apply(
        self,
        cache: Arc<LayerCache>,
        tmp: &Path,
        progress: &Progress,
    ) -> Result<(), TemplateError> {
        tokio::fs::create_dir_all(tmp)
            .await
            .map_err(|e| TemplateError::Image(format!("create {}: {e}", tmp.display())))?;
        let chains = self.resolved.chain_ids();
        let n = chains.len();
        let gate = Arc::new(tokio::sync::Semaphore::new(PARALLEL_FETCHES));
        let shown = self.reference.whole();
        let mut fetches = Vec::with_capacity(n);
        for (i, chain) in chains.iter().enumerate() {
            if cache.has(chain) {
                fetches.push(None);
                continue;
            }
            let (client, reference, desc) = (
                self.client.clone(),
                self.reference.clone(),
                self.descriptors[i].clone(),
            );
            let path = tmp.join(format!("{}.blob", uuidish(&desc.digest)));
            let (gate, shown) = (gate.clone(), shown.clone());
            fetches.push(Some(tokio::spawn(async move {
                let _permit = gate.acquire_owned().await;
                let file = TempFile(path);
                let out = tokio::fs::File::create(&file.0).await.map_err(|e| {
                    TemplateError::Image(format!("create {}: {e}", file.0.display()))
                })?;
                let t0 = Instant::now();
                client
                    .pull_blob(&reference, &desc, out)
                    .await
                    .map_err(|e| registry_error(&shown, e))?;
                Ok::<_, TemplateError>((file, t0.elapsed()))
            })));
        }
        let mut result = Ok(());
        for (i, fetch) in fetches.iter_mut().enumerate() {
            let layer = &self.resolved.layers[i];
            let Some(handle) = fetch.take() else {
                let text = format!("layer {} already on the node", short(&layer.digest));
                layer_done(progress, i, n, &[], text);
                continue;
            };
            let (file, took) = match handle.await {
                Ok(Ok(f)) => f,
                Ok(Err(e)) => {
                    result = Err(e);
                    break;
                }
                Err(e) => {
                    result = Err(TemplateError::Image(format!("a layer fetch failed: {e}")));
                    break;
                }
            };
            let t0 = Instant::now();
            let (cache, parent, chain, diff_id) = (
                cache.clone(),
                (i > 0).then(|| chains[i - 1].clone()),
                chains[i].clone(),
                layer.diff_id.clone(),
            );
            let applied = tokio::task::spawn_blocking(move || {
                let f = std::fs::File::open(&file.0)
                    .map_err(|e| TemplateError::Image(format!("open {}: {e}", file.0.display())))?;
                cache.add(parent.as_deref(), &chain, &diff_id, f)
            })
            .await
            .map_err(|e| TemplateError::Image(format!("unpacking a layer failed: {e}")))
            .and_then(|r| r);
            match applied {
                Ok(stats) => {
                    let text = format!(
                        "layer {} {}: fetched in {:.1} s, {} files unpacked in {:.1} s",
                        short(&layer.digest),
                        human_bytes(layer.size),
                        took.as_secs_f64(),
                        stats.entries,
                        t0.elapsed().as_secs_f64()
                    );
                    layer_done(progress, i, n, &stats.notes, text);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Fetches still running when one failed are stopped (their files go with them).
        for handle in fetches.into_iter().flatten() {
            handle.abort();
        }
        result
    }
}

/// A file name for a blob being fetched: its digest's hex and a random suffix (two pulls
/// of one layer never share a file).
fn uuidish(digest: &str) -> String {
    format!("{}-{:08x}", short(digest), rand::random::<u32>())
}
