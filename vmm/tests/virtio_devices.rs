//! The virtio-rng and virtio-console devices on real split virtqueues in
//! guest memory built by the test (virtio-queue's mock), with well-formed
//! and hostile descriptor chains: wrong directions, buffers outside guest
//! memory, loops, oversized requests; and their sources and sinks.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::Queue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::chardev::{Output, OUTPUT_BUFFER};
use vmm::pci::console::{ConsoleDevice, ConsoleInput, INPUT_BUFFER, MAX_CHAIN};
use vmm::pci::rng::{RngDevice, RngError, MAX_REQUEST};

const MEM: u64 = 0x100_0000;
const BUF: u64 = 0x10_0000;
const W: u16 = VRING_DESC_F_WRITE as u16;
const N: u16 = VRING_DESC_F_NEXT as u16;

/// One descriptor: (addr, len, device-writable, explicit next or None).
type D = (u64, u32, bool, Option<u16>);

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap()
}

/// Lays out `chains` in one descriptor table (each head in the avail ring).
fn queue<'a>(
    mem: &'a GuestMemoryMmap,
    chains: &[Vec<D>],
) -> (MockSplitQueue<'a, GuestMemoryMmap>, Queue) {
    let vq = MockSplitQueue::new(mem, 64);
    let mut offset = 0u16;
    for chain in chains {
        let mut raw = Vec::new();
        for (i, &(addr, len, write, next)) in chain.iter().enumerate() {
            let last = i + 1 == chain.len();
            let (f, n) = match next {
                Some(n) => (N, n),
                None if last => (0, 0),
                None => (N, offset + i as u16 + 1),
            };
            let flags = if write { W } else { 0 } | f;
            raw.push(RawDescriptor::from(SplitDescriptor::new(
                addr, len, flags, n,
            )));
        }
        vq.add_desc_chains(&raw[..1], offset).unwrap();
        for (i, d) in raw.iter().enumerate().skip(1) {
            vq.desc_table().store(offset + i as u16, *d).unwrap();
        }
        offset += raw.len() as u16;
    }
    let q: Queue = vq.create_queue().unwrap();
    (vq, q)
}

fn used(vq: &MockSplitQueue<'_, GuestMemoryMmap>) -> Vec<(u32, u32)> {
    let n = vq.used().idx().load();
    (0..n as usize)
        .map(|i| {
            let e = vq.used().ring().ref_at(i).unwrap().load();
            (e.id(), e.len())
        })
        .collect()
}

