//! File throughput: write a file through `PUT /v1/sandboxes/{id}/files`, then read it back
//! through `GET`, in MB/s (10^6 bytes per second).

use std::time::Instant;

use anyhow::{Result, bail};
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;

use super::report::{section, stats_header, stats_row};
use super::session::Session;
use super::stats::{Stats, mb_per_s, stats};

const PATH: &str = "/tmp/space-bench.bin";

#[derive(Debug, Clone, Serialize)]
pub struct FilesReport {
    pub size_bytes: u64,
    pub runs: usize,
    pub write_mb_s: Option<Stats>,
    pub read_mb_s: Option<Stats>,
}

/// `len` bytes that do not compress (xorshift64).
pub fn payload(len: usize) -> Bytes {
    let mut out = Vec::with_capacity(len + 8);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

pub async fn measure(s: &Session, mib: u64, runs: usize) -> Result<FilesReport> {
    let size = mib * 1024 * 1024;
    let data = payload(size as usize);
    let sb = s.create().await?;
    let mut write = Vec::with_capacity(runs);
    let mut read = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        let entry =
            s.c.write_file(&sb.id, PATH, Some(0o644), false, data.clone())
                .await?;
        write.push(mb_per_s(size, t0.elapsed()));
        if entry.size != size {
            bail!("wrote {size} bytes but the sandbox has {}", entry.size);
        }
        let t0 = Instant::now();
        let mut stream = s.c.read_file(&sb.id, PATH).await?;
        let mut got = 0u64;
        while let Some(chunk) = stream.next().await {
            got += chunk?.len() as u64;
        }
        read.push(mb_per_s(size, t0.elapsed()));
        if got != size {
            bail!("read {got} bytes back of the {size} written");
        }
    }
    Ok(FilesReport {
        size_bytes: size,
        runs,
        write_mb_s: stats(&write),
        read_mb_s: stats(&read),
    })
}

pub fn print(r: &FilesReport) {
    section(&format!(
        "file throughput: {} MiB file, {} runs",
        r.size_bytes / (1024 * 1024),
        r.runs
    ));
    stats_header("MB/s (10^6 bytes/s)");
    stats_row("write (PUT .../files)", r.write_mb_s.as_ref(), 1.0);
    stats_row("read (GET .../files)", r.read_mb_s.as_ref(), 1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_has_the_length_and_does_not_repeat_trivially() {
        let p = payload(1000);
        assert_eq!(p.len(), 1000);
        assert_ne!(&p[..8], &p[8..16]);
        assert_eq!(payload(0).len(), 0);
    }
}
