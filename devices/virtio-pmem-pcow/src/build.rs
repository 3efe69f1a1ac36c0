//! Building a region: the image prepared (every active cluster whole,
//! the pool sized), the mappings planned ([`crate::plan`]) and checked
//! against the files and `vm.max_map_count`, the reservation mapped, holes
//! registered with userfaultfd, write tracking started, the pool's worker
//! started.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use pcow::{Image, LiveImage};

use crate::clusters::{push_run, Clusters};
use crate::harvest::Tracking;
use crate::mapping::{
    check_map_count, max_map_count, process_map_count, MapsError, Reservation, PAGE_SIZE,
    VMA_MARGIN,
};
use crate::pagemap::{PageScanner, PagemapError};
use crate::plan::{plan, Plan, RunKind};
use crate::pool::{default_pool_clusters, PoolCtl, PoolOptions};
use crate::state::{Counters, RegionState, Writable};
use crate::uffd::{Uffd, UffdError};
use crate::view::View;

/// Errors building a region.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("image")]
    Image(#[from] pcow::Error),
    #[error("the image is not open for writing")]
    ReadOnly,
    #[error("host page size is {0}, only 4096 is supported")]
    PageSize(u64),
    #[error("virtual size {0} does not fit the address space")]
    TooLarge(u64),
    #[error("the image has {clusters} clusters of {cluster_size} bytes, past the device's limit of {limit} clusters (larger clusters map a larger image)")]
    TooManyClusters {
        clusters: u64,
        cluster_size: u64,
        limit: u64,
    },
    #[error("no memory for the state of {clusters} clusters")]
    StateMemory {
        clusters: u64,
        #[source]
        source: std::collections::TryReserveError,
    },
    #[error("reserving {len} bytes of address space")]
    Reserve {
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("chain file {depth}: {what}")]
    BadLayout { depth: usize, what: String },
    #[error(
        "mapping {len:#x} bytes at region offset {offset:#x} (file {depth} at {file_offset:#x})"
    )]
    Map {
        offset: u64,
        len: u64,
        depth: usize,
        file_offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("userfaultfd")]
    Uffd(#[from] UffdError),
    #[error("pagemap")]
    Pagemap(#[from] PagemapError),
}

/// How a region is built.
#[derive(Debug, Clone, Default)]
pub struct RegionOptions {
    /// Use this instead of `/proc/sys/vm/max_map_count` (tests).
    pub max_map_count: Option<u64>,
    /// Find written pages by reading `/proc/self/pagemap` instead of the
    /// `PAGEMAP_SCAN` ioctl (tests of the fallback; the ioctl is used when
    /// the kernel has it).
    pub pagemap_read_fallback: bool,
    /// Clusters the image pre-allocates (fallocate) ahead of the last one
    /// in use, see [`pcow::Image::set_pool_clusters`]; `None` is
    /// [`crate::pool::default_pool_clusters`] of the image's size. The pool's
    /// worker refills it; without one, the write fault that runs out does
    /// (about 1.1 ms for 4 MiB on tmpfs).
    pub pool_clusters: Option<u64>,
    /// The longest the monitor keeps reading its userfaultfd after a fault
    /// (see [`crate::fault_poll`]); `None` is
    /// [`crate::fault_poll::DEFAULT_FAULT_POLL`], zero never polls.
    pub fault_poll: Option<std::time::Duration>,
    /// Bytes of zero-mapped holes (holes the guest only read) a barrier
    /// leaves mapped. With write tracking every barrier's scan walks their
    /// page-table entries (its fast path, under 1 ms per GiB here); without
    /// it (a kernel before 6.7, or the pagemap read fallback) it classifies
    /// each of their pages (about 10 ms per GiB); a hole costs it a table
    /// lookup. Past the budget, a barrier turns every zero-mapped cluster
    /// nobody wrote back into a hole; a later read faults it in again.
    /// `None` is [`DEFAULT_ZERO_BUDGET`].
    pub zero_budget: Option<u64>,
    /// Bytes of the aligned window a write fault in a hole may fill
    /// (rounded down to whole clusters; a cluster or less, e.g. 0, turns
    /// it off). Once the guest has written into one cluster of a window
    /// (or into the last one of the window before, for a fault in its
    /// first), its next write fault there maps every hole of the window
    /// with its own cluster, in one mapping of consecutive clusters of the
    /// file: a sequential or clustered writer takes one or two faults per
    /// window instead of one per cluster. The image grows by the window's holes
    /// (zeros until written); a window the guest wrote once stays as thin
    /// as before, as do clusters shared with a snapshot or the base and
    /// holes the guest only read. `None` is [`DEFAULT_EXPAND_WINDOW`].
    pub expand_window: Option<u64>,
    /// Runs first on each thread the region spawns (its monitor's, its
    /// pool worker), see [`crate::ThreadHook`]; `None` runs nothing.
    pub thread_hook: Option<crate::ThreadHook>,
}

/// The default of [`RegionOptions::zero_budget`]: 256 MiB, at most about
/// 2.5 ms of every barrier's scan without write tracking (0.1-0.2 ms with
/// it), and 512 KiB of page tables.
pub const DEFAULT_ZERO_BUDGET: u64 = 256 << 20;

/// The default of [`RegionOptions::expand_window`]: 2 MiB, a huge page
/// (32 clusters of 64 KiB; no window at 2 MiB clusters). A guest's file
/// systems allocate in extents, so the rest of a window it wrote twice
/// into is likely next (Linux's transparent huge pages, when always on,
/// fill 2 MiB on a first touch; this waits for the second).
pub const DEFAULT_EXPAND_WINDOW: u64 = 2 << 20;

/// Most clusters a region maps: the device keeps a byte of state per
/// cluster of the view ([`Clusters`]) and plans every one at open, so this
/// bounds both (64 MiB, and the plan's walk) whatever size an image
/// declares: 256 GiB at 4 KiB clusters, 4 TiB at 64 KiB, 128 TiB at 2 MiB.
pub const MAX_REGION_CLUSTERS: u64 = 1 << 26;

/// Builds the region of `image` (opened read-write, or deferred: then
/// nothing is written to it before the checks of its size passed) with
/// its pool.
pub(crate) fn build(
    image: Image,
    opts: &RegionOptions,
    pool_opts: &PoolOptions,
) -> Result<RegionState, RegionError> {
    if !image.is_writer() {
        return Err(RegionError::ReadOnly);
    }
    // SAFETY: sysconf only reads its integer argument.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page != PAGE_SIZE as libc::c_long {
        return Err(RegionError::PageSize(page as u64));
    }
    // What the size costs is checked before the image is written to (the
    // writer's DIRTY flag) or anything is planned: the state of every
    // cluster and the address space of the whole view.
    let size = image.virtual_size();
    let len = usize::try_from(size).map_err(|_| RegionError::TooLarge(size))?;
    let cs = image.cluster_size();
    let clusters = size / cs;
    if clusters > MAX_REGION_CLUSTERS {
        return Err(RegionError::TooManyClusters {
            clusters,
            cluster_size: cs,
            limit: MAX_REGION_CLUSTERS,
        });
    }
    let mut mapping =
        Reservation::new(len).map_err(|source| RegionError::Reserve { len: size, source })?;
    let mut image = LiveImage::new(image)?;
    let pool_clusters = opts
        .pool_clusters
        .unwrap_or_else(|| default_pool_clusters(size, cs));
    image.set_pool_clusters(pool_clusters);
    // Every active cluster whole, so each maps shared as one piece.
    image.complete_active_clusters()?;
    image.flush()?;
    let max = match opts.max_map_count {
        Some(m) => m,
        None => max_map_count()?,
    };
    let in_use = process_map_count()?;
    // An image whose clusters lie scattered over its file needs a mapping
    // per cluster: past half of what the process has left, the shortest
    // runs wait for the guest's first access (the other half is the
    // room of the faults and barriers that map at run time).
    let room = max.saturating_sub(in_use).saturating_sub(VMA_MARGIN);
    let Plan {
        runs,
        clusters: states,
        deferred,
    } = plan(&image, room / 2).map_err(|source| RegionError::StateMemory { clusters, source })?;
    if deferred > 0 {
        log::info!(
            "{deferred} scattered clusters are mapped at their first access \
             (mapping all at open needs more than half of the {room} mappings \
             vm.max_map_count={max} leaves; `pcow-img compact` makes them contiguous)"
        );
    }
    let planned_vmas = runs.len() as u64;
    check_map_count(planned_vmas, max, in_use)?;

    // Mapped pages must lie inside their files (a page past the end of
    // a file would raise SIGBUS on access instead of an error here).
    let files = image.chain_files();
    let mut lens = Vec::with_capacity(files.len());
    for (depth, f) in files.iter().enumerate() {
        let l = f
            .metadata()
            .map_err(|e| RegionError::BadLayout {
                depth,
                what: format!("stat: {e}"),
            })?
            .len();
        lens.push(l);
    }
    for r in &runs {
        if let RunKind::File { depth, offset, .. } = r.kind {
            let flen = lens.get(depth).copied().ok_or(RegionError::BadLayout {
                depth,
                what: "no such file in the chain".into(),
            })?;
            // The kernel zero-fills the tail of a file's last page, so a
            // mapping may end anywhere inside that page.
            let mappable = flen.next_multiple_of(PAGE_SIZE);
            if !offset.is_multiple_of(PAGE_SIZE)
                || offset.checked_add(r.len).is_none_or(|e| e > mappable)
            {
                return Err(RegionError::BadLayout {
                        depth,
                        what: format!(
                            "{:#x} bytes at {offset:#x} are not page-aligned inside the file ({flen} bytes)",
                            r.len
                        ),
                    });
            }
        }
    }

    let uffd = Uffd::for_holes(!opts.pagemap_read_fallback)?;
    // Shared runs side by side in the region, advised together.
    let mut shared_spans: Vec<(u64, u64)> = Vec::new();
    for r in &runs {
        match r.kind {
            RunKind::File {
                depth,
                offset,
                shared,
            } => {
                mapping
                    .map_file_unadvised(r.offset, r.len, files[depth].as_raw_fd(), offset, shared)
                    .map_err(|source| RegionError::Map {
                        offset: r.offset,
                        len: r.len,
                        depth,
                        file_offset: offset,
                        source,
                    })?;
                if shared {
                    push_run(&mut shared_spans, (r.offset, r.offset + r.len));
                }
            }
            RunKind::Hole => uffd.register_missing(mapping.base() + r.offset, r.len)?,
            // The reservation is already anonymous, untouched memory.
            RunKind::Anon => {}
        }
    }
    for (start, end) in shared_spans {
        mapping.advise_random(start, end - start);
    }
    // The open checked its own need against the limit; what the guest's
    // faults and the barriers map from now on counts against it.
    mapping.limit_mappings(max, in_use + planned_vmas + 2);
    drop(files);
    let scanner = PageScanner::new(opts.pagemap_read_fallback)?;
    let view = View {
        cs,
        mapping,
        uffd: Arc::new(uffd),
        clusters: Clusters::new(states),
    };
    let zero_budget = opts.zero_budget.unwrap_or(DEFAULT_ZERO_BUDGET);
    let tracking = Tracking::start(&view, scanner, zero_budget, !opts.pagemap_read_fallback);
    let mut pool = PoolCtl::new(
        pool_opts,
        cs,
        pool_clusters,
        size / cs,
        opts.thread_hook.clone(),
    );
    if let Err(e) = pool.start(&image) {
        log::warn!("no pre-allocation worker ({e}), the pool refills inline");
    }
    pool.configure(&mut image);
    // The pool is empty after the open: fill it before the first fault.
    pool.request(&image);
    Ok(RegionState {
        view,
        tracking,
        image: Writable::Open(Box::new(image)),
        pool,
        out_of_space: None,
        counters: Counters {
            planned_vmas,
            deferred,
            ..Counters::default()
        },
        expand_window: (opts.expand_window.unwrap_or(DEFAULT_EXPAND_WINDOW) / cs).max(1),
        read_ahead_next: 0,
    })
}
