//! MSI-X: the capability's control bits, the vector table and the pending
//! bit array, emulated in the VMM; delivery goes to an [`InterruptSink`].
//!
//! Masking is done here: a vector whose entry or the whole function is
//! masked (or MSI-X disabled) sets its pending bit instead of reaching the
//! sink, and is delivered when unmasked. The sink therefore only sees
//! vectors the guest is ready for; a KVM sink writes the vector's irqfd,
//! whose GSI route it programs in [`InterruptSink::program`].

use std::io;

/// Capability id of MSI-X.
pub const MSIX_CAP_ID: u8 = 0x11;
/// Message control: MSI-X enable.
pub const MSIX_ENABLE: u16 = 1 << 15;
/// Message control: function mask.
pub const MSIX_FUNCTION_MASK: u16 = 1 << 14;
/// Bytes per table entry.
pub const ENTRY_SIZE: u64 = 16;
/// Vector control: entry masked.
const ENTRY_MASKED: u32 = 1;

/// One table entry as the guest programmed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixEntry {
    /// Message address (low 32 bits, then high).
    pub addr: u64,
    /// Message data.
    pub data: u32,
    /// The entry's mask bit.
    pub masked: bool,
}

impl Default for MsixEntry {
    fn default() -> Self {
        // Entries are masked at reset (PCI spec).
        MsixEntry {
            addr: 0,
            data: 0,
            masked: true,
        }
    }
}

/// Where interrupts go. The KVM implementation keeps one irqfd per vector
/// and a GSI route per programmed entry (`KVM_SET_GSI_ROUTING`); tests
/// record the vectors.
pub trait InterruptSink: Send {
    /// Delivers MSI-X `vector` (unmasked, MSI-X enabled: checked by the
    /// caller).
    fn trigger(&self, vector: u16) -> io::Result<()>;
    /// The guest changed `vector`'s entry (address, data or mask); a KVM
    /// sink updates its GSI route. The default does nothing.
    fn program(&self, vector: u16, entry: MsixEntry) {
        let _ = (vector, entry);
    }
}

/// The MSI-X table, PBA and the capability's control bits.
#[derive(Debug)]
pub struct Msix {
    entries: Vec<MsixEntry>,
    pending: Vec<bool>,
    control: u16,
}

impl Msix {
    /// A table of `vectors` entries (1..=2048), all masked, MSI-X disabled.
    pub fn new(vectors: u16) -> Msix {
        let n = usize::from(vectors.clamp(1, 2048));
        Msix {
            entries: vec![MsixEntry::default(); n],
            pending: vec![false; n],
            control: 0,
        }
    }

    /// Number of vectors.
    pub fn len(&self) -> u16 {
        self.entries.len() as u16
    }

    /// Whether there are no vectors (never: at least one).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The table size field of message control (N - 1).
    pub fn table_size_field(&self) -> u16 {
        self.len() - 1
    }

    /// The table's size in bytes.
    pub fn table_bytes(&self) -> u64 {
        u64::from(self.len()) * ENTRY_SIZE
    }

    /// The PBA's size in bytes (whole qwords).
    pub fn pba_bytes(&self) -> u64 {
        u64::from(self.len()).div_ceil(64) * 8
    }

    /// Message control as the guest left it (enable, function mask).
    pub fn enabled(&self) -> bool {
        self.control & MSIX_ENABLE != 0
    }

    fn function_masked(&self) -> bool {
        self.control & MSIX_FUNCTION_MASK != 0
    }

    /// The entry of `vector`.
    pub fn entry(&self, vector: u16) -> Option<MsixEntry> {
        self.entries.get(usize::from(vector)).copied()
    }

    /// Whether `vector` is pending.
    pub fn is_pending(&self, vector: u16) -> bool {
        self.pending
            .get(usize::from(vector))
            .copied()
            .unwrap_or(false)
    }

    /// Disables MSI-X and masks every entry (function reset).
    pub fn reset(&mut self) {
        self.entries.fill(MsixEntry::default());
        self.pending.fill(false);
        self.control = 0;
    }

