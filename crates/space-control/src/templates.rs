//! Template work that takes a while (a registry pull, a Dockerfile build): the engine starts
//! it on the node and answers with its progress as ndjson [`TemplateLog`] lines, the last one
//! `done` (the new version) or `error`. The work runs to its end even when the client goes
//! away: a template then appears all the same, or nothing does.

use futures::StreamExt;
use futures::stream::BoxStream;
use space_api::{PullTemplate, TemplateLog, is_valid_template_name};
use space_node_api::{PullSpec, TemplateEvent, TemplateSource};

use crate::convert::template_dto;
use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};

/// Longest start or ready command accepted.
const MAX_COMMAND_LEN: usize = 16 * 1024;
/// Longest ready timeout accepted.
const MAX_READY_TIMEOUT_SECS: u64 = 3600;

/// `argv` as one shell command line (each word single-quoted where it needs to be).
fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Longest image reference accepted (registries allow 255 for a name, plus a tag or digest).
const MAX_REFERENCE_LEN: usize = 512;

/// A name a user may give a template: valid, and not the builder's own prefix.
pub(crate) fn check_template_name(name: &str) -> ControlResult<()> {
    if name.starts_with(crate::build::BUILD_PREFIX) {
        Err(ControlError::invalid(format!(
            "template names starting with {} are the builder's own",
            crate::build::BUILD_PREFIX
        )))
    } else if is_valid_template_name(name) {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid template name {name:?}: expected [a-z0-9][a-z0-9._-]{{0,62}}"
        )))
    }
}

impl Engine {
    /// Refuses a name that is taken unless `replace` (then a new version is made).
    pub(crate) async fn check_name_free(&self, name: &str, replace: bool) -> ControlResult<()> {
        if !replace
            && self
                .node
                .list_templates()
                .await?
                .iter()
                .any(|t| t.name == name)
        {
            return Err(ControlError::conflict(format!(
                "template {name} exists: pass replace (--replace) to make a new version of it"
            )));
        }
        Ok(())
    }

    /// Starts a registry pull into a new version of `name`; its progress as it happens.
    pub async fn pull_template(
        &self,
        name: &str,
        req: PullTemplate,
    ) -> ControlResult<BoxStream<'static, TemplateLog>> {
        check_template_name(name)?;
        let reference = req.reference.trim();
        if reference.is_empty() {
            return Err(ControlError::invalid(
                "reference is empty: name an image, e.g. python:3.12-slim",
            ));
        }
        if reference.len() > MAX_REFERENCE_LEN || reference.chars().any(char::is_whitespace) {
            return Err(ControlError::invalid(format!(
                "{:?} is not an image reference",
                req.reference
            )));
        }
        if req.password.is_some() && req.username.is_none() {
            return Err(ControlError::invalid("a password needs a username"));
        }
        self.check_name_free(name, req.replace).await?;
        let source = TemplateSource::Registry(PullSpec {
            reference: reference.to_string(),
            username: req.username,
            password: req.password,
            insecure: req.insecure,
        });
        Ok(self.template_work(name, source))
    }

    /// Runs `source`'s import on the node in a task of its own, its progress as a stream.
    pub(crate) fn template_work(
        &self,
        name: &str,
        source: TemplateSource,
    ) -> BoxStream<'static, TemplateLog> {
        let (out, rx) = tokio::sync::mpsc::unbounded_channel();
        let (node, store, name) = (self.node.clone(), self.store.clone(), name.to_string());
        tokio::spawn(async move {
            let (progress, mut events) = tokio::sync::mpsc::unbounded_channel();
            let forward = {
                let out = out.clone();
                async move {
                    while let Some(ev) = events.recv().await {
                        let _ = out.send(log_line(ev));
                    }
                }
            };
            let work = node.import_template_with_progress(&name, source, progress);
            let (result, ()) = tokio::join!(work, forward);
            let settings = match &result {
                Ok(info) => store
                    .template_settings(&info.name)
                    .await
                    .map_err(ControlError::from),
                Err(_) => Ok(Default::default()),
            };
            let _ = out.send(
                match result
                    .map_err(ControlError::from)
                    .and_then(|info| settings.map(|s| s.apply(template_dto(&info))))
                {
                    Ok(template) => TemplateLog::Done { template },
                    Err(e) => TemplateLog::Error {
                        error: e.body().error,
                    },
                },
            );
        });
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx).boxed()
    }
}

