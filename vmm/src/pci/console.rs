//! virtio-console (virtio type 3) with one port, no multiport: `hvc0` in a
//! Linux guest (`console=hvc0`). Queue 0 (receiveq) carries input to the
//! guest, queue 1 (transmitq) its output. No features; the 12-byte
//! configuration (cols, rows, max_nr_ports, emerg_wr) reads zero sizes
//! and one port.
//!
//! - Output: each transmit chain's device-readable buffers go to the sink
//!   (the `--console` backend's bounded [`crate::chardev::Output`], which
//!   never blocks: a slow consumer loses the oldest bytes, counted), then
//!   the chain is returned with length 0.
//! - Input: the control loop appends bytes to the shared [`ConsoleInput`]
//!   (bounded to [`INPUT_BUFFER`]; beyond it new bytes are dropped and
//!   counted) and notifies queue 0; the device fills the guest's receive
//!   buffers while it has bytes and returns each with the count written.
//!   Receive buffers wait in the queue while there is no input.
//! - Guest input is checked: a transmit chain with a device-writable
//!   descriptor, a receive chain with a device-readable one, or a buffer
//!   outside guest memory is returned unused (length 0) and counted,
//!   logged once per power of two; a transmit chain gives at most
//!   [`MAX_CHAIN`] bytes.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

use super::virtio_pci::{VirtioDevice, VirtioError};

/// Virtio device type.
pub const DEVICE_TYPE: u32 = 3;
/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// The receive queue.
pub const RX_QUEUE: u16 = 0;
/// The transmit queue.
pub const TX_QUEUE: u16 = 1;
/// Bytes of input held for the guest at most.
pub const INPUT_BUFFER: usize = 64 * 1024;
/// Bytes one transmit chain gives at most.
pub const MAX_CHAIN: usize = 64 * 1024;
/// `struct virtio_console_config`: cols, rows (u16), max_nr_ports,
/// emerg_wr (u32).
pub const CONFIG_SIZE: usize = 12;

const QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE, QUEUE_SIZE];

/// Input waiting for the guest, shared with the control loop.
#[derive(Debug, Default)]
pub struct ConsoleInput {
    buf: VecDeque<u8>,
    dropped: u64,
}

impl ConsoleInput {
    /// A shareable empty input.
    pub fn shared() -> Arc<Mutex<ConsoleInput>> {
        Arc::new(Mutex::new(ConsoleInput::default()))
    }

    /// Appends `bytes`; what does not fit in [`INPUT_BUFFER`] is dropped.
    /// Returns how many were kept.
    pub fn push(&mut self, bytes: &[u8]) -> usize {
        let room = INPUT_BUFFER.saturating_sub(self.buf.len());
        let n = bytes.len().min(room);
        self.buf.extend(&bytes[..n]);
        if n < bytes.len() {
            let before = self.dropped;
            self.dropped += (bytes.len() - n) as u64;
            if before == 0 || (before >> 20) != (self.dropped >> 20) {
                log::warn!(
                    "virtio-console: the guest does not read its input: {} byte(s) dropped so far",
                    self.dropped
                );
            }
        }
        n
    }

    /// Bytes waiting.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// Counters of the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsoleStats {
    /// Bytes the guest wrote.
    pub tx_bytes: u64,
    /// Bytes given to the guest.
    pub rx_bytes: u64,
    /// Chains returned unused.
    pub bad_chains: u64,
}

struct Active {
    mem: GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
}

/// The virtio console.
pub struct ConsoleDevice {
    /// `None`: output discarded (`--console null`).
    sink: Option<Box<dyn Write + Send>>,
    input: Arc<Mutex<ConsoleInput>>,
    active: Option<Active>,
    stats: ConsoleStats,
}

