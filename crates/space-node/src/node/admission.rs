//! Admission of new sandboxes (decision 0049): none starts while the node's MemAvailable is
//! below its floor ([`super::NodeConfig::min_free_memory_mib`]).

use super::{Node, pools};
use crate::api::NodeError;

impl Node {
    /// Refuses a new sandbox while the node's MemAvailable is below its floor
    /// ([`super::NodeConfig::min_free_memory_mib`]).
    pub(crate) fn check_free_memory(&self) -> Result<(), NodeError> {
        let floor = self.cfg.min_free_memory_mib;
        if floor == 0 {
            return Ok(());
        }
        match pools::meminfo_bytes("MemAvailable") {
            Some(avail) => admit(avail >> 20, floor),
            None => Ok(()),
        }
    }
}

/// Whether a new sandbox may start with `avail_mib` of the node's memory available and a
/// floor of `floor_mib`: refused below the floor, naming both and what to do.
pub(crate) fn admit(avail_mib: u64, floor_mib: u64) -> Result<(), NodeError> {
    if avail_mib < floor_mib {
        return Err(NodeError::Exhausted(format!(
            "memory: the node has {avail_mib} MiB available, below its floor of {floor_mib} MiB \
             (spaced --min-free-memory); remove or pause sandboxes, or lower the floor"
        )));
    }
    Ok(())
}
