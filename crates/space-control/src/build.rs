//! Dockerfile builds (decision 0018): `POST /v1/templates/{name}/build` with the build
//! context as a tar body. Every RUN executes in a sandbox of the build (namespace runtime,
//! egress per `egress`), never on the host; COPY and ADD write through the sandbox's daemon.
//! Each step that changes files ends as an internal template, `space-build-<key>`, whose key
//! is the parent's key, the instruction and the hash of the files it copies: a rebuild
//! starts from the newest step whose key it already has. ENV, USER, WORKDIR, LABEL, CMD and
//! ENTRYPOINT only change the template's defaults (and the keys after them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use futures::stream::BoxStream;
use sha2::{Digest, Sha256};
use space_api::net::{Egress, NetworkPolicy};
use space_api::{CreateSandbox, CreateSnapshot, ExecEvent, ExecRequest, Template, TemplateLog};
use space_node_api::{PullSpec, TemplateDefaults, TemplateEvent, TemplateSource};
use space_proto as pb;
use tokio::sync::mpsc::UnboundedSender;

use crate::dockerfile::{Command, Instruction, Step, parse};
use crate::engine::{Engine, ExecReply};
use crate::error::{ControlError, ControlResult};
use crate::templates::check_template_name;

/// Internal templates (build steps, base images) carry this prefix; users cannot name one so.
pub const BUILD_PREFIX: &str = "space-build-";
/// Largest Dockerfile accepted.
const MAX_DOCKERFILE_BYTES: u64 = 1 << 20;
/// Lines of a failed RUN's output repeated in its error.
const TAIL_LINES: usize = 20;
/// A build sandbox's memory (pip and npm installs need more than a create's default).
const BUILD_MEMORY_MIB: u64 = 2048;

/// The query of a build: `dockerfile`, `no_cache`, `replace`, `egress`, `insecure`, and
/// `build_arg=K=V` (repeatable).
#[derive(Debug, Default, Clone)]
pub struct BuildOptions {
    pub dockerfile: String,
    pub no_cache: bool,
    pub replace: bool,
    pub egress: Egress,
    pub insecure: bool,
    pub build_args: BTreeMap<String, String>,
}

fn parse_bool(k: &str, v: &str) -> ControlResult<bool> {
    match v {
        "true" | "1" => Ok(true),
        "false" | "0" | "" => Ok(false),
        _ => Err(ControlError::invalid(format!(
            "{k}={v:?}: expected true or false"
        ))),
    }
}

impl BuildOptions {
    pub fn from_query(q: Option<&str>) -> ControlResult<Self> {
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(q.unwrap_or_default())
            .map_err(|e| ControlError::invalid(format!("bad query: {e}")))?;
        let mut o = BuildOptions {
            dockerfile: "Dockerfile".into(),
            ..Default::default()
        };
        for (k, v) in pairs {
            match k.as_str() {
                "dockerfile" => o.dockerfile = v,
                "no_cache" => o.no_cache = parse_bool(&k, &v)?,
                "replace" => o.replace = parse_bool(&k, &v)?,
                "insecure" => o.insecure = parse_bool(&k, &v)?,
                "egress" => {
                    o.egress = match v.as_str() {
                        "open" => Egress::Open,
                        "none" => Egress::None,
                        _ => {
                            return Err(ControlError::invalid(format!(
                                "egress={v:?}: expected open or none"
                            )));
                        }
                    }
                }
                "build_arg" => match v.split_once('=') {
                    Some((n, val)) if !n.is_empty() => {
                        o.build_args.insert(n.to_string(), val.to_string());
                    }
                    _ => {
                        return Err(ControlError::invalid(format!(
                            "build_arg={v:?}: expected NAME=VALUE"
                        )));
                    }
                },
                _ => {
                    return Err(ControlError::invalid(format!(
                        "unknown query parameter {k:?}"
                    )));
                }
            }
        }
        Ok(o)
    }
}