impl std::fmt::Debug for ConsoleDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleDevice")
            .field("discard", &self.sink.is_none())
            .field("active", &self.active.is_some())
            .field("stats", &self.stats)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConsoleDevice {
    /// A console writing to `sink` (`None`: discarded) and reading `input`.
    pub fn new(
        sink: Option<Box<dyn Write + Send>>,
        input: Arc<Mutex<ConsoleInput>>,
    ) -> ConsoleDevice {
        ConsoleDevice {
            sink,
            input,
            active: None,
            stats: ConsoleStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> ConsoleStats {
        self.stats
    }

    fn bad_chain(&mut self, queue: &str, why: &str) {
        self.stats.bad_chains += 1;
        if self.stats.bad_chains.is_power_of_two() {
            log::warn!(
                "virtio-console: {queue} chain skipped: {why} ({} so far)",
                self.stats.bad_chains
            );
        }
    }

    /// Moves every available transmit chain's bytes to the sink.
    pub fn process_tx<M: GuestMemory>(
        &mut self,
        mem: &M,
        queue: &mut Queue,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        let mut bytes = Vec::new();
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            bytes.clear();
            let mut bad = None;
            for d in chain {
                if d.is_write_only() {
                    bad = Some("a device-writable descriptor");
                    break;
                }
                let len = (d.len() as usize).min(MAX_CHAIN - bytes.len());
                let start = bytes.len();
                bytes.resize(start + len, 0);
                if !GuestMemory::check_range(mem, d.addr(), d.len() as usize, Permissions::Read)
                    || mem.read_slice(&mut bytes[start..], d.addr()).is_err()
                {
                    bad = Some("a buffer outside guest memory");
                    break;
                }
            }
            match bad {
                Some(why) => self.bad_chain("transmit", why),
                None => {
                    self.stats.tx_bytes += bytes.len() as u64;
                    if let Some(s) = self.sink.as_mut() {
                        // The sink buffers (chardev::OutputWriter): it
                        // never blocks and never fails.
                        let _ = s.write_all(&bytes);
                    }
                }
            }
            queue.add_used(mem, head, 0)?;
            used = true;
        }
        if used {
            return queue.needs_notification(mem);
        }
        Ok(false)
    }

    /// Fills the guest's receive buffers with waiting input.
    pub fn process_rx<M: GuestMemory>(
        &mut self,
        mem: &M,
        queue: &mut Queue,
    ) -> Result<bool, virtio_queue::Error> {
        let input = self.input.clone();
        let mut input = lock(&input);
        let mut used = false;
        while !input.is_empty() {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let mut targets: Vec<(GuestAddress, usize)> = Vec::new();
            let mut bad = None;
            for d in chain {
                if !d.is_write_only() {
                    bad = Some("a device-readable descriptor");
                    break;
                }
                if !GuestMemory::check_range(mem, d.addr(), d.len() as usize, Permissions::Write) {
                    bad = Some("a buffer outside guest memory");
                    break;
                }
                targets.push((d.addr(), d.len() as usize));
            }
            let mut written = 0usize;
            if let Some(why) = bad {
                self.bad_chain("receive", why);
            } else {
                for (addr, len) in targets {
                    let n = len.min(input.buf.len());
                    if n == 0 {
                        break;
                    }
                    let (a, b) = input.buf.as_slices();
                    let chunk: Vec<u8> = a.iter().chain(b).take(n).copied().collect();
                    if mem.write_slice(&chunk, addr).is_err() {
                        break;
                    }
                    input.buf.drain(..n);
                    written += n;
                }
                self.stats.rx_bytes += written as u64;
            }
            queue.add_used(mem, head, written as u32)?;
            used = true;
        }
        if used {
            return queue.needs_notification(mem);
        }
        Ok(false)
    }
}

impl VirtioDevice for ConsoleDevice {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats;
        vec![
            ("tx_bytes", s.tx_bytes),
            ("rx_bytes", s.rx_bytes),
            ("bad_chains", s.bad_chains),
        ]
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        0
    }

    fn config_size(&self) -> usize {
        CONFIG_SIZE
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // cols 0, rows 0, max_nr_ports 1, emerg_wr 0.
        let mut cfg = [0u8; CONFIG_SIZE];
        cfg[4..8].copy_from_slice(&1u32.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| cfg.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        _features: u64,
        queues: Vec<(u16, Queue)>,
    ) -> Result<(), VirtioError> {
        let got = queues.len();
        let mut it = queues.into_iter();
        match (it.next(), it.next(), it.next()) {
            (Some((RX_QUEUE, rx)), Some((TX_QUEUE, tx)), None) => {
                self.active = Some(Active { mem, rx, tx });
                Ok(())
            }
            _ => Err(VirtioError::QueueCount { expected: 2, got }),
        }
    }

    fn process_queue(&mut self, index: u16) -> Result<bool, VirtioError> {
        let Some(mut a) = self.active.take_if(|_| index <= TX_QUEUE) else {
            return Err(VirtioError::QueueNotActive(index));
        };
        let r = if index == RX_QUEUE {
            self.process_rx(&a.mem, &mut a.rx)
        } else {
            self.process_tx(&a.mem, &mut a.tx)
        };
        self.active = Some(a);
        r.map_err(|e| VirtioError::Process {
            index,
            source: Box::new(e),
        })
    }

    fn queue_states(&self) -> Vec<(u16, virtio_queue::QueueState)> {
        self.active
            .iter()
            .flat_map(|a| [(RX_QUEUE, a.rx.state()), (TX_QUEUE, a.tx.state())])
            .collect()
    }

    fn reset(&mut self) {
        self.active = None;
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/console_state.rs"]
mod state;
pub use state::ConsoleInputState;
