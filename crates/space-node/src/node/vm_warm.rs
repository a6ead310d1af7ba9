//! A template's warm state for the microvm runtime (issue 6, decision 0014): a booted VM's
//! memory checkpoint, so that creating a microvm sandbox restores instead of booting.
//!
//! `templates/<name>/<version>/vm-<key>/` holds `state`, `state.sha256`, `mem` (the runtime's
//! checkpoint files) and `disk.ext4`, the disk the checkpointed guest had mounted. The key
//! (`Runtime::checkpoint_key`) names what a restore must match: accelerator, RAM, vCPUs and
//! the kernel + initramfs image. It is made by one background task per node, on the first
//! create that finds none: a builder VM with no user data boots from the template's disk
//! and, once its daemon serves the channel, is checkpointed and goes; the directory is built
//! aside and renamed into place, so it exists whole or not at all. A checkpoint a restore
//! refuses (e.g. corrupted) is removed and made again; the create that found it boots
//! instead.
//!
//! A template with a start or ready command (decision 0019) is checkpointed once it is
//! ready: the node connects to the builder, runs the start command, waits for the ready
//! command, leaves, and only then checkpoints. A restored VM then already runs what the
//! template starts (a server answers at once), and the launch only confirms the ready
//! command. Such a checkpoint's directory name carries a hash of the two commands
//! (`vm-<key>-s<hash>`), so that one made before the start command ran (by an earlier
//! spaced, as `vm-<key>`) is never taken for it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use rand::Rng;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::start::StartSettings;
use super::{Node, NodeError, SANDBOX_DISK, blocking, template_disk, template_env};
use crate::api::{Limits, TemplateInfo};
use crate::ids::hex;
use crate::runtime::{LaunchPlan, Runtime};
use crate::storage;

/// The runtime name of a builder VM starts with this (sandbox ids cannot: they have no '-').
const BUILDER_PREFIX: &str = "warm-";

/// The hostname of a builder VM (a restore gives each sandbox its own).
const BUILDER_HOSTNAME: &str = "space";

/// How long after a failed build a create may ask for the checkpoint again.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// The checkpoint directory of template `tmpl` for runtime key `key`.
pub(crate) fn checkpoint_dir(tmpl: &TemplateInfo, key: &str) -> PathBuf {
    let d = &tmpl.defaults;
    let name = if StartSettings::named(d) {
        let mut h = Sha256::new();
        for cmd in [&d.start_cmd, &d.ready_cmd] {
            h.update(cmd.as_deref().unwrap_or("").as_bytes());
            h.update([0]);
        }
        format!("vm-{key}-s{}", hex(&h.finalize()[..6]))
    } else {
        format!("vm-{key}")
    };
    tmpl.path.with_file_name(name)
}

/// How long the builder waits, after its host left, before the checkpoint: time for the
/// guest to see the hang-up and end the session (a restored guest that did not would still
/// take the next host's preface for a new session: see space-daemon's vport.rs).
const HOST_LEFT_SETTLE: std::time::Duration = std::time::Duration::from_millis(300);

/// Removes a checkpoint directory a restore refused: renamed aside first, so no later create
/// finds half of it.
pub(crate) fn discard_checkpoint(dir: &Path) {
    let aside = dir.with_extension(format!("bad-{:08x}", rand::rng().random::<u32>()));
    match std::fs::rename(dir, &aside) {
        Ok(()) => {
            if let Err(e) = std::fs::remove_dir_all(&aside) {
                tracing::warn!(path = %aside.display(), error = %e, "cannot remove a refused checkpoint");
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %dir.display(), error = %e, "cannot set a refused checkpoint aside")
        }
    }
}

/// The queue of checkpoints to make, and what is queued or being made.
pub(crate) struct VmWarm {
    tx: mpsc::UnboundedSender<(TemplateInfo, Limits)>,
    rx: Mutex<Option<mpsc::UnboundedReceiver<(TemplateInfo, Limits)>>>,
    pending: Mutex<HashSet<PathBuf>>,
}

impl Default for VmWarm {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
            pending: Mutex::new(HashSet::new()),
        }
    }
}

/// Random bytes as lowercase hex.
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::rng().fill(&mut b[..]);
    hex(&b)
}