/// A context path (`a/b`, `./c`) as components beneath the context; `None` if it climbs out.
fn context_rel(p: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if !out.pop() {
                    return None;
                }
            }
            c => out.push(c),
        }
    }
    Some(out)
}

/// A file COPY sends: where in the image, its mode, its bytes.
struct CopyFile {
    dest: String,
    mode: u32,
    data: Vec<u8>,
    /// The instruction's destination (where ADD unpacks an archive).
    dir: String,
}

/// What a COPY/ADD sends: files, directories to make, the hash of it all (its cache key's
/// part), and notes on what was skipped.
#[derive(Default)]
struct CopyPlan {
    files: Vec<CopyFile>,
    dirs: Vec<String>,
    hash: String,
    notes: Vec<String>,
}

/// Plans a COPY/ADD from the context.
fn collect_copy(
    context: &Path,
    srcs: &[String],
    dest: &str,
    workdir: &str,
    chmod: Option<u32>,
) -> Result<CopyPlan, String> {
    let dest_abs = if dest.starts_with('/') {
        dest.to_string()
    } else {
        format!("{}/{dest}", workdir.trim_end_matches('/'))
    };
    let many = srcs.len() > 1 || dest.ends_with('/') || dest == "." || dest.ends_with("/.");
    let (mut files, mut dirs, mut notes) = (Vec::new(), Vec::new(), Vec::new());
    let mut hasher = Sha256::new();
    hasher.update(dest_abs.as_bytes());
    for src in srcs {
        let rel = context_rel(src)
            .ok_or_else(|| format!("COPY source {src:?} is outside the build context"))?;
        // A `*` or `?` in the last component matches names in its directory.
        let (dir_rel, pattern) = match rel.file_name().map(|n| n.to_string_lossy().into_owned()) {
            Some(n) if n.contains(['*', '?', '[']) => {
                (rel.parent().unwrap_or(Path::new("")).to_path_buf(), Some(n))
            }
            _ => (rel.clone(), None),
        };
        let matches: Vec<PathBuf> = match pattern {
            None => vec![dir_rel.clone()],
            Some(p) => {
                let glob = globset::Glob::new(&p)
                    .map_err(|e| format!("COPY source {src:?}: {e}"))?
                    .compile_matcher();
                let mut m: Vec<PathBuf> = std::fs::read_dir(context.join(&dir_rel))
                    .map_err(|e| format!("COPY source {src:?}: {e}"))?
                    .flatten()
                    .filter(|e| glob.is_match(e.file_name()))
                    .map(|e| dir_rel.join(e.file_name()))
                    .collect();
                m.sort();
                if m.is_empty() {
                    return Err(format!(
                        "COPY source {src:?} matches no file in the build context"
                    ));
                }
                m
            }
        };
        for m in matches {
            let host = context.join(&m);
            let md = std::fs::symlink_metadata(&host)
                .map_err(|_| format!("COPY source {src:?} is not in the build context"))?;
            if md.is_dir() {
                // A directory's contents go into the destination.
                let base = dest_abs.trim_end_matches('/').to_string();
                dirs.push(base.clone());
                let mut out = Out {
                    top: &base,
                    chmod,
                    files: &mut files,
                    dirs: &mut dirs,
                    notes: &mut notes,
                };
                walk(&host, &base, &mut out)?;
            } else if md.is_file() {
                let data =
                    std::fs::read(&host).map_err(|e| format!("read {}: {e}", m.display()))?;
                let mode = chmod
                    .unwrap_or(std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o7777);
                let dest = match m.file_name() {
                    Some(n) if many => {
                        format!("{}/{}", dest_abs.trim_end_matches('/'), n.to_string_lossy())
                    }
                    _ => dest_abs.clone(),
                };
                files.push(CopyFile {
                    dest,
                    mode,
                    data,
                    dir: dest_abs.clone(),
                });
            } else {
                notes.push(format!(
                    "skipped {} (not a regular file or directory)",
                    m.display()
                ));
            }
        }
    }
    files.sort_by(|a, b| a.dest.cmp(&b.dest));
    for f in &files {
        hasher.update(f.dest.as_bytes());
        hasher.update(f.mode.to_le_bytes());
        hasher.update(Sha256::digest(&f.data));
    }
    for d in &dirs {
        hasher.update(d.as_bytes());
    }
    Ok(CopyPlan {
        files,
        dirs,
        hash: format!("{:x}", hasher.finalize()),
        notes,
    })
}

