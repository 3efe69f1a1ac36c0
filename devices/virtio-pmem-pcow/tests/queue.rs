//! FLUSH through a real split virtqueue in guest memory built by the test,
//! well-formed and malformed chains alike, and the raw-file region.

use std::sync::{Arc, Mutex};

use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_pmem_pcow::{FlushBackend, FlushError, Metrics, PmemDevice, RawError, RawRegion};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM: u64 = 0x100_0000;
const REQ: u64 = 0x10_0000;
const RESP: u64 = 0x20_0000;
const UNTOUCHED: u32 = 0xdead_beef;
const W: u16 = VRING_DESC_F_WRITE as u16;

#[derive(Clone, Default)]
struct Backend {
    calls: Arc<Mutex<u32>>,
    fail: bool,
}

impl FlushBackend for Backend {
    fn flush(&mut self) -> Result<(), FlushError> {
        *self.calls.lock().unwrap() += 1;
        if self.fail {
            return Err(FlushError::Failed("injected I/O error".into()));
        }
        Ok(())
    }
}

/// One descriptor as the test describes it: (addr, len, write?, explicit
/// next index or None for "the following one / end").
type D = (u64, u32, bool, Option<u16>);

struct Outcome {
    used: Vec<(u32, u32)>,
    responses: Vec<u32>,
    metrics: Metrics,
    flushes: u32,
    notify: bool,
}

/// Lays out `chains` in one descriptor table, runs the device once and
/// reads back the used ring and the responses.
fn run(chains: &[Vec<D>], fail: bool) -> Outcome {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    let mut offset = 0u16;
    for chain in chains {
        let mut raw = Vec::new();
        for (i, &(addr, len, write, next)) in chain.iter().enumerate() {
            let last = i + 1 == chain.len();
            let (flag_next, next_idx) = match next {
                Some(n) => (VRING_DESC_F_NEXT as u16, n),
                None if last => (0, 0),
                None => (VRING_DESC_F_NEXT as u16, offset + i as u16 + 1),
            };
            let flags = if write { W } else { 0 } | flag_next;
            raw.push(RawDescriptor::from(SplitDescriptor::new(
                addr, len, flags, next_idx,
            )));
            if write && addr + 4 <= MEM {
                mem.write_obj(UNTOUCHED, GuestAddress(addr)).unwrap();
            }
        }
        // Only the head goes into the avail ring; add_desc_chains decides
        // heads from NEXT flags, so add each chain on its own.
        vq.add_desc_chains(&raw[..1], offset).unwrap();
        for (i, d) in raw.iter().enumerate().skip(1) {
            vq.desc_table().store(offset + i as u16, *d).unwrap();
        }
        offset += raw.len() as u16;
    }
    let mut q: Queue = vq.create_queue().unwrap();
    let backend = Backend {
        fail,
        ..Backend::default()
    };
    let calls = backend.calls.clone();
    let mut dev = PmemDevice::new(0x1_0000_0000, 0x20_0000, backend);
    let notify = dev.process_queue(&mem, &mut q).unwrap();
    let n = vq.used().idx().load();
    let used: Vec<(u32, u32)> = (0..n as usize)
        .map(|i| {
            let e = vq.used().ring().ref_at(i).unwrap().load();
            (e.id(), e.len())
        })
        .collect();
    let responses = chains
        .iter()
        .map(|c| {
            c.iter()
                .find(|d| d.2 && d.0 + 4 <= MEM)
                .map(|d| u32::from_le(mem.read_obj::<u32>(GuestAddress(d.0)).unwrap()))
                .unwrap_or(UNTOUCHED)
        })
        .collect();
    let flushes = *calls.lock().unwrap();
    Outcome {
        used,
        responses,
        metrics: dev.metrics(),
        flushes,
        notify,
    }
}

#[test]
fn flush_is_answered_ok_after_the_backend_ran() {
    // Guest memory starts zeroed: type 0 is FLUSH.
    let o = run(&[vec![(REQ, 4, false, None), (RESP, 4, true, None)]], false);
    assert_eq!(o.used, [(0, 4)]);
    assert_eq!(o.responses, [0]);
    assert_eq!(o.flushes, 1);
    assert_eq!(o.metrics.flushes, 1);
    assert!(o.notify);
}

