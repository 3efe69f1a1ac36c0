//! Groundwork for VM snapshots (issue 17): the snapshot directory and its
//! format ([`dir`]), guest RAM in it and its restore modes ([`memory`]),
//! and what a restore asks for ([`restore`]). `vm.snapshot` and
//! `vm.restore` do not use these yet.

pub mod dir;
pub mod memory;
pub mod restore;