/// Where [`walk`] puts what it finds.
struct Out<'a> {
    /// The COPY's destination directory (where ADD unpacks archives).
    top: &'a str,
    chmod: Option<u32>,
    files: &'a mut Vec<CopyFile>,
    dirs: &'a mut Vec<String>,
    notes: &'a mut Vec<String>,
}

fn walk(dir: &Path, dest: &str, out: &mut Out<'_>) -> Result<(), String> {
    let mut ents: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("read {}: {e}", dir.display()))?
        .flatten()
        .collect();
    ents.sort_by_key(|e| e.file_name());
    for e in ents {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == space_api::BUILD_DOCKERFILE_ENTRY {
            continue;
        }
        let md = std::fs::symlink_metadata(e.path()).map_err(|e| e.to_string())?;
        let d = format!("{dest}/{name}");
        if md.is_dir() {
            out.dirs.push(d.clone());
            walk(&e.path(), &d, out)?;
        } else if md.is_file() {
            let data = std::fs::read(e.path()).map_err(|err| format!("read {name}: {err}"))?;
            let mode = out
                .chmod
                .unwrap_or(std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o7777);
            out.files.push(CopyFile {
                dest: d,
                mode,
                data,
                dir: out.top.to_string(),
            });
        } else {
            out.notes.push(format!(
                "skipped {d} (a symlink or special file in the context)"
            ));
        }
    }
    Ok(())
}

fn key_of(parent: &str, step: &Step, extra: &str) -> String {
    format!(
        "{:x}",
        Sha256::digest(format!("{parent}\n{}\n{extra}", step.text).as_bytes())
    )
}

fn step_template(key: &str) -> String {
    format!("{BUILD_PREFIX}{}", &key[..32])
}

/// What a build carries from step to step.
struct BuildState {
    /// The template the next filesystem step starts from.
    base: String,
    key: String,
    defaults: TemplateDefaults,
    shell: Vec<String>,
    /// Declared ARGs and their values, for RUN's environment.
    args: BTreeMap<String, String>,
    /// The base's start command, ready command and timeout, given back to the result.
    start: (Option<String>, Option<String>, Option<u64>),
}

struct Build {
    engine: Arc<Engine>,
    name: String,
    /// The tenant whose key asked for the build (None: an admin key): FROM sees only the
    /// templates it may use (decision 0048).
    tenant: Option<String>,
    opts: BuildOptions,
    context: PathBuf,
    steps: Vec<Step>,
    out: UnboundedSender<TemplateLog>,
}

impl Build {
    fn say(&self, line: TemplateLog) {
        let _ = self.out.send(line);
    }

    fn step(&self, i: usize, text: String) {
        self.say(TemplateLog::Step {
            n: i as u32 + 1,
            of: self.steps.len() as u32,
            text,
        });
    }

    /// Whether the build's tenant may start FROM template `name`: one it may see (another
    /// tenant's private template, or a build's internal step, is no template to it, and FROM
    /// then looks for an image of that name).
    async fn may_use(&self, name: &str) -> ControlResult<bool> {
        let Some(tenant) = &self.tenant else {
            return Ok(true);
        };
        Ok(!name.starts_with(BUILD_PREFIX)
            && self
                .engine
                .store
                .template_settings(name)
                .await?
                .visible_to(tenant))
    }

