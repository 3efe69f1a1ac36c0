//! Arbitrary bytes as a guest's virtqueue: the descriptor table, the
//! available ring and the buffers live in a 64 KiB guest memory filled
//! with the input, the queue size and ring addresses come from its first
//! bytes. The virtio-pmem device serves the queue (parsing every chain:
//! directions, lengths, addresses, loops) with a backend that counts
//! flushes. It must answer or drop each chain without panicking, and
//! never flush more often than it saw chains.
#![no_main]

use libfuzzer_sys::fuzz_target;
use virtio_pmem_pcow::{FlushBackend, FlushError, PmemDevice};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM: usize = 64 << 10;

struct Counting(u64);

impl FlushBackend for Counting {
    fn flush(&mut self) -> Result<(), FlushError> {
        self.0 += 1;
        // Every other flush fails (the EIO path), every third finds the
        // disk full (the request stays queued, the device stalls).
        if self.0 % 3 == 0 {
            let e = std::io::Error::from_raw_os_error(28); // ENOSPC
            return Err(FlushError::from_error(Box::new(e)));
        }
        if self.0 % 2 == 0 {
            return Err(FlushError::Failed("injected".into()));
        }
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]) else {
        return;
    };
    let n = data.len().min(MEM);
    if mem.write_slice(&data[..n], GuestAddress(0)).is_err() {
        return;
    }
    let size = 1u16 << (data[0] % 9); // 1..=256
    let addr = |b: u8| u32::from(b) * 256; // inside the 64 KiB
    let Ok(mut q) = Queue::new(256) else { return };
    q.set_size(size);
    q.set_desc_table_address(Some(addr(data[1]) & !15), Some(0));
    q.set_avail_ring_address(Some(addr(data[2]) & !1), Some(0));
    q.set_used_ring_address(Some(addr(data[3]) & !3), Some(0));
    q.set_event_idx(data[4] & 1 == 1);
    q.set_ready(true);
    let mut dev = PmemDevice::new(1 << 32, 2 << 20, Counting(0));
    // Several passes: each sees the used ring the last one wrote; a
    // stalled device serves nothing until unstalled.
    for _ in 0..3 {
        let _ = dev.process_queue(&mem, &mut q);
        if dev.stalled().is_some() {
            let before = dev.backend_mut().0;
            let _ = dev.process_queue(&mem, &mut q);
            assert_eq!(dev.backend_mut().0, before, "a stalled device flushed");
            dev.unstall();
        }
    }
    let m = dev.metrics();
    assert_eq!(
        m.flushes + m.flush_errors + m.flush_stalls,
        dev.backend_mut().0
    );
});