    /// The guest wrote message control (its enable and function mask bits
    /// count); pending vectors now unmasked are delivered.
    pub fn set_control(&mut self, control: u16, sink: &dyn InterruptSink) {
        self.control = control & (MSIX_ENABLE | MSIX_FUNCTION_MASK);
        self.deliver_pending(sink);
    }

    /// Raises `vector`: delivered now, or left pending while masked or
    /// disabled. Vectors past the table are dropped.
    pub fn raise(&mut self, vector: u16, sink: &dyn InterruptSink) {
        let v = usize::from(vector);
        let Some(entry) = self.entries.get(v) else {
            return;
        };
        if !self.enabled() || self.function_masked() || entry.masked {
            self.pending[v] = true;
            return;
        }
        if let Err(e) = sink.trigger(vector) {
            log::warn!("MSI-X vector {vector}: delivery failed: {e}");
        }
    }

    fn deliver_pending(&mut self, sink: &dyn InterruptSink) {
        if !self.enabled() || self.function_masked() {
            return;
        }
        for v in 0..self.entries.len() {
            if self.pending[v] && !self.entries[v].masked {
                self.pending[v] = false;
                if let Err(e) = sink.trigger(v as u16) {
                    log::warn!("MSI-X vector {v}: delivery failed: {e}");
                }
            }
        }
    }

    /// A guest read in the table (dword or qword, aligned); other accesses
    /// read zeros.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if !matches!(data.len(), 4 | 8) || !offset.is_multiple_of(data.len() as u64) {
            return;
        }
        for (i, chunk) in data.chunks_mut(4).enumerate() {
            let off = offset + 4 * i as u64;
            let Some(e) = self.entries.get((off / ENTRY_SIZE) as usize) else {
                return;
            };
            let v = match off % ENTRY_SIZE {
                0 => e.addr as u32,
                4 => (e.addr >> 32) as u32,
                8 => e.data,
                _ => u32::from(e.masked),
            };
            chunk.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// A guest write in the table (dword or qword, aligned; others are
    /// dropped). Unmasking a pending vector delivers it.
    pub fn write_table(&mut self, offset: u64, data: &[u8], sink: &dyn InterruptSink) {
        if !matches!(data.len(), 4 | 8) || !offset.is_multiple_of(data.len() as u64) {
            log::debug!(
                "MSI-X table: dropped {}-byte write at {offset:#x}",
                data.len()
            );
            return;
        }
        for (i, chunk) in data.chunks(4).enumerate() {
            let off = offset + 4 * i as u64;
            let idx = (off / ENTRY_SIZE) as usize;
            let Some(e) = self.entries.get_mut(idx) else {
                return;
            };
            let mut b = [0u8; 4];
            b.copy_from_slice(chunk);
            let v = u32::from_le_bytes(b);
            match off % ENTRY_SIZE {
                0 => e.addr = (e.addr & !0xffff_ffff) | u64::from(v),
                4 => e.addr = (e.addr & 0xffff_ffff) | (u64::from(v) << 32),
                8 => e.data = v,
                _ => e.masked = v & ENTRY_MASKED != 0,
            }
            sink.program(idx as u16, *e);
        }
        self.deliver_pending(sink);
    }

    /// A guest read in the PBA (read-only; dword or qword, aligned).
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if !matches!(data.len(), 4 | 8) || !offset.is_multiple_of(data.len() as u64) {
            return;
        }
        for (i, b) in data.iter_mut().enumerate() {
            for bit in 0..8 {
                let v = (offset as usize + i) * 8 + bit;
                if self.pending.get(v).copied().unwrap_or(false) {
                    *b |= 1 << bit;
                }
            }
        }
    }
}

// Snapshot state (issue 17): capture and restore, kept under snapshot/.
#[path = "../snapshot/msix_state.rs"]
mod state;
pub use state::{MsixEntryState, MsixState};