    /// FROM: a template on the node, else an image pulled once into an internal template.
    async fn from(
        &self,
        image: &str,
        all: &[space_node_api::TemplateInfo],
    ) -> ControlResult<(String, String, TemplateDefaults)> {
        if let Some(t) = all.iter().find(|t| t.name == image)
            && self.may_use(&t.name).await?
        {
            return Ok((
                t.name.clone(),
                format!("template {}@{} {}", t.name, t.version, t.source),
                t.defaults.clone(),
            ));
        }
        let internal = format!(
            "{BUILD_PREFIX}img-{}",
            &format!("{:x}", Sha256::digest(image.as_bytes()))[..24]
        );
        let have = all.iter().find(|t| t.name == internal);
        let info = match have {
            Some(t) if !self.opts.no_cache => t.clone(),
            _ => {
                let (progress, mut events) = tokio::sync::mpsc::unbounded_channel();
                let out = self.out.clone();
                let fwd = async move {
                    while let Some(ev) = events.recv().await {
                        if let TemplateEvent::Note(text) | TemplateEvent::Step { text, .. } = ev {
                            let _ = out.send(TemplateLog::Output { text });
                        }
                    }
                };
                let pull = self.engine.node.import_template_with_progress(
                    &internal,
                    TemplateSource::Registry(PullSpec {
                        reference: image.to_string(),
                        insecure: self.opts.insecure,
                        ..Default::default()
                    }),
                    progress,
                );
                let (r, ()) = tokio::join!(pull, fwd);
                r.map_err(|e| match e {
                    space_node_api::NodeError::NotFound { .. } => ControlError::not_found(format!(
                        "FROM {image}: no template {image} on the node, and no such image in its registry"
                    )),
                    e => ControlError::from(e),
                })?
            }
        };
        Ok((
            info.name.clone(),
            format!("image {}", info.source),
            info.defaults,
        ))
    }

