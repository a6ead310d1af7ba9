//! Start and ready commands (issue 12 item 4, decision 0019): a template may name a start
//! command, run in the background in every sandbox the node launches (cold creates, warm pool
//! members, restarts, microvm restores; as the template's default user), and a ready command,
//! retried until it exits 0; the launch answers only then. A microvm's warm checkpoint is
//! taken before any start command ran (its builder VM never has a host), so a restored VM
//! runs them after the restore.

use std::time::{Duration, Instant};

use space_proto::ExecRequest;
use space_proto::guest_client::GuestClient;
use space_proto::process_event::Event;
use tonic::transport::Channel;

use super::Node;
use crate::state::SandboxRecord;

/// How long a ready command may take to succeed, unless the template says.
pub const DEFAULT_READY_TIMEOUT_SECS: u64 = 60;
const READY_INTERVAL: Duration = Duration::from_millis(100);
/// Output of the last failed ready check kept for the error.
const KEPT_OUTPUT: usize = 2048;

fn sh(cmd: &str) -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into(), cmd.into()]
}

impl Node {
    /// Runs the template's start command and waits for its ready command (no-op for a
    /// template with neither).
    pub(super) async fn start_and_wait_ready(
        &self,
        rec: &SandboxRecord,
        client: &GuestClient<Channel>,
    ) -> Result<(), String> {
        // Most templates have neither: that costs one lookup, no copy.
        let Some(Some((name, start, ready, timeout))) =
            self.templates
                .with(&rec.spec.template, rec.template_version, |t| {
                    let d = &t.defaults;
                    (d.start_cmd.is_some() || d.ready_cmd.is_some()).then(|| {
                        (
                            t.name.clone(),
                            d.start_cmd.clone(),
                            d.ready_cmd.clone(),
                            d.ready_timeout_secs,
                        )
                    })
                })
        else {
            return Ok(());
        };
        let timeout = Duration::from_secs(timeout.unwrap_or(DEFAULT_READY_TIMEOUT_SECS));
        let id = &rec.spec.id;
        let mut guest = client.clone();
        let t0 = Instant::now();
        if let Some(start) = &start {
            guest
                .start(ExecRequest {
                    argv: sh(start),
                    tag: "start".into(),
                    ..Default::default()
                })
                .await
                .map_err(|s| {
                    format!(
                        "template {}'s start command {start:?} could not start: {}",
                        name,
                        s.message()
                    )
                })?;
        }
        if let Some(ready) = &ready {
            loop {
                let (code, out) = match run_once(&mut guest, ready).await {
                    Ok(r) => r,
                    Err(s) => (None, s.message().to_string()),
                };
                if code == Some(0) {
                    break;
                }
                if t0.elapsed() >= timeout {
                    return Err(format!(
                        "template {}'s ready command {ready:?} did not succeed within {} s \
                         (last exit {}; output: {})",
                        name,
                        timeout.as_secs(),
                        code.map_or("none".to_string(), |c| c.to_string()),
                        out.trim()
                    ));
                }
                tokio::time::sleep(READY_INTERVAL).await;
            }
        }
        tracing::info!(id, template = %name, ms = t0.elapsed().as_millis() as u64, "start command ready");
        Ok(())
    }
}

/// Runs `cmd` once; its exit status (128 + signal for a signal) and the start of its output.
async fn run_once(
    guest: &mut GuestClient<Channel>,
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
