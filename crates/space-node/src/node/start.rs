//! Start and ready commands (issue 12 item 4, decision 0019): a template may name a start
//! command, run in the background (as the template's default user) once per boot of every
//! sandbox the node launches (cold creates, warm pool members, restarts), and a ready
//! command, retried until it exits 0; the launch answers only then.
//!
//! A microvm restored from a memory checkpoint already ran the start command before the
//! checkpoint: a template's warm checkpoint is taken after its builder VM ran the start
//! command and passed the ready check (vm_warm.rs), and a paused sandbox's own checkpoint
//! holds its processes. A restore therefore runs only the ready command, to confirm.
//!
//! Also here: `restart`, which starts a stopped sandbox again, from the memory checkpoint it
//! came with when it is a microvm moved or restored from another node (decision 0038).

use std::time::{Duration, Instant};

use crate::api::GuestChannel;
use space_proto::ExecRequest;
use space_proto::guest_client::GuestClient;
use space_proto::process_event::Event;

use super::{Entry, Node};
use crate::api::TemplateDefaults;
use crate::api::{NodeError, SandboxSpec, SandboxStatus};
use crate::state::SandboxRecord;

/// How long a ready command may take to succeed, unless the template says.
pub const DEFAULT_READY_TIMEOUT_SECS: u64 = 60;
const READY_INTERVAL: Duration = Duration::from_millis(100);
/// Output of the last failed ready check kept for the error.
const KEPT_OUTPUT: usize = 2048;

fn sh(cmd: &str) -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into(), cmd.into()]
}

/// A template's start and ready commands.
#[derive(Debug, Clone)]
pub(crate) struct StartSettings {
    pub template: String,
    pub start: Option<String>,
    pub ready: Option<String>,
    pub timeout: Duration,
}

impl StartSettings {
    /// Whether the defaults name a start or a ready command.
    pub(crate) fn named(d: &TemplateDefaults) -> bool {
        d.start_cmd.is_some() || d.ready_cmd.is_some()
    }

    /// The settings of a template whose defaults name a start or a ready command.
    pub(crate) fn of(template: &str, d: &TemplateDefaults) -> Option<StartSettings> {
        Self::named(d).then(|| StartSettings {
            template: template.to_owned(),
            start: d.start_cmd.clone(),
            ready: d.ready_cmd.clone(),
            timeout: Duration::from_secs(
                d.ready_timeout_secs.unwrap_or(DEFAULT_READY_TIMEOUT_SECS),
            ),
        })
    }

    /// Starts the start command (unless `run_start` is false) and waits for the ready
    /// command to succeed, within the timeout. `id` names the VM or sandbox in the log.
    pub(crate) async fn run(
        &self,
        id: &str,
        client: &GuestChannel,
        run_start: bool,
    ) -> Result<(), String> {
        let name = &self.template;
        let mut guest = client.clone().client();
        let t0 = Instant::now();
        if let Some(start) = self.start.as_ref().filter(|_| run_start) {
            guest
                .start(ExecRequest {
                    argv: sh(start),
                    tag: "start".into(),
                    ..Default::default()
                })
                .await
                .map_err(|s| {
                    format!(
                        "template {name}'s start command {start:?} could not start: {}",
                        s.message()
                    )
                })?;
        }
        if let Some(ready) = &self.ready {
            loop {
                let (code, out) = match run_once(&mut guest, ready).await {
                    Ok(r) => r,
                    Err(s) => (None, s.message().to_string()),
                };
                if code == Some(0) {
                    break;
                }
                if t0.elapsed() >= self.timeout {
                    return Err(format!(
                        "template {name}'s ready command {ready:?} did not succeed within {} s \
                         (last exit {}; output: {})",
                        self.timeout.as_secs(),
                        code.map_or("none".to_string(), |c| c.to_string()),
                        out.trim()
                    ));
                }
                tokio::time::sleep(READY_INTERVAL).await;
            }
        }
        tracing::info!(id, template = %name, run_start, ms = t0.elapsed().as_millis() as u64, "start command ready");
        Ok(())
    }
}

impl Node {
    /// Runs the template's start command (not after a restore: see the module docs) and
    /// waits for its ready command (no-op for a template with neither).
    pub(super) async fn start_and_wait_ready(
        &self,
        rec: &SandboxRecord,
        client: &GuestChannel,
        restored: bool,
    ) -> Result<(), String> {
        // Most templates have neither: that costs one lookup, no copy.
        let Some(Some(settings)) =
            self.templates
                .with(&rec.spec.template, rec.template_version, |t| {
                    StartSettings::of(&t.name, &t.defaults)
                })
        else {
            return Ok(());
        };
        settings.run(&rec.spec.id, client, !restored).await
    }
}

/// Runs `cmd` once; its exit status (128 + signal for a signal) and the start of its output.
async fn run_once(
    guest: &mut GuestClient<GuestChannel>,
    cmd: &str,
) -> Result<(Option<i32>, String), tonic::Status> {
    let mut events = guest
        .exec(ExecRequest {
            argv: sh(cmd),
            ..Default::default()
        })
        .await?
        .into_inner();
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(ev) = events.message().await? {
        match ev.event {
            Some(Event::Output(o)) if out.len() < KEPT_OUTPUT => out.extend_from_slice(&o.data),
            Some(Event::Exit(e)) => code = Some(if e.signaled { 128 + e.signal } else { e.code }),
            _ => {}
        }
    }
    out.truncate(KEPT_OUTPUT);
    Ok((code, String::from_utf8_lossy(&out).into_owned()))
}

impl Node {
    /// Starts a stopped sandbox again on its kept rootfs (limits, env and hostname from
    /// `spec`). On failure the sandbox stays stopped; nothing of its data is removed.
    pub(super) async fn restart(
        &self,
        spec: &SandboxSpec,
        mut entry: Entry,
    ) -> Result<SandboxStatus, NodeError> {
        entry.record.spec = spec.clone();
        entry.record.launched = None;
        // A sandbox that came from another node with its memory (a microvm's `adopt_from`)
        // continues from it.
        let resume = self.layout.sandbox_dir(&spec.id).join(super::moves::RESUME);
        let memory = resume.join(super::snapshots::VM_DIR);
        let (launched, client) = if memory.join(crate::runtime::microvm::STATE_FILE).is_file() {
            self.launch_from(&mut entry.record, Some(&memory), &resume)
                .await?
        } else {
            self.launch(&mut entry.record, None).await?
        };
        entry.record.launched = Some(launched);
        entry.client = Some(client);
        let status = self.status_of(&entry.record);
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(spec.id.clone(), entry);
        self.persist(&spec.id, false).await?;
        let subvols = self.subvols.clone();
        if subvols.is_subvolume(&resume) {
            // Used: the VM's memory is its own now. Deleted after the answer (a subvolume's
            // delete waits for a commit).
            tokio::task::spawn_blocking(move || {
                if let Err(e) = subvols.delete(&resume) {
                    tracing::warn!(error = %e, "could not delete a used memory checkpoint");
                }
            });
        }
        tracing::info!(id = %spec.id, restored = status.restored, "stopped sandbox started again");
        Ok(status)
    }
}