    async fn run(self) -> ControlResult<Template> {
        let t0 = Instant::now();
        // The node's templates when the build starts: the step cache is looked up in them.
        let all = self.engine.node.list_templates().await?;
        let have: std::collections::HashSet<&str> = all.iter().map(|t| t.name.as_str()).collect();
        let mut st = BuildState {
            base: String::new(),
            key: String::new(),
            defaults: TemplateDefaults::default(),
            shell: vec!["/bin/sh".into(), "-c".into()],
            args: BTreeMap::new(),
            start: (None, None, None),
        };
        for (i, step) in self.steps.iter().enumerate() {
            let line = step.line;
            match &step.instruction {
                Instruction::From(image) => {
                    let (mut base, desc, mut defaults) = self.from(image, &all).await?;
                    st.key = key_of("", step, &desc);
                    // The base's start and ready commands are the result's too, but no build
                    // sandbox runs them (as docker build never runs CMD): the steps start from
                    // a version of the base without them.
                    st.start = (
                        defaults.start_cmd.take(),
                        defaults.ready_cmd.take(),
                        defaults.ready_timeout_secs.take(),
                    );
                    if st.start.0.is_some() || st.start.1.is_some() {
                        let quiet = step_template(&st.key);
                        if self.opts.no_cache || !have.contains(quiet.as_str()) {
                            self.engine
                                .node
                                .import_template(
                                    &quiet,
                                    TemplateSource::Derived {
                                        from: base.clone(),
                                        defaults: defaults.clone(),
                                    },
                                )
                                .await?;
                        }
                        base = quiet;
                    }
                    st.base = base;
                    st.defaults = defaults;
                    self.step(i, format!("{} ({desc})", step.text));
                }
                Instruction::Arg(n, default) => {
                    if let Some(v) = self.opts.build_args.get(n).or(default.as_ref()) {
                        st.args.insert(n.clone(), v.clone());
                    }
                    st.key = key_of(&st.key, step, &format!("{:?}", st.args.get(n)));
                    self.step(i, step.text.clone());
                }
                Instruction::Env(pairs) => {
                    for (k, v) in pairs {
                        st.defaults.env.insert(k.clone(), v.clone());
                    }
                    st.key = key_of(&st.key, step, "");
                    self.step(i, step.text.clone());
                }
                Instruction::Workdir(d) => {
                    let abs = if d.starts_with('/') {
                        d.clone()
                    } else {
                        format!(
                            "{}/{d}",
                            st.defaults
                                .workdir
                                .clone()
                                .unwrap_or_else(|| "/".into())
                                .trim_end_matches('/')
                        )
                    };
                    st.defaults.workdir = Some(abs);
                    st.key = key_of(&st.key, step, "");
                    self.step(i, step.text.clone());
                }
                Instruction::User(u) => {
                    st.defaults.user = Some(u.split(':').next().unwrap_or_default().to_string());
                    st.key = key_of(&st.key, step, "");
                    self.step(i, step.text.clone());
                }
                Instruction::Label(_) | Instruction::Ignored(_) => {
                    self.step(i, format!("{} (no effect on a template)", step.text));
                }
                Instruction::Entrypoint(c) | Instruction::Cmd(c) => {
                    let argv = match c {
                        Command::Exec(v) => v.clone(),
                        Command::Shell(s) => {
                            let mut v = st.shell.clone();
                            v.push(s.clone());
                            v
                        }
                    };
                    if matches!(step.instruction, Instruction::Entrypoint(_)) {
                        st.defaults.entrypoint = argv;
                    } else {
                        st.defaults.cmd = argv;
                    }
                    st.key = key_of(&st.key, step, "");
                    self.step(i, step.text.clone());
                }
                Instruction::Shell(v) => {
                    st.shell = v.clone();
                    st.key = key_of(&st.key, step, "");
                    self.step(i, step.text.clone());
                }
                Instruction::Run(_) | Instruction::Copy { .. } => {
                    let mut copy = None;
                    let extra = match &step.instruction {
                        Instruction::Copy {
                            srcs, dest, chmod, ..
                        } => {
                            let workdir = st.defaults.workdir.clone().unwrap_or_else(|| "/".into());
                            let (ctx, srcs, dest, chmod) =
                                (self.context.clone(), srcs.clone(), dest.clone(), *chmod);
                            let collected = tokio::task::spawn_blocking(move || {
                                collect_copy(&ctx, &srcs, &dest, &workdir, chmod)
                            })
                            .await
                            .map_err(ControlError::internal)?
                            .map_err(|m| {
                                ControlError::invalid(format!("Dockerfile line {line}: {m}"))
                            })?;
                            let hash = collected.hash.clone();
                            copy = Some(collected);
                            hash
                        }
                        _ => format!("{:?}|{:?}|{:?}", st.args, st.shell, st.defaults),
                    };
                    let key = key_of(&st.key, step, &extra);
                    let cached = step_template(&key);
                    if !self.opts.no_cache && have.contains(cached.as_str()) {
                        self.step(i, format!("{} (cached)", step.text));
                    } else {
                        self.step(i, step.text.clone());
                        let t = Instant::now();
                        self.fs_step(&st, step, copy, &cached).await?;
                        self.say(TemplateLog::Note {
                            text: format!("step {} took {:.1} s", i + 1, t.elapsed().as_secs_f64()),
                        });
                    }
                    st.key = key;
                    st.base = cached;
                }
            }
        }
        self.engine
            .check_name_free(&self.name, self.opts.replace)
            .await?;
        let mut defaults = st.defaults.clone();
        (
            defaults.start_cmd,
            defaults.ready_cmd,
            defaults.ready_timeout_secs,
        ) = st.start.clone();
        let info = self
            .engine
            .node
            .import_template(
                &self.name,
                TemplateSource::Derived {
                    from: st.base.clone(),
                    defaults,
                },
            )
            .await?;
        self.say(TemplateLog::Note {
            text: format!("built in {:.1} s", t0.elapsed().as_secs_f64()),
        });
        self.engine.template_out(&info).await
    }