fn source(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    f
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn rng_fills_device_writable_buffers_from_the_source() {
    let data = pattern(300);
    let src = source(&data);
    let mut rng = RngDevice::open(src.path()).unwrap();
    let m = mem();
    let (vq, mut q) = queue(
        &m,
        &[
            vec![(BUF, 64, true, None)],
            vec![
                (BUF + 0x1000, 100, true, None),
                (BUF + 0x2000, 36, true, None),
            ],
        ],
    );
    assert!(rng.process(&m, &mut q).unwrap());
    assert_eq!(used(&vq), [(0, 64), (1, 136)]);
    let mut got = vec![0u8; 64];
    m.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert_eq!(got, data[..64]);
    let mut got = vec![0u8; 100];
    m.read_slice(&mut got, GuestAddress(BUF + 0x1000)).unwrap();
    assert_eq!(got, data[64..164]);
    let mut got = vec![0u8; 36];
    m.read_slice(&mut got, GuestAddress(BUF + 0x2000)).unwrap();
    assert_eq!(got, data[164..200]);
    let s = rng.stats();
    assert_eq!((s.requests, s.bytes, s.bad_chains), (2, 200, 0));
}

#[test]
fn rng_answers_short_at_the_end_of_a_file_source() {
    let src = source(&pattern(10));
    let mut rng = RngDevice::open(src.path()).unwrap();
    let m = mem();
    let (vq, mut q) = queue(
        &m,
        &[vec![(BUF, 64, true, None)], vec![(BUF, 64, true, None)]],
    );
    rng.process(&m, &mut q).unwrap();
    assert_eq!(used(&vq), [(0, 10), (1, 0)]);
    assert_eq!(rng.stats().source_short, 2);
}

#[test]
fn rng_skips_hostile_chains_and_goes_on() {
    let src = source(&pattern(MAX_REQUEST * 2));
    let mut rng = RngDevice::open(src.path()).unwrap();
    let m = mem();
    let sentinel = [0xaau8; 16];
    m.write_slice(&sentinel, GuestAddress(BUF)).unwrap();
    let (vq, mut q) = queue(
        &m,
        &[
            // device-readable: refused, nothing written
            vec![(BUF, 16, false, None)],
            // a writable one then a readable one: refused as a whole
            vec![(BUF, 16, true, None), (BUF + 0x100, 16, false, None)],
            // outside guest memory, and straddling its end
            vec![(MEM + 0x1000, 16, true, None)],
            vec![(MEM - 8, 16, true, None)],
            // u64 wrap-around
            vec![(u64::MAX - 4, 16, true, None)],
            // a loop: the chain points at itself (the queue's TTL ends it)
            vec![(BUF + 0x200, 8, true, Some(6))],
            // more than MAX_REQUEST asked: MAX_REQUEST given
            vec![(BUF + 0x10000, (MAX_REQUEST * 2) as u32, true, None)],
            // still served after all that
            vec![(BUF + 0x400, 4, true, None)],
        ],
    );
    rng.process(&m, &mut q).unwrap();
    let u = used(&vq);
    assert_eq!(u.len(), 8, "{u:?}");
    assert_eq!(&u[..5], [(0, 0), (1, 0), (3, 0), (4, 0), (5, 0)]);
    // The loop is served up to its TTL (the queue size, 64) of 8-byte
    // buffers, then ends.
    assert_eq!(u[5], (6, 64 * 8));
    assert_eq!(u[6], (7, MAX_REQUEST as u32));
    assert_eq!(u[7], (8, 4));
    let mut back = [0u8; 16];
    m.read_slice(&mut back, GuestAddress(BUF)).unwrap();
    assert_eq!(back, sentinel, "a refused chain got bytes");
    assert_eq!(rng.stats().bad_chains, 5);
}

#[test]
fn rng_sources_that_cannot_serve_are_config_errors() {
    let dir = tempfile::tempdir().unwrap();
    let e = RngDevice::open(&dir.path().join("missing")).unwrap_err();
    assert!(matches!(e, RngError::Open { .. }), "{e}");
    assert!(e.to_string().contains("cannot open it for reading"));
    let e = RngDevice::open(dir.path()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "rng source {}: is a directory, not a file or a character device",
            dir.path().display()
        )
    );
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path and mode.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = RngDevice::open(&fifo).unwrap_err();
    assert!(e.to_string().contains("is a FIFO"), "{e}");
    // The usual source works.
    let mut rng = RngDevice::open(std::path::Path::new("/dev/urandom")).unwrap();
    let m = mem();
    let (vq, mut q) = queue(&m, &[vec![(BUF, 256, true, None)]]);
    rng.process(&m, &mut q).unwrap();
    assert_eq!(used(&vq), [(0, 256)]);
    let mut got = [0u8; 256];
    m.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert!(got.iter().any(|&b| b != 0));
}

/// A sink that collects what the console writes.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn console() -> (ConsoleDevice, Sink, Arc<Mutex<ConsoleInput>>) {
    let sink = Sink::default();
    let input = ConsoleInput::shared();
    let dev = ConsoleDevice::new(Some(Box::new(sink.clone())), input.clone());
    (dev, sink, input)
}

#[test]
fn console_output_reaches_the_sink_in_order_and_hostile_chains_are_skipped() {
    let (mut dev, sink, _) = console();
    let m = mem();
    m.write_slice(b"hello ", GuestAddress(BUF)).unwrap();
    m.write_slice(b"hvc0", GuestAddress(BUF + 0x100)).unwrap();
    m.write_slice(b"!\n", GuestAddress(BUF + 0x200)).unwrap();
    let (vq, mut q) = queue(
        &m,
        &[
            vec![(BUF, 6, false, None), (BUF + 0x100, 4, false, None)],
            // a device-writable descriptor in the transmit queue
            vec![(BUF + 0x300, 8, true, None)],
            // outside guest memory
            vec![(MEM - 2, 8, false, None)],
            vec![(u64::MAX - 1, 8, false, None)],
            vec![(BUF + 0x200, 2, false, None)],
        ],
    );
    assert!(dev.process_tx(&m, &mut q).unwrap());
    assert_eq!(used(&vq), [(0, 0), (2, 0), (3, 0), (4, 0), (5, 0)]);
    assert_eq!(&*sink.0.lock().unwrap(), b"hello hvc0!\n");
    let s = dev.stats();
    assert_eq!((s.tx_bytes, s.bad_chains), (12, 3));
}

