//! A barrier whose remaps the kernel refuses at `vm.max_map_count`. The
//! test runs the region in a child process that uses up its own mappings.
//! It has a test binary of its own because spawning copies the file
//! table: until the child execs, it holds every image a concurrent test
//! has open, and that test's next open of the image finds it locked.

mod common;

use common::*;

use std::path::PathBuf;

use virtio_pmem_pcow::max_map_count;
use virtio_pmem_pcow::RegionOptions;

/// The child of `a_remap_refused_at_the_vma_limit_leaves_the_data_in_the_image`
/// reads its image path from here.
const REMAP_CHILD_IMAGE: &str = "PCOW_REMAP_CHILD_IMAGE";
const REMAP_CLUSTERS: u64 = 20;
/// The largest `vm.max_map_count` the test uses up (Debian's default is
/// 65,530; some distributions set 1,048,576).
const MAX_FILLABLE: u64 = 4 << 20;

/// Uses up the process's mappings (`vm.max_map_count`): every other page of
/// a `PROT_NONE` reservation made readable, one VMA each, until the kernel
/// refuses a split. Dropping it unmaps the reservation.
struct VmaFiller {
    addr: *mut libc::c_void,
    len: usize,
    vmas: usize,
}

impl VmaFiller {
    fn fill() -> VmaFiller {
        let max = max_map_count().unwrap() as usize;
        let pages = 2 * max + 2;
        let len = pages * PAGE as usize;
        // SAFETY: a fresh anonymous reservation; nothing else uses it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED, "reserving the filler");
        let mut vmas = 0;
        for i in (1..pages).step_by(2) {
            // SAFETY: page `i` is inside the reservation made above.
            let r = unsafe {
                libc::mprotect(
                    addr.cast::<u8>().add(i * PAGE as usize).cast(),
                    PAGE as usize,
                    libc::PROT_READ,
                )
            };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                assert_eq!(e.raw_os_error(), Some(libc::ENOMEM), "mprotect: {e}");
                return VmaFiller { addr, len, vmas };
            }
            vmas += 2;
        }
        panic!("{pages} pages of splits never reached vm.max_map_count={max}");
    }
}

impl Drop for VmaFiller {
    fn drop(&mut self) {
        // SAFETY: the reservation made in `fill`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// Every other cluster of the first `2 * REMAP_CLUSTERS`: read (zero-mapped),
/// then one run of bytes written into each.
fn remap_writes(rig: &Rig, model: &mut [u8], seed: u64) {
    for c in (0..REMAP_CLUSTERS).map(|i| 2 * i + 1) {
        rig.read(c * K64, 1);
        let data = pattern(seed + c, 300);
        let off = c * K64 + 1000;
        rig.write(off, &data);
        model[off as usize..][..data.len()].copy_from_slice(&data);
    }
}

#[test]
fn a_remap_refused_at_the_vma_limit_leaves_the_data_in_the_image() {
    if !uffd_or_skip("a_remap_refused_at_the_vma_limit_leaves_the_data_in_the_image") {
        return;
    }
    let max = max_map_count().unwrap();
    if max > MAX_FILLABLE {
        // Filling would take minutes and gigabytes of page tables.
        eprintln!(
            "SKIPPED a_remap_refused_at_the_vma_limit_leaves_the_data_in_the_image: \
             vm.max_map_count={max} is above the {MAX_FILLABLE} mappings it fills"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limit.pcow");
    create(&path, 64 * K64, K64, None).close().unwrap();
    // The filler takes every mapping of its process: a child of its own.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "remap_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(REMAP_CHILD_IMAGE, &path)
        .output()
        .expect("spawn the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("REMAP-CHILD-OK"),
        "child: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "{}",
        stdout
            .lines()
            .find(|l| l.contains("REMAP-CHILD-OK"))
            .unwrap_or("")
    );
    // Closed by the child: clean, and everything it wrote is there.
    check_clean(&path);
    let mut model = vec![0u8; (64 * K64) as usize];
    for seed in [100, 200] {
        for c in (0..REMAP_CLUSTERS).map(|i| 2 * i + 1) {
            let data = pattern(seed + c, 300);
            model[(c * K64 + 1000) as usize..][..data.len()].copy_from_slice(&data);
        }
    }
    same(&reopen_read(&path), &model, "reopened after the child");
}

/// The child: runs only when the parent sets the environment.
#[test]
#[ignore = "run by a_remap_refused_at_the_vma_limit_leaves_the_data_in_the_image"]
fn remap_child() {
    let Some(path) = std::env::var_os(REMAP_CHILD_IMAGE) else {
        return;
    };
    let path = PathBuf::from(path);
    let rig = Rig::open(&path, &RegionOptions::default()).unwrap();
    let mut model = vec![0u8; rig.region.len() as usize];
    remap_writes(&rig, &mut model, 100);

    // Each written cluster sits inside the holes' mapping: mapping it
    // shared from the file splits that mapping, which the limit refuses.
    let filler = VmaFiller::fill();
    let st = rig.region.barrier().unwrap();
    let filled = filler.vmas;
    drop(filler);
    assert_eq!(st.clusters_copied, REMAP_CLUSTERS, "{st:?}");
    assert_eq!(st.remap_failures, REMAP_CLUSTERS, "{st:?}");
    assert_eq!(st.clusters_remapped, 0, "{st:?}");
    // Committed all the same: the image has every write, the region
    // still shows it.
    same(
        &view_forced(&path),
        &model,
        "image after the refused remaps",
    );
    same(
        &rig.read(0, model.len()),
        &model,
        "region after the refused remaps",
    );

    // The clusters stay private with their pages protected: a barrier
    // without writes finds nothing, and a new write is found, copied and
    // this time mapped from the file.
    let idle = rig.region.barrier().unwrap();
    assert_eq!((idle.private_pages, idle.pages_copied), (0, 0), "{idle:?}");
    let vmas_before = rig.region.status().unwrap().vmas;
    remap_writes(&rig, &mut model, 200);
    let again = rig.region.barrier().unwrap();
    assert_eq!(again.remap_failures, 0, "{again:?}");
    assert_eq!(again.clusters_remapped, REMAP_CLUSTERS, "{again:?}");
    assert!(rig.region.status().unwrap().vmas > vmas_before);
    same(&view_forced(&path), &model, "image after the remaps");
    same(&rig.read(0, model.len()), &model, "region after the remaps");
    rig.close();
    println!("REMAP-CHILD-OK filler {filled} mappings; refused barrier {st:?}; next {again:?}");
}
