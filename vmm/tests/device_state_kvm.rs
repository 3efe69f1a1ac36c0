//! `Machine::device_states` and `Machine::restore_devices` on real
//! machines (KVM VM, irqfds, ioeventfds): every device's state is captured
//! under its id, restored into a second machine built from the same
//! config, and captured again identical; a collection that does not match
//! the machine is refused naming the device.
//!
//! Without a usable `/dev/kvm` the test prints `SKIPPED <test>: no
//! /dev/kvm` and passes, except under CI (`CI` set).

mod common;

use std::path::Path;
use std::sync::Arc;

use vmm::chardev::Chardevs;
use vmm::config::VmConfig;
use vmm::machine::Machine;
use vmm::pci::PciDevice;
use vmm::snapshot::device_state::{
    DeviceState, DeviceStates, DeviceStatesError, StateError, POWER_ID, SERIAL_ID,
};
use vmm::PortIo;

/// Whether KVM can be used; panics under CI when /dev/kvm exists but
/// cannot be opened.
fn kvm_or_skip(test: &str) -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            if Path::new("/dev/kvm").exists() && std::env::var_os("CI").is_some() {
                panic!("{test}: /dev/kvm exists but does not open under CI: {e}");
            }
            println!("SKIPPED {test}: no /dev/kvm ({e})");
            false
        }
    }
}

fn build(kernel: &Path) -> Machine {
    let mut cfg: VmConfig = serde_json::from_value(serde_json::json!({
        "memory": {"size": 64u64 << 20},
        "payload": {"kernel": kernel},
        "serial": {"mode": "Null"},
        "console": {"mode": "Null"},
    }))
    .unwrap();
    let chardevs = Arc::new(Chardevs::open(&mut cfg).unwrap());
    Machine::build(&cfg, &[], &chardevs).unwrap()
}

fn json(s: &DeviceStates) -> DeviceStates {
    serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap()
}

#[test]
fn machine_device_states_round_trip_and_mismatches_are_refused() {
    let test = "machine_device_states_round_trip_and_mismatches_are_refused";
    if !kvm_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("kernel");
    common::halting_kernel(&kernel);

    let a = build(&kernel);
    // Guest-like state in several devices.
    {
        let mut s = a.serial.as_ref().unwrap().lock().unwrap();
        s.io_out(0x3ff, &[0x5a]); // scratch
        s.io_out(0x3fb, &[0x1b]); // LCR
        s.enqueue_input(b"in").unwrap();
    }
    a.console
        .as_ref()
        .unwrap()
        .input
        .lock()
        .unwrap()
        .push(b"typed");
    {
        let mut rng = a.rng.virtio.lock().unwrap();
        rng.write_config(0x04, &[0x06, 0x00]); // memory decoding, bus master
        rng.write_bar(0, 0x14, &[0x03]); // ACKNOWLEDGE | DRIVER
    }
    let states = a.device_states();
    let ids: Vec<&str> = states.ids().collect();
    assert_eq!(
        ids,
        vec![
            "__console",
            "__pci_bus0",
            "__power",
            "__serial",
            "_virtio-pci-__console",
            "_virtio-pci-__rng",
        ]
    );
    let Some(DeviceState::VirtioPci(rng)) = states.get("_virtio-pci-__rng") else {
        panic!("rng state");
    };
    assert_eq!((rng.device_type, rng.status), (4, 3));

    let mut b = build(&kernel);
    b.restore_devices(json(&states)).unwrap();
    b.serve_restored_queues();
    assert_eq!(b.device_states(), states);
    assert_eq!(b.console.as_ref().unwrap().input.lock().unwrap().len(), 5);

    // Mismatches, each on a fresh machine.
    let mut missing = json(&states);
    missing.take(POWER_ID).unwrap();
    let e = build(&kernel).restore_devices(missing).unwrap_err();
    assert!(
        matches!(&e, DeviceStatesError::Missing { id } if id == POWER_ID),
        "{e}"
    );

    let mut extra = json(&states);
    let power = extra.get(POWER_ID).unwrap().clone();
    extra.insert("_virtio-pci-_pmem0", power);
    let e = build(&kernel).restore_devices(extra).unwrap_err();
    assert!(
        matches!(&e, DeviceStatesError::Unknown { ids } if ids == &["_virtio-pci-_pmem0"]),
        "{e}"
    );

    let mut hostile = json(&states);
    if let Some(DeviceState::Serial(s)) = hostile.get_mut(SERIAL_ID) {
        s.in_buffer = vec![0; 100];
        s.line_status |= 1;
    }
    let e = build(&kernel).restore_devices(hostile).unwrap_err();
    assert_eq!(e.to_string(), "device __serial");
    assert!(matches!(
        e,
        DeviceStatesError::Device {
            source: StateError::TooLong {
                field: "in_buffer",
                ..
            },
            ..
        }
    ));
}