#[test]
fn console_transmit_chains_are_capped() {
    let (mut dev, sink, _) = console();
    let m = mem();
    let (vq, mut q) = queue(&m, &[vec![(BUF, (MAX_CHAIN * 3) as u32, false, None)]]);
    dev.process_tx(&m, &mut q).unwrap();
    assert_eq!(used(&vq), [(0, 0)]);
    assert_eq!(sink.0.lock().unwrap().len(), MAX_CHAIN);
}

#[test]
fn console_input_fills_receive_buffers_only_when_there_is_some() {
    let (mut dev, _, input) = console();
    let m = mem();
    let (vq, mut q) = queue(
        &m,
        &[
            vec![(BUF, 4, true, None), (BUF + 0x100, 4, true, None)],
            // a device-readable descriptor in the receive queue
            vec![(BUF + 0x200, 4, false, None)],
            vec![(BUF + 0x300, 64, true, None)],
            vec![(BUF + 0x400, 64, true, None)],
        ],
    );
    // No input: the buffers wait.
    assert!(!dev.process_rx(&m, &mut q).unwrap());
    assert!(used(&vq).is_empty());
    input.lock().unwrap().push(b"echo hi\n");
    assert!(dev.process_rx(&m, &mut q).unwrap());
    assert_eq!(used(&vq), [(0, 8)]);
    let mut got = [0u8; 4];
    m.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert_eq!(&got, b"echo");
    m.read_slice(&mut got, GuestAddress(BUF + 0x100)).unwrap();
    assert_eq!(&got, b" hi\n");
    // The bad chain is returned unused and the input kept for the next.
    input.lock().unwrap().push(b"ls\n");
    dev.process_rx(&m, &mut q).unwrap();
    assert_eq!(used(&vq), [(0, 8), (2, 0), (3, 3)]);
    assert!(input.lock().unwrap().is_empty());
    assert_eq!(dev.stats().rx_bytes, 11);
    assert_eq!(dev.stats().bad_chains, 1);
}

#[test]
fn console_input_is_bounded() {
    let input = ConsoleInput::shared();
    let mut i = input.lock().unwrap();
    assert_eq!(i.push(&vec![b'x'; INPUT_BUFFER + 100]), INPUT_BUFFER);
    assert_eq!(i.push(b"more"), 0);
    assert_eq!(i.len(), INPUT_BUFFER);
    assert_eq!(i.dropped(), 104);
}

#[test]
fn console_output_through_a_stuck_consumer_never_blocks_the_device() {
    // The console's sink is a chardev Output whose target (a pipe nobody
    // reads) blocks once full: the device thread keeps going.
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is valid for two ints.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both are new descriptors owned here.
    let (r, w) = unsafe {
        use std::os::fd::FromRawFd;
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    let out = Output::new("console-test", Some(Box::new(w))).unwrap();
    let input = ConsoleInput::shared();
    let dev = ConsoleDevice::new(Some(Box::new(out.writer())), input);
    let dev = Arc::new(Mutex::new(dev));
    let d = dev.clone();
    let worker = std::thread::spawn(move || {
        let m = mem();
        m.write_slice(&[b'z'; 4096], GuestAddress(BUF)).unwrap();
        // 64 chains of 4 KiB each round, 8 rounds: 2 MiB, far past the
        // pipe (64 KiB) and the buffer.
        for _ in 0..8 {
            let chains: Vec<Vec<D>> = (0..64).map(|_| vec![(BUF, 4096, false, None)]).collect();
            let (vq, mut q) = queue(&m, &chains);
            d.lock().unwrap().process_tx(&m, &mut q).unwrap();
            assert_eq!(used(&vq).len(), 64);
        }
    });
    let t = std::time::Instant::now();
    worker.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!(dev.lock().unwrap().stats().tx_bytes, 8 * 64 * 4096);
    let s = out.stats();
    assert_eq!(s.pushed, 8 * 64 * 4096);
    assert!(s.dropped >= s.pushed - (OUTPUT_BUFFER as u64) - 2 * 65536 - 16384);
    drop(r);
}
