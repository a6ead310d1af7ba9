//! Which space-daemon binary the node bind-mounts into sandboxes (and packs into microvm
//! initramfs images). It must be static: nothing inside a sandbox provides a dynamic loader
//! or the host's libc. `cargo build` leaves a dynamically linked `space-daemon` next to
//! `spaced`; picking that one made every create fail with an internal error, so a binary that
//! asks for a program interpreter is refused (named on the command line) or skipped (found by
//! the search), with the reason in spaced's start-up error.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// ELF program header type of the program interpreter (the dynamic loader).
const PT_INTERP: u32 = 3;

/// Why `path` cannot run inside a sandbox, or `None` when it can (a static x86-64 or
/// aarch64 ELF executable: no `PT_INTERP`). Reads the ELF header and program headers only;
/// parsing those two tables by hand costs less than a crate that parses all of ELF.
pub fn unusable_reason(path: &Path) -> Option<String> {
    let mut head = Vec::new();
    let read = std::fs::File::open(path).and_then(|f| f.take(64 * 1024).read_to_end(&mut head));
    if let Err(e) = read {
        return Some(format!("cannot be read: {e}"));
    }
    if head.len() < 64 || &head[..4] != b"\x7fELF" {
        return Some("is not an ELF executable".into());
    }
    if head[4] != 2 || head[5] != 1 {
        return Some("is not a 64-bit little-endian ELF executable".into());
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(head[0x20..0x28].try_into().expect("8 bytes")) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let at = phoff.saturating_add(i * phentsize);
        let Some(ph) = head.get(at..at + 4) else {
            return Some("has program headers beyond its first 64 KiB".into());
        };
        if u32::from_le_bytes(ph.try_into().expect("4 bytes")) == PT_INTERP {
            return Some(
                "is dynamically linked: build it static (scripts/up and scripts/test do: \
                 RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build -p space-daemon \
                 --target x86_64-unknown-linux-gnu)"
                    .into(),
            );
        }
    }
    None
}

/// Resolves the daemon binary: the flag, $SPACE_DAEMON_BINARY, then the first usable one of
/// `space-daemon` next to spaced, the static build under `target/<triple>/<profile>/` of the
/// same cargo profile, and /usr/local/lib/space/space-daemon.
pub fn daemon_binary(flag: Option<PathBuf>) -> Result<PathBuf> {
    let named = match (flag, std::env::var_os("SPACE_DAEMON_BINARY")) {
        (Some(p), _) => Some((p, "--daemon-binary")),
        (None, Some(p)) => Some((PathBuf::from(p), "SPACE_DAEMON_BINARY")),
        (None, None) => None,
    };
    if let Some((p, from)) = named {
        if !p.is_file() {
            bail!(
                "space-daemon binary {} (from {from}) does not exist",
                p.display()
            );
        }
        if let Some(why) = unusable_reason(&p) {
            bail!("space-daemon binary {} (from {from}) {why}", p.display());
        }
        return Ok(p);
    }
    let mut tried = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        tried.push(dir.join("space-daemon"));
        // target/<profile>/spaced -> target/x86_64-unknown-linux-gnu/<profile>/space-daemon
        if let (Some(profile), Some(target)) = (dir.file_name(), dir.parent()) {
            tried.push(
                target
                    .join(format!("{}-unknown-linux-gnu", std::env::consts::ARCH))
                    .join(profile)
                    .join("space-daemon"),
            );
        }
    }
    tried.push(PathBuf::from("/usr/local/lib/space/space-daemon"));
    let mut problems = Vec::new();
    for p in &tried {
        if !p.is_file() {
            continue;
        }
        match unusable_reason(p) {
            None => return Ok(p.clone()),
            Some(why) => {
                tracing::warn!(path = %p.display(), "skipping a space-daemon that {why}");
                problems.push(format!("{} {why}", p.display()));
            }
        }
    }
    if problems.is_empty() {
        bail!(
            "space-daemon binary not found (tried {}); pass --daemon-binary or set SPACE_DAEMON_BINARY",
            tried
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    bail!(
        "no usable space-daemon binary: {}; pass --daemon-binary or set SPACE_DAEMON_BINARY",
        problems.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_daemon_binary_names_the_path() {
        let e = daemon_binary(Some(PathBuf::from("/nonexistent/space-daemon"))).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/space-daemon"), "{e}");
    }

    #[test]
    fn dynamic_binaries_are_refused_and_static_ones_taken() {
        // Debian's /bin/sh (dash) is dynamically linked. (This test binary may not be:
        // scripts/test builds everything static.)
        let dynamic = PathBuf::from("/bin/sh");
        let why = unusable_reason(&dynamic).unwrap();
        assert!(why.contains("dynamically linked"), "{why}");
        let e = daemon_binary(Some(dynamic)).unwrap_err();
        assert!(e.to_string().contains("--daemon-binary"), "{e}");
        // busybox-static has no interpreter.
        assert_eq!(unusable_reason(Path::new("/bin/busybox")), None);
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("script");
        std::fs::write(&text, "#!/bin/sh\n").unwrap();
        assert!(unusable_reason(&text).unwrap().contains("not an ELF"));
        assert!(
            unusable_reason(&dir.path().join("nope"))
                .unwrap()
                .contains("cannot be read")
        );
    }
}
