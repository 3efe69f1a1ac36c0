//! virtio-pmem for pcow images (and raw files, as upstream).
//!
//! The crate knows nothing of KVM or PCI. A VMM gives it guest memory and a
//! virtqueue; it parses requests ([`request`]), answers them through a
//! [`FlushBackend`] and exposes the config space ([`device`]). Raw files
//! are mapped as upstream Cloud Hypervisor does ([`raw`]).
//!
//! A pcow chain becomes one host region: writable clusters mapped shared,
//! read-only layers private, holes served by userfaultfd. [`PcowRegion`]
//! is what a VMM holds (FLUSH, live snapshot, live overlay, status); its
//! [`Monitor`] serves the faults. Copy-on-write pages are found with
//! userfaultfd write-protect-async tracking and `PAGEMAP_SCAN`
//! ([`pagemap`]), or, when the VMM gives the region one, with a
//! [`WriteLog`] of the guest's writes (KVM's dirty log), and stored per
//! 4 KiB page.
//!
//! # Modules, lowest first
//!
//! - `mapping`: the reservation the region is mapped over, and the
//!   process's mapping limits;
//! - [`uffd`]: the userfaultfd ABI and `Uffd`; [`pagemap`]: `PAGEMAP_SCAN`
//!   and the write tracker;
//! - `clusters`: cluster states and runs (the one place that merges
//!   adjacent ranges); `plan`: the mappings of an image's layout;
//!   `view`: the reservation, the userfaultfd and the cluster states;
//! - `health`: typed failures kept for the status; `quiesce`: holding
//!   writers; `pool`: the pre-allocation worker; `fault_poll`: the
//!   monitor's adaptive poll window; `request`, `device`: the virtqueue's
//!   requests and the device model; `raw`: raw files;
//! - [`write_log`]: the write log a VMM may give a region;
//! - `harvest`: write tracking and the pages a barrier moves; `state`:
//!   the region state and its locks; `build`: building a region;
//! - `fault`: fault resolution and the [`Monitor`]; `barrier`: the
//!   barrier; `overlay`: live overlays; `freeze`: a VM snapshot's
//!   freeze of the top image; [`MonitorThread`]: the monitor's thread;
//! - `region`: [`PcowRegion`], the facade, and [`PmemBackend`] (either
//!   kind of device as a [`FlushBackend`], for a VMM).
//!
//! # Threads
//!
//! - the monitor thread ([`MonitorThread`], one per device) serves the
//!   userfaultfd (faults into holes, and wakes) and the pool's eventfd;
//! - a barrier, a snapshot, an overlay and a freeze run on their caller's thread (the
//!   device's queue for a guest FLUSH, the VMM's for the API);
//! - the pool worker (one per device) reserves clusters with `fallocate`
//!   off the fault path and signals the pool's eventfd.
//!
//! The two threads this crate spawns (the monitor's, the pool worker) run
//! [`RegionOptions::thread_hook`] first, if the user gave one
//! ([`ThreadHook`], `thread_hook.rs`): the VMM installs a seccomp filter
//! there without this crate knowing about seccomp.
//!
//! # Locks, in the order they are taken
//!
//! 1. the barrier lock (`Shared::serialize`): one barrier, snapshot or
//!    overlay of a device at a time; it also holds the [`BarrierTotals`];
//! 2. the writers' hold ([`Quiesce::hold`], the VMM pauses its vCPUs):
//!    taken without the state lock, so the monitor serves the faults of
//!    the writers the hold waits for;
//! 3. the state lock (`Shared::lock`): the cluster states, the mapping,
//!    the image in memory, the pool's bookkeeping. The monitor takes it
//!    alone, per batch of faults. It is held for in-memory work, mmap and
//!    ioctl calls and writes into the page cache (a barrier's copy of the
//!    written pages into the file; an allocation when the pre-allocated
//!    pool is empty, after a wait of at most 10 ms for the pool worker's
//!    next piece, which never needs this lock), never across a sync by a
//!    FLUSH barrier: it drops the lock (and the writers) before the
//!    commit's syncs and takes it again to publish the commit, so a fault
//!    never waits for a sync. Snapshots
//!    and overlays keep it (and the writers) through their commits, so
//!    faults wait for them. `status` copies under it and scans the page
//!    tables and reads `/proc/self/maps` without it;
//! 4. the pool's channel (the worker's request and completions) and the
//!    write gate's state: innermost, held for a few instructions.
//!
//! Nothing takes a lock above one it holds; the monitor's poll state is
//! taken only by the thread serving the userfaultfd, before the state lock.
#![warn(missing_docs)]

mod barrier;
mod build;
mod clusters;
pub mod device;
mod fault;
pub mod fault_poll;
mod freeze;
mod harvest;
mod health;
mod mapping;
mod monitor_thread;
mod overlay;
pub mod pagemap;
mod plan;
mod pool;
mod quiesce;
pub mod raw;
mod region;
pub mod request;
mod state;
mod thread_hook;
pub mod uffd;
mod view;
pub mod write_log;

pub use barrier::{BarrierError, BarrierStats};
pub use build::{
    RegionError, RegionOptions, DEFAULT_EXPAND_WINDOW, DEFAULT_ZERO_BUDGET, MAX_REGION_CLUSTERS,
};
pub use device::{
    DeviceError, FlushBackend, FlushError, Metrics, PmemDevice, CONFIG_SIZE, DEVICE_TYPE,
    QUEUE_SIZE,
};
pub use fault::{Monitor, MonitorError, NoCluster, READ_AHEAD_BYTES};
pub use freeze::{fail_next_freeze, FreezeError, FreezeInfo, FreezeStep};
pub use health::{is_out_of_space, Failure};
pub use mapping::{max_map_count, MapsError, VMA_MARGIN};
pub use monitor_thread::{MonitorReport, MonitorThread};
pub use overlay::{OverlayError, OverlayInfo};
pub use pool::{default_pool_clusters, PoolOptions, PoolStatus, DEFAULT_POOL_MIN_CLUSTERS};
pub use quiesce::{GateEntry, Quiesce, QuiesceError, WriteGate};
pub use raw::{RawError, RawRegion};
pub use region::{PcowRegion, PmemBackend, Status};
pub use request::{parse, Request, RequestError, RequestType};
pub use state::{BarrierTotals, FaultCounters, NoImage};
pub use thread_hook::{ConfineError, DeviceThread, HookError, ThreadHook};
pub use uffd::{Uffd, UffdError};
pub use write_log::{WriteLog, WriteLogError};