impl Node {
    /// The template's warm checkpoint for `limits` on runtime `rt`, when one is made; when
    /// none is, asks the background task for one (the caller boots meanwhile).
    pub(crate) fn template_checkpoint(
        &self,
        rt: &dyn Runtime,
        tmpl: &TemplateInfo,
        limits: &Limits,
    ) -> Option<PathBuf> {
        let key = rt.checkpoint_key(limits)?;
        let dir = checkpoint_dir(tmpl, &key);
        if dir.is_dir() {
            return Some(dir);
        }
        if self.vm_warm.pending.lock().unwrap().insert(dir) {
            let _ = self.vm_warm.tx.send((tmpl.clone(), *limits));
        }
        None
    }

    /// Kills builder VMs a crash left behind, or one booting at shutdown (their run dirs name
    /// them; their jail cgroups hold their QEMUs) and removes their run dirs. Called before
    /// the node serves and when it shuts down.
    pub(super) async fn destroy_stale_builders(&self) {
        let run = self.layout.run_sandboxes();
        let names: Vec<String> = std::fs::read_dir(&run)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(BUILDER_PREFIX))
                    .collect()
            })
            .unwrap_or_default();
        if names.is_empty() {
            return;
        }
        let rt = match self.microvm().await {
            Ok(rt) => rt.clone(),
            Err(why) => {
                tracing::warn!(
                    why,
                    "stale template checkpoint builders, but no microvm runtime"
                );
                return;
            }
        };
        for name in names {
            if let Err(e) = rt.destroy(&name, None).await {
                tracing::warn!(builder = %name, error = %e, "destroying a stale builder VM failed");
            }
            if let Err(e) = storage::remove_tree(&run.join(&name)) {
                tracing::warn!(builder = %name, error = %e, "removing a stale builder's run dir failed");
            }
            tracing::info!(builder = %name, "stale template checkpoint builder destroyed");
        }
    }

    /// Starts the task that makes the checkpoints asked for.
    pub(super) fn start_vm_warm(self: &Arc<Self>) {
        let Some(rx) = self.vm_warm.rx.lock().unwrap().take() else {
            return;
        };
        tokio::spawn(vm_warm_loop(Arc::downgrade(self), rx));
    }

    /// Makes the warm checkpoint of `tmpl` for `limits` (nothing when it exists).
    pub(crate) async fn make_template_checkpoint(
        &self,
        tmpl: &TemplateInfo,
        limits: &Limits,
    ) -> Result<PathBuf, NodeError> {
        let rt = self
            .microvm()
            .await
            .map_err(|e| NodeError::Unavailable {
                id: tmpl.name.clone(),
                reason: e.to_owned(),
            })?
            .clone();
        let Some(key) = rt.checkpoint_key(limits) else {
            return Err(NodeError::InvalidArgument(
                "this node's microvm runtime keeps no checkpoints".to_owned(),
            ));
        };
        let dir = checkpoint_dir(tmpl, &key);
        if dir.is_dir() {
            return Ok(dir);
        }
        let t0 = Instant::now();
        let building = dir.with_extension("building");
        let id = format!("{BUILDER_PREFIX}{}", random_hex(6));
        let uid_base = self.allocate_uids()?;
        let plan = LaunchPlan {
            id: id.clone(),
            rootfs: tmpl.path.clone(),
            uid_base,
            id_count: self.cfg.uid_count,
            hostname: BUILDER_HOSTNAME.to_owned(),
            limits: *limits,
            env: Vec::new(),
            daemon_binary: self.cfg.daemon_binary.clone(),
            channel_socket: self.layout.channel_socket(&id),
            run_dir: self.layout.run_sandbox_dir(&id),
            netns: None,
            disk: Some(building.join(SANDBOX_DISK)),
        };
        let result = async {
            let (tmpl_path, building2, plan2) = (tmpl.path.clone(), building.clone(), plan.clone());
            blocking(move || {
                storage::remove_tree(&building2)?;
                storage::mkdir_private(&building2)?;
                let image = template_disk(&tmpl_path);
                crate::runtime::microvm::ensure_template_disk(&tmpl_path, &image)
                    .map_err(|e| NodeError::Internal(format!("template disk: {e}")))?;
                let disk = plan2.disk.as_deref().unwrap_or(&image);
                crate::runtime::microvm::clone_disk(&image, disk)
                    .map_err(|e| storage::StorageError::io("reflink", disk, e))?;
                storage::remove_tree(&plan2.run_dir)?;
                storage::mkdir_private(&plan2.run_dir)?;
                Ok(())
            })
            .await?;
            let launched = rt
                .launch(&plan)
                .await
                .map_err(|e| NodeError::Internal(format!("boot the builder VM: {e}")))?;
            let booted = t0.elapsed();
            // A template that starts something is checkpointed once that is ready; the node
            // leaves the builder first. Any other builder never has a host.
            if let Some(st) = StartSettings::of(&tmpl.name, &tmpl.defaults)
                && let Err(e) = self.start_in_builder(&id, &plan, tmpl, &st).await
            {
                if let Err(d) = rt.destroy(&id, Some(&launched)).await {
                    tracing::warn!(id, error = %d, "destroy of the builder VM failed");
                }
                return Err(e);
            }
            let made = rt
                .checkpoint(&id, &building, false)
                .await
                .map_err(|e| NodeError::Internal(format!("checkpoint the builder VM: {e}")));
            if let Err(e) = rt.destroy(&id, Some(&launched)).await {
                tracing::warn!(id, error = %e, "destroy of the builder VM failed");
            }
            made?;
            let (building2, dir2) = (building.clone(), dir.clone());
            blocking(move || {
                // The builder's uid range is freed now, and may go to a user's sandbox: the
                // disk it owned goes back to root.
                let disk = building2.join(SANDBOX_DISK);
                std::os::unix::fs::chown(&disk, Some(0), Some(0))
                    .map_err(|e| storage::StorageError::io("chown", &disk, e))?;
                std::fs::rename(&building2, &dir2)
                    .map_err(|e| storage::StorageError::io("rename", &dir2, e))?;
                Ok(())
            })
            .await?;
            tracing::info!(
                template = %tmpl.name,
                version = tmpl.version,
                key,
                boot_ms = booted.as_millis() as u64,
                total_ms = t0.elapsed().as_millis() as u64,
                "template checkpoint made: microvm creates restore it"
            );
            Ok(dir.clone())
        }
        .await;
        self.free_uids(uid_base);
        let run_dir = plan.run_dir.clone();
        let leftover = if result.is_err() {
            Some(building)
        } else {
            None
        };
        let _ = blocking(move || {
            storage::remove_tree(&run_dir)?;
            if let Some(b) = leftover {
                storage::remove_tree(&b)?;
            }
            Ok(())
        })
        .await;
        result
    }

    /// Runs template `tmpl`'s start command in builder VM `id` and waits for its ready
    /// command, as a launch would (the template's environment and user, a fresh identity),
    /// then leaves the guest and gives it time to see that.
    async fn start_in_builder(
        &self,
        id: &str,
        plan: &LaunchPlan,
        tmpl: &TemplateInfo,
        st: &StartSettings,
    ) -> Result<(), NodeError> {
        let env = template_env(&tmpl.defaults, BUILDER_HOSTNAME, &[]);
        let client = self
            .connector
            .connect_personalized(
                &plan.channel_socket,
                space_proto::PersonalizeRequest {
                    env: env.into_iter().collect(),
                    hostname: BUILDER_HOSTNAME.to_owned(),
                    ..crate::runtime::microvm::guest_identity(id)
                },
            )
            .await
            .map_err(|e| NodeError::Internal(format!("connect to the builder VM: {e}")))?;
        st.run(id, &client, true)
            .await
            .map_err(|reason| NodeError::NotReady {
                id: tmpl.name.clone(),
                reason,
            })?;
        drop(client);
        tokio::time::sleep(HOST_LEFT_SETTLE).await;
        Ok(())
    }
}

async fn vm_warm_loop(weak: Weak<Node>, mut rx: mpsc::UnboundedReceiver<(TemplateInfo, Limits)>) {
    while let Some((tmpl, limits)) = rx.recv().await {
        let Some(node) = weak.upgrade() else { return };
        if node.pools.is_closing() {
            return;
        }
        match node.make_template_checkpoint(&tmpl, &limits).await {
            Ok(dir) => {
                node.vm_warm.pending.lock().unwrap().remove(&dir);
            }
            Err(e) => {
                tracing::warn!(template = %tmpl.name, version = tmpl.version, error = %e,
                    "cannot make the template's microvm checkpoint; creates keep booting");
                // Asked again by a create after a minute, not by every create.
                let rt = node.microvm().await.ok().cloned();
                if let Some(key) = rt.and_then(|rt| rt.checkpoint_key(&limits)) {
                    let dir = checkpoint_dir(&tmpl, &key);
                    let weak = weak.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(RETRY_AFTER).await;
                        if let Some(node) = weak.upgrade() {
                            node.vm_warm.pending.lock().unwrap().remove(&dir);
                        }
                    });
                }
            }
        }
    }
}
