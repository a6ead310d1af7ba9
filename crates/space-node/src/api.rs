//! The node contract, defined in `space-node-api` (issue 14) and re-exported here.

pub use space_node_api::*;