fn log_line(ev: TemplateEvent) -> TemplateLog {
    match ev {
        TemplateEvent::Step { n, of, text } => TemplateLog::Step { n, of, text },
        TemplateEvent::Note(text) => TemplateLog::Note { text },
        TemplateEvent::Output(text) => TemplateLog::Output { text },
    }
}

impl Engine {
    /// Every version of a template (internal ones are not shown: 404).
    pub async fn get_template(&self, name: &str) -> ControlResult<space_api::TemplateDetail> {
        let versions = if name.starts_with(crate::build::BUILD_PREFIX) {
            Vec::new()
        } else {
            self.node.template_versions(name).await?
        };
        if versions.is_empty() {
            return Err(ControlError::not_found(format!(
                "template {name} not found"
            )));
        }
        let settings = self.store.template_settings(name).await?;
        Ok(space_api::TemplateDetail {
            name: name.to_string(),
            runtime: settings.runtime.clone(),
            replicas: settings.replicas,
            versions: versions
                .iter()
                .map(|t| settings.apply(template_dto(t)))
                .collect(),
        })
    }

    /// A new version of `name` with the start settings of `req` merged over the newest
    /// version's (decision 0019).
    pub async fn set_template_start(
        &self,
        name: &str,
        req: space_api::SetTemplateStart,
    ) -> ControlResult<space_api::Template> {
        check_template_name(name)?;
        let Some(latest) = self.node.template_versions(name).await?.pop() else {
            return Err(ControlError::not_found(format!(
                "template {name} not found"
            )));
        };
        let mut d = latest.defaults.clone();
        let check = |what: &str, v: &str| -> ControlResult<()> {
            if v.len() > MAX_COMMAND_LEN || v.contains('\0') {
                return Err(ControlError::invalid(format!(
                    "{what} must be at most {MAX_COMMAND_LEN} bytes with no NUL"
                )));
            }
            Ok(())
        };
        if let Some(s) = req.start_cmd {
            check("start_cmd", &s)?;
            d.start_cmd = match s.as_str() {
                "" => None,
                "image" => {
                    let argv: Vec<String> =
                        d.entrypoint.iter().chain(d.cmd.iter()).cloned().collect();
                    if argv.is_empty() {
                        return Err(ControlError::invalid(format!(
                            "start_cmd \"image\": template {name} has no image ENTRYPOINT or CMD"
                        )));
                    }
                    Some(shell_join(&argv))
                }
                _ => Some(s),
            };
        }
        if let Some(r) = req.ready_cmd {
            check("ready_cmd", &r)?;
            d.ready_cmd = Some(r).filter(|r| !r.is_empty());
        }
        if let Some(t) = req.ready_timeout_secs {
            if !(1..=MAX_READY_TIMEOUT_SECS).contains(&t) {
                return Err(ControlError::invalid(format!(
                    "ready_timeout_secs must be 1..={MAX_READY_TIMEOUT_SECS}"
                )));
            }
            d.ready_timeout_secs = Some(t);
        }
        let info = self
            .node
            .import_template(
                name,
                TemplateSource::Derived {
                    from: name.to_string(),
                    defaults: d,
                },
            )
            .await?;
        self.template_out(&info).await
    }

    /// Deletes a version, or the whole template; refused while sandboxes use it (409).
    pub async fn remove_template(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> ControlResult<space_api::TemplateRemoved> {
        check_template_name(name)?;
        let versions = self.node.remove_template(name, version).await?;
        if self.node.template_versions(name).await?.is_empty() {
            // Settings of a template that is gone would surprise a later one of that name.
            self.store
                .put_template_settings(name, &Default::default())
                .await?;
        }
        Ok(space_api::TemplateRemoved {
            name: name.to_string(),
            versions,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shell_join_quotes_what_needs_it() {
        let argv: Vec<String> = ["python3", "-m", "http.server", "it's here", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            super::shell_join(&argv),
            "python3 -m http.server 'it'\\''s here' ''"
        );
    }
}
