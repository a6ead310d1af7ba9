//! `space cp`: files and directories, recursively, both ways, preserving permission bits.
//! Like `docker cp`: copying onto an existing directory puts the source inside it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use space_api::{Client, ClientError, FileType, MakeDirRequest, is_valid_sandbox_id};
use tokio::io::AsyncWriteExt;

/// `ID:PATH` -> (id, path); anything else is local.
fn remote(arg: &str) -> Option<(&str, &str)> {
    let (id, path) = arg.split_once(':')?;
    is_valid_sandbox_id(id).then_some((id, path))
}

pub async fn run(c: &Client, src: &str, dst: &str) -> Result<()> {
    match (remote(src), remote(dst)) {
        (None, Some((id, path))) => upload(c, Path::new(src), id, path).await,
        (Some((id, path)), None) => download(c, id, path, Path::new(dst)).await,
        (Some(_), Some(_)) => bail!("copying between sandboxes is not supported"),
        (None, None) => bail!("one of SRC and DST must be ID:PATH"),
    }
}

fn join_remote(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

fn basename(p: &Path) -> Result<String> {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .with_context(|| format!("{} has no file name", p.display()))
}

async fn remote_is_dir(c: &Client, id: &str, path: &str) -> Result<bool> {
    match c.stat(id, path).await {
        Ok(e) => Ok(e.file_type == FileType::Dir),
        Err(ClientError::Api { status: 404, .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

async fn upload(c: &Client, src: &Path, id: &str, dst: &str) -> Result<()> {
    if !dst.starts_with('/') {
        bail!("{dst:?} must be an absolute path inside the sandbox");
    }
    let meta = std::fs::metadata(src).with_context(|| format!("cannot read {}", src.display()))?;
    // Ask for the sandbox first: a 404 from `stat` below would otherwise be taken for "no such
    // path", and an upload to a missing sandbox is refused before its body is read, which the
    // client sees as a broken pipe rather than the server's answer.
    c.get_sandbox(id).await?;
    let target = if remote_is_dir(c, id, dst).await? {
        join_remote(dst, &basename(&std::fs::canonicalize(src)?)?)
    } else {
        dst.to_string()
    };
    if meta.is_dir() {
        upload_dir(c, src, id, &target).await
    } else {
        c.upload_file(
            id,
            src,
            &target,
            Some(meta.permissions().mode() & 0o7777),
            true,
        )
        .await?;
        Ok(())
    }
}

async fn mkdir_remote(c: &Client, id: &str, path: &str, mode: u32) -> Result<()> {
    let req = MakeDirRequest {
        path: path.to_string(),
        parents: true,
        mode: Some(mode),
    };
    match c.mkdir(id, &req).await {
        Ok(_) => Ok(()),
        Err(ClientError::Api { status: 409, .. }) if remote_is_dir(c, id, path).await? => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn upload_dir(c: &Client, src: &Path, id: &str, dst: &str) -> Result<()> {
    // Iterative walk: (local dir, remote dir).
    let mut stack: Vec<(PathBuf, String)> = vec![(src.to_path_buf(), dst.to_string())];
    while let Some((local, remote)) = stack.pop() {
        let mode = std::fs::metadata(&local)?.permissions().mode() & 0o7777;
        mkdir_remote(c, id, &remote, mode | 0o700).await?;
        let mut entries: Vec<_> = std::fs::read_dir(&local)
            .with_context(|| format!("cannot list {}", local.display()))?
            .collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let ft = e.file_type()?;
            let r = join_remote(&remote, &name);
            if ft.is_dir() {
                stack.push((path, r));
            } else if ft.is_file() {
                let mode = e.metadata()?.permissions().mode() & 0o7777;
                c.upload_file(id, &path, &r, Some(mode), true).await?;
            } else {
                eprintln!(
                    "space: skipping {} (not a regular file or directory)",
                    path.display()
                );
            }
        }
    }
    Ok(())
}

async fn download(c: &Client, id: &str, src: &str, dst: &Path) -> Result<()> {
    let entry = c.stat(id, src).await?;
    let target = if dst.is_dir() {
        dst.join(if entry.name.is_empty() {
            "root"
        } else {
            &entry.name
        })
    } else {
        dst.to_path_buf()
    };
    match entry.file_type {
        FileType::Dir => download_dir(c, id, src, &target, entry.mode).await,
        FileType::File => download_file(c, id, src, &target, entry.mode).await,
        _ => bail!("{src} is not a regular file or directory"),
    }
}

async fn download_file(c: &Client, id: &str, src: &str, dst: &Path, mode: u32) -> Result<()> {
    let mut stream = c.read_file(id, src).await?;
    let mut f = tokio::fs::File::create(dst)
        .await
        .with_context(|| format!("cannot create {}", dst.display()))?;
    while let Some(chunk) = stream.next().await {
        f.write_all(&chunk?)
            .await
            .with_context(|| format!("cannot write {}", dst.display()))?;
    }
    f.flush().await?;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(mode & 0o7777))
        .with_context(|| format!("cannot chmod {}", dst.display()))?;
    Ok(())
}

async fn download_dir(c: &Client, id: &str, src: &str, dst: &Path, mode: u32) -> Result<()> {
    let mut dirs: Vec<(PathBuf, u32)> = Vec::new();
    let mut stack: Vec<(String, PathBuf, u32)> = vec![(src.to_string(), dst.to_path_buf(), mode)];
    while let Some((remote, local, mode)) = stack.pop() {
        std::fs::create_dir_all(&local)
            .with_context(|| format!("cannot create {}", local.display()))?;
        dirs.push((local.clone(), mode));
        for e in c.list_dir(id, &remote, Some(1)).await? {
            let local_path = local.join(&e.name);
            let remote_path = join_remote(&remote, &e.name);
            match e.file_type {
                FileType::Dir => stack.push((remote_path, local_path, e.mode)),
                FileType::File => download_file(c, id, &remote_path, &local_path, e.mode).await?,
                FileType::Symlink => {
                    if let Some(t) = &e.symlink_target {
                        let _ = std::fs::remove_file(&local_path);
                        std::os::unix::fs::symlink(t, &local_path).with_context(|| {
                            format!("cannot create symlink {}", local_path.display())
                        })?;
                    }
                }
                FileType::Other => {
                    eprintln!("space: skipping {remote_path} (not a regular file or directory)")
                }
            }
        }
    }
    // Directory modes last, so read-only directories could be filled first.
    for (dir, mode) in dirs.into_iter().rev() {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode & 0o7777))
            .with_context(|| format!("cannot chmod {}", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_remote_args() {
        assert_eq!(
            remote("abcdefghij0123456789:/tmp/x"),
            Some(("abcdefghij0123456789", "/tmp/x"))
        );
        assert_eq!(remote("./local:file"), None);
        assert_eq!(remote("/tmp/x"), None);
        assert_eq!(join_remote("/a/", "b"), "/a/b");
        assert_eq!(join_remote("/", "b"), "/b");
    }
}
