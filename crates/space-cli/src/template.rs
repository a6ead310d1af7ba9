//! `space template ...`: import, pull, list, settings and templates from snapshots.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use space_api::{Client, TemplateLog};

use crate::print_json;

#[derive(Debug, Subcommand)]
pub(crate) enum TemplateCmd {
    /// Import a template from a directory or a tarball (.tar, .tar.gz, .tar.zst): a root
    /// filesystem, an OCI image layout, or a `docker save` archive.
    Import {
        name: String,
        path: PathBuf,
        /// Make a new version when NAME exists.
        #[arg(long)]
        replace: bool,
    },
    /// Build template NAME from a Dockerfile: every RUN runs in a sandbox of the build; each
    /// step is cached (a rebuild re-runs from the first changed step).
    Build {
        name: String,
        /// The build context (default: the current directory).
        #[arg(default_value = ".")]
        context: PathBuf,
        /// The Dockerfile (default: CONTEXT/Dockerfile).
        #[arg(short = 'f', long = "file")]
        file: Option<PathBuf>,
        /// A value for an ARG (repeatable).
        #[arg(long = "build-arg", value_name = "K=V", value_parser = crate::parse_kv)]
        build_args: Vec<(String, String)>,
        /// Run every step again.
        #[arg(long)]
        no_cache: bool,
        /// The build sandboxes' egress (default open).
        #[arg(long, default_value = "open", value_parser = ["open", "none"])]
        egress: String,
        /// Plain HTTP to the registry of an image FROM names.
        #[arg(long)]
        insecure: bool,
        /// Make a new version when NAME exists.
        #[arg(long)]
        replace: bool,
    },
    /// Pull an image from an OCI registry into template NAME (REF as `docker pull` takes it:
    /// python:3.12-slim, localhost:5000/team/app@sha256:...).
    Pull {
        name: String,
        reference: String,
        /// For basic auth, or a token realm that asks for credentials.
        #[arg(long)]
        username: Option<String>,
        /// Read the password from stdin (one line).
        #[arg(long, requires = "username")]
        password_stdin: bool,
        /// Speak plain HTTP to the registry.
        #[arg(long)]
        insecure: bool,
        /// Make a new version when NAME exists.
        #[arg(long)]
        replace: bool,
    },
    /// Show a template's versions (source, created, path) and settings.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove a template (every version) or one version of it; refused while sandboxes use
    /// it.
    Rm {
        name: String,
        #[arg(long)]
        version: Option<u32>,
    },
    /// List templates.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Make a new version of template NAME from a sandbox's disk snapshot, with no copy
    /// (a namespace sandbox's; the template keeps the sandbox's template defaults).
    FromSnapshot {
        name: String,
        id: String,
        snap: String,
    },
    /// Set a template's settings: the runtime its creates get when they name none
    /// (`default`: the node's), and its start and ready commands (a new version).
    Set {
        name: String,
        #[arg(long, value_name = "namespace|microvm|default")]
        runtime: Option<String>,
        /// Replicas the template's sandboxes get when their create names none (0 or 1;
        /// decision 0037).
        #[arg(long, value_name = "N")]
        replicas: Option<u32>,
        /// Whether other tenants may read it and create sandboxes of it (decision 0048;
        /// default: shared for the `default` tenant's templates, private for another's).
        #[arg(long, value_name = "true|false")]
        shared: Option<bool>,
        /// Started in the background in every new sandbox (`image`: the image's ENTRYPOINT
        /// and CMD; `none`: no start command). Makes a new version.
        #[arg(long, value_name = "CMD")]
        start_cmd: Option<String>,
        /// Retried until it exits 0; creates answer then (`none`: no ready command). Makes a
        /// new version.
        #[arg(long, value_name = "CMD")]
        ready_cmd: Option<String>,
        /// How long the ready command may take, in seconds (default 60).
        #[arg(long, value_name = "SECS")]
        ready_timeout: Option<u64>,
    },
}

