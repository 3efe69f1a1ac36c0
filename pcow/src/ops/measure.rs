//! Measure: the file size a pcow image needs, from the spec's layout (one
//! super cluster, then segments of one meta cluster and up to `N` data
//! clusters each).

use std::path::Path;

use super::convert::{geometry, pcow_size, ImageFormat, Source};
use crate::error::Result;
use crate::format::Geometry;

/// File sizes of a pcow image, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Measurement {
    /// The size a conversion (or, without an input, a new empty image)
    /// occupies: only the clusters that hold data.
    pub required: u64,
    /// The size with every cluster of the virtual size allocated.
    pub fully_allocated: u64,
    /// The virtual size of the image measured (rounded up to the cluster
    /// size).
    pub virtual_size: u64,
    /// Cluster size used.
    pub cluster_size: u64,
}

/// Bytes of a single-layer pcow file with `data` data clusters written in
/// virtual order: the super cluster, `ceil(data / N)` meta clusters and the
/// data clusters.
pub fn file_size(g: Geometry, data: u64) -> u64 {
    let meta = data.div_ceil(u64::from(g.capacity()));
    g.offset(1 + meta + data)
}

/// Measures a new image of `virtual_size` bytes (rounded up to the
/// cluster size) with the given cluster size (default 64 KiB).
pub fn measure_size(virtual_size: u64, cluster_size: Option<u64>) -> Result<Measurement> {
    let g = geometry(cluster_size)?;
    let vs = pcow_size(virtual_size, g.cluster_size());
    Ok(Measurement {
        required: file_size(g, 0),
        fully_allocated: file_size(g, vs / g.cluster_size()),
        virtual_size: vs,
        cluster_size: g.cluster_size(),
    })
}

/// Measures the pcow image that converting `input` would produce: its
/// required size counts exactly the clusters `convert` would allocate
/// (those with a non-zero byte).
pub fn measure_image(
    input: &Path,
    input_format: Option<ImageFormat>,
    cluster_size: Option<u64>,
    force_share: bool,
) -> Result<Measurement> {
    let g = geometry(cluster_size)?;
    let src = Source::open(input, input_format, force_share)?;
    let mut data = 0u64;
    src.scan_nonzero(g.cluster_size(), &mut |_, _| {}, &mut |_, _| {
        data += 1;
        Ok(())
    })?;
    let vs = pcow_size(src.size(), g.cluster_size());
    Ok(Measurement {
        required: file_size(g, data),
        fully_allocated: file_size(g, vs / g.cluster_size()),
        virtual_size: vs,
        cluster_size: g.cluster_size(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_arithmetic() {
        let g = Geometry::from_cluster_size(65536).unwrap();
        let n = u64::from(g.capacity());
        assert_eq!(file_size(g, 0), 65536);
        assert_eq!(file_size(g, 1), 3 * 65536);
        assert_eq!(file_size(g, n), (2 + n) * 65536);
        assert_eq!(file_size(g, n + 1), (4 + n) * 65536);
        let m = measure_size(1 << 30, None).unwrap();
        assert_eq!(m.required, 65536);
        let clusters = (1u64 << 30) / 65536;
        assert_eq!(
            m.fully_allocated,
            (1 + clusters.div_ceil(n) + clusters) * 65536
        );
    }
}
