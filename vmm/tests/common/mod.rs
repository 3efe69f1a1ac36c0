//! Fixtures shared by the binary's tests.
#![allow(dead_code)] // each test binary uses a part

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

/// Serializes the tests of one binary. A test that spawns the VMM forks,
/// and a forked child holds the parent's open files, and so their flock
/// locks, until it execs: an image another test thread has open at that
/// moment looks locked to whoever opens it next (the VMM, or the test
/// itself). One test at a time removes that race.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes a minimal ELF "kernel" with a PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY)
/// whose code halts forever: enough for the VMM to build and run a whole
/// machine, on the host's emulating KVM too.
pub fn halting_kernel(path: &Path) {
    const LOAD: u64 = 0x10_0000;
    let code = [0xf4u8, 0xeb, 0xfd];
    let mut e = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    for v in [LOAD, 64, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 2, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    let ph = |e: &mut Vec<u8>, ty: u32, fl: u32, off: u64, addr: u64, len: u64, al: u64| {
        e.extend_from_slice(&ty.to_le_bytes());
        e.extend_from_slice(&fl.to_le_bytes());
        for v in [off, addr, addr, len, len, al] {
            e.extend_from_slice(&v.to_le_bytes());
        }
    };
    ph(&mut e, 1, 5, 0x1000, LOAD, code.len() as u64, 0x1000);
    ph(&mut e, 4, 4, 176, 0, 20, 4);
    for v in [4u32, 4, 18] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(b"Xen\0");
    e.extend_from_slice(&(LOAD as u32).to_le_bytes());
    e.resize(0x1000, 0);
    e.extend_from_slice(&code);
    std::fs::write(path, e).unwrap();
}
