//! virtio-rng (virtio type 4), the entropy device upstream always gives a
//! guest (`--rng src=PATH`, default `/dev/urandom`): one request queue
//! whose buffers the device fills from the source file. No features, no
//! device configuration.
//!
//! The source is opened when the machine is built; a path that cannot be
//! opened, or is a directory, FIFO or socket (a read could block the VMM
//! thread), is a config error then. Guest input is checked: a chain whose
//! descriptors are not all device-writable, or that points outside guest
//! memory, is returned unused (length 0) and counted, logged once per
//! power of two; a request gets at most [`MAX_REQUEST`] bytes.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestMemory, GuestMemoryMmap, Permissions};

use super::virtio_pci::{VirtioDevice, VirtioError};
use crate::chardev::check_entropy_source;

/// Virtio device type.
pub const DEVICE_TYPE: u32 = 4;
/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Bytes one request gets at most (Linux asks for up to a page).
pub const MAX_REQUEST: usize = 64 * 1024;

const QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];

/// Errors of opening the entropy source.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("rng source {}: cannot open it for reading", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("rng source {}: is {kind}, not a file or a character device", path.display())]
    NotASource { path: PathBuf, kind: &'static str },
}

/// Counters of the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RngStats {
    /// Requests answered with at least one byte.
    pub requests: u64,
    /// Bytes given to the guest.
    pub bytes: u64,
    /// Chains returned unused (read-only descriptor, outside memory).
    pub bad_chains: u64,
    /// Reads of the source that failed or found its end.
    pub source_short: u64,
}

struct Active {
    mem: GuestMemoryMmap,
    queue: Queue,
}

/// The virtio-rng device.
pub struct RngDevice {
    source: File,
    path: PathBuf,
    active: Option<Active>,
    stats: RngStats,
    buf: Vec<u8>,
}

impl std::fmt::Debug for RngDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RngDevice")
            .field("path", &self.path)
            .field("active", &self.active.is_some())
            .field("stats", &self.stats)
            .finish()
    }
}

impl RngDevice {
    /// Opens `path` as the entropy source.
    pub fn open(path: &Path) -> Result<RngDevice, RngError> {
        let open = |source| RngError::Open {
            path: path.to_owned(),
            source,
        };
        // O_NONBLOCK: a source with nothing to give answers short instead
        // of holding the VMM thread.
        let source = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(open)?;
        if let Some(kind) = check_entropy_source(&source).map_err(open)? {
            return Err(RngError::NotASource {
                path: path.to_owned(),
                kind,
            });
        }
        Ok(RngDevice {
            source,
            path: path.to_owned(),
            active: None,
            stats: RngStats::default(),
            buf: Vec::new(),
        })
    }

    /// The source's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Counters so far.
    pub fn stats(&self) -> RngStats {
        self.stats
    }

    fn bad_chain(&mut self, why: &str) {
        self.stats.bad_chains += 1;
        if self.stats.bad_chains.is_power_of_two() {
            log::warn!(
                "virtio-rng: chain skipped: {why} ({} so far)",
                self.stats.bad_chains
            );
        }
    }

    /// Fills up to `len` bytes of `self.buf` from the source; returns how
    /// many it got.
    fn read_source(&mut self, len: usize) -> usize {
        self.buf.resize(len, 0);
        let mut got = 0;
        while got < len {
            match self.source.read(&mut self.buf[got..len]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        log::warn!("virtio-rng: reading {}: {e}", self.path.display());
                    }
                    break;
                }
            }
        }
        if got < len {
            self.stats.source_short += 1;
        }
        got
    }

    /// Serves every available request of `queue`; whether the driver
    /// needs an interrupt.
    pub fn process<M: GuestMemory>(
        &mut self,
        mem: &M,
        queue: &mut Queue,
    ) -> Result<bool, virtio_queue::Error> {
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            // Check the whole chain before giving it anything.
            let mut targets = Vec::new();
            let mut total = 0usize;
            let mut bad = None;
            for d in chain {
                if !d.is_write_only() {
                    bad = Some("a device-readable descriptor");
                    break;
                }
                let len = (d.len() as usize).min(MAX_REQUEST - total);
                if !GuestMemory::check_range(mem, d.addr(), d.len() as usize, Permissions::Write) {
                    bad = Some("a buffer outside guest memory");
                    break;
                }
                if len > 0 {
                    targets.push((d.addr(), len));
                    total += len;
                }
            }
            let mut written = 0u32;
            if let Some(why) = bad {
                self.bad_chain(why);
            } else {
                for (addr, len) in targets {
                    let n = self.read_source(len);
                    if n == 0 {
                        break;
                    }
                    // Checked above; a failure here only shortens the answer.
                    if mem.write_slice(&self.buf[..n], addr).is_err() {
                        break;
                    }
                    written += n as u32;
                    if n < len {
                        break;
                    }
                }
                if written > 0 {
                    self.stats.requests += 1;
                    self.stats.bytes += u64::from(written);
                }
            }
            queue.add_used(mem, head, written)?;
            used = true;
        }
        if used {
            return queue.needs_notification(mem);
        }
        Ok(false)
    }
}

impl VirtioDevice for RngDevice {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats;
        vec![
            ("requests", s.requests),
            ("bytes", s.bytes),
            ("bad_chains", s.bad_chains),
            ("source_short", s.source_short),
        ]
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        0
    }

    fn config_size(&self) -> usize {
        0
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
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
        let Some(mut a) = self.active.take_if(|_| index == 0) else {
            return Err(VirtioError::QueueNotActive(index));
        };
        let r = self.process(&a.mem, &mut a.queue);
        self.active = Some(a);
        r.map_err(|e| VirtioError::Process {
            index,
            source: Box::new(e),
        })
    }

    fn queue_states(&self) -> Vec<(u16, virtio_queue::QueueState)> {
        self.active.iter().map(|a| (0, a.queue.state())).collect()
    }

    fn reset(&mut self) {
        self.active = None;
    }
}
