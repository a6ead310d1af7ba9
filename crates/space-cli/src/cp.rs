//! `space cp`: files and directories, recursively, both ways, as `docker cp` places them.
//! The copying itself, and every rule that keeps a hostile sandbox from reaching the host
//! through it, is `space_api::copy` (docs/THREAT_MODEL.md, "Host-side copies").

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use space_api::copy::{self, CopyReport, DownloadOptions, SandboxFiles, UploadOptions};
use space_api::{Client, is_valid_sandbox_id};

#[derive(Debug, clap::Args)]
pub struct CpArgs {
    /// LOCAL or ID:PATH (ID:DIR/. or ID:/ copies a directory's contents)
    pub src: String,
    /// ID:PATH or LOCAL
    pub dst: String,
    /// Downloads: the most a copy may take (file bytes plus 512 per entry), e.g. 500M, 20G.
    #[arg(long, value_parser = parse_size, default_value = "8G")]
    pub max_bytes: u64,
    /// Downloads: keep permission and sticky bits and modification times, never set-id bits
    /// (default: modes masked by the umask, as `tar --no-same-permissions`).
    #[arg(short = 'p', long)]
    pub preserve: bool,
    /// Uploads: follow symlinks inside the source tree (default: skipped with a note).
    #[arg(short = 'L', long)]
    pub follow_links: bool,
    /// Downloads: give up when the sandbox sends nothing for this many seconds.
    #[arg(long, default_value_t = 60)]
    pub stall_secs: u64,
}

/// `ID:PATH` -> (id, path); anything else is local.
fn remote(arg: &str) -> Option<(&str, &str)> {
    let (id, path) = arg.split_once(':')?;
    is_valid_sandbox_id(id).then_some((id, path))
}

/// `123`, `64K`, `500M`, `20G`, `1T` (powers of 1024) -> bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 4096, 500M, 20G)"))?;
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => {
            return Err(format!(
                "{s:?} is not a size: the unit must be K, M, G or T"
            ));
        }
    };
    n.checked_mul(1 << shift)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{s:?} is out of range"))
}

pub async fn run(c: &Client, a: &CpArgs) -> Result<()> {
    let report = match (remote(&a.src), remote(&a.dst)) {
        (None, Some((id, path))) => {
            let opts = UploadOptions {
                follow_links: a.follow_links,
            };
            copy::upload(c, id, Path::new(&a.src), path, &opts).await?
        }
        (Some((id, path)), None) => {
            let opts = DownloadOptions {
                max_bytes: a.max_bytes,
                preserve: a.preserve,
                stall: Duration::from_secs(a.stall_secs.max(1)),
            };
            // Ask for the sandbox first, so a wrong id reads as one, not as a missing path.
            c.get_sandbox(id).await?;
            copy::download(
                &SandboxFiles { client: c, id },
                path,
                Path::new(&a.dst),
                &opts,
            )
            .await?
        }
        (Some(_), Some(_)) => bail!("copying between sandboxes is not supported"),
        (None, None) => bail!("one of SRC and DST must be ID:PATH"),
    };
    print_report(&report);
    Ok(())
}

fn print_report(r: &CopyReport) {
    for (path, why) in &r.skipped {
        eprintln!("space: skipped {path}: {why}");
    }
    if std::io::stderr().is_terminal() {
        eprintln!(
            "copied {} files, {} directories, {} symlinks, {} bytes",
            r.files, r.dirs, r.symlinks, r.bytes
        );
    }
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
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("500M"), Ok(500 << 20));
        assert_eq!(parse_size("8g"), Ok(8 << 30));
        // The flag's default is the library's.
        assert_eq!(parse_size("8G"), Ok(copy::DEFAULT_MAX_BYTES));
        for bad in ["", "0", "12Q", "G", "-1", "99999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