#[test]
fn backend_failure_is_eio() {
    let o = run(&[vec![(REQ, 4, false, None), (RESP, 4, true, None)]], true);
    assert_eq!(o.used, [(0, 4)]);
    assert_eq!(o.responses, [1]);
    assert_eq!(o.metrics.flush_errors, 1);
}

#[test]
fn several_chains_in_one_pass_and_split_buffers() {
    let o = run(
        &[
            vec![(REQ, 4, false, None), (RESP, 4, true, None)],
            // request in two readable pieces, response larger than needed
            vec![
                (REQ, 4, false, None),
                (REQ + 0x100, 12, false, None),
                (RESP + 0x100, 64, true, None),
            ],
        ],
        false,
    );
    assert_eq!(o.used, [(0, 4), (2, 4)]);
    assert_eq!(o.responses, [0, 0]);
    assert_eq!(o.flushes, 2);
}

#[test]
fn malformed_chains_are_returned_unanswered() {
    let cases: Vec<(&str, Vec<D>)> = vec![
        ("no response", vec![(REQ, 4, false, None)]),
        ("no request", vec![(RESP, 4, true, None)]),
        (
            "short request",
            vec![(REQ, 2, false, None), (RESP, 4, true, None)],
        ),
        (
            "short response",
            vec![(REQ, 4, false, None), (RESP, 2, true, None)],
        ),
        (
            "wrong direction",
            vec![(RESP, 4, true, None), (REQ, 4, false, None)],
        ),
        (
            "request outside memory",
            vec![(MEM - 2, 4, false, None), (RESP, 4, true, None)],
        ),
        (
            "response outside memory",
            vec![(REQ, 4, false, None), (MEM + 0x1000, 4, true, None)],
        ),
        (
            "address overflow",
            vec![(u64::MAX - 1, 4, false, None), (RESP, 4, true, None)],
        ),
        // A loop: the second descriptor points back at the first. The
        // chain iterator stops after the queue size; what it yields is a
        // readable descriptor after a writable one.
        (
            "loop",
            vec![(REQ, 4, false, None), (RESP, 4, true, Some(0))],
        ),
        ("self loop", vec![(REQ, 4, false, Some(0))]),
        ("next beyond the table", vec![(REQ, 4, false, Some(200))]),
    ];
    for (name, chain) in cases {
        let o = run(&[chain], false);
        assert_eq!(o.used, [(0, 0)], "{name}");
        assert_eq!(
            o.responses,
            [UNTOUCHED],
            "{name}: the device wrote into the chain"
        );
        assert_eq!(o.flushes, 0, "{name}");
        assert_eq!(o.metrics.malformed_chains, 1, "{name}");
    }
}

#[test]
fn unknown_request_type_is_eio_without_flushing() {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    mem.write_obj(7u32.to_le(), GuestAddress(REQ)).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    let descs = [
        RawDescriptor::from(SplitDescriptor::new(REQ, 4, VRING_DESC_F_NEXT as u16, 1)),
        RawDescriptor::from(SplitDescriptor::new(RESP, 4, W, 0)),
    ];
    vq.add_desc_chains(&descs, 0).unwrap();
    let mut q: Queue = vq.create_queue().unwrap();
    let backend = Backend::default();
    let calls = backend.calls.clone();
    let mut dev = PmemDevice::new(0, 0x20_0000, backend);
    dev.process_queue(&mem, &mut q).unwrap();
    assert_eq!(
        u32::from_le(mem.read_obj::<u32>(GuestAddress(RESP)).unwrap()),
        1
    );
    assert_eq!(*calls.lock().unwrap(), 0);
    assert_eq!(dev.metrics().unknown_requests, 1);
    assert_eq!(q.next_used(), 1);
}

#[test]
fn config_space_is_start_and_size_little_endian() {
    let dev = PmemDevice::new(0x1_2345_6789, 0x4000_0000, Backend::default());
    let c = dev.config();
    assert_eq!(
        u64::from_le_bytes(c[..8].try_into().unwrap()),
        0x1_2345_6789
    );
    assert_eq!(u64::from_le_bytes(c[8..].try_into().unwrap()), 0x4000_0000);
    let mut part = [0xffu8; 8];
    dev.read_config(8, &mut part);
    assert_eq!(part, [0, 0, 0, 0x40, 0, 0, 0, 0]);
    dev.read_config(12, &mut part);
    assert_eq!(part, [0; 8], "bytes past the config space read as zero");
    dev.read_config(u64::MAX, &mut part);
    assert_eq!(part, [0; 8]);
    assert_eq!(virtio_pmem_pcow::DEVICE_TYPE, 27);
    assert_eq!(dev.features(), 1 << 32);
}

