//! virtio-pmem for pcow images (and raw files, as upstream).
//!
//! The crate knows nothing of KVM or PCI. A VMM gives it guest memory and a
//! virtqueue; it parses requests ([`request`]), answers them through a
//! [`device::FlushBackend`] and exposes the config space ([`device`]). Raw
//! files are mapped as upstream Cloud Hypervisor does ([`raw`]).
//!
//! A pcow chain becomes one host region ([`region`]): writable clusters
//! mapped shared, read-only layers private, holes served by the
//! userfaultfd [`monitor`] (an fd for the VMM's epoll loop). The [`barrier`]
//! moves copy-on-write pages into the image and commits it; [`PcowRegion`]
//! ([`pcow_device`]) is what a VMM holds (FLUSH, live snapshot, live
//! overlay, status). The [`pool`] worker pre-allocates clusters off the
//! fault path and signals an eventfd the monitor exposes as its second fd.
//! [`pagemap`] wraps `PAGEMAP_SCAN`.
//!
//! Copy-on-write pages are found with userfaultfd write-protect-async
//! tracking and `PAGEMAP_SCAN`, and stored per 4 KiB page. The scan walks
//! the page tables the guest has populated: its cost follows what was
//! touched, not the image's size, but it is not a log of the writes (a
//! large base the guest has read costs about 0.4 ms per GiB at every
//! barrier). The monitor polls its userfaultfd briefly after a fault
//! ([`fault_poll`]).
#![warn(missing_docs)]

pub mod barrier;
pub mod device;
pub mod fault_poll;
pub mod monitor;
pub mod monitor_thread;
pub mod pagemap;
pub mod pcow_device;
pub mod pool;
pub mod raw;
pub mod region;
pub mod request;
pub mod uffd;

pub use barrier::{is_out_of_space, BarrierError, BarrierStats, Quiesce, QuiesceError, WriteGate};
pub use device::{
    FlushBackend, FlushError, Metrics, PmemDevice, CONFIG_SIZE, DEVICE_TYPE, QUEUE_SIZE,
};
pub use monitor::{FaultCounters, Monitor, MonitorError};
pub use monitor_thread::{MonitorReport, MonitorThread};
pub use pcow_device::{OverlayError, OverlayInfo, PcowRegion, Status};
pub use pool::{PoolOptions, PoolStatus};
pub use raw::{RawError, RawRegion};
pub use region::{RegionError, RegionOptions, DEFAULT_ZERO_BUDGET};
pub use request::{parse, Request, RequestError, RequestType};
