//! The virtio-pmem device model: identity, config space and the request
//! queue. Transport (virtio-pci), interrupts and the memslot belong to the
//! VMM; persistence belongs to a [`FlushBackend`].

use std::ops::Deref;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestMemory};

use crate::request::{parse, RequestType, RESP_EIO, RESP_OK};

/// `VIRTIO_ID_PMEM`.
pub const DEVICE_TYPE: u32 = 27;
/// Size of the one request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Size of the config space: `{ le64 start; le64 size; }`.
pub const CONFIG_SIZE: usize = 16;

/// Why a flush did not complete.
#[derive(Debug)]
pub enum FlushError {
    /// The barrier failed: the guest is answered EIO.
    Failed(Box<dyn std::error::Error + Send + Sync>),
    /// The file system is full: the request stays in the queue, unanswered,
    /// and the device stalls until [`PmemDevice::unstall`]; the VMM pauses
    /// the guest meanwhile and retries once space was freed (QEMU's
    /// `werror=enospc`: the guest never sees the error).
    NoSpace(Box<dyn std::error::Error + Send + Sync>),
}

impl FlushError {
    /// Sorts a barrier's error: out of space stalls, anything else fails.
    pub fn from_error(e: Box<dyn std::error::Error + Send + Sync>) -> FlushError {
        if crate::health::is_out_of_space(&*e) {
            FlushError::NoSpace(e)
        } else {
            FlushError::Failed(e)
        }
    }
}

/// Makes the device's region durable: fsync for a raw file, a pcow
/// barrier for an image.
pub trait FlushBackend {
    /// Runs a barrier. The device answers the guest only after it returns.
    fn flush(&mut self) -> Result<(), FlushError>;
}

/// Counters the VMM reports (and that keep guest-triggered logging bounded).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Metrics {
    /// FLUSH requests answered OK.
    pub flushes: u64,
    /// FLUSH requests answered EIO because the backend failed.
    pub flush_errors: u64,
    /// Requests of an unknown type (answered EIO).
    pub unknown_requests: u64,
    /// Chains returned unanswered because they were malformed.
    pub malformed_chains: u64,
    /// Chains whose response could not be written.
    pub response_errors: u64,
    /// FLUSH requests left in the queue because the file system was full
    /// (each retry counts).
    pub flush_stalls: u64,
}

/// Errors that stop queue processing (the queue itself is broken).
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("virtqueue access failed")]
    Queue(#[source] virtio_queue::Error),
}

/// A virtio-pmem device: where the region sits in guest-physical space and
/// how to make it durable.
pub struct PmemDevice<B> {
    start: u64,
    size: u64,
    backend: B,
    metrics: Metrics,
    /// Set while a FLUSH waits for space: the queue is not served.
    stalled: Option<String>,
}

impl<B: FlushBackend> PmemDevice<B> {
    /// A device whose region is `size` bytes at guest-physical `start`.
    pub fn new(start: u64, size: u64, backend: B) -> Self {
        PmemDevice {
            start,
            size,
            backend,
            metrics: Metrics::default(),
            stalled: None,
        }
    }

    /// Feature bits offered: virtio 1.x only (no legacy).
    pub fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    /// The config space bytes (little-endian `start`, `size`).
    pub fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        c[..8].copy_from_slice(&self.start.to_le_bytes());
        c[8..].copy_from_slice(&self.size.to_le_bytes());
        c
    }

    /// Reads config space at `offset` into `data`; bytes past the end read
    /// as zero (a driver probing beyond it gets no garbage).
    pub fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| c.get(o).copied())
                .unwrap_or(0);
        }
    }

    /// Counters so far.
    pub fn metrics(&self) -> Metrics {
        self.metrics
    }

    /// The backend (the VMM uses it for live operations).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Why the queue is stalled: a FLUSH found the file system full and
    /// waits, unanswered, in the queue.
    pub fn stalled(&self) -> Option<&str> {
        self.stalled.as_deref()
    }

    /// Lets the queue be served again (the next [`process_queue`] retries
    /// the FLUSH that stalled it). Call once space was freed.
    ///
    /// [`process_queue`]: PmemDevice::process_queue
    pub fn unstall(&mut self) {
        self.stalled = None;
    }

    /// Serves every available request. Returns whether the used ring
    /// changed and the driver should be notified. A stalled device serves
    /// nothing.
    pub fn process_queue<M, Q>(&mut self, mem: M, queue: &mut Q) -> Result<bool, DeviceError>
    where
        M: Deref + Clone,
        M::Target: GuestMemory + Sized,
        Q: QueueT,
    {
        let mut used = false;
        while self.stalled.is_none() {
            let Some(chain) = queue.pop_descriptor_chain(mem.clone()) else {
                break;
            };
            let head = chain.head_index();
            let len = match parse(chain) {
                Ok(req) => {
                    let ret = match req.kind {
                        RequestType::Flush => match self.backend.flush() {
                            Ok(()) => {
                                self.metrics.flushes += 1;
                                RESP_OK
                            }
                            Err(FlushError::NoSpace(e)) => {
                                // Put the request back: it is popped again
                                // (and the barrier retried) after `unstall`.
                                queue.set_next_avail(queue.next_avail().wrapping_sub(1));
                                self.metrics.flush_stalls += 1;
                                let msg = error_report::chain(&*e);
                                log::warn!("virtio-pmem flush waits for space: {msg}");
                                self.stalled = Some(msg);
                                break;
                            }
                            Err(FlushError::Failed(e)) => {
                                self.metrics.flush_errors += 1;
                                log::error!(
                                    "virtio-pmem flush failed: {}",
                                    error_report::chain(&*e)
                                );
                                RESP_EIO
                            }
                        },
                        RequestType::Unknown(t) => {
                            self.metrics.unknown_requests += 1;
                            if self.metrics.unknown_requests.is_power_of_two() {
                                log::warn!(
                                    "virtio-pmem: unknown request type {t} ({} so far)",
                                    self.metrics.unknown_requests
                                );
                            }
                            RESP_EIO
                        }
                    };
                    match mem.write_obj(ret.to_le(), req.response) {
                        Ok(()) => 4,
                        Err(_) => {
                            self.metrics.response_errors += 1;
                            0
                        }
                    }
                }
                Err(e) => {
                    self.metrics.malformed_chains += 1;
                    if self.metrics.malformed_chains.is_power_of_two() {
                        log::warn!(
                            "virtio-pmem: malformed chain: {e} ({} so far)",
                            self.metrics.malformed_chains
                        );
                    }
                    0
                }
            };
            queue
                .add_used(&*mem, head, len)
                .map_err(DeviceError::Queue)?;
            used = true;
        }
        if used {
            return queue.needs_notification(&*mem).map_err(DeviceError::Queue);
        }
        Ok(false)
    }
}
