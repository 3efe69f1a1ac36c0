//! virtio-pmem for pcow images (and raw files, as upstream).
//!
//! The crate knows nothing of KVM or PCI. A VMM gives it guest memory and a
//! virtqueue; it parses requests ([`request`]), answers them through a
//! [`device::FlushBackend`] and exposes the config space ([`device`]). Raw
//! files are mapped as upstream Cloud Hypervisor does ([`raw`]).
//!
//! Not here yet: the pcow region and its image monitor (userfaultfd
//! expansion, copy-on-write harvest, barrier, live snapshot and overlay).
#![warn(missing_docs)]

pub mod device;
pub mod raw;
pub mod request;

pub use device::{FlushBackend, Metrics, PmemDevice, CONFIG_SIZE, DEVICE_TYPE, QUEUE_SIZE};
pub use raw::{RawError, RawRegion};
pub use request::{parse, Request, RequestError, RequestType};
