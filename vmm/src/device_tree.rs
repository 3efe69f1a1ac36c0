//! `vm.info`'s `device_tree`, in upstream's shape: one node per device,
//! keyed by id. A virtio device's node holds what the guest reaches it by
//! (its `MmioAddressRange`, for pmem the region) and hangs under the node
//! of its PCI function, `_virtio-pci-<id>`, which holds the BARs and the
//! `pci_bdf`. Keys whose value would be `None` are left out, as upstream.

use std::collections::BTreeMap;

use serde::Serialize;

/// A resource of a device node, externally tagged as upstream serializes
/// it (`{"PciBar": {...}}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Resource {
    /// A port range.
    PioAddressRange {
        /// First port.
        base: u16,
        /// Ports.
        size: u16,
    },
    /// A guest-physical range.
    MmioAddressRange {
        /// Start.
        base: u64,
        /// Length.
        size: u64,
    },
    /// A PCI BAR as the guest programmed it.
    PciBar {
        /// BAR index.
        index: usize,
        /// Address (0 before the guest assigns one).
        base: u64,
        /// Size.
        size: u64,
        /// `Mmio64` for ours.
        type_: &'static str,
        /// Prefetchable.
        prefetchable: bool,
    },
    /// A legacy interrupt line.
    LegacyIrq(u32),
}

/// One node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceNode {
    /// The device id (the key too).
    pub id: String,
    /// What it occupies.
    pub resources: Vec<Resource>,
    /// Its parent's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Its children's ids.
    pub children: Vec<String>,
    /// `0000:00:DD.F`, for PCI functions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci_bdf: Option<String>,
}

/// The tree, keyed by id.
pub type DeviceTree = BTreeMap<String, DeviceNode>;

/// A leaf device without a PCI function (the serial port, the IO-APIC).
pub fn add_platform(tree: &mut DeviceTree, id: &str, resources: Vec<Resource>) {
    tree.insert(
        id.to_owned(),
        DeviceNode {
            id: id.to_owned(),
            resources,
            parent: None,
            children: Vec::new(),
            pci_bdf: None,
        },
    );
}

/// A virtio device `id` behind its PCI function: the function's node
/// `_virtio-pci-<id>` with BAR 0 (`bar`: address if assigned, size) and
/// the bdf, and the device's own node with `resources` under it.
pub fn add_virtio(
    tree: &mut DeviceTree,
    id: &str,
    bdf: &str,
    bar: (Option<u64>, u64),
    resources: Vec<Resource>,
) {
    let function = format!("_virtio-pci-{id}");
    tree.insert(
        function.clone(),
        DeviceNode {
            id: function.clone(),
            resources: vec![Resource::PciBar {
                index: 0,
                base: bar.0.unwrap_or(0),
                size: bar.1,
                type_: "Mmio64",
                prefetchable: false,
            }],
            parent: None,
            children: vec![id.to_owned()],
            pci_bdf: Some(bdf.to_owned()),
        },
    );
    tree.insert(
        id.to_owned(),
        DeviceNode {
            id: id.to_owned(),
            resources,
            parent: Some(function),
            children: Vec::new(),
            pci_bdf: None,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_shape() {
        let mut t = DeviceTree::new();
        add_virtio(
            &mut t,
            "_pmem0",
            "0000:00:02.0",
            (Some(0xc000_0000), 0x8000),
            vec![Resource::MmioAddressRange {
                base: 1 << 32,
                size: 2 << 20,
            }],
        );
        add_platform(&mut t, "__serial", vec![Resource::LegacyIrq(4)]);
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "_pmem0": {"id": "_pmem0", "children": [], "parent": "_virtio-pci-_pmem0",
                    "resources": [{"MmioAddressRange": {"base": 4294967296u64, "size": 2097152}}]},
                "_virtio-pci-_pmem0": {"id": "_virtio-pci-_pmem0", "children": ["_pmem0"],
                    "pci_bdf": "0000:00:02.0",
                    "resources": [{"PciBar": {"index": 0, "base": 3221225472u64,
                        "size": 32768, "type_": "Mmio64", "prefetchable": false}}]},
                "__serial": {"id": "__serial", "children": [], "resources": [{"LegacyIrq": 4}]},
            })
        );
    }
}
