//! Groundwork of VM snapshots (issue 17): the pieces a snapshot is made
//! of, each captured from a paused VM and restored into a fresh one. The
//! API does not offer snapshot or restore yet.

pub mod cpu_state;
pub mod hex_bytes;
pub mod vm_state;
