//! The integration tests, one binary (linking one test binary instead of one per file is
//! minutes off a clean CI run, and its two test threads stay busy across all of them).
//! Each module drives a real spaced; run one with `cargo test -p space-tests --test it MODULE::`.

mod api;
mod base;
mod bench;
mod build;
mod chaos;
mod checkpoint;
mod cli;
mod cluster;
mod console;
mod cp_hostile;
mod diff;
mod disk_quota;
mod e2b;
mod host_access;
mod isolation;
mod metrics;
mod microvm;
mod network;
mod oci;
mod pause;
mod placement;
mod pool;
mod pool_api;
mod postgres;
mod reconnect;
mod recovery;
mod replicas;
mod scale;
mod sdk;
mod snapshot_policy;
mod snapshots;
mod templates;
mod tenants;
mod top;
mod vm_moves;
