//! Upstream's `vm.info` configs, v50 to v54, as JSON literals: each is
//! accepted by deserialization and validation, knows every field (none
//! ignored), and round-trips through our serialization. The v54 literals
//! are the exact bytes upstream's v54 `vm.info` returned (measured with
//! upstream's `cloud-hypervisor` and `ch-remote`, 2026-11-25): ours must be
//! byte-identical. The older ones are written from upstream's structs at
//! those tags (`vmm/src/vm_config.rs`): v50/v51 serialize `null`s and
//! `iommu: false` everywhere, v52 flattens `PciDeviceCommonConfig` into
//! devices (`iommu` left out when false) and splits serial from console,
//! v53 leaves out `None` keys and adds `cpus.profile`, `memory.reserve` and
//! `rtc`.

use std::path::Path;

use super::*;

/// v54, `{"payload": {"kernel", "cmdline"}, "cpus": {"boot_vcpus": 2,
/// "max_vcpus": 4}, "pmem": [{"file", "id": "p0"}]}` as created.
const V54_MINIMAL: &str = r#"{"cpus":{"boot_vcpus":2,"max_vcpus":4,"kvm_hyperv":false,"max_phys_bits":46,"features":{"amx":false},"nested":true,"core_scheduling":"Vm","profile":"Host"},"memory":{"size":536870912,"mergeable":false,"hotplug_method":"Acpi","shared":false,"hugepages":false,"prefault":false,"reserve":false,"thp":true},"payload":{"kernel":"/tmp/k","cmdline":"console=ttyS0"},"rng":{"pci_segment":0,"src":"/dev/urandom"},"pmem":[{"id":"p0","pci_segment":0,"file":"/tmp/p.raw","discard_writes":false}],"serial":{"mode":"Null"},"console":{"mode":"Tty","pci_segment":0},"debug_console":{"mode":"Off","iobase":233},"pvpanic":false,"iommu":false,"watchdog":false,"landlock_enable":false}"#;

/// v54 with every field this VMM accepts spelled out at a non-trivial
/// value (topology, affinity, core scheduling, thp, zones, empty device
/// lists, rng and console ids, a serial file, debug port, PCI segment,
/// platform).
const V54_FULL: &str = r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2,"topology":{"threads_per_core":1,"cores_per_die":2,"dies_per_package":1,"packages":1},"kvm_hyperv":false,"max_phys_bits":46,"affinity":[],"features":{"amx":false},"nested":true,"core_scheduling":"Off","profile":"Host"},"memory":{"size":1073741824,"mergeable":false,"hotplug_method":"Acpi","hotplug_size":0,"shared":false,"hugepages":false,"prefault":false,"reserve":false,"zones":[],"thp":false},"payload":{"kernel":"/tmp/k","cmdline":"console=hvc0 root=/dev/pmem0","initramfs":"/tmp/k"},"rate_limit_groups":[],"disks":[],"net":[],"rng":{"id":"rng0","pci_segment":0,"src":"/dev/urandom"},"generic_vhost_user":[],"fs":[],"pmem":[{"pci_segment":0,"file":"/tmp/p.raw","size":4194304,"discard_writes":true}],"serial":{"file":"/tmp/serial.log","mode":"File"},"console":{"mode":"Off","id":"con0","pci_segment":0},"debug_console":{"mode":"Off","iobase":1026},"devices":[],"user_devices":[],"vdpa":[],"pvpanic":false,"iommu":false,"numa":[],"watchdog":false,"pci_segments":[{"pci_segment":0,"mmio32_aperture_weight":2,"mmio64_aperture_weight":1}],"platform":{"num_pci_segments":1,"iommu_address_width_bits":48,"iommufd":false,"vfio_p2p_dma":false},"landlock_enable":false,"landlock_rules":[]}"#;

/// v53: the same shape as v54 (v54 only changed the net device's `mac`).
const V53: &str = r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1,"kvm_hyperv":false,"max_phys_bits":46,"features":{"amx":false},"nested":true,"core_scheduling":"Vm","profile":"Host"},"memory":{"size":536870912,"mergeable":false,"hotplug_method":"Acpi","shared":false,"hugepages":false,"prefault":false,"reserve":false,"thp":true},"payload":{"kernel":"/tmp/k","cmdline":"console=ttyS0"},"rng":{"pci_segment":0,"src":"/dev/urandom"},"pmem":[{"id":"_pmem0","pci_segment":0,"file":"/tmp/p.raw","size":4194304,"discard_writes":false}],"serial":{"mode":"Tty"},"console":{"mode":"Off","pci_segment":0},"debug_console":{"mode":"Off","iobase":233},"pvpanic":false,"iommu":false,"watchdog":false,"landlock_enable":false}"#;

