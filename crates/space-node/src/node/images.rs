//! OCI images as templates, on the node (decision 0017): a registry pull, or an OCI layout /
//! `docker save` archive on the node's filesystem, applied into the layer cache and made a
//! template as an O(1) snapshot of its top layer.

use std::sync::Arc;
use std::time::Instant;

use super::{Node, blocking};
use crate::api::{
    NodeError, PullSpec, TemplateEvent, TemplateInfo, TemplateProgress, TemplateSource,
};
use crate::oci::archive::{self, LocalImage};
use crate::oci::{self, LayerCache, Resolved, human_bytes, layer_done, registry, say, short};

impl Node {
    /// A new version of `name` from `source` (the caller retires the old version's pool).
    pub(super) async fn import_impl(
        &self,
        name: &str,
        source: TemplateSource,
        progress: &TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        let path = match &source {
            TemplateSource::Dir(p) | TemplateSource::Tar(p) => p.clone(),
            TemplateSource::Snapshot {
                sandbox,
                snapshot,
                defaults,
            } => {
                return self
                    .template_from_snapshot(name, sandbox, snapshot, defaults.clone())
                    .await;
            }
            TemplateSource::Registry(spec) => return self.pull_image(name, spec, progress).await,
            TemplateSource::Derived { from, defaults } => {
                let Some(base) = self.templates.latest(from) else {
                    return Err(NodeError::NotFound {
                        kind: "template",
                        id: from.clone(),
                    });
                };
                let (store, name, defaults) =
                    (self.templates.clone(), name.to_string(), defaults.clone());
                let desc = format!("derived:{}@{}", base.name, base.version);
                return blocking(move || {
                    Ok(store.from_subvolume(&name, &base.path, &desc, defaults)?)
                })
                .await;
            }
        };
        if !path.exists() {
            return Err(NodeError::InvalidArgument(format!(
                "template source {} does not exist",
                path.display()
            )));
        }
        match self.local_image(&source).await? {
            Some(image) => self.import_local_image(name, image, progress).await,
            None => {
                let (store, name) = (self.templates.clone(), name.to_string());
                blocking(move || Ok(store.import(&name, &source)?)).await
            }
        }
    }

