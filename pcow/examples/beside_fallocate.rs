//! What a 4 KiB write to a tmpfs file costs, with `pwrite` and through a
//! mapping (`pcow::io::store_through_mapping`), alone and while another
//! thread reserves pieces of the same file with `fallocate` back to back
//! (a device's pool worker in a long refill; each piece is freed again
//! right after): the numbers behind `Commit::beside_fallocate`.
//!
//! usage: beside_fallocate [DIR] (default /dev/shm; DIR must be tmpfs)
//!
//! Prints, for each case, p50 / p90 / p99 / max in microseconds of 300
//! writes made 2 ms apart. Pin it to one CPU (`taskset -c 1`) to see a
//! writer and a worker that share it, as in the nested sandbox's L1.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const WRITES: usize = 300;
const RESERVED: u64 = 64 << 20;

#[derive(Clone, Copy)]
enum How {
    Pwrite,
    Mapping,
}

fn write(f: &File, how: How, buf: &[u8]) -> Result<()> {
    match how {
        How::Pwrite => f.write_all_at(buf, 0).context("pwrite"),
        How::Mapping => {
            // SAFETY: `buf` is valid for reads of its length; the file is
            // only grown while this runs.
            let ok = unsafe {
                pcow::io::store_through_mapping(f.as_raw_fd(), buf.as_ptr(), buf.len(), 0)
            };
            if !ok {
                bail!("the store through a mapping declined");
            }
            Ok(())
        }
    }
}

/// Writes 300 times, 2 ms apart, while a worker reserves pieces of `piece`
/// bytes (none: no worker); returns the sorted latencies in µs.
fn run(path: &PathBuf, how: How, piece: Option<u64>) -> Result<Vec<f64>> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    pcow::io::allocate_file(&f, 0, RESERVED).context("reserving")?;
    let buf = [7u8; 4096];
    f.write_all_at(&buf, 0)?;
    let stop = Arc::new(AtomicBool::new(false));
    let worker = piece
        .map(|piece| -> Result<_> {
            let wf = f.try_clone()?;
            let stop = stop.clone();
            // Reserves one piece beyond the end and frees it again, over
            // and over: the inode lock is held nearly all the time, as while
            // a long refill is reserved, without growing the file.
            Ok(std::thread::spawn(move || -> std::io::Result<()> {
                let (at, len) = (RESERVED as i64, piece as i64);
                while !stop.load(Ordering::Relaxed) {
                    pcow::io::allocate_file(&wf, RESERVED, piece)?;
                    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                    // SAFETY: fallocate only reads its integer arguments;
                    // `wf` is open for the call.
                    if unsafe { libc::fallocate(wf.as_raw_fd(), mode, at, len) } != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            }))
        })
        .transpose()?;
    let mut lat = Vec::with_capacity(WRITES);
    let mut result = Ok(());
    for _ in 0..WRITES {
        std::thread::sleep(Duration::from_millis(2));
        let t = Instant::now();
        if let Err(e) = write(&f, how, &buf) {
            result = Err(e);
            break;
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(w) = worker {
        match w.join() {
            Ok(r) => r.context("the worker's fallocate")?,
            Err(_) => bail!("the worker panicked"),
        }
    }
    drop(f);
    std::fs::remove_file(path).ok();
    result?;
    lat.sort_by(f64::total_cmp);
    Ok(lat)
}

fn main() -> Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "/dev/shm".into()));
    let path = dir.join(format!(".beside-fallocate-{}", std::process::id()));
    let at = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q) as usize];
    for (what, piece) in [
        ("no worker", None),
        ("worker, 256 KiB pieces", Some(256 << 10)),
        ("worker, 2 MiB pieces", Some(2 << 20)),
    ] {
        for (name, how) in [("pwrite", How::Pwrite), ("mapping", How::Mapping)] {
            let v = run(&path, how, piece)?;
            println!(
                "{what:<24} {name:<8} p50 {:>7.0}  p90 {:>7.0}  p99 {:>7.0}  max {:>7.0} us",
                at(&v, 0.5),
                at(&v, 0.9),
                at(&v, 0.99),
                at(&v, 1.0)
            );
        }
    }
    Ok(())
}
