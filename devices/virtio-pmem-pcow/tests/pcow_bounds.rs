//! An image the device cannot map is a clear error, never an abort
//! (issue 19): a view of 2^56 bytes at 4 KiB clusters made the device plan
//! the state of 2^44 clusters (a 17.6 TB allocation). The refusal comes
//! before anything is written: the image stays byte for byte as it was.

mod common;

use common::*;

use std::sync::Arc;

use virtio_pmem_pcow::{PcowRegion, RegionError, RegionOptions, WriteGate, MAX_REGION_CLUSTERS};

fn refused(size: u64, cs: u64) -> (String, RegionError) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.pcow");
    let mut img = create(&path, size, cs, None);
    img.write_at(b"data", size - cs).unwrap();
    img.close().unwrap();
    let before = std::fs::read(&path).unwrap();
    let gate = Arc::new(WriteGate::new());
    let e = match PcowRegion::open(&path, gate, &RegionOptions::default()) {
        Err(e) => e,
        Ok(_) => panic!("a region of {size} bytes at {cs}-byte clusters must be refused"),
    };
    assert!(
        std::fs::read(&path).unwrap() == before,
        "a refused image must be left as it was"
    );
    (e.to_string(), e)
}

#[test]
fn a_view_of_2_pow_56_bytes_is_refused_naming_the_limit() {
    let (msg, e) = refused(1 << 56, 4096);
    assert!(
        matches!(
            e,
            RegionError::TooManyClusters {
                clusters,
                cluster_size: 4096,
                limit: MAX_REGION_CLUSTERS,
            } if clusters == 1 << 44
        ),
        "{e:?}"
    );
    assert!(msg.contains("limit of 67108864 clusters"), "{msg}");
}

#[test]
fn one_cluster_past_the_limit_is_refused() {
    let (_, e) = refused((MAX_REGION_CLUSTERS + 1) * 4096, 4096);
    assert!(matches!(e, RegionError::TooManyClusters { .. }), "{e:?}");
}

#[test]
fn the_largest_view_at_2_mib_clusters_is_refused_the_same_way() {
    let (_, e) = refused(1 << 56, 2 << 20);
    assert!(
        matches!(e, RegionError::TooManyClusters { clusters, .. } if clusters == 1 << 35),
        "{e:?}"
    );
}