    /// [`crate::api::NodeApi::remove_template`].
    pub(super) async fn remove_template_impl(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<Vec<u32>, NodeError> {
        crate::ids::validate_template_name(name)?;
        let all: Vec<u32> = self
            .templates
            .versions(name)
            .iter()
            .map(|t| t.version)
            .collect();
        let Some(&latest) = all.last() else {
            return Err(NodeError::NotFound {
                kind: "template",
                id: name.to_string(),
            });
        };
        let doomed: Vec<u32> = match version {
            None => all.clone(),
            Some(v) if all.contains(&v) => vec![v],
            Some(v) => {
                return Err(NodeError::NotFound {
                    kind: "template version",
                    id: format!("{name}@{v}"),
                });
            }
        };
        let users: Vec<String> = {
            let table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            let mut u: Vec<String> = table
                .values()
                .filter(|e| {
                    !e.record.pool_member
                        && e.record.spec.template == name
                        && doomed.contains(&e.record.template_version)
                })
                .map(|e| e.record.spec.id.clone())
                .collect();
            u.sort();
            u
        };
        if !users.is_empty() {
            let shown: Vec<&str> = users.iter().take(5).map(String::as_str).collect();
            return Err(NodeError::Conflict(format!(
                "template {name} is used by {} sandbox{} ({}{}): remove them first",
                users.len(),
                if users.len() == 1 { "" } else { "es" },
                shown.join(", "),
                if users.len() > 5 { ", ..." } else { "" }
            )));
        }
        if doomed.contains(&latest)
            && let Some(p) = self.pools.view(name)
            && p.min > 0
        {
            return Err(NodeError::Conflict(format!(
                "template {name} has a warm pool (min {}): `space pool set {name} --min 0` first",
                p.min
            )));
        }
        // Ready members of a version that goes are retired first.
        let keep = all
            .iter()
            .rev()
            .find(|v| !doomed.contains(v))
            .copied()
            .unwrap_or(u32::MAX);
        let old = self.pools.retire_other_versions(name, keep);
        self.retire_all(old).await;
        let (store, n, d) = (self.templates.clone(), name.to_string(), doomed.clone());
        blocking(move || Ok(store.remove(&n, &d)?)).await?;
        tracing::info!(name, versions = ?doomed, "removed template versions");
        Ok(doomed)
    }

    /// Pulls `spec` from its registry into a new version of `name`.
    pub(super) async fn pull_image(
        &self,
        name: &str,
        spec: &PullSpec,
        progress: &TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        let t0 = Instant::now();
        let pull = registry::resolve(spec).await?;
        announce(progress, &pull.resolved);
        let resolved_source = pull.resolved.source.clone();
        let (config, layers) = (pull.resolved.config.clone(), pull.resolved.layers.clone());
        pull.apply(self.layers.clone(), &self.layout.oci_tmp(), progress)
            .await?;
        let resolved = Resolved {
            config,
            layers,
            source: resolved_source,
        };
        let info = self.template_of_image(name, resolved).await?;
        tracing::info!(name, version = info.version, reference = %spec.reference,
            ms = t0.elapsed().as_millis() as u64, "pulled an image");
        Ok(info)
    }

    /// The image a directory or tar source holds, if it holds one (else it is a rootfs).
    pub(super) async fn local_image(
        &self,
        source: &TemplateSource,
    ) -> Result<Option<LocalImage>, NodeError> {
        let source = source.clone();
        blocking(move || {
            Ok(match &source {
                TemplateSource::Dir(p) if archive::detect_dir(p).is_some() => {
                    Some(LocalImage::open_dir(p)?)
                }
                TemplateSource::Tar(p) if archive::tar_is_image(p)? => {
                    Some(LocalImage::open_tar(p)?)
                }
                _ => None,
            })
        })
        .await
    }

    /// Applies a local image's layers (those not in the cache) and makes it a template.
    pub(super) async fn import_local_image(
        &self,
        name: &str,
        image: LocalImage,
        progress: &TemplateProgress,
    ) -> Result<TemplateInfo, NodeError> {
        announce(progress, &image.resolved);
        let (cache, progress2) = (self.layers.clone(), progress.clone());
        let image = blocking(move || {
            apply_local(&cache, &image, &progress2)?;
            Ok(image)
        })
        .await?;
        tracing::info!(name, path = %image.path().display(), "imported an image");
        self.template_of_image(name, image.resolved).await
    }

    /// A new version of `name` from an applied image: a snapshot of its top layer (an empty
    /// tree for an image of no layers), with the image config's defaults.
    async fn template_of_image(
        &self,
        name: &str,
        resolved: Resolved,
    ) -> Result<TemplateInfo, NodeError> {
        let defaults = oci::defaults_from_config(&resolved.config);
        let top = oci::top_rootfs(&self.layers, &resolved);
        let (store, name) = (self.templates.clone(), name.to_string());
        blocking(move || {
            Ok(match top {
                Some(top) => store.from_subvolume(&name, &top, &resolved.source, defaults)?,
                None => store.empty_version(&name, &resolved.source, defaults)?,
            })
        })
        .await
    }
}

fn announce(progress: &TemplateProgress, r: &Resolved) {
    let total: u64 = r.layers.iter().map(|l| l.size).sum();
    let size = if total > 0 {
        format!(", {}", human_bytes(total))
    } else {
        String::new()
    };
    say(
        progress,
        TemplateEvent::Note(format!(
            "{}: {} layer{}{size}",
            r.source,
            r.layers.len(),
            if r.layers.len() == 1 { "" } else { "s" }
        )),
    );
}

fn apply_local(
    cache: &Arc<LayerCache>,
    image: &LocalImage,
    progress: &TemplateProgress,
) -> Result<(), NodeError> {
    let chains = image.resolved.chain_ids();
    let n = chains.len();
    for (i, chain) in chains.iter().enumerate() {
        let layer = &image.resolved.layers[i];
        let shown = if layer.digest.is_empty() {
            short(&layer.diff_id)
        } else {
            short(&layer.digest)
        };
        if cache.has(chain) {
            layer_done(
                progress,
                i,
                n,
                &[],
                format!("layer {shown} already on the node"),
            );
            continue;
        }
        let t0 = Instant::now();
        let parent = (i > 0).then(|| chains[i - 1].as_str());
        let stats = cache.add(parent, chain, &layer.diff_id, image.open_layer(i)?)?;
        layer_done(
            progress,
            i,
            n,
            &stats.notes,
            format!(
                "layer {shown}: {} files, {} unpacked in {:.1} s",
                stats.entries,
                human_bytes(stats.bytes),
                t0.elapsed().as_secs_f64()
            ),
        );
    }
    Ok(())
}
