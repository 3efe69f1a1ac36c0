//! The virtio-pmem device crate's [`PmemDevice`] as a [`VirtioDevice`]:
//! one queue of [`QUEUE_SIZE`], the 16-byte config (start, size), FLUSH
//! served on notification.

use virtio_pmem_pcow::{FlushBackend, PmemDevice, CONFIG_SIZE, DEVICE_TYPE, QUEUE_SIZE};
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;

use super::virtio_pci::{VirtioDevice, VirtioError};

/// The queues after activation.
struct Active {
    mem: GuestMemoryMmap,
    queue: Queue,
}

/// A [`PmemDevice`] driven through virtio-pci.
pub struct PmemVirtio<B> {
    device: PmemDevice<B>,
    active: Option<Active>,
}

impl<B> std::fmt::Debug for PmemVirtio<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PmemVirtio")
            .field("active", &self.active.is_some())
            .finish()
    }
}

impl<B: FlushBackend> PmemVirtio<B> {
    /// Wraps `device`.
    pub fn new(device: PmemDevice<B>) -> PmemVirtio<B> {
        PmemVirtio {
            device,
            active: None,
        }
    }

    /// The device (metrics, the backend for live operations).
    pub fn device(&self) -> &PmemDevice<B> {
        &self.device
    }

    /// The device, mutably.
    pub fn device_mut(&mut self) -> &mut PmemDevice<B> {
        &mut self.device
    }
}

const QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];

impl<B: FlushBackend + Send> VirtioDevice for PmemVirtio<B> {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        self.device.features()
    }

    fn config_size(&self) -> usize {
        CONFIG_SIZE
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        self.device.read_config(offset, data)
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        _features: u64,
        queues: Vec<(u16, Queue)>,
    ) -> Result<(), VirtioError> {
        let got = queues.len();
        let mut it = queues.into_iter();
        match (it.next(), it.next()) {
            (Some((0, queue)), None) => {
                self.active = Some(Active { mem, queue });
                Ok(())
            }
            _ => Err(VirtioError::QueueCount { expected: 1, got }),
        }
    }

    fn process_queue(&mut self, index: u16) -> Result<bool, VirtioError> {
        let Some(a) = self.active.as_mut().filter(|_| index == 0) else {
            return Err(VirtioError::QueueNotActive(index));
        };
        self.device
            .process_queue(&a.mem, &mut a.queue)
            .map_err(|e| VirtioError::Process {
                index,
                source: Box::new(e),
            })
    }

    fn queue_states(&self) -> Vec<(u16, virtio_queue::QueueState)> {
        self.active.iter().map(|a| (0, a.queue.state())).collect()
    }

    fn reset(&mut self) {
        self.active = None;
        self.device.unstall();
    }

    fn stalled(&self) -> Option<String> {
        self.device.stalled().map(str::to_owned)
    }

    fn unstall(&mut self) {
        self.device.unstall();
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let m = self.device.metrics();
        vec![
            ("flushes", m.flushes),
            ("flush_errors", m.flush_errors),
            (
                "malformed_requests",
                m.malformed_chains + m.unknown_requests,
            ),
        ]
    }
}