    /// RUN, COPY or ADD in a fresh sandbox of `st.base`; its result becomes template `into`.
    async fn fs_step(
        &self,
        st: &BuildState,
        step: &Step,
        copy: Option<CopyPlan>,
        into: &str,
    ) -> ControlResult<()> {
        let sb = self
            .engine
            .create_sandbox(CreateSandbox {
                template: Some(st.base.clone()),
                runtime: Some("namespace".into()),
                memory_mib: Some(BUILD_MEMORY_MIB),
                network: Some(NetworkPolicy {
                    egress: Some(self.opts.egress),
                    allow: Vec::new(),
                }),
                hostname: Some("build".into()),
                ..Default::default()
            })
            .await?;
        let id = sb.id.clone();
        let result = self.in_sandbox(&id, st, step, copy, into).await;
        if let Err(e) = self.engine.delete_sandbox(&id).await {
            tracing::warn!(id, error = %e.message, "removing a build sandbox failed");
        }
        result
    }

    async fn in_sandbox(
        &self,
        id: &str,
        st: &BuildState,
        step: &Step,
        copy: Option<CopyPlan>,
        into: &str,
    ) -> ControlResult<()> {
        let line = step.line;
        if let Some(dir) = &st.defaults.workdir {
            self.mkdir(id, dir, "root").await?;
        }
        match &step.instruction {
            Instruction::Run(cmd) => {
                let argv = match cmd {
                    Command::Exec(v) => v.clone(),
                    Command::Shell(s) => {
                        let mut v = st.shell.clone();
                        v.push(s.clone());
                        v
                    }
                };
                let (code, tail) = self.exec(id, argv, st, None).await.map_err(|e| {
                    ControlError::invalid(format!(
                        "Dockerfile line {line}: {}: {}",
                        step.text, e.message
                    ))
                })?;
                if code != 0 {
                    return Err(ControlError::invalid(format!(
                        "Dockerfile line {line}: {} failed with exit code {code}; its last output:\n{}",
                        step.text,
                        tail.join("\n")
                    )));
                }
            }
            Instruction::Copy { chown, add, .. } => {
                let CopyPlan {
                    files, dirs, notes, ..
                } = copy.unwrap_or_default();
                for n in notes {
                    self.say(TemplateLog::Note { text: n });
                }
                let owner = chown
                    .as_deref()
                    .map(|c| c.split(':').next().unwrap_or("root").to_string())
                    .unwrap_or_else(|| "root".into());
                for d in &dirs {
                    self.mkdir(id, d, &owner).await?;
                }
                for f in files {
                    let is_archive = *add
                        && (f.data.starts_with(&[0x1f, 0x8b])
                            || f.data.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
                            || f.data.get(257..262) == Some(b"ustar"));
                    if is_archive {
                        // ADD unpacks a local archive into its destination: inside the
                        // sandbox, by the image's own tar.
                        let tmp = format!("/tmp/.space-add-{:08x}", rand::random::<u32>());
                        self.write(id, &tmp, 0o600, "root", f.data).await?;
                        self.mkdir(id, &f.dir, &owner).await?;
                        let argv = vec![
                            "tar".into(),
                            "-xf".into(),
                            tmp.clone(),
                            "-C".into(),
                            f.dir.clone(),
                        ];
                        let (code, tail) = self.exec(id, argv, st, Some("root")).await?;
                        let _ = self
                            .exec(id, vec!["rm".into(), "-f".into(), tmp], st, Some("root"))
                            .await;
                        if code != 0 {
                            return Err(ControlError::invalid(format!(
                                "Dockerfile line {line}: ADD could not unpack its archive into {}: {}",
                                f.dir,
                                tail.join("\n")
                            )));
                        }
                    } else {
                        self.write(id, &f.dest, f.mode, &owner, f.data).await?;
                    }
                }
            }
            _ => {}
        }
        let snap = self
            .engine
            .create_snapshot(
                id,
                CreateSnapshot {
                    label: Some(format!("build step {line}")),
                    kind: None,
                },
            )
            .await?;
        self.engine
            .node
            .import_template(
                into,
                TemplateSource::Snapshot {
                    sandbox: id.to_string(),
                    snapshot: snap.id,
                    defaults: Some(st.defaults.clone()),
                },
            )
            .await?;
        Ok(())
    }

