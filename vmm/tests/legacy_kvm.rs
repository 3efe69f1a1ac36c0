//! Host KVM tier for the legacy devices: a guest on the host's `/dev/kvm`
//! talks to COM1 and the power ports through the [`PortBus`] a vCPU gets.
//!
//! The guest is the project's test guest (its page tables, GDT and long
//! mode setup) with its code replaced at the entry by a few hand-assembled
//! instructions (as `host_kvm.rs` does for its fault test).
//!
//! Without a usable `/dev/kvm` a test prints `SKIPPED: no /dev/kvm (...)`
//! and passes, except under CI (`CI` set) when `/dev/kvm` exists: then it
//! must work, and a failure fails the test.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::boot::layout;
use vmm::config::ConsoleConfig;
use vmm::legacy::power::I8042_COMMAND_PORT;
use vmm::legacy::serial::COM1_BASE;
use vmm::legacy::{
    power_channel, IrqTrigger, PortBus, PortBusBuilder, PowerDevice, PowerEvent,
    PowerEventReceiver, SerialDevice, SharedSerial,
};
use vmm::testguest::TestGuest;
use vmm::vcpu::{self, VcpuControl, VcpuStop};
use vmm::Vm;

mod common;
use common::{chain, vm_or_skip};

const M2: u64 = 2 << 20;
/// A guest gets this long.
const GUEST_DEADLINE: Duration = Duration::from_secs(20);
const LSR: u16 = COM1_BASE + 5;
/// COM2's LSR: no device there.
const UNKNOWN_PORT: u16 = 0x2fd;

/// A tiny x86-64 assembler for the few instructions the guests use.
#[derive(Default)]
struct Code(Vec<u8>);

impl Code {
    /// mov dx, port
    fn dx(&mut self, port: u16) -> &mut Self {
        let p = port.to_le_bytes();
        self.0.extend_from_slice(&[0x66, 0xBA, p[0], p[1]]);
        self
    }

    /// Waits until LSR has `bit` set: in al, dx; test al, bit; jz back.
    fn wait_lsr(&mut self, bit: u8) -> &mut Self {
        self.dx(LSR);
        self.0.extend_from_slice(&[0xEC, 0xA8, bit, 0x74, 0xFB]);
        self
    }

    /// Writes `byte` to COM1 once THR is empty.
    fn put(&mut self, byte: u8) -> &mut Self {
        self.wait_lsr(0x20).dx(COM1_BASE);
        self.0.extend_from_slice(&[0xB0, byte, 0xEE]); // mov al, byte; out dx, al
        self
    }

    /// Waits for an input byte, reads it, flips its case (xor 0x20) and
    /// writes it back.
    fn echo_flipped(&mut self) -> &mut Self {
        self.wait_lsr(0x01).dx(COM1_BASE);
        self.0.extend_from_slice(&[0xEC, 0x34, 0x20, 0xEE]); // in; xor al, 0x20; out
        self
    }

    /// Reads a byte from `port` and writes it to COM1 (no THRE wait: the
    /// virtual THR is always empty).
    fn copy_port(&mut self, port: u16) -> &mut Self {
        self.dx(port);
        self.0.push(0xEC); // in al, dx
        self.dx(COM1_BASE);
        self.0.push(0xEE); // out dx, al
        self
    }

    /// out port, value (a byte).
    fn out(&mut self, port: u16, value: u8) -> &mut Self {
        self.dx(port);
        self.0.extend_from_slice(&[0xB0, value, 0xEE]);
        self
    }

    /// hlt, then jump back to it.
    fn halt(&mut self) -> &mut Self {
        self.0.extend_from_slice(&[0xF4, 0xEB, 0xFD]);
        self
    }
}

struct NoIrq;

impl IrqTrigger for NoIrq {
    fn trigger(&self) -> io::Result<()> {
        Ok(())
    }
}