pub(crate) async fn run(c: Client, cmd: TemplateCmd) -> Result<i32> {
    match cmd {
        TemplateCmd::Show { name, json } => {
            let t = c.get_template(&name).await?;
            if json {
                print_json(&t)?;
            } else {
                println!(
                    "{} (runtime {}, replicas {})",
                    t.name,
                    t.runtime.as_deref().unwrap_or("default"),
                    t.replicas.unwrap_or(0)
                );
                println!("{:>7}  {:<25}  SOURCE", "VERSION", "CREATED");
                for v in &t.versions {
                    println!(
                        "{:>7}  {:<25}  {}",
                        v.version,
                        v.created_at,
                        v.source.as_deref().unwrap_or("-")
                    );
                }
            }
            Ok(0)
        }
        TemplateCmd::Rm { name, version } => {
            let r = c.remove_template(&name, version).await?;
            let vs: Vec<String> = r.versions.iter().map(u32::to_string).collect();
            println!("removed {} version {}", r.name, vs.join(", "));
            Ok(0)
        }
        TemplateCmd::Build {
            name,
            context,
            file,
            build_args,
            no_cache,
            egress,
            insecure,
            replace,
        } => {
            check_name(&c, &name, replace).await?;
            let dockerfile = file.unwrap_or_else(|| context.join("Dockerfile"));
            let (tar, n) = tokio::task::spawn_blocking(move || {
                crate::build::context_tar(&context, &dockerfile)
            })
            .await??;
            eprintln!("sending the build context ({n} entries)");
            let q = crate::build::query(no_cache, replace, &egress, insecure, &build_args);
            let log = c.build_template(&name, &q, tar.path()).await?;
            let t = follow(log).await?;
            println!("{} {}", t.name, t.version);
            Ok(0)
        }
        TemplateCmd::Pull {
            name,
            reference,
            username,
            password_stdin,
            insecure,
            replace,
        } => {
            let password = if password_stdin {
                let mut line = String::new();
                std::io::stdin()
                    .read_line(&mut line)
                    .context("cannot read the password from stdin")?;
                Some(line.trim_end_matches(['\n', '\r']).to_string())
            } else {
                None
            };
            let req = space_api::PullTemplate {
                reference,
                username,
                password,
                insecure,
                replace,
            };
            let log = c.pull_template(&name, &req).await?;
            let t = follow(log).await?;
            println!("{} {}", t.name, t.version);
            Ok(0)
        }
        TemplateCmd::Import {
            name,
            path,
            replace,
        } => {
            check_name(&c, &name, replace).await?;
            let t = import_template(&c, &name, &path, replace).await?;
            println!("{} {}", t.name, t.version);
            Ok(0)
        }
        TemplateCmd::FromSnapshot { name, id, snap } => {
            let req = space_api::TemplateFromSnapshot {
                sandbox: id,
                snapshot: snap,
            };
            let t = c.template_from_snapshot(&name, &req).await?;
            println!("{} {}", t.name, t.version);
            Ok(0)
        }
        TemplateCmd::Ls { json } => {
            let list = c.list_templates().await?;
            if json {
                print_json(&space_api::TemplateList { templates: list })?;
            } else {
                println!(
                    "{:<20}  {:>7}  {:<9}  {:<16}  {:<7}  CREATED",
                    "NAME", "VERSION", "RUNTIME", "TENANT", "SHARED"
                );
                for t in list {
                    println!(
                        "{:<20}  {:>7}  {:<9}  {:<16}  {:<7}  {}",
                        t.name,
                        t.version,
                        t.runtime.as_deref().unwrap_or("default"),
                        t.tenant,
                        if t.shared { "yes" } else { "no" },
                        t.created_at
                    );
                }
            }
            Ok(0)
        }
        TemplateCmd::Set {
            name,
            runtime,
            replicas,
            shared,
            start_cmd,
            ready_cmd,
            ready_timeout,
        } => {
            if runtime.is_none()
                && replicas.is_none()
                && shared.is_none()
                && start_cmd.is_none()
                && ready_cmd.is_none()
                && ready_timeout.is_none()
            {
                bail!(
                    "nothing to set: pass --runtime, --replicas, --shared, --start-cmd, \
                     --ready-cmd or --ready-timeout"
                );
            }
            if runtime.is_some() || replicas.is_some() || shared.is_some() {
                // The settings are replaced whole: what is not given stays as it is. (A
                // template that cannot be read gets the server's own refusal below.)
                let now = c.get_template(&name).await.ok();
                let req = space_api::SetTemplateSettings {
                    runtime: match runtime {
                        Some(r) => (r != "default").then_some(r),
                        None => now.as_ref().and_then(|t| t.runtime.clone()),
                    },
                    replicas: replicas.or(now.as_ref().and_then(|t| t.replicas)),
                    shared: shared.or(now
                        .as_ref()
                        .and_then(|t| t.versions.last())
                        .map(|v| v.shared)),
                };
                let t = c.set_template_settings(&name, &req).await?;
                println!(
                    "{} runtime {}, replicas {}, {}",
                    t.name,
                    t.runtime.as_deref().unwrap_or("default"),
                    t.replicas.unwrap_or(0),
                    if t.shared { "shared" } else { "private" }
                );
            }
            if start_cmd.is_some() || ready_cmd.is_some() || ready_timeout.is_some() {
                let clear =
                    |v: Option<String>| v.map(|v| if v == "none" { String::new() } else { v });
                let req = space_api::SetTemplateStart {
                    start_cmd: clear(start_cmd),
                    ready_cmd: clear(ready_cmd),
                    ready_timeout_secs: ready_timeout,
                };
                let t = c.set_template_start(&name, &req).await?;
                println!(
                    "{} version {}: start {}, ready {}",
                    t.name,
                    t.version,
                    t.start_cmd.as_deref().unwrap_or("none"),
                    t.ready_cmd.as_deref().unwrap_or("none")
                );
            }
            Ok(0)
        }
    }
}

