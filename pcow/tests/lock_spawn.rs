//! A lock this process has released is not reported as held while another
//! of its threads starts programs: each fork copies the process's open
//! file descriptions, and with them its `flock`s, until the child execs.
//! This is the race that once made a device test fail in CI with
//! `Locked`. A test binary of its own: it starts hundreds of processes.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use pcow::{Error, RawImage};

#[test]
fn reopening_while_another_thread_starts_programs_finds_no_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img.raw");
    std::fs::write(&path, [0u8; 4096]).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let spawned = Arc::new(AtomicU32::new(0));
    let spawner = {
        let (stop, spawned) = (stop.clone(), spawned.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::process::Command::new("true")
                    .status()
                    .expect("running true");
                spawned.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // Reopen for as long as 300 programs take to start (30 s at most).
    let t0 = std::time::Instant::now();
    let (mut rounds, mut conflicts) = (0u32, 0u32);
    while spawned.load(Ordering::Relaxed) < 300 && t0.elapsed().as_secs() < 30 {
        rounds += 1;
        // A writer's exclusive lock, taken and released.
        match RawImage::open(&path, true, false) {
            Ok(img) => drop(img),
            Err(Error::Locked { .. }) => conflicts += 1,
            Err(e) => panic!("{e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    spawner.join().unwrap();
    let spawned = spawned.load(Ordering::Relaxed);
    eprintln!("{rounds} reopens, {spawned} programs started, {conflicts} conflicts");
    assert!(
        spawned >= 100 && rounds >= 1000,
        "{spawned} programs, {rounds} reopens: the race was not exercised"
    );
    // Without the retries about half the reopens conflict here; with them,
    // only a child that waits over 100 ms to exec could cause one.
    assert!(
        conflicts * 100 <= rounds,
        "{conflicts} of {rounds} reopens found the lock held"
    );
}
