//! The per-process output ring: one byte sequence (stdout, stderr and pty interleaved in the
//! order read) addressed by absolute offsets, of which only the last `cap` bytes are kept.

use std::collections::VecDeque;

use space_proto::Stream;

/// What a reader at some offset gets next.
#[derive(Debug, PartialEq, Eq)]
pub enum RingRead {
    /// `[from, to)` was dropped before the reader got to it; continue at `to`.
    Gap { from: u64, to: u64 },
    /// Bytes of one stream starting at `offset`.
    Data {
        stream: Stream,
        offset: u64,
        data: Vec<u8>,
    },
    /// The reader is at the end of what was produced so far.
    End,
}

/// Bounded output buffer with byte offsets.
#[derive(Debug)]
pub struct OutputRing {
    cap: usize,
    data: VecDeque<u8>,
    /// Offset of `data[0]`: everything before it was dropped.
    start: u64,
    /// `(offset, stream)` where each run of one stream begins, ascending. The first run may
    /// begin before `start`; a run lasts until the next one begins (or the end).
    runs: VecDeque<(u64, Stream)>,
}

impl OutputRing {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            data: VecDeque::new(),
            start: 0,
            runs: VecDeque::new(),
        }
    }

    /// How many bytes it keeps.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Offset of the oldest retained byte.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Offset one past the newest byte: the total number of bytes ever produced.
    pub fn end(&self) -> u64 {
        self.start + self.data.len() as u64
    }

    /// Append output read from `stream`, dropping the oldest bytes beyond the capacity.
    pub fn push(&mut self, stream: Stream, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let end = self.end();
        if self.runs.back().map(|r| r.1) != Some(stream) {
            self.runs.push_back((end, stream));
        }
        if bytes.len() >= self.cap {
            let skip = bytes.len() - self.cap;
            self.data.clear();
            self.data.extend(&bytes[skip..]);
            self.start = end + skip as u64;
        } else {
            self.data.extend(bytes);
            let over = self.data.len().saturating_sub(self.cap);
            if over > 0 {
                self.data.drain(..over);
                self.start += over as u64;
            }
        }
        while self.runs.len() >= 2 && self.runs[1].0 <= self.start {
            self.runs.pop_front();
        }
    }

    /// Read at most `max` bytes (of a single stream) from `from`.
    pub fn read(&self, from: u64, max: usize) -> RingRead {
        if from < self.start {
            return RingRead::Gap {
                from,
                to: self.start,
            };
        }
        let end = self.end();
        if from >= end || max == 0 {
            return RingRead::End;
        }
        // The run containing `from`: the last one that begins at or before it.
        let idx = self.runs.partition_point(|r| r.0 <= from).saturating_sub(1);
        let (_, stream) = self.runs[idx];
        let run_end = self.runs.get(idx + 1).map_or(end, |r| r.0);
        let n = ((run_end - from) as usize).min(max);
        let first = (from - self.start) as usize;
        let (a, b) = self.data.as_slices();
        let mut data = Vec::with_capacity(n);
        let last = first + n;
        if first < a.len() {
            data.extend_from_slice(&a[first..last.min(a.len())]);
        }
        if last > a.len() {
            data.extend_from_slice(&b[first.saturating_sub(a.len())..last - a.len()]);
        }
        RingRead::Data {
            stream,
            offset: from,
            data,
        }
    }

    /// Release spare capacity (the process has exited; nothing more will be pushed).
    pub fn shrink(&mut self) {
        self.data.shrink_to_fit();
        self.runs.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(ring: &OutputRing, mut from: u64, max: usize) -> Vec<RingRead> {
        let mut out = Vec::new();
        loop {
            let r = ring.read(from, max);
            match &r {
                RingRead::End => return out,
                RingRead::Gap { to, .. } => from = *to,
                RingRead::Data { data, .. } => from += data.len() as u64,
            }
            out.push(r);
        }
    }

    #[test]
    fn interleaved_streams_keep_order_and_offsets() {
        let mut ring = OutputRing::new(1024);
        ring.push(Stream::Stdout, b"ab");
        ring.push(Stream::Stdout, b"c");
        ring.push(Stream::Stderr, b"XY");
        ring.push(Stream::Stdout, b"d");
        assert_eq!(ring.end(), 6);
        assert_eq!(
            drain(&ring, 0, 100),
            vec![
                RingRead::Data {
                    stream: Stream::Stdout,
                    offset: 0,
                    data: b"abc".to_vec()
                },
                RingRead::Data {
                    stream: Stream::Stderr,
                    offset: 3,
                    data: b"XY".to_vec()
                },
                RingRead::Data {
                    stream: Stream::Stdout,
                    offset: 5,
                    data: b"d".to_vec()
                },
            ]
        );
        // Mid-run start and a small max.
        assert_eq!(
            ring.read(1, 1),
            RingRead::Data {
                stream: Stream::Stdout,
                offset: 1,
                data: b"b".to_vec()
            }
        );
    }

    #[test]
    fn overflow_drops_oldest_and_reports_gap() {
        let mut ring = OutputRing::new(4);
        ring.push(Stream::Stdout, b"0123");
        ring.push(Stream::Stderr, b"45");
        assert_eq!(ring.start(), 2);
        assert_eq!(ring.read(0, 10), RingRead::Gap { from: 0, to: 2 });
        assert_eq!(
            drain(&ring, 2, 10)[0],
            RingRead::Data {
                stream: Stream::Stdout,
                offset: 2,
                data: b"23".to_vec()
            }
        );
        // A push larger than the capacity keeps only its tail.
        ring.push(Stream::Stdout, b"abcdefgh");
        assert_eq!((ring.start(), ring.end()), (10, 14));
        assert_eq!(
            drain(&ring, 10, 10),
            vec![RingRead::Data {
                stream: Stream::Stdout,
                offset: 10,
                data: b"efgh".to_vec()
            }]
        );
        assert_eq!(ring.runs.len(), 1);
    }

    #[test]
    fn wrapped_storage_reads_across_the_seam() {
        let mut ring = OutputRing::new(8);
        for i in 0..100u8 {
            ring.push(Stream::Pty, &[i, i]);
        }
        let all: Vec<u8> = drain(&ring, ring.start(), 3)
            .into_iter()
            .flat_map(|r| match r {
                RingRead::Data { data, .. } => data,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(all, vec![96, 96, 97, 97, 98, 98, 99, 99]);
        assert_eq!(ring.read(ring.end(), 3), RingRead::End);
    }

    #[test]
    fn zero_capacity_keeps_nothing() {
        let mut ring = OutputRing::new(0);
        ring.push(Stream::Stdout, b"abc");
        assert_eq!((ring.start(), ring.end()), (3, 3));
        assert_eq!(ring.read(0, 10), RingRead::Gap { from: 0, to: 3 });
    }
}
