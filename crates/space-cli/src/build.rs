//! `space template build`: the build context is tarred here (without what `.dockerignore`
//! excludes, never following symlinks), the Dockerfile added to it, and the build's progress
//! shown as it comes (decision 0018).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use globset::GlobMatcher;

use space_api::BUILD_DOCKERFILE_ENTRY as DOCKERFILE_ENTRY;

/// `.dockerignore`: patterns in order, `!` re-includes; a path is excluded when the last
/// pattern matching it (or one of its parent directories) excludes.
pub(crate) struct Ignore(Vec<(GlobMatcher, bool)>);

impl Ignore {
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let mut v = Vec::new();
        for raw in text.lines() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (neg, pat) = match line.strip_prefix('!') {
                Some(p) => (true, p.trim()),
                None => (false, line),
            };
            let pat = pat.trim_start_matches('/').trim_end_matches('/');
            let pat = pat.strip_prefix("./").unwrap_or(pat);
            if pat.is_empty() {
                continue;
            }
            let g = globset::GlobBuilder::new(pat)
                .literal_separator(true)
                .build()
                .with_context(|| format!(".dockerignore: bad pattern {line:?}"))?;
            v.push((g.compile_matcher(), neg));
        }
        Ok(Self(v))
    }

    pub(crate) fn excluded(&self, rel: &str) -> bool {
        let mut out = false;
        for (g, neg) in &self.0 {
            // The pattern applies to the path and to every directory above it.
            let mut p = rel;
            let hit = loop {
                if g.is_match(p) {
                    break true;
                }
                match p.rsplit_once('/') {
                    Some((parent, _)) => p = parent,
                    None => break false,
                }
            };
            if hit {
                out = !neg;
            }
        }
        out
    }
}

/// Tars `context` (minus `.dockerignore`'s exclusions) plus the Dockerfile into a temp file.
pub(crate) fn context_tar(
    context: &Path,
    dockerfile: &Path,
) -> Result<(tempfile::NamedTempFile, usize)> {
    let md = std::fs::metadata(context)
        .with_context(|| format!("cannot read the build context {}", context.display()))?;
    if !md.is_dir() {
        bail!("the build context {} is not a directory", context.display());
    }
    let df = std::fs::read(dockerfile)
        .with_context(|| format!("cannot read the Dockerfile {}", dockerfile.display()))?;
    let ignore = match std::fs::read_to_string(context.join(".dockerignore")) {
        Ok(t) => Ignore::parse(&t)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ignore(Vec::new()),
        Err(e) => return Err(e).context("cannot read .dockerignore"),
    };
    let tmp = tempfile::NamedTempFile::new().context("cannot create a temporary file")?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(tmp.reopen()?));
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Deterministic);
    let mut n = 0usize;
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = context.join(&rel);
        let mut ents: Vec<_> = std::fs::read_dir(&dir)
            .with_context(|| format!("cannot read {}", dir.display()))?
            .flatten()
            .collect();
        ents.sort_by_key(|e| e.file_name());
        for e in ents {
            let r = rel.join(e.file_name());
            let rs = r.to_string_lossy().into_owned();
            if ignore.excluded(&rs) {
                continue;
            }
            let ft = e.file_type()?;
            if ft.is_dir() {
                b.append_dir(&r, e.path())?;
                stack.push(r);
            } else if ft.is_file() || ft.is_symlink() {
                b.append_path_with_name(e.path(), &r)
                    .with_context(|| format!("cannot archive {}", e.path().display()))?;
            }
            n += 1;
        }
    }
    let mut h = tar::Header::new_gnu();
    h.set_size(df.len() as u64);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    b.append_data(&mut h, DOCKERFILE_ENTRY, &df[..])?;
    b.into_inner()?.into_inner().map_err(|e| e.into_error())?;
    Ok((tmp, n))
}

/// The build's query: the options the server reads.
pub(crate) fn query(
    no_cache: bool,
    replace: bool,
    egress: &str,
    insecure: bool,
    build_args: &[(String, String)],
) -> Vec<(String, String)> {
    let mut q = vec![
        ("dockerfile".to_string(), DOCKERFILE_ENTRY.to_string()),
        ("no_cache".into(), no_cache.to_string()),
        ("replace".into(), replace.to_string()),
        ("egress".into(), egress.to_string()),
        ("insecure".into(), insecure.to_string()),
    ];
    for (k, v) in build_args {
        q.push(("build_arg".into(), format!("{k}={v}")));
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dockerignore_excludes_with_exceptions_and_parents() {
        let i =
            Ignore::parse("# c\nnode_modules\n*.log\n!keep.log\n/build/\ndocs/**/*.tmp\n").unwrap();
        assert!(i.excluded("node_modules"));
        assert!(i.excluded("node_modules/x/y.js"));
        assert!(i.excluded("a.log"));
        assert!(!i.excluded("keep.log"));
        assert!(!i.excluded("sub/a.log"), "* does not cross /");
        assert!(i.excluded("build/out"));
        assert!(i.excluded("docs/a/b/c.tmp"));
        assert!(!i.excluded("src/main.rs"));
    }
}
