//! Recovery at node start: the table is rebuilt from the `sandbox.json` records on disk; live
//! sandboxes are adopted (their init and channel reconnected, not restarted), the rest are
//! marked stopped, and half-created leftovers are removed (decision 0009).

use super::*;

/// Sandboxes whose network slot or channel is taken back at once during recovery.
const ADOPT_PARALLEL: usize = 32;

impl Node {
    /// Rebuilds the table from `sandbox.json` records: adopts live sandboxes, marks the rest
    /// stopped, removes half-created leftovers.
    pub(super) async fn recover(self: &Arc<Self>) -> Result<(), NodeError> {
        let layout = self.layout.clone();
        let subvols = self.subvols.clone();
        let (records, members) = blocking(move || load_records(&layout, subvols.as_ref())).await?;
        // Every runtime the sandboxes need, made now: one the node lacks is said once.
        let mut kinds: Vec<RuntimeKind> = records
            .iter()
            .chain(members.iter().map(|(_, r)| r))
            .map(|r| r.runtime)
            .collect();
        kinds.sort_by_key(|k| k.as_str());
        kinds.dedup();
        for kind in kinds {
            if let Err(e) = self.runtime_for(kind).await {
                tracing::error!(%kind, error = %e, "this node has sandboxes of a runtime it lacks");
            }
        }
        self.destroy_stale_builders().await;
        // Ready sandboxes of a warm pool (or one caught mid-hand-out) from the last run: kill
        // and delete them; the pools refill from scratch.
        for (dir, rec) in members {
            let name = rec.runtime_name().to_owned();
            if let Err(e) = self.rt(&rec).destroy(&name, rec.launched.as_ref()).await {
                tracing::warn!(member = %name, error = %e, "destroying a stale pool sandbox failed");
            }
            let (layout, subvols) = (self.layout.clone(), self.subvols.clone());
            blocking(move || {
                remove_sandbox_storage(&layout, subvols.as_ref(), &dir)?;
                Ok(storage::remove_tree(&layout.run_sandbox_dir(&name))?)
            })
            .await?;
            tracing::info!(member = %rec.runtime_name(), "stale pool sandbox destroyed");
        }
        // Quota groups of sandboxes that are gone (a crash mid-remove or mid-create).
        let (layout, subvols) = (self.layout.clone(), self.subvols.clone());
        match blocking(move || Ok(crate::quota::sweep(&layout, subvols.as_ref())?)).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(groups = n, "stale disk-quota groups destroyed"),
            Err(e) => tracing::warn!(error = %e, "could not sweep the disk-quota groups"),
        }
        let mut adopt = Vec::new();
        let mut dead = Vec::new();
        {
            let mut uids = self.uids.lock().unwrap_or_else(|e| e.into_inner());
            let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            let mut conflicting = Vec::new();
            for mut rec in records {
                let id = rec.spec.id.clone();
                let alive = rec
                    .launched
                    .as_ref()
                    .is_some_and(|l| self.rt(&rec).alive(l));
                if !uids.claim(rec.uid_base) {
                    conflicting.push(id.clone());
                }
                if alive && self.rt(&rec).is_frozen(rec.runtime_name()) {
                    // Paused: its daemon cannot answer; connect after resume, on first use.
                    tracing::info!(id, "sandbox is paused; adopted without a channel");
                } else if alive {
                    adopt.push((id.clone(), rec.runtime_name().to_owned()));
                } else if rec.launched.is_some() {
                    dead.push((
                        id.clone(),
                        rec.runtime,
                        rec.runtime_name().to_owned(),
                        rec.launched.take(),
                    ));
                }
                table.insert(id, Entry::new(rec, None));
            }
            // Ranges are only mapped at launch (the rootfs is idmapped, never chowned), so a
            // stopped sandbox whose range collides simply gets a fresh one.
            for id in conflicting {
                let Some(e) = table.get_mut(&id) else {
                    continue;
                };
                if adopt.iter().any(|(a, _)| a == &id) {
                    tracing::error!(
                        id,
                        uid_base = e.record.uid_base,
                        "running sandbox shares its uid range with another; stop one of them"
                    );
                    continue;
                }
                let new = uids.allocate()?;
                tracing::warn!(
                    id,
                    old = e.record.uid_base,
                    new,
                    "reassigned a conflicting uid range"
                );
                e.record.uid_base = new;
                e.record.uid_count = uids.count();
            }
        }
        // Clean up what the runtime may have left of sandboxes that died while we were away.
        for (id, kind, name, launched) in dead {
            if let Err(e) = self.rt_of(kind).destroy(&name, launched.as_ref()).await {
                tracing::warn!(id, error = %e, "cleaning up a dead sandbox failed");
            }
            tracing::info!(id, "sandbox init is gone; marked stopped");
            self.persist(&id, false).await?;
        }
        // Take back the network slots the records name (running and stopped sandboxes keep
        // theirs); a slot that is gone (host reboot) is replaced at the next start.
        if let Some(net) = &self.network {
            let with_slots: Vec<SandboxRecord> = self
                .table
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter(|e| e.record.slot.is_some())
                .map(|e| e.record.clone())
                .collect();
            // Concurrently: each slot is a netns to open and one firewall transaction (its
            // table and policy), mostly waits on the kernel.
            let lost: Vec<String> = futures::stream::iter(with_slots)
                .map(|rec| async move {
                    let id = rec.spec.id.clone();
                    let slot = rec.slot.as_ref().expect("filtered");
                    match net
                        .adopt(&id, slot, &rec.spec.network, &rec.spec.secrets)
                        .await
                    {
                        Ok(()) => None,
                        Err(e) => {
                            tracing::warn!(id, error = %e, "could not take back the sandbox's network slot");
                            Some(id)
                        }
                    }
                })
                .buffer_unordered(ADOPT_PARALLEL)
                .filter_map(std::future::ready)
                .collect()
                .await;
            for id in lost {
                if let Some(e) = self
                    .table
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_mut(&id)
                {
                    e.record.slot = None;
                }
                self.persist(&id, false).await?;
            }
            net.finish_recovery().await;
        }
        // Adopt running sandboxes: reconnect their channels (bounded parallelism).
        let results: Vec<_> = futures::stream::iter(adopt)
            .map(|(id, name)| {
                let node = self.clone();
                async move {
                    let sock = node.layout.channel_socket(&name);
                    (id, node.connector.connect(&sock).await)
                }
            })
            .buffer_unordered(ADOPT_PARALLEL)
            .collect()
            .await;
        let mut adopted = 0;
        {
            let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            for (id, res) in results {
                match res {
                    Ok(c) => {
                        adopted += 1;
                        if let Some(e) = table.get_mut(&id) {
                            e.client = Some(c);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(id, error = %e, "adopted sandbox's channel did not answer; will retry on use")
                    }
                }
            }
        }
        // Run dirs of sandboxes we know nothing about.
        if let Ok(rd) = std::fs::read_dir(self.layout.run_sandboxes()) {
            // Run dirs are named by the runtime's name of a sandbox (decision 0013).
            let known: std::collections::HashSet<String> = self
                .table
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .map(|e| e.record.runtime_name().to_owned())
                .collect();
            for ent in rd.flatten() {
                let name = ent.file_name().to_string_lossy().into_owned();
                if !known.contains(&name) {
                    tracing::warn!(path = %ent.path().display(), "removing stale run dir");
                    let _ = storage::remove_tree(&ent.path());
                }
            }
        }
        let total = self.table.lock().unwrap_or_else(|e| e.into_inner()).len();
        tracing::info!(sandboxes = total, adopted, "node state recovered");
        Ok(())
    }
}

