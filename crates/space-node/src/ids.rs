//! Names and ids the node accepts, and the allocator of per-sandbox host uid ranges.

use std::collections::BTreeSet;

use crate::api::NodeError;

/// Bytes as lowercase hex: checksums, short hashes in names, random ids.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Sandbox ids: `[a-z0-9][a-z0-9-]{0,62}` (the control plane uses 20 characters of
/// `[a-z0-9]`). They name directories, cgroups and sockets, so nothing else is accepted.
pub fn validate_sandbox_id(id: &str) -> Result<(), NodeError> {
    let b = id.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "sandbox id {id:?} must match [a-z0-9][a-z0-9-]{{0,62}}"
        )))
    }
}

/// Template names: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_template_name(name: &str) -> Result<(), NodeError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "template name {name:?} must match [a-z0-9][a-z0-9._-]{{0,62}}"
        )))
    }
}

/// Hostnames: 1..=63 characters of `[A-Za-z0-9-]`, not starting or ending with `-`.
pub fn validate_hostname(h: &str) -> Result<(), NodeError> {
    let b = h.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-';
    if ok {
        Ok(())
    } else {
        Err(NodeError::InvalidArgument(format!(
            "hostname {h:?} must be 1-63 characters of [A-Za-z0-9-]"
        )))
    }
}

/// Environment variable names: non-empty, no `=` and no NUL; values: no NUL.
pub fn validate_env(env: &[(String, String)]) -> Result<(), NodeError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(NodeError::InvalidArgument(format!(
                "invalid environment variable {k:?}"
            )));
        }
    }
    Ok(())
}

/// Hands out disjoint host uid/gid ranges: slot `n` is `start + n * count .. + count`.
/// The lowest free slot is reused first.
#[derive(Debug)]
pub struct UidAllocator {
    start: u32,
    count: u32,
    max_slots: u32,
    used: BTreeSet<u32>,
}

impl UidAllocator {
    pub fn new(start: u32, count: u32) -> Result<Self, NodeError> {
        if count == 0 {
            return Err(NodeError::InvalidArgument("uid_count must be > 0".into()));
        }
        let max_slots = (u64::from(u32::MAX) + 1 - u64::from(start)) / u64::from(count);
        Ok(Self {
            start,
            count,
            max_slots: u32::try_from(max_slots).unwrap_or(u32::MAX),
            used: BTreeSet::new(),
        })
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    /// The first uid of the range in `slot`.
    pub fn base_of(&self, slot: u32) -> u32 {
        self.start + slot * self.count
    }

    /// The slot whose range starts at `base`, if `base` is one of ours.
    pub fn slot_of(&self, base: u32) -> Option<u32> {
        let off = base.checked_sub(self.start)?;
        (off % self.count == 0 && off / self.count < self.max_slots).then_some(off / self.count)
    }

    /// Marks the range starting at `base` used (records loaded on open). False when `base` is
    /// not a range of this allocator or is taken already.
    pub fn claim(&mut self, base: u32) -> bool {
        match self.slot_of(base) {
            Some(s) => self.used.insert(s),
            None => false,
        }
    }

    /// The lowest free range; returns its first uid.
    pub fn allocate(&mut self) -> Result<u32, NodeError> {
        let mut slot = 0u32;
        for &u in &self.used {
            if u != slot {
                break;
            }
            slot += 1;
        }
        if slot >= self.max_slots {
            return Err(NodeError::Exhausted(format!(
                "all {} uid ranges are in use",
                self.max_slots
            )));
        }
        self.used.insert(slot);
        Ok(self.base_of(slot))
    }

    /// Ranges not in use.
    pub fn available(&self) -> u64 {
        u64::from(self.max_slots).saturating_sub(self.used.len() as u64)
    }

    pub fn free(&mut self, base: u32) {
        if let Some(s) = self.slot_of(base) {
            self.used.remove(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names() {
        assert!(validate_sandbox_id("abcdefghij0123456789").is_ok());
        for bad in ["", "A", "-a", "a/b", "a..", "..", &"a".repeat(64)] {
            assert!(validate_sandbox_id(bad).is_err(), "{bad:?}");
        }
        assert!(validate_template_name("base").is_ok());
        assert!(validate_template_name("py3.12_x-y").is_ok());
        for bad in ["", ".", "..", ".x", "a/b", "Base", &"a".repeat(64)] {
            assert!(validate_template_name(bad).is_err(), "{bad:?}");
        }
        assert!(validate_hostname("my-box1").is_ok());
        assert!(validate_hostname("-x").is_err());
        assert!(validate_hostname("a.b").is_err());
        assert!(validate_env(&[("A".into(), "b=c".into())]).is_ok());
        assert!(validate_env(&[("A=B".into(), "c".into())]).is_err());
    }

    #[test]
    fn lowest_free_slot_is_reused() {
        let mut a = UidAllocator::new(1_000_000_000, 65536).unwrap();
        assert!(a.claim(1_000_000_000 + 2 * 65536));
        assert!(!a.claim(1_000_000_000 + 2 * 65536), "double claim");
        assert!(!a.claim(1_000_000_001), "unaligned");
        assert!(!a.claim(5), "below start");
        assert_eq!(a.allocate().unwrap(), 1_000_000_000);
        assert_eq!(a.allocate().unwrap(), 1_000_000_000 + 65536);
        assert_eq!(a.allocate().unwrap(), 1_000_000_000 + 3 * 65536);
        a.free(1_000_000_000 + 65536);
        assert_eq!(a.allocate().unwrap(), 1_000_000_000 + 65536);
    }

    #[test]
    fn exhaustion_is_reported() {
        let mut a = UidAllocator::new(u32::MAX - 2 * 65536 + 1, 65536).unwrap();
        a.allocate().unwrap();
        a.allocate().unwrap();
        assert!(matches!(a.allocate(), Err(NodeError::Exhausted(_))));
    }
}
