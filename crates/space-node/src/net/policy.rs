//! Parsing and matching of egress rules: the contract's (`space_node_api::policy`).

pub use space_node_api::policy::*;
