//! A sandbox's storage sent to and received from another node, and templates sent on
//! demand (issue 14, decision 0035): the node's side of [`NodeApi::send_sandbox`] and its
//! siblings. A child module of `node` (it shares the node's table, locks and uid slots); the
//! streams themselves are `crate::moves`.
//!
//! [`NodeApi::send_sandbox`]: crate::api::NodeApi::send_sandbox

use std::path::Path;

use super::disk::{self, At};
use super::snapshots::VM_DIR;
use super::{Entry, Node, blocking, check_spec, remove_sandbox_storage};
use crate::api::moves::{MoveStep, MoveStream, Received};
use crate::api::{NodeError, Phase, SandboxSpec, SandboxStatus, TemplateInfo};
use crate::ids;
use crate::storage::{self, StorageError};

/// Where an adopted microvm keeps the checkpoint it came with (device state and RAM, `vm/`,
/// next to the disk image it was taken with) until its next start restores it.
pub(super) const RESUME: &str = "resume";

impl Node {
    #[tracing::instrument(name = "node.send", skip_all, fields(sandbox = id, step = step.as_str()))]
    pub(super) async fn send_sandbox_impl(
        &self,
        id: &str,
        step: MoveStep,
        have: &[String],
    ) -> Result<MoveStream, NodeError> {
        ids::validate_sandbox_id(id)?;
        let have = have.to_vec();
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let entry = self.require_entry(id)?;
        let running = self.is_running(&entry.record);
        let name = entry.record.runtime_name();
        if step == MoveStep::Final && running && !self.rt(&entry.record).is_frozen(name) {
            return Err(NodeError::WrongPhase {
                id: id.to_owned(),
                phase: Phase::Running,
            });
        }
        let disk = self.disk(&entry.record);
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.to_owned());
        if disk.in_guest() && step == MoveStep::Final && running {
            // A paused VM's final copy keeps its memory: device state and RAM go into the
            // copy being filled, next to the disk image sealed after them (decision 0038).
            let out = crate::moves::outgoing_dir(&layout, id);
            let filling = blocking({
                let (layout, subvols, out) = (layout.clone(), subvols.clone(), out.clone());
                move || {
                    if !subvols.is_subvolume(&out.join(MoveStep::Base.as_str())) {
                        return Err(NodeError::Conflict(format!(
                            "sandbox {id2} has no base sent: a move sends its base step first"
                        )));
                    }
                    let at = At::new(&layout, subvols.as_ref(), &id2);
                    Ok(disk.begin_copy(at, &out, MoveStep::Final.as_str())?)
                }
            })
            .await?;
            if let Some(filling) = filling {
                self.rt(&entry.record)
                    .checkpoint(name, &filling.join(VM_DIR), false)
                    .await
                    .map_err(|e| {
                        NodeError::Internal(format!("failed to checkpoint the VM to move it: {e}"))
                    })?;
            }
        }
        let id2 = id.to_owned();
        let items = blocking(move || {
            let sv = subvols.as_ref();
            let at = At::new(&layout, sv, &id2);
            // A move's copies are not charged to the sandbox here: they leave.
            let copy = |out: &Path, name: &str| disk.seal_copy(at, out, name, false);
            crate::moves::plan(&layout, sv, &id2, step, &have, &copy)
        })
        .await?;
        Ok(crate::moves::send(items))
    }

    #[tracing::instrument(name = "node.receive", skip_all, fields(sandbox = id, step = step.as_str()))]
    pub(super) async fn receive_sandbox_impl(
        &self,
        id: &str,
        step: MoveStep,
        have: &[String],
        parts: MoveStream,
    ) -> Result<Received, NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        if self.entry(id).is_some() {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is on this node already"
            )));
        }
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.to_owned());
        let have = have.to_vec();
        blocking(move || {
            let incoming = crate::moves::incoming_dir(&layout, &id2);
            match step {
                MoveStep::Base => {
                    // What an earlier try left goes first.
                    remove_sandbox_storage(&layout, subvols.as_ref(), &id2)?;
                    storage::mkdir_private(&layout.sandbox_dir(&id2))?;
                    // The snapshots the sender leaves out come from this node's replica;
                    // the rest of the replica goes (the sandbox will run here).
                    crate::moves::take_from_replica(&layout, subvols.as_ref(), &id2, &have)?;
                    storage::mkdir_private(&incoming)?;
                }
                MoveStep::Final => {
                    if !subvols.is_subvolume(&incoming.join(MoveStep::Base.as_str())) {
                        return Err(NodeError::Conflict(format!(
                            "no base of sandbox {id2} was received here: a move receives its \
                             base step first"
                        )));
                    }
                    let last = crate::moves::received_final(&layout, &id2);
                    if subvols.is_subvolume(&last) {
                        subvols.delete(&last)?;
                    }
                }
            }
            Ok(())
        })
        .await?;
        let dir = self.layout.sandbox_dir(id);
        let got =
            crate::moves::receive(&dir, parts, space_node_api::moves::valid_move_path).await?;
        if step == MoveStep::Base {
            // The base's data goes to disk now, while the sandbox still runs on its source:
            // left dirty, the final step's commits (snapshot, record) would write it out
            // while the sandbox is paused.
            blocking(move || {
                let d = std::fs::File::open(&dir).map_err(|e| StorageError::io("open", &dir, e))?;
                rustix::fs::syncfs(&d).map_err(|e| StorageError::io("sync", &dir, e.into()).into())
            })
            .await?;
        }
        tracing::info!(id, step = step.as_str(), bytes = got.bytes, "move received");
        Ok(got)
    }

    #[tracing::instrument(name = "node.adopt", skip_all, fields(sandbox = %spec.id))]
    pub(super) async fn adopt_sandbox_impl(
        &self,
        spec: &SandboxSpec,
    ) -> Result<SandboxStatus, NodeError> {
        let received = crate::moves::received_final(&self.layout, &spec.id);
        let status = self
            .adopt_with(spec, "moving", move |_, subvols, id| {
                if !subvols.is_subvolume(&received) {
                    return Err(NodeError::Conflict(format!(
                        "sandbox {id} was not received here: nothing to adopt"
                    )));
                }
                Ok(received)
            })
            .await?;
        // The received copies go after the answer: deleting a subvolume waits for a commit.
        let (layout, subvols, id) = (self.layout.clone(), self.subvols.clone(), spec.id.clone());
        tokio::task::spawn_blocking(move || {
            let incoming = crate::moves::incoming_dir(&layout, &id);
            if let Err(e) = crate::moves::remove_move_dir(&incoming, subvols.as_ref()) {
                tracing::warn!(id, error = %e, "could not remove a move's received copies");
            }
        });
        Ok(status)
    }

    /// Makes a sandbox of `spec` from storage that came from another node (a move's, a
    /// replica's), stopped: `place` (blocking, under the sandbox's lock) checks what was
    /// received, makes the sandbox's directory with its snapshots in it, and answers the
    /// read-only subvolume the sandbox's disk comes from: a writable snapshot of it becomes
    /// the rootfs, or a microvm's image is reflinked out of it (with the memory checkpoint
    /// beside it kept for the next start). Idempotent: a sandbox the node has already is
    /// answered as it is.
    pub(super) async fn adopt_with<F>(
        &self,
        spec: &SandboxSpec,
        doing: &'static str,
        place: F,
    ) -> Result<SandboxStatus, NodeError>
    where
        F: FnOnce(
                &storage::Layout,
                &dyn storage::Subvolumes,
                &str,
            ) -> Result<std::path::PathBuf, NodeError>
            + Send
            + 'static,
    {
        check_spec(spec)?;
        let id = spec.id.clone();
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        if let Some(entry) = self.entry(&id) {
            return Ok(self.status_of(&entry.record));
        }
        let tmpl = self
            .templates
            .latest(&spec.template)
            .ok_or_else(|| NodeError::NotFound {
                kind: "template",
                id: spec.template.clone(),
            })?;
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.clone());
        let from = blocking(move || place(&layout, subvols.as_ref(), &id2)).await?;
        // What came is what it is: a microvm's copy holds its disk image.
        let came = disk::kind_of_copy(&from);
        if let Some(named) = spec.runtime.filter(|k| *k != came) {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} came as a {came} sandbox, not the {named} its spec names"
            )));
        }
        crate::quota::check_limit(&spec.limits, came, self.subvols.as_ref())?;
        if let Err(why) = self.runtime_for(came).await {
            return Err(NodeError::Conflict(format!(
                "sandbox {id} is a {came} sandbox, and this node cannot run one: {why}"
            )));
        }
        let uid_base = self.allocate_uids()?;
        let mut rec = self.new_record(spec, tmpl.version, uid_base);
        rec.runtime = came;
        let (layout, subvols, rec2) = (self.layout.clone(), self.subvols.clone(), rec.clone());
        let made = blocking(move || {
            let id = &rec2.spec.id;
            let dir = layout.sandbox_dir(id);
            let (rootfs, resume) = (layout.sandbox_rootfs(id), dir.join(RESUME));
            for sub in [&rootfs, &resume] {
                if subvols.is_subvolume(sub) {
                    subvols.delete(sub)?;
                }
            }
            let at = At::new(&layout, subvols.as_ref(), id);
            disk::of(came).adopt_from(at, &from)?;
            // Its limit here, with what came (its snapshots) charged to it.
            crate::quota::set_limit(&layout, subvols.as_ref(), id, rec2.spec.limits.disk_mib)?;
            // Made durable right after (as a create's is), not while it is down.
            storage::write_json_atomic(&layout.sandbox_record(id), &rec2, false)?;
            Ok(())
        })
        .await;
        if let Err(e) = made {
            self.free_uids(uid_base);
            return Err(e);
        }
        let status = self.status_of(&rec);
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), Entry::new(rec, None));
        tracing::info!(id, template = %spec.template, version = tmpl.version, doing, "sandbox from another node adopted");
        self.sync_record_in_background(&id);
        Ok(status)
    }

    pub(super) async fn send_template_impl(&self, name: &str) -> Result<MoveStream, NodeError> {
        ids::validate_template_name(name)?;
        let t = self
            .templates
            .latest(name)
            .ok_or_else(|| NodeError::NotFound {
                kind: "template",
                id: name.to_owned(),
            })?;
        let dir = t.path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(crate::moves::send(vec![
            crate::moves::Item::File {
                rel: "template.json".into(),
                path: dir.join("template.json"),
            },
            crate::moves::Item::Subvolume {
                rel: ".".into(),
                path: t.path.clone(),
                parent: None,
            },
        ]))
    }

    #[tracing::instrument(name = "node.receive_template", skip_all, fields(template = name))]
    pub(super) async fn receive_template_impl(
        &self,
        name: &str,
        parts: MoveStream,
    ) -> Result<TemplateInfo, NodeError> {
        ids::validate_template_name(name)?;
        let dir = self.templates.receiving_dir(name)?;
        let got =
            crate::moves::receive(&dir, parts, space_node_api::moves::valid_template_path).await;
        let templates = self.templates.clone();
        let (name2, dir2) = (name.to_owned(), dir.clone());
        let info = match got {
            Ok(got) => {
                let info = blocking(move || Ok(templates.adopt_received(&name2, &dir2)?)).await?;
                tracing::info!(
                    template = name,
                    version = info.version,
                    bytes = got.bytes,
                    "template received"
                );
                info
            }
            Err(e) => {
                let subvols = self.subvols.clone();
                let _ = blocking(move || {
                    let _ = subvols.delete(&dir2.join("rootfs"));
                    Ok(storage::remove_tree(&dir2)?)
                })
                .await;
                return Err(e);
            }
        };
        Ok(info)
    }

    pub(super) async fn discard_move_impl(&self, id: &str) -> Result<(), NodeError> {
        ids::validate_sandbox_id(id)?;
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        let held = self.entry(id).is_some();
        let (layout, subvols, id2) = (self.layout.clone(), self.subvols.clone(), id.to_owned());
        blocking(move || {
            if held {
                // The source: its sandbox stays; the copies taken for the move go.
                crate::moves::remove_move_dir(
                    &crate::moves::outgoing_dir(&layout, &id2),
                    subvols.as_ref(),
                )?;
            } else {
                // A target that never adopted it: everything received goes.
                remove_sandbox_storage(&layout, subvols.as_ref(), &id2)?;
            }
            Ok(())
        })
        .await
    }
}