    /// Runs `argv` as the build's user; streams its output as lines. (exit status, last lines)
    async fn exec(
        &self,
        id: &str,
        argv: Vec<String>,
        st: &BuildState,
        user: Option<&str>,
    ) -> ControlResult<(i32, Vec<String>)> {
        let req = ExecRequest {
            cmd: argv,
            env: st.args.clone(),
            cwd: st.defaults.workdir.clone(),
            user: user
                .map(str::to_string)
                .or_else(|| st.defaults.user.clone()),
            ..Default::default()
        };
        let ExecReply::Events(mut events) = self.engine.exec(id, req).await? else {
            return Err(ControlError::internal("a build exec ran in the background"));
        };
        let mut tail: std::collections::VecDeque<String> = Default::default();
        let mut partial: Vec<u8> = Vec::new();
        let mut status = None;
        let emit = |bytes: &[u8], tail: &mut std::collections::VecDeque<String>| {
            let text = String::from_utf8_lossy(bytes)
                .trim_end_matches('\r')
                .to_string();
            let _ = self.out.send(TemplateLog::Output { text: text.clone() });
            tail.push_back(text);
            if tail.len() > TAIL_LINES {
                tail.pop_front();
            }
        };
        while let Some(ev) = events.next().await {
            match ev {
                ExecEvent::Stdout { data, .. }
                | ExecEvent::Stderr { data, .. }
                | ExecEvent::Pty { data, .. } => {
                    partial.extend_from_slice(&data);
                    while let Some(pos) = partial.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = partial.drain(..=pos).collect();
                        emit(&line[..line.len() - 1], &mut tail);
                    }
                }
                ev @ ExecEvent::Exit { .. } => status = ev.exit_status(),
                ExecEvent::Error { message, .. } => return Err(ControlError::unavailable(message)),
                _ => {}
            }
        }
        if !partial.is_empty() {
            emit(&partial, &mut tail);
        }
        let status = status.ok_or_else(|| {
            ControlError::unavailable("the step's process ended without an exit status")
        })?;
        Ok((status, tail.into_iter().collect()))
    }

    async fn mkdir(&self, id: &str, path: &str, user: &str) -> ControlResult<()> {
        let mut guest = self.engine.guest(id).await?;
        match guest
            .make_dir(pb::MakeDirRequest {
                path: path.to_string(),
                mode: 0o755,
                parents: true,
                user: user.to_string(),
            })
            .await
        {
            Ok(_) => Ok(()),
            // A directory that is there already is what mkdir -p wants.
            Err(s) if s.code() == tonic::Code::AlreadyExists => Ok(()),
            Err(s) => Err(s.into()),
        }
    }

    async fn write(
        &self,
        id: &str,
        path: &str,
        mode: u32,
        user: &str,
        data: Vec<u8>,
    ) -> ControlResult<()> {
        let mut guest = self.engine.guest(id).await?;
        let open = pb::WriteFileRequest {
            msg: Some(pb::write_file_request::Msg::Open(pb::WriteFileOpen {
                path: path.to_string(),
                mode,
                make_parents: true,
                user: user.to_string(),
                append: false,
                metadata: Default::default(),
            })),
        };
        let chunks: Vec<pb::WriteFileRequest> = data
            .chunks(space_proto::CHUNK_BYTES)
            .map(|c| pb::WriteFileRequest {
                msg: Some(pb::write_file_request::Msg::Data(c.to_vec())),
            })
            .collect();
        guest
            .write_file(futures::stream::iter(std::iter::once(open).chain(chunks)))
            .await?;
        Ok(())
    }
}