/// v52: `null`s everywhere, devices with `PciDeviceCommonConfig` first,
/// `core_scheduling` but no `profile`/`reserve`, serial without `iommu`.
const V52: &str = r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2,"topology":null,"kvm_hyperv":false,"max_phys_bits":46,"affinity":null,"features":{"amx":false},"nested":true,"core_scheduling":"Vm"},"memory":{"size":536870912,"mergeable":false,"hotplug_method":"Acpi","hotplug_size":null,"hotplugged_size":null,"shared":false,"hugepages":false,"hugepage_size":null,"prefault":false,"zones":null,"thp":true},"payload":{"firmware":null,"kernel":"/tmp/k","cmdline":"console=ttyS0 root=/dev/pmem0","initramfs":null},"rate_limit_groups":null,"disks":null,"net":null,"rng":{"id":null,"pci_segment":0,"pci_device_id":null,"src":"/dev/urandom"},"balloon":null,"generic_vhost_user":null,"fs":null,"pmem":[{"id":"root","pci_segment":0,"pci_device_id":null,"file":"/tmp/p.raw","size":null,"discard_writes":true}],"serial":{"file":null,"mode":"Null","socket":null},"console":{"file":null,"mode":"Tty","socket":null,"id":null,"pci_segment":0,"pci_device_id":null},"debug_console":{"file":null,"mode":"Off","iobase":233},"devices":null,"user_devices":null,"vdpa":null,"vsock":null,"pvpanic":false,"iommu":false,"numa":null,"watchdog":false,"pci_segments":null,"platform":null,"tpm":null,"landlock_enable":false,"landlock_rules":null}"#;

/// v51: as v50 (v51 only added disk fields and `numa[].device_id`).
const V51: &str = r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1,"topology":null,"kvm_hyperv":false,"max_phys_bits":46,"affinity":null,"features":{"amx":false},"nested":true},"memory":{"size":268435456,"mergeable":false,"hotplug_method":"Acpi","hotplug_size":null,"hotplugged_size":null,"shared":false,"hugepages":false,"hugepage_size":null,"prefault":false,"zones":null,"thp":true},"payload":{"firmware":null,"kernel":"/tmp/k","cmdline":null,"initramfs":"/tmp/k"},"rate_limit_groups":null,"disks":null,"net":null,"rng":{"src":"/dev/urandom","iommu":false},"balloon":null,"fs":null,"pmem":null,"serial":{"file":"/tmp/serial.log","mode":"File","iommu":false,"socket":null},"console":{"file":null,"mode":"Null","iommu":false,"socket":null},"debug_console":{"file":null,"mode":"Off","iobase":233},"devices":null,"user_devices":null,"vdpa":null,"vsock":null,"pvpanic":false,"iommu":false,"numa":null,"watchdog":false,"pci_segments":null,"platform":null,"tpm":null,"landlock_enable":false,"landlock_rules":null}"#;

/// v50: `nested` is new; serial and console are one struct with `iommu`;
/// pmem fields in their old order.
const V50: &str = r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2,"topology":null,"kvm_hyperv":false,"max_phys_bits":46,"affinity":null,"features":{"amx":false},"nested":true},"memory":{"size":536870912,"mergeable":false,"hotplug_method":"Acpi","hotplug_size":null,"hotplugged_size":null,"shared":false,"hugepages":false,"hugepage_size":null,"prefault":false,"zones":null,"thp":true},"payload":{"firmware":null,"kernel":"/tmp/k","cmdline":"console=ttyS0","initramfs":null},"rate_limit_groups":null,"disks":null,"net":null,"rng":{"src":"/dev/urandom","iommu":false},"balloon":null,"fs":null,"pmem":[{"file":"/tmp/p.raw","size":4194304,"iommu":false,"discard_writes":false,"id":"_pmem0","pci_segment":0},{"file":"/tmp/q.raw","size":null,"iommu":false,"discard_writes":false,"id":"data","pci_segment":0}],"serial":{"file":null,"mode":"Null","iommu":false,"socket":null},"console":{"file":null,"mode":"Tty","iommu":false,"socket":null},"debug_console":{"file":null,"mode":"Off","iobase":233},"devices":null,"user_devices":null,"vdpa":null,"vsock":null,"pvpanic":false,"iommu":false,"numa":null,"watchdog":false,"pci_segments":null,"platform":{"num_pci_segments":1,"iommu_segments":null,"iommu_address_width_bits":64,"serial_number":null,"uuid":null,"oem_strings":null},"tpm":null,"landlock_enable":false,"landlock_rules":null}"#;