#[test]
fn raw_region_shared_reaches_the_file_and_discard_writes_does_not() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("raw.img");
    std::fs::write(&p, vec![0u8; 2 << 20]).unwrap();
    {
        let mut r = RawRegion::open(&p, false).unwrap();
        assert_eq!(r.mapping().len(), 2 << 20);
        assert!(matches!(
            RawRegion::open(&p, true),
            Err(RawError::Locked { .. })
        ));
        // SAFETY: the mapping is 2 MiB long and alive for this write.
        unsafe { r.mapping().as_ptr().add(4096).write_bytes(0xab, 16) };
        r.flush().unwrap();
    }
    assert_eq!(&std::fs::read(&p).unwrap()[4096..4112], &[0xab; 16]);
    {
        let mut r = RawRegion::open(&p, true).unwrap();
        // SAFETY: as above.
        unsafe { r.mapping().as_ptr().write_bytes(0xcd, 16) };
        r.flush().unwrap();
    }
    assert_eq!(&std::fs::read(&p).unwrap()[..16], &[0u8; 16]);
    std::fs::write(&p, b"").unwrap();
    assert!(matches!(
        RawRegion::open(&p, false),
        Err(RawError::Empty { .. })
    ));
}

/// Out of space on the first flush, fine afterwards.
struct FullOnce(u32);

impl FlushBackend for FullOnce {
    fn flush(&mut self) -> Result<(), FlushError> {
        self.0 += 1;
        if self.0 == 1 {
            let e = std::io::Error::from_raw_os_error(libc::ENOSPC);
            return Err(FlushError::from_error(Box::new(e)));
        }
        Ok(())
    }
}

#[test]
fn a_full_disk_leaves_the_flush_queued_until_unstall() {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let vq = MockSplitQueue::new(&mem, 16);
    for (i, resp) in [RESP, RESP + 0x100].into_iter().enumerate() {
        let i = 2 * i as u16;
        let chain = [
            RawDescriptor::from(SplitDescriptor::new(
                REQ,
                4,
                VRING_DESC_F_NEXT as u16,
                i + 1,
            )),
            RawDescriptor::from(SplitDescriptor::new(resp, 4, W, 0)),
        ];
        vq.add_desc_chains(&chain, i).unwrap();
        mem.write_obj(UNTOUCHED, GuestAddress(resp)).unwrap();
    }
    let mut q: Queue = vq.create_queue().unwrap();
    let mut dev = PmemDevice::new(0x1_0000_0000, 0x20_0000, FullOnce(0));
    // The first FLUSH finds the disk full: nothing is answered, the
    // request stays available, the second is not even looked at.
    assert!(!dev.process_queue(&mem, &mut q).unwrap());
    assert_eq!(vq.used().idx().load(), 0);
    let why = dev.stalled().expect("stalled").to_owned();
    assert!(why.contains("No space left on device"), "{why}");
    assert_eq!(dev.metrics().flush_stalls, 1);
    assert_eq!(mem.read_obj::<u32>(GuestAddress(RESP)).unwrap(), UNTOUCHED);
    // While stalled, notifications serve nothing.
    assert!(!dev.process_queue(&mem, &mut q).unwrap());
    assert_eq!(dev.backend_mut().0, 1);
    // Space was freed: the same request is retried and both are answered
    // OK, in order.
    dev.unstall();
    assert!(dev.process_queue(&mem, &mut q).unwrap());
    assert_eq!(vq.used().idx().load(), 2);
    assert_eq!(vq.used().ring().ref_at(0).unwrap().load().id(), 0);
    assert_eq!(vq.used().ring().ref_at(1).unwrap().load().id(), 2);
    assert_eq!(mem.read_obj::<u32>(GuestAddress(RESP)).unwrap(), 0);
    assert_eq!(mem.read_obj::<u32>(GuestAddress(RESP + 0x100)).unwrap(), 0);
    let m = dev.metrics();
    assert_eq!((m.flushes, m.flush_errors, m.flush_stalls), (2, 0, 1));
    assert!(dev.stalled().is_none());
}
