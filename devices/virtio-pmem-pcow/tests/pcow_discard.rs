//! `discard_writes` on pcow: regions on temporary overlays
//! (`PcowRegion::open_discarding`). Host threads play two guests on one
//! image at once; each must see its own writes and only its own, barriers
//! and FLUSH must work, the image chain must stay byte for byte as it was
//! and check clean, writers must be refused while the regions run, image
//! operations refused clearly, and no file may be left behind, after a
//! close or after a SIGKILL of the process holding the region.

mod common;

use common::*;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use pcow::{Error, Image, OpenOptions, TempOptions};
use virtio_pmem_pcow::{
    BarrierError, FlushBackend, OverlayError, PcowRegion, RegionOptions, WriteGate,
};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;

/// image.pcow (data in [2, 4) MiB) over base.pcow (data in [0, 2) MiB);
/// the rest is holes. Returns the image's path and its view.
fn chain(dir: &Path) -> (PathBuf, Vec<u8>) {
    let base = dir.join("base.pcow");
    let mut b = create(&base, SIZE, K64, None);
    b.write_at(&pattern(1, 2 * MIB as usize), 0).unwrap();
    b.close().unwrap();
    let top = dir.join("image.pcow");
    let mut t = create(&top, SIZE, K64, Some("base.pcow"));
    t.write_at(&pattern(2, 2 * MIB as usize), 2 * MIB).unwrap();
    t.close().unwrap();
    let view = view_forced(&top);
    (top, view)
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Whether a writer's open of the image is refused as locked.
fn writer_refused(path: &Path) -> bool {
    matches!(
        Image::open(path, OpenOptions::read_write()),
        Err(Error::Locked { .. })
    )
}

/// Whether no process holds a lock on the file (checked without opening
/// it as an image, which would write it).
fn free(path: &Path) -> bool {
    std::fs::File::open(path).unwrap().try_lock().is_ok()
}

fn open_discarding(path: &Path, temp: &TempOptions) -> Rig {
    let gate = Arc::new(WriteGate::new());
    let (region, monitor) =
        PcowRegion::open_discarding(path, temp, gate.clone(), &RegionOptions::default())
            .expect("open a discarding region");
    Rig {
        region,
        monitor: serve(monitor),
        gate,
    }
}

/// Writes of one guest: 4 KiB pieces over data of both layers and holes,
/// some straddling clusters.
fn writes(seed: u64) -> Vec<(u64, Vec<u8>)> {
    let raw = pattern(seed, 96);
    let mut offs = raw.chunks(2).map(|c| {
        let page = u64::from(u16::from_le_bytes([c[0], c[1]])) % (SIZE / PAGE - 1);
        page * PAGE + if c[0] % 3 == 0 { PAGE / 2 } else { 0 }
    });
    (0..48)
        .map(|i| {
            let off = offs.next().unwrap();
            (off, pattern(seed * 1000 + i, PAGE as usize))
        })
        .collect()
}

#[test]
fn two_regions_on_one_image_each_see_their_own_writes_and_the_image_is_untouched() {
    if !uffd_or_skip("two_regions_on_one_image") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (image, view) = chain(dir.path());
    let base = dir.path().join("base.pcow");
    let image_bytes = std::fs::read(&image).unwrap();
    let base_bytes = std::fs::read(&base).unwrap();
    let files = listing(dir.path());

    let mut a = open_discarding(&image, &TempOptions::default());
    let b = open_discarding(&image, &TempOptions::default());
    assert!(a.region.is_discarding().unwrap());
    assert_eq!(a.region.len(), SIZE);
    assert_eq!(listing(dir.path()), files, "no named file while open");

    // Each guest writes from its own thread while barriers run on both.
    let mut models = [view.clone(), view.clone()];
    let plans = [writes(7), writes(8)];
    std::thread::scope(|s| {
        for (rig, plan) in [(&a, &plans[0]), (&b, &plans[1])] {
            s.spawn(move || {
                for (off, data) in plan {
                    rig.write(*off, data);
                }
            });
        }
        for _ in 0..5 {
            a.region.barrier().expect("barrier a");
            b.region.barrier().expect("barrier b");
        }
    });
    for (model, plan) in models.iter_mut().zip(&plans) {
        for (off, data) in plan {
            model[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }
    }
    // A FLUSH as the virtqueue would answer it, then a last barrier.
    FlushBackend::flush(&mut a.region).expect("flush");
    b.region.barrier().expect("barrier");
    same(&a.read(0, SIZE as usize), &models[0], "guest a");
    same(&b.read(0, SIZE as usize), &models[1], "guest b");
    for rig in [&a, &b] {
        let st = rig.region.status().unwrap();
        assert_eq!(st.pending_private_pages, 0);
        assert!(st.allocated_clusters > 0, "writes went into the overlay");
        assert_eq!(st.chain.len(), 3, "{:?}", st.chain);
        assert!(st.chain[0].to_string_lossy().ends_with(" (deleted)"));
        assert_eq!(st.chain[1], image.canonicalize().unwrap());
        assert_eq!(st.chain[2], base.canonicalize().unwrap());
        assert!(st.snapshots.is_empty());
    }

    // The chain is shared by readers, refused to writers.
    assert!(writer_refused(&image));
    assert!(writer_refused(&base));
    drop(open_forced(&image));
    drop(Image::open(&image, OpenOptions::read_only()).expect("a reader"));

    // Image operations are refused, and say why.
    let e = a.region.snapshot_create("s").unwrap_err();
    assert!(matches!(e, BarrierError::Discarding), "{e}");
    assert!(e.to_string().contains("discard_writes"), "{e}");
    let e = a.region.snapshot_delete("s").unwrap_err();
    assert!(matches!(e, BarrierError::Discarding), "{e}");
    let e = a.region.overlay(&dir.path().join("new.pcow")).unwrap_err();
    assert!(matches!(e, OverlayError::Discarding), "{e}");
    assert!(e.to_string().contains("pcow-img create"), "{e}");
    assert!(matches!(
        a.region.snapshot_apply("s"),
        Err(BarrierError::LiveRollback)
    ));
    // The device goes on after the refusals.
    a.write(5 * MIB, b"after");
    a.region.barrier().expect("barrier after the refusals");
    assert_eq!(a.read(5 * MIB, 5), b"after");

    a.close();
    assert!(writer_refused(&image), "b still runs on it");
    b.close();
    assert!(free(&image) && free(&base));
    assert!(
        std::fs::read(&image).unwrap() == image_bytes,
        "image changed"
    );
    assert!(std::fs::read(&base).unwrap() == base_bytes, "base changed");
    assert_eq!(listing(dir.path()), files);
    check_clean(&image);
    check_clean(&base);
    same(&view_forced(&image), &view, "the image's view");
}

#[test]
fn the_overlay_goes_where_it_is_told_and_refusals_leave_nothing() {
    if !uffd_or_skip("the_overlay_goes_where_it_is_told") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let (image, view) = chain(dir.path());
    let files = listing(dir.path());
    let temp = TempOptions {
        dir: Some(elsewhere.path().to_owned()),
        named: true,
    };
    let rig = open_discarding(&image, &temp);
    let st = rig.region.status().unwrap();
    assert!(st.chain[0].starts_with(elsewhere.path().canonicalize().unwrap()));
    assert!(listing(elsewhere.path()).is_empty());
    rig.write(7 * MIB, b"hole");
    assert_eq!(rig.read(7 * MIB, 4), b"hole");
    rig.close();
    assert!(listing(elsewhere.path()).is_empty());

    // A writer holds the image: a discarding region is refused (Locked),
    // and leaves nothing.
    let w = Image::open(&image, OpenOptions::read_write()).unwrap();
    let e = PcowRegion::open_discarding(
        &image,
        &TempOptions::default(),
        Arc::new(WriteGate::new()),
        &RegionOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            virtio_pmem_pcow::RegionError::Image(Error::Locked { .. })
        ),
        "{e}"
    );
    drop(w);
    let e = PcowRegion::open_discarding(
        &image,
        &TempOptions {
            dir: Some(dir.path().join("missing")),
            named: false,
        },
        Arc::new(WriteGate::new()),
        &RegionOptions::default(),
    )
    .unwrap_err();
    assert!(format!("{e:?}").contains("missing"), "{e:?}");
    assert_eq!(listing(dir.path()), files);
    same(&view_forced(&image), &view, "the image's view");
}

const CHILD_ENV: &str = "PMEM_DISCARD_CHILD";

/// Not a test: the process `a_killed_holder_leaves_nothing_behind` starts
/// and kills. It runs a discarding region on the image named in the
/// environment, writes into a hole and over data, runs a barrier, says
/// "ready" and waits.
#[test]
#[ignore = "helper process of a_killed_holder_leaves_nothing_behind"]
fn child_running_a_discarding_region() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (mode, image) = spec.split_once(':').unwrap();
    let temp = TempOptions {
        dir: None,
        named: mode == "named",
    };
    let rig = open_discarding(Path::new(image), &temp);
    rig.write(0, &[0xee; 8192]);
    rig.write(6 * MIB, &[0xdd; 8192]);
    rig.region.barrier().unwrap();
    println!("ready");
    std::thread::sleep(std::time::Duration::from_secs(120));
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_killed_holder_leaves_nothing_behind() {
    if !uffd_or_skip("a_killed_holder_leaves_nothing_behind") {
        return;
    }
    for mode in ["tmpfile", "named"] {
        let dir = tempfile::tempdir().unwrap();
        let (image, view) = chain(dir.path());
        let image_bytes = std::fs::read(&image).unwrap();
        let files = listing(dir.path());
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "child_running_a_discarding_region",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, format!("{mode}:{}", image.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut child = KillOnDrop(child);
        let mut ready = false;
        for line in out.lines() {
            // libtest may print "test NAME ... " on the same line first.
            if line.unwrap().trim_end().ends_with("ready") {
                ready = true;
                break;
            }
        }
        assert!(ready, "the child's region did not start ({mode})");
        assert!(writer_refused(&image), "{mode}");
        // Another discarding region runs beside the child's.
        let rig = open_discarding(&image, &TempOptions::default());
        assert_eq!(rig.read(0, 4), &view[..4], "{mode}: not the child's writes");
        rig.close();
        assert_eq!(listing(dir.path()), files, "{mode}");
        // SAFETY: kill only sends a signal to the child we started.
        assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) }, 0);
        child.0.wait().unwrap();
        assert_eq!(listing(dir.path()), files, "{mode}: left behind");
        assert!(free(&image), "{mode}");
        assert!(std::fs::read(&image).unwrap() == image_bytes, "{mode}");
        check_clean(&image);
        same(&view_forced(&image), &view, "the image's view");
    }
}
