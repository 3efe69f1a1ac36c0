//! The concurrency soak: writer threads (standing in for vCPUs) fault and
//! write the same clusters, down to the same pages, while other threads run
//! barriers, take and delete snapshots and make live overlays, for
//! `PCOW_SOAK_SECS` seconds (default 5; docs/reliability.md has a run of
//! minutes). Every byte is verified: each writer owns 8-byte stripes of
//! every page and checks its own stripes as it goes; at the end the region,
//! and the chain reopened from disk, equal the union of the writers'
//! models, and every file of the chain checks clean.
//!
//! The image starts as an overlay on a base with data, so writes land in
//! holes (write faults), in base clusters (copy-on-write), in zero-mapped
//! holes (reads first) and, after each snapshot, in history again.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use pcow::{Image, OpenOptions};
use virtio_pmem_pcow::{PcowRegion, RegionOptions, WriteGate};

const WRITERS: usize = 4;
const STRIPE: usize = 8;
const CLUSTERS: u64 = 96;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn soak_secs() -> u64 {
    std::env::var("PCOW_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
}

/// Offset of writer `w`'s stripe `k` in page `page`.
fn stripe_at(page: u64, w: usize, k: u64) -> u64 {
    page * PAGE + (k * WRITERS as u64 + w as u64) * STRIPE as u64
}

const STRIPES_PER_PAGE: u64 = PAGE / (STRIPE as u64 * WRITERS as u64);

/// One writer: random stripes of its own, in random pages of random
/// clusters, read back right away and once more at the end; sometimes a
/// read first (a hole becomes zero-mapped, then private).
fn writer(
    w: usize,
    region: Arc<PcowRegion>,
    gate: Arc<WriteGate>,
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    initial: Arc<Vec<u8>>,
) -> Vec<u8> {
    let len = region.len();
    let base = region.host_addr() as usize;
    // The guest's view as this writer knows it: the base's data, then its
    // own stripes.
    let mut model = initial.to_vec();
    let mut rng = Rng(0x5eed_0000 + w as u64 * 7919);
    let pages = len / PAGE;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let page = rng.below(pages);
        let k = rng.below(STRIPES_PER_PAGE);
        let off = stripe_at(page, w, k);
        if rng.below(8) == 0 {
            let _ = gread(base, len, off, STRIPE);
        }
        let v = (rng.next() | 1).to_le_bytes();
        {
            let _in = gate.enter();
            gwrite(base, len, off, &v);
        }
        model[off as usize..][..STRIPE].copy_from_slice(&v);
        let got = gread(base, len, off, STRIPE);
        assert_eq!(got, v, "writer {w}: stripe at {off:#x} reads back wrong");
        n += 1;
        if n.is_multiple_of(64) {
            // A stripe written earlier: still there after whatever barriers,
            // snapshots and overlays ran since.
            let page = rng.below(pages);
            let off = stripe_at(page, w, rng.below(STRIPES_PER_PAGE));
            assert_eq!(
                gread(base, len, off, STRIPE),
                model[off as usize..][..STRIPE],
                "writer {w}: an earlier stripe at {off:#x} changed"
            );
        }
    }
    writes.fetch_add(n, Ordering::Relaxed);
    model
}

#[test]
fn writers_barriers_snapshots_and_overlays_race_and_every_byte_survives() {
    if !uffd_or_skip("writers_barriers_snapshots_and_overlays_race_and_every_byte_survives") {
        return;
    }
    let secs = soak_secs();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.pcow");
    let top = dir.path().join("top.pcow");
    // A base with data in every other cluster.
    let mut b = create(&base, CLUSTERS * K64, K64, None);
    let mut initial = vec![0u8; (CLUSTERS * K64) as usize];
    for c in (0..CLUSTERS).step_by(2) {
        let d = pattern(c, K64 as usize);
        b.write_at(&d, c * K64).unwrap();
        initial[(c * K64) as usize..][..K64 as usize].copy_from_slice(&d);
    }
    b.close().unwrap();
    create(&top, CLUSTERS * K64, K64, Some("base.pcow"))
        .close()
        .unwrap();

    let gate = Arc::new(WriteGate::new());
    let (region, monitor) =
        PcowRegion::open(&top, gate.clone(), &RegionOptions::default()).expect("open");
    let monitor = serve(monitor);
    let region = Arc::new(region);
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));

    let initial = Arc::new(initial);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (r, g, s, n) = (region.clone(), gate.clone(), stop.clone(), writes.clone());
            let i = initial.clone();
            std::thread::spawn(move || writer(w, r, g, s, n, i))
        })
        .collect();
    let barriers = {
        let (r, s) = (region.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(42);
            let mut n = 0u64;
            while !s.load(Ordering::Relaxed) {
                r.barrier().expect("barrier");
                n += 1;
                std::thread::sleep(Duration::from_micros(rng.below(5000)));
            }
            n
        })
    };
    // Snapshots every ~100 ms (at most 4 kept), an overlay every ~2 s (at
    // most 3).
    let mut rng = Rng(7);
    let (mut snaps, mut deletes, mut overlays) = (0u64, 0u64, 0u64);
    let mut kept: Vec<String> = Vec::new();
    let t0 = Instant::now();
    let mut next_overlay = Duration::from_secs(2).min(Duration::from_secs(secs) / 2);
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(50 + rng.below(100)));
        let tag = format!("soak{snaps}");
        region.snapshot_create(&tag).expect("snapshot");
        snaps += 1;
        kept.push(tag);
        if kept.len() > 4 {
            let victim = kept.remove(0);
            region.snapshot_delete(&victim).expect("snapshot delete");
            deletes += 1;
        }
        if t0.elapsed() >= next_overlay && overlays < 3 {
            let ov = dir.path().join(format!("ov{overlays}.pcow"));
            region.overlay(&ov).expect("overlay");
            overlays += 1;
            kept.clear();
            next_overlay += Duration::from_secs(2);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let models: Vec<Vec<u8>> = writers.into_iter().map(|h| h.join().unwrap()).collect();
    let nbarriers = barriers.join().unwrap();
    region.barrier().expect("final barrier");

    // Each writer's stripes from its model: together every byte.
    let mut want = vec![0u8; initial.len()];
    for (w, m) in models.iter().enumerate() {
        for page in 0..CLUSTERS * K64 / PAGE {
            for k in 0..STRIPES_PER_PAGE {
                let off = stripe_at(page, w, k) as usize;
                want[off..off + STRIPE].copy_from_slice(&m[off..off + STRIPE]);
            }
        }
    }
    let st = region.status().expect("status");
    same(
        &gread(region.host_addr() as usize, region.len(), 0, want.len()),
        &want,
        "the region after the soak",
    );
    let top_now = st.chain[0].clone();
    drop(monitor);
    drop(Arc::try_unwrap(region).expect("last user of the region"));

    let img = Image::open(&top_now, OpenOptions::read_only()).expect("reopen");
    let mut got = vec![0u8; want.len()];
    img.read_at(&mut got, 0).unwrap();
    drop(img);
    same(&got, &want, "the chain reopened from disk");
    for f in open_forced(&top_now).chain_paths() {
        check_clean(&f);
    }
    let w = writes.load(Ordering::Relaxed);
    eprintln!(
        "soak {secs} s: {w} writes by {WRITERS} writers, {nbarriers} barriers, {snaps} snapshots \
         ({deletes} deleted), {overlays} overlays; faults {:?}; every byte verified",
        st.faults
    );
    assert!(w > 0 && nbarriers > 0 && snaps > 0);
}