/// The standard bus: COM1 from `serial`, power ports.
fn bus(serial: &ConsoleConfig) -> (PortBus, Option<SharedSerial>, PowerEventReceiver) {
    let serial = SerialDevice::from_config(serial, &vmm::chardev::Backend::Null, Box::new(NoIrq))
        .expect("serial")
        .map(SerialDevice::shared);
    let (tx, rx) = power_channel().expect("power channel");
    let mut b = PortBusBuilder::new();
    if let Some(s) = &serial {
        b.add_serial(s.clone()).unwrap();
    }
    b.add_power(PowerDevice::new(tx).shared()).unwrap();
    (b.build(), serial, rx)
}

/// Runs `code` on vCPU 0 of `vm` with `bus` until it halts.
fn run(vm: &Vm, code: &Code, bus: &PortBus, test: &str) -> VcpuStop {
    let loaded = TestGuest::default()
        .load(vm.memory(), vm.ram_end())
        .expect("load guest");
    vm.memory()
        .write_slice(&code.0, GuestAddress(loaded.entry()))
        .unwrap();
    let cpu = vm.create_vcpu(0).expect("vcpu");
    loaded.configure(&cpu).expect("configure");
    let ctl = VcpuControl::new().expect("control");
    let t = vcpu::spawn(cpu, Arc::clone(&ctl), Box::new(bus.clone())).expect("spawn");
    let start = Instant::now();
    while !t.is_finished() {
        if start.elapsed() > GUEST_DEADLINE {
            ctl.stop();
            let _ = t.join();
            panic!("{test}: the guest did not halt in {GUEST_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let (stop, stats) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
    eprintln!("{test}: {:?}, {stats:?}", start.elapsed());
    stop
}

#[test]
fn guest_serial_output_input_and_poweroff() {
    let test = "guest_serial_output_input_and_poweroff";
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serial.log");
    let cfg = ConsoleConfig::parse_serial(&format!("file={}", log.display())).unwrap();
    let (bus, serial, rx) = bus(&cfg);
    let serial = serial.expect("file mode makes a device");
    // input waiting before the guest starts
    assert_eq!(serial.lock().unwrap().enqueue_input(b"pQ").unwrap(), 2);
    let mut code = Code::default();
    for &b in b"hello " {
        code.put(b);
    }
    code.echo_flipped()
        .echo_flipped()
        .copy_port(UNKNOWN_PORT)
        .put(b'\n')
        .out(layout::ACPI_SHUTDOWN_PORT, 0x34)
        .halt();
    assert_eq!(run(&vm, &code, &bus, test), VcpuStop::Halted);
    assert_eq!(std::fs::read(&log).unwrap(), b"hello Pq\xff\n");
    assert_eq!(rx.try_recv(), Some(PowerEvent::PowerOff));
    assert_eq!(rx.try_recv(), None);
    assert_eq!(bus.unknown_accesses(), 1);
    let stats = serial.lock().unwrap().stats();
    assert_eq!((stats.out_bytes, stats.lost_bytes), (10, 0), "{stats:?}");
}

#[test]
fn guest_reboot_writes_are_reset_events() {
    let test = "guest_reboot_writes_are_reset_events";
    let Some(vm) = vm_or_skip(test, M2) else {
        return;
    };
    let (bus, serial, rx) = bus(&ConsoleConfig::parse_serial("off").unwrap());
    assert!(serial.is_none());
    let mut code = Code::default();
    // ACPI reset, then Linux's fallbacks: keyboard controller, 0xcf9
    code.out(layout::ACPI_SHUTDOWN_PORT, 1)
        .out(I8042_COMMAND_PORT, 0xfe)
        .out(layout::RESET_CONTROL_PORT, 0x02)
        .out(layout::RESET_CONTROL_PORT, 0x06)
        .out(COM1_BASE, b'x') // serial off: an unknown port
        .halt();
    assert_eq!(run(&vm, &code, &bus, test), VcpuStop::Halted);
    let events: Vec<_> = std::iter::from_fn(|| rx.try_recv()).collect();
    assert_eq!(events, [PowerEvent::Reset; 3]);
    assert_eq!(bus.unknown_accesses(), 1);
}