/// `json` with the literal's paths pointed at real files in `dir` (a
/// kernel, 4 MiB raw pmem files, a serial log).
fn with_files(json: &str, dir: &Path) -> String {
    let f = |name: &str, len: u64| {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        p.display().to_string()
    };
    json.replace("/tmp/k", &f("k", 4096))
        .replace("/tmp/p.raw", &f("p.raw", 4 << 20))
        .replace("/tmp/q.raw", &f("q.raw", 4 << 20))
        .replace(
            "/tmp/serial.log",
            &dir.join("serial.log").display().to_string(),
        )
}

fn accepted(name: &str, literal: &str) -> VmConfig {
    let (v, ignored) = from_json_ignoring::<VmConfig>(literal.as_bytes())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(ignored.is_empty(), "{name}: ignored {ignored:?}");
    // round trip: our serialization parses back to the same config
    let ours = serde_json::to_string(&v).unwrap();
    let back: VmConfig = from_json(ours.as_bytes()).unwrap();
    assert_eq!(back, v, "{name}: {ours}");
    let dir = tempfile::tempdir().unwrap();
    let mut real: VmConfig = from_json(with_files(literal, dir.path()).as_bytes()).unwrap();
    real.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
    v
}

#[test]
fn upstream_v54_configs_are_accepted_and_serialize_byte_identical() {
    for (name, literal) in [("v54 minimal", V54_MINIMAL), ("v54 full", V54_FULL)] {
        let v = accepted(name, literal);
        assert_eq!(serde_json::to_string(&v).unwrap(), literal, "{name}");
    }
    let v = accepted("v54 minimal", V54_MINIMAL);
    assert_eq!((v.cpus.boot_vcpus, v.cpus.max_vcpus), (2, 4));
    assert_eq!(v.pmem()[0].id.as_deref(), Some("p0"));
}

#[test]
fn upstream_v53_config_is_accepted_and_serializes_byte_identical() {
    let v = accepted("v53", V53);
    assert_eq!(serde_json::to_string(&v).unwrap(), V53);
    assert_eq!(v.serial.mode, ConsoleOutputMode::Tty);
}

#[test]
fn upstream_v50_to_v52_configs_are_accepted() {
    let v52 = accepted("v52", V52);
    assert_eq!(v52.pmem()[0].id.as_deref(), Some("root"));
    assert!(v52.pmem()[0].discard_writes);
    let v51 = accepted("v51", V51);
    assert_eq!(v51.serial.mode, ConsoleOutputMode::File);
    assert_eq!(v51.memory.size, 256 << 20);
    let v50 = accepted("v50", V50);
    assert_eq!(v50.pmem().len(), 2);
    assert_eq!(v50.pmem()[1].id.as_deref(), Some("data"));
    assert_eq!(v50.platform, Some(PlatformConfig::default()));
    // What we write for them now is v54's shape: no nulls, no iommu false.
    for v in [&v52, &v51, &v50] {
        let s = serde_json::to_string(v).unwrap();
        assert!(!s.contains("null"), "{s}");
        let j = serde_json::to_value(v).unwrap();
        for dev in [&j["rng"], &j["console"], &j["serial"]]
            .into_iter()
            .chain(j["pmem"].as_array().into_iter().flatten())
        {
            assert!(dev.get("iommu").is_none(), "{dev}");
        }
    }
}

#[test]
fn our_default_config_has_upstream_shape() {
    let v = cli::CommandLine::parse([
        "--kernel",
        "/tmp/k",
        "--cmdline",
        "console=ttyS0",
        "--cpus",
        "boot=2,max=4",
        "--pmem",
        "file=/tmp/p.raw,id=p0",
    ])
    .unwrap()
    .vm
    .unwrap();
    // The command line gives what upstream's `vm.create` of the same
    // config gave (V54_MINIMAL).
    assert_eq!(serde_json::to_string(&v).unwrap(), V54_MINIMAL);
}