/// The records of a node's sandboxes, and the warm pool members (with their dir names).
type LoadedRecords = (Vec<SandboxRecord>, Vec<(String, SandboxRecord)>);

/// Reads every sandbox record; removes sandbox dirs without one (half-created). Records still
/// marked as pool members come back apart, whatever dir they are in.
fn load_records(layout: &Layout, subvols: &dyn Subvolumes) -> Result<LoadedRecords, NodeError> {
    let dir = layout.sandboxes();
    let rd = std::fs::read_dir(&dir).map_err(|e| StorageError::io("read directory", &dir, e))?;
    let mut out = Vec::new();
    let mut members = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| StorageError::io("read directory", &dir, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        let path = ent.path();
        if ids::validate_sandbox_id(&name).is_err() {
            tracing::warn!(path = %path.display(), "ignoring unexpected entry in sandboxes/");
            continue;
        }
        let rec_path = layout.sandbox_record(&name);
        // A record whose data never reached the disk (host crash right after create) reads
        // back empty: the sandbox is half-created too.
        let empty = std::fs::symlink_metadata(&rec_path).map(|m| m.len() == 0);
        if !matches!(empty, Ok(false)) {
            tracing::warn!(path = %path.display(), "removing half-created sandbox (no sandbox.json)");
            remove_sandbox_storage(layout, subvols, &name)?;
            continue;
        }
        match storage::read_json::<SandboxRecord>(&rec_path) {
            Ok(rec) if rec.pool_member => members.push((name, rec)),
            Ok(rec) if rec.spec.id == name => {
                let at = super::disk::At::new(layout, subvols, &name);
                if let Err(e) = super::disk::of(rec.runtime).upgrade(at) {
                    tracing::error!(id = %name, error = %e, "could not bring a sandbox's files up to date");
                }
                out.push(rec)
            }
            Ok(rec) => tracing::error!(path = %rec_path.display(), id = %rec.spec.id,
                "record names another sandbox; leaving it alone"),
            Err(e) => tracing::error!(error = %e, "unreadable sandbox record; leaving it alone"),
        }
    }
    Ok((out, members))
}