/// Uploads a template: a directory is tarred first (to a temp file, streamed); a tarball
/// is uploaded as is.
async fn import_template(
    c: &Client,
    name: &str,
    path: &Path,
    replace: bool,
) -> Result<space_api::Template> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.is_dir() {
        let src = path.to_path_buf();
        let tmp = tokio::task::spawn_blocking(move || -> Result<tempfile::NamedTempFile> {
            let tmp = tempfile::NamedTempFile::new().context("cannot create a temporary file")?;
            let mut b = tar::Builder::new(std::io::BufWriter::new(tmp.reopen()?));
            b.follow_symlinks(false);
            b.mode(tar::HeaderMode::Complete);
            b.append_dir_all(".", &src)
                .with_context(|| format!("cannot archive {}", src.display()))?;
            b.into_inner()?.into_inner().map_err(|e| e.into_error())?;
            Ok(tmp)
        })
        .await??;
        Ok(c.import_template_file(name, tmp.path(), replace).await?)
    } else if meta.is_file() {
        Ok(c.import_template_file(name, path, replace).await?)
    } else {
        bail!("{} is neither a directory nor a tarball", path.display())
    }
}

/// Shows a template's progress on stderr as it comes; the new version at its end.
pub(crate) async fn follow(
    log: space_api::client::TemplateLogStream,
) -> Result<space_api::Template> {
    let t0 = std::time::Instant::now();
    let t = space_api::client::finish_template_log(log, |line| match line {
        TemplateLog::Step { n, of, text } => eprintln!("[{n}/{of}] {text}"),
        TemplateLog::Note { text } => eprintln!("note: {text}"),
        TemplateLog::Output { text } => eprintln!("  | {text}"),
        TemplateLog::Done { .. } | TemplateLog::Error { .. } => {}
    })
    .await?;
    eprintln!(
        "{} version {} ready in {:.1} s",
        t.name,
        t.version,
        t0.elapsed().as_secs_f64()
    );
    Ok(t)
}

/// Refuses, before anything is uploaded, a name the server would refuse (the server checks
/// again): not a valid name, or taken without `--replace`.
async fn check_name(c: &Client, name: &str, replace: bool) -> Result<()> {
    if !space_api::is_valid_template_name(name) {
        bail!("invalid template name {name:?}: expected [a-z0-9][a-z0-9._-]{{0,62}}");
    }
    if !replace && c.list_templates().await?.iter().any(|t| t.name == name) {
        bail!("template {name} exists: pass --replace to make a new version of it");
    }
    Ok(())
}