impl Engine {
    /// Receives the context, parses the Dockerfile (errors name the line: 400 at once) and
    /// starts the build; its progress as it happens.
    pub async fn build_template<S, E>(
        self: &Arc<Self>,
        name: &str,
        tenant: Option<&str>,
        opts: BuildOptions,
        content_length: Option<u64>,
        body: S,
    ) -> ControlResult<BoxStream<'static, TemplateLog>>
    where
        S: futures::Stream<Item = Result<bytes::Bytes, E>> + Send + Unpin + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        // The body is read before anything is refused: a client cut short by an early answer
        // sees a broken pipe, not the error.
        let tar = self.receive_upload("context", content_length, body).await?;
        check_template_name(name)?;
        let dir = TempDir(
            self.cfg
                .data_dir
                .join("tmp")
                .join(format!("build-{:08x}", rand::random::<u32>())),
        );
        let (tar_path, ctx, df) = (
            tar.0.clone(),
            dir.0.join("context"),
            opts.dockerfile.clone(),
        );
        let dockerfile = tokio::task::spawn_blocking(move || -> ControlResult<String> {
            std::fs::create_dir_all(&ctx).map_err(|e| {
                ControlError::internal(format_args!("create {}: {e}", ctx.display()))
            })?;
            let f = std::fs::File::open(&tar_path).map_err(ControlError::internal)?;
            space_unpack::apply_layer(&ctx, f).map_err(|e| {
                ControlError::invalid(format!("the build context is not a valid tar archive: {e}"))
            })?;
            let rel = context_rel(&df).ok_or_else(|| {
                ControlError::invalid(format!("dockerfile {df:?} is outside the build context"))
            })?;
            let path = ctx.join(rel);
            let md = std::fs::symlink_metadata(&path).map_err(|_| {
                ControlError::invalid(format!("no Dockerfile {df:?} in the build context"))
            })?;
            if !md.is_file() || md.len() > MAX_DOCKERFILE_BYTES {
                return Err(ControlError::invalid(format!(
                    "Dockerfile {df:?} is not a regular file of at most 1 MiB"
                )));
            }
            std::fs::read_to_string(&path)
                .map_err(|e| ControlError::invalid(format!("Dockerfile {df:?}: {e}")))
        })
        .await
        .map_err(ControlError::internal)??;
        drop(tar);
        let steps = parse(&dockerfile, &opts.build_args)
            .map_err(|e| ControlError::invalid(e.to_string()))?;
        self.check_name_free(name, opts.replace).await?;
        let (out, rx) = tokio::sync::mpsc::unbounded_channel();
        let build = Build {
            engine: self.clone(),
            name: name.to_string(),
            tenant: tenant.map(str::to_owned),
            opts,
            context: dir.0.join("context"),
            steps,
            out: out.clone(),
        };
        tokio::spawn(async move {
            let _dir = dir;
            let last = match build.run().await {
                Ok(template) => TemplateLog::Done { template },
                Err(e) => TemplateLog::Error {
                    error: e.body().error,
                },
            };
            let _ = out.send(last);
        });
        Ok(tokio_stream::wrappers::UnboundedReceiverStream::new(rx).boxed())
    }
}

/// Removes a directory tree when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_paths_never_climb_out() {
        assert_eq!(context_rel("./a/../b").unwrap(), PathBuf::from("b"));
        assert!(context_rel("../x").is_none());
        assert!(context_rel("a/../../x").is_none());
        assert_eq!(context_rel(".").unwrap(), PathBuf::new());
    }

    #[test]
    fn options_come_from_the_query() {
        let o = BuildOptions::from_query(Some(
            "dockerfile=d%2FDockerfile&no_cache=true&build_arg=A%3D1&build_arg=B%3D2&egress=none",
        ))
        .unwrap();
        assert_eq!(o.dockerfile, "d/Dockerfile");
        assert!(o.no_cache);
        assert_eq!(o.egress, Egress::None);
        assert_eq!(o.build_args.len(), 2);
        for bad in [
            "bogus=1",
            "egress=some",
            "build_arg=novalue",
            "replace=maybe",
        ] {
            assert!(BuildOptions::from_query(Some(bad)).is_err(), "{bad}");
        }
    }
}
