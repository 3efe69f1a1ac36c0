//! The request body of every `ch-remote` command that sends one, built from
//! its arguments as upstream Cloud Hypervisor's `ch-remote` (v54) builds it:
//! the same keys, the same defaults, the same JSON field order, so the
//! bytes on the wire are upstream's (`docs/api.md` has the table of them).
//!
//! Devices this VMM does not have (disks, nets, ...) are still parsed and
//! sent: the server answers for them. Options that pass file descriptors
//! (`fd=`, `net_fds=`, `vfio_fds=`, `iommufd_fd=`) are refused here, since
//! this client sends no descriptors.

use crate::json::{Json, Object};
use crate::options::{check_printable, parse_size, OptionError, Options, SIZE_EXPECTED};

const U8: &str = "an integer from 0 to 255";
const U16: &str = "an integer from 0 to 65535";
const U32: &str = "an integer from 0 to 4294967295";
const U64: &str = "an unsigned integer";
const USIZE: &str = "an unsigned integer";
/// Highest host CPU number a `queue_affinity` list may name: bounds the
/// expansion of a range (upstream would try to build any range given).
const MAX_HOST_CPU: u64 = 65535;

/// `add-pmem`'s syntax, for errors and `--help`.
pub const PMEM_SYNTAX: &str = "file=<backing_file_path>,size=<persistent_memory_size>,\
    iommu=on|off,discard_writes=on|off,id=<device_id>,pci_segment=<segment_id>,\
    pci_device_id=<pci_slot>";
/// `add-disk`'s syntax.
pub const DISK_SYNTAX: &str = "path=<disk_image_path>,readonly=on|off,direct=on|off,\
    iommu=on|off,num_queues=<number_of_queues>,queue_size=<size_of_each_queue>,\
    vhost_user=on|off,socket=<vhost_user_socket_path>,bw_size=<bytes>,\
    bw_one_time_burst=<bytes>,bw_refill_time=<ms>,ops_size=<io_ops>,\
    ops_one_time_burst=<io_ops>,ops_refill_time=<ms>,id=<device_id>,\
    pci_segment=<segment_id>,pci_device_id=<pci_slot>,rate_limit_group=<group_id>,\
    queue_affinity=<list_of_queue_indices_with_their_associated_cpuset>,\
    serial=<serial_number>,backing_files=on|off,sparse=on|off,\
    image_type=<raw,qcow2,vhd,vhdx,vmdk>,lock_granularity=byte-range|full";
/// `add-net`'s syntax.
pub const NET_SYNTAX: &str = "tap=<if_name>,ip=<ip_addr>,mask=<net_mask>,mac=<mac_addr>,\
    host_mac=<mac_addr>,mtu=<mtu>,iommu=on|off,num_queues=<number_of_queues>,\
    queue_size=<size_of_each_queue>,id=<device_id>,vhost_user=<vhost_user_enable>,\
    socket=<vhost_user_socket_path>,vhost_mode=client|server,bw_size=<bytes>,\
    bw_one_time_burst=<bytes>,bw_refill_time=<ms>,ops_size=<io_ops>,\
    ops_one_time_burst=<io_ops>,ops_refill_time=<ms>,pci_segment=<segment_id>,\
    pci_device_id=<pci_slot>,offload_tso=on|off,offload_ufo=on|off,offload_csum=on|off";
/// `add-fs`'s syntax.
pub const FS_SYNTAX: &str = "tag=<tag_name>,socket=<socket_path>,num_queues=<number_of_queues>,\
    queue_size=<size_of_each_queue>,id=<device_id>,pci_segment=<segment_id>,\
    pci_device_id=<pci_slot>";
/// `add-vsock`'s syntax.
pub const VSOCK_SYNTAX: &str = "cid=<context_id>,socket=<socket_path>,iommu=on|off,\
    id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>";
/// `add-device`'s syntax.
pub const DEVICE_SYNTAX: &str = "path=<device_path>,iommu=on|off,id=<device_id>,\
    pci_segment=<segment_id>,pci_device_id=<pci_slot>,x_nv_gpudirect_clique=<clique_id>,\
    x_exclude_mmap_bars=[<bar>...]";
/// `add-vdpa`'s syntax.
pub const VDPA_SYNTAX: &str = "path=<device_path>,num_queues=<number_of_queues>,iommu=on|off,\
    id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>";
/// `add-user-device`'s syntax.
pub const USER_DEVICE_SYNTAX: &str =
    "socket=<socket_path>,id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>";
/// `add-generic-vhost-user`'s syntax.
pub const GENERIC_VHOST_USER_SYNTAX: &str = "device_type=<virtio device type number or name>,\
    socket=<socket_path>,queue_sizes=[<size>,...],id=<device_id>,pci_segment=<segment_id>,\
    pci_device_id=<pci_slot>";
/// `restore`'s syntax.
pub const RESTORE_SYNTAX: &str = "source_url=<source_url>,prefault=on|off,\
    memory_restore_mode=copy|ondemand|copyonwrite,resume=on|off,\
    zone_updates=[<zone_id>@<host_numa_node>,...],pmem=[<pmem_id>@<clone_file>,...]";
/// `send-migration`'s syntax.
pub const SEND_MIGRATION_SYNTAX: &str = "destination_url=<url>[,local=on|off,\
    preserve_source=on|off,downtime_ms=<milliseconds>,timeout_s=<seconds>,\
    timeout_strategy=cancel|ignore,connections=<amount>,tls_dir=<path>,\
    memory_mode=precopy|postcopy]";
/// `receive-migration`'s syntax.
pub const RECEIVE_MIGRATION_SYNTAX: &str = "receiver_url=<url>[,tls_dir=<path>]\
    [,memory_mode=precopy|postcopy][,zone_updates=[<zone_id>@<host_numa_node>,...]]";
/// `pmem-snapshot`'s syntax.
pub const PMEM_SNAPSHOT_SYNTAX: &str = "id=<pmem_device_id>,tag=<snapshot_tag>";
/// `pmem-overlay`'s syntax.
pub const PMEM_OVERLAY_SYNTAX: &str = "id=<pmem_device_id>,file=<new_overlay_path>";
/// `pmem-rollback`'s syntax.
pub const PMEM_ROLLBACK_SYNTAX: &str =
    "id=<pmem_device_id>,snapshot=<tag_or_numeric_id>[,reset=on|off]";
/// `pmem-snapshot-delete`'s syntax.
pub const PMEM_SNAPSHOT_DELETE_SYNTAX: &str = "id=<pmem_device_id>,snapshot=<tag_or_numeric_id>";
/// `pmem-flush`'s syntax.
pub const PMEM_FLUSH_SYNTAX: &str = "<pmem_device_id> or id=<pmem_device_id>";

/// `id`, `iommu` (left out when off, as upstream), `pci_segment`,
/// `pci_device_id`: the fields every PCI device body starts with.
fn pci_common(o: &Options) -> Result<Object, OptionError> {
    let iommu = o.toggle("iommu")?.unwrap_or(false);
    Ok(Object::new()
        .some("id", o.string("id"))
        .some("iommu", iommu.then_some(true))
        .field(
            "pci_segment",
            o.uint("pci_segment", u16::MAX.into(), U16)?.unwrap_or(0),
        )
        .some(
            "pci_device_id",
            o.uint("pci_device_id", u8::MAX.into(), U8)?,
        ))
}

const PCI_IOMMU: [&str; 4] = ["id", "iommu", "pci_segment", "pci_device_id"];
const PCI: [&str; 3] = ["id", "pci_segment", "pci_device_id"];

fn keys(own: &[&'static str], common: &[&'static str]) -> Vec<&'static str> {
    own.iter().chain(common).copied().collect()
}

/// `vm.add-pmem`.
///
/// ```
/// let body = api_client::commands::add_pmem("file=F,size=4M,id=p1")?;
/// assert_eq!(
///     body,
///     r#"{"id":"p1","pci_segment":0,"file":"F","size":4194304,"discard_writes":false}"#
/// );
/// # Ok::<(), api_client::OptionError>(())
/// ```
pub fn add_pmem(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &keys(&["file", "size", "discard_writes"], &PCI_IOMMU))?;
    let file = o.required("file")?;
    let size = o.size("size")?;
    if size == Some(0) {
        return Err(OptionError::InvalidValue {
            key: "size".into(),
            value: o.string("size").unwrap_or_default().into(),
            expected: "a size greater than 0",
        });
    }
    Ok(pci_common(&o)?
        .field("file", file)
        .some("size", size)
        .field(
            "discard_writes",
            o.toggle("discard_writes")?.unwrap_or(false),
        )
        .to_string())
}

/// The `rate_limiter_config` object from the `bw_*` and `ops_*` keys, as
/// upstream builds it: a bucket only when its size and refill time are
/// both non-zero.
fn rate_limiter(o: &Options) -> Result<Option<Object>, OptionError> {
    let bucket = |prefix: &str| -> Result<Option<Object>, OptionError> {
        let get = |k: &str| o.uint(&format!("{prefix}_{k}"), u64::MAX, U64);
        let (size, burst, refill) = (get("size")?, get("one_time_burst")?, get("refill_time")?);
        let (size, refill) = (size.unwrap_or(0), refill.unwrap_or(0));
        Ok((size != 0 && refill != 0).then(|| {
            Object::new()
                .field("size", size)
                .field("one_time_burst", burst.unwrap_or(0))
                .field("refill_time", refill)
        }))
    };
    let (bw, ops) = (bucket("bw")?, bucket("ops")?);
    if bw.is_none() && ops.is_none() {
        return Ok(None);
    }
    Ok(Some(
        Object::new().nullable("bandwidth", bw).nullable("ops", ops),
    ))
}

const RATE_KEYS: [&str; 6] = [
    "bw_size",
    "bw_one_time_burst",
    "bw_refill_time",
    "ops_size",
    "ops_one_time_burst",
    "ops_refill_time",
];

/// `vm.add-disk`.
pub fn add_disk(arg: &str) -> Result<String, OptionError> {
    let mut own = vec![
        "path",
        "readonly",
        "direct",
        "queue_size",
        "num_queues",
        "vhost_user",
        "socket",
        "_disable_io_uring",
        "_disable_aio",
        "serial",
        "rate_limit_group",
        "queue_affinity",
        "backing_files",
        "sparse",
        "image_type",
        "lock_granularity",
    ];
    own.extend(RATE_KEYS);
    let o = Options::parse(arg, &keys(&own, &PCI_IOMMU))?;
    let affinity = o
        .affinity_list(
            "queue_affinity",
            u16::MAX.into(),
            MAX_HOST_CPU,
            "[<queue_index>@[<host_cpu>,...],...] (cpus up to 65535)",
        )?
        .map(|list| {
            list.into_iter()
                .map(|(queue, cpus)| {
                    Json::from(
                        Object::new()
                            .field("queue_index", queue)
                            .field("host_cpus", cpus),
                    )
                })
                .collect::<Vec<Json>>()
        });
    let socket = o.string("socket");
    let image_types = [
        ("vmdk", "FlatVmdk"),
        ("vhd", "FixedVhd"),
        ("qcow2", "Qcow2"),
        ("raw", "Raw"),
        ("vhdx", "Vhdx"),
    ];
    // Upstream ignores image_type for a vhost-user disk.
    let image_type = match socket {
        None => o.choice("image_type", &image_types, "raw, qcow2, vhd, vhdx or vmdk")?,
        Some(_) => None,
    };
    let lock = o.choice(
        "lock_granularity",
        &[("byte-range", "ByteRange"), ("full", "Full")],
        "byte-range or full",
    )?;
    let flag = |k: &str, default| o.toggle(k).map(|v| v.unwrap_or(default));
    Ok(pci_common(&o)?
        .some("path", o.string("path"))
        .field("readonly", flag("readonly", false)?)
        .field("direct", flag("direct", false)?)
        .field(
            "num_queues",
            o.uint("num_queues", u64::MAX, USIZE)?.unwrap_or(1),
        )
        .field(
            "queue_size",
            o.uint("queue_size", u16::MAX.into(), U16)?.unwrap_or(128),
        )
        .field("vhost_user", flag("vhost_user", false)?)
        .some("vhost_socket", socket)
        .some("rate_limit_group", o.string("rate_limit_group"))
        .some("rate_limiter_config", rate_limiter(&o)?)
        .field("disable_io_uring", flag("_disable_io_uring", false)?)
        .field("disable_aio", flag("_disable_aio", false)?)
        .some("serial", o.string("serial"))
        .some("queue_affinity", affinity)
        .field("backing_files", flag("backing_files", false)?)
        .field("sparse", flag("sparse", true)?)
        .field("image_type", image_type.unwrap_or("Unknown"))
        .field("lock_granularity", lock.unwrap_or("ByteRange"))
        .to_string())
}

/// `aa:bb:cc:dd:ee:ff`, six hex octets; upstream writes them lower case.
fn mac(o: &Options, key: &str) -> Result<Option<String>, OptionError> {
    let Some(v) = o.string(key) else {
        return Ok(None);
    };
    let octets: Vec<&str> = v.split(':').collect();
    let ok = octets.len() == 6
        && octets
            .iter()
            .all(|x| x.len() == 2 && x.bytes().all(|b| b.is_ascii_hexdigit()));
    if !ok {
        return Err(OptionError::InvalidValue {
            key: key.to_owned(),
            value: v.to_owned(),
            expected: "a MAC address (12:34:56:78:9a:bc)",
        });
    }
    Ok(Some(v.to_ascii_lowercase()))
}

fn ip(o: &Options, key: &str) -> Result<Option<String>, OptionError> {
    let Some(v) = o.string(key) else {
        return Ok(None);
    };
    v.parse::<std::net::IpAddr>()
        .map(|ip| Some(ip.to_string()))
        .map_err(|_| OptionError::InvalidValue {
            key: key.to_owned(),
            value: v.to_owned(),
            expected: "an IPv4 or IPv6 address",
        })
}

/// `vm.add-net`.
pub fn add_net(arg: &str) -> Result<String, OptionError> {
    let mut own = vec![
        "tap",
        "ip",
        "mask",
        "mac",
        "host_mac",
        "offload_tso",
        "offload_ufo",
        "offload_csum",
        "mtu",
        "queue_size",
        "num_queues",
        "vhost_user",
        "socket",
        "vhost_mode",
        "fd",
    ];
    own.extend(RATE_KEYS);
    let o = Options::parse(arg, &keys(&own, &PCI_IOMMU))?;
    if o.has("fd") {
        return Err(OptionError::FileDescriptors { key: "fd" });
    }
    let flag = |k: &str, default| o.toggle(k).map(|v| v.unwrap_or(default));
    let mode = o.choice(
        "vhost_mode",
        &[("client", "Client"), ("server", "Server")],
        "client or server",
    )?;
    Ok(pci_common(&o)?
        .some("tap", o.string("tap"))
        .some("ip", ip(&o, "ip")?)
        .some("mask", ip(&o, "mask")?)
        .some("mac", mac(&o, "mac")?)
        .some("host_mac", mac(&o, "host_mac")?)
        .some("mtu", o.uint("mtu", u16::MAX.into(), U16)?)
        .field(
            "num_queues",
            o.uint("num_queues", u64::MAX, USIZE)?.unwrap_or(2),
        )
        .field(
            "queue_size",
            o.uint("queue_size", u16::MAX.into(), U16)?.unwrap_or(256),
        )
        .field("vhost_user", flag("vhost_user", false)?)
        .some("vhost_socket", o.string("socket"))
        .field("vhost_mode", mode.unwrap_or("Client"))
        .some("rate_limiter_config", rate_limiter(&o)?)
        .field("offload_tso", flag("offload_tso", true)?)
        .field("offload_ufo", flag("offload_ufo", true)?)
        .field("offload_csum", flag("offload_csum", true)?)
        .to_string())
}

/// `vm.add-fs`.
pub fn add_fs(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(
        arg,
        &keys(&["tag", "socket", "num_queues", "queue_size"], &PCI),
    )?;
    let tag = o.required("tag")?;
    // The virtio-fs tag field is 36 bytes.
    if tag.len() > 36 {
        return Err(OptionError::InvalidValue {
            key: "tag".into(),
            value: tag.into(),
            expected: "at most 36 bytes",
        });
    }
    Ok(pci_common(&o)?
        .field("tag", tag)
        .field("socket", o.required("socket")?)
        .field(
            "num_queues",
            o.uint("num_queues", u64::MAX, USIZE)?.unwrap_or(1),
        )
        .field(
            "queue_size",
            o.uint("queue_size", u16::MAX.into(), U16)?.unwrap_or(1024),
        )
        .to_string())
}

/// `vm.add-vsock`.
pub fn add_vsock(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &keys(&["socket", "cid"], &PCI_IOMMU))?;
    let socket = o.required("socket")?;
    o.required("cid")?;
    Ok(pci_common(&o)?
        .field("cid", o.uint("cid", u32::MAX.into(), U32)?.unwrap_or(0))
        .field("socket", socket)
        .to_string())
}

/// `vm.add-device` (VFIO).
pub fn add_device(arg: &str) -> Result<String, OptionError> {
    let own = ["path", "fd", "x_nv_gpudirect_clique", "x_exclude_mmap_bars"];
    let o = Options::parse(arg, &keys(&own, &PCI_IOMMU))?;
    if o.has("fd") {
        return Err(OptionError::FileDescriptors { key: "fd" });
    }
    Ok(pci_common(&o)?
        .some("path", o.string("path"))
        .some(
            "x_nv_gpudirect_clique",
            o.uint("x_nv_gpudirect_clique", u8::MAX.into(), U8)?,
        )
        .field(
            "x_exclude_mmap_bars",
            o.uint_list(
                "x_exclude_mmap_bars",
                5,
                "a list of BAR indices 0 to 5 ([0,2])",
            )?
            .unwrap_or_default(),
        )
        .to_string())
}

/// `vm.add-vdpa`.
pub fn add_vdpa(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &keys(&["path", "num_queues"], &PCI_IOMMU))?;
    Ok(pci_common(&o)?
        .field("path", o.required("path")?)
        .field(
            "num_queues",
            o.uint("num_queues", u64::MAX, USIZE)?.unwrap_or(1),
        )
        .to_string())
}

/// `vm.add-user-device`.
pub fn add_user_device(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &keys(&["socket"], &PCI))?;
    Ok(pci_common(&o)?
        .field("socket", o.required("socket")?)
        .to_string())
}

/// Virtio device type names upstream accepts for `device_type=`, with
/// their ids (the virtio specification's numbering).
const VIRTIO_TYPES: [(&str, u64); 45] = [
    ("net", 1),
    ("block", 2),
    ("console", 3),
    ("rng", 4),
    ("balloon", 5),
    ("iomem", 6),
    ("rpmsg", 7),
    ("scsi", 8),
    ("9p", 9),
    ("mac80211_wlan", 10),
    ("rproc_serial", 11),
    ("caif", 12),
    ("memory_balloon", 13),
    ("gpu", 16),
    ("clock", 17),
    ("input", 18),
    ("vsock", 19),
    ("crypto", 20),
    ("signal_dist", 21),
    ("pstore", 22),
    ("iommu", 23),
    ("mem", 24),
    ("sound", 25),
    ("fs", 26),
    ("pmem", 27),
    ("rpmb", 28),
    ("mac80211_hwsim", 29),
    ("video_encoder", 30),
    ("video_decoder", 31),
    ("scmi", 32),
    ("nitro_sec_mod", 33),
    ("i2c", 34),
    ("watchdog", 35),
    ("can", 36),
    ("dmabuf", 37),
    ("param_serv", 38),
    ("audio_policy", 39),
    ("bt", 40),
    ("gpio", 41),
    ("rdma", 42),
    ("camera", 43),
    ("ism", 44),
    ("spi", 45),
    ("tee", 46),
    ("cpu_balloon", 47),
];

/// `vm.add-generic-vhost-user`.
pub fn add_generic_vhost_user(arg: &str) -> Result<String, OptionError> {
    let own = ["device_type", "virtio_id", "queue_sizes", "socket"];
    let o = Options::parse(arg, &keys(&own, &PCI))?;
    let socket = o.required("socket")?;
    let queue_sizes = o
        .uint_list(
            "queue_sizes",
            u16::MAX.into(),
            "a list of queue sizes ([256,256])",
        )?
        .ok_or(OptionError::Required { key: "queue_sizes" })?;
    let (key, name) = match (o.string("device_type"), o.string("virtio_id")) {
        (Some(t), _) => ("device_type", t),
        (None, Some(t)) => ("virtio_id", t),
        (None, None) => return Err(OptionError::Required { key: "device_type" }),
    };
    let named = VIRTIO_TYPES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, id)| *id);
    let numeric = name
        .starts_with(|c: char| ('1'..='9').contains(&c))
        .then(|| name.parse::<u32>().ok().map(u64::from))
        .flatten();
    let id = named.or(numeric).ok_or_else(|| OptionError::InvalidValue {
        key: key.into(),
        value: name.into(),
        expected: "a virtio device type name (fs, net, block, ...) or number",
    })?;
    // Upstream refuses these two: the VMM provides them itself.
    if id == 23 || id == 35 {
        return Err(OptionError::InvalidValue {
            key: key.into(),
            value: name.into(),
            expected: "a device type other than iommu and watchdog",
        });
    }
    Ok(pci_common(&o)?
        .field("socket", socket)
        .field("queue_sizes", queue_sizes)
        .field("device_type", id)
        .to_string())
}

fn zone_updates(o: &Options) -> Result<Vec<Json>, OptionError> {
    let pairs = o.pair_list(
        "zone_updates",
        u32::MAX.into(),
        "[<zone_id>@<host_numa_node>,...]",
    )?;
    Ok(pairs
        .unwrap_or_default()
        .into_iter()
        .map(|(id, node)| {
            Object::new()
                .field("id", id)
                .field("host_numa_node", node)
                .into()
        })
        .collect())
}

fn refuse_fds(o: &Options, keys: &[&'static str]) -> Result<(), OptionError> {
    match keys.iter().find(|k| o.has(k)) {
        Some(key) => Err(OptionError::FileDescriptors { key }),
        None => Ok(()),
    }
}

/// `vm.restore`.
pub fn restore(arg: &str) -> Result<String, OptionError> {
    let all = [
        "source_url",
        "prefault",
        "memory_restore_mode",
        "net_fds",
        "vfio_fds",
        "iommufd_fd",
        "resume",
        "zone_updates",
        "pmem",
    ];
    let o = Options::parse(arg, &all)?;
    refuse_fds(&o, &["net_fds", "vfio_fds", "iommufd_fd"])?;
    let mode = o.choice(
        "memory_restore_mode",
        &[
            ("copy", "Copy"),
            ("ondemand", "OnDemand"),
            ("copyonwrite", "CopyOnWrite"),
        ],
        "copy, ondemand or copyonwrite",
    )?;
    // This VMM's clone extension: sent only when given, so that the bytes
    // of upstream's own options stay upstream's.
    let clones = o.path_pair_list("pmem", "[<pmem_id>@<clone_file>,...]")?;
    let body = Object::new()
        .field("source_url", o.required("source_url")?)
        .field("prefault", o.toggle("prefault")?.unwrap_or(false))
        .field("memory_restore_mode", mode.unwrap_or("Copy"))
        .field("net_fds", Json::Null)
        .field("vfio_fds", Json::Null)
        .field("iommufd_fd", Json::Null)
        .field("resume", o.toggle("resume")?.unwrap_or(false))
        .field("zone_updates", zone_updates(&o)?);
    let body = match clones {
        None => body,
        Some(list) => body.field(
            "pmem",
            list.into_iter()
                .map(|(id, file)| Object::new().field("id", id).field("file", file).into())
                .collect::<Vec<Json>>(),
        ),
    };
    Ok(body.to_string())
}

/// `tcp:<host>:<port>` or `unix:<path>`, as upstream checks a migration URL.
fn migration_url(key: &str, url: &str, tls: bool) -> Result<(), OptionError> {
    let bad = |expected| OptionError::InvalidValue {
        key: key.to_owned(),
        value: url.to_owned(),
        expected,
    };
    if let Some(addr) = url.strip_prefix("tcp:") {
        let (host, port) = addr
            .rsplit_once(':')
            .ok_or_else(|| bad("tcp:<host>:<port>"))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad("tcp:<host>:<port>"));
        }
        Ok(())
    } else if url.strip_prefix("unix:").is_some_and(|p| !p.is_empty()) {
        if tls {
            return Err(OptionError::Conflict {
                what: "UNIX sockets and TLS encryption cannot be used at the same time",
            });
        }
        Ok(())
    } else {
        Err(bad("tcp:<host>:<port> or unix:<path>"))
    }
}

const MEMORY_MODES: [(&str, &str); 2] = [("precopy", "Precopy"), ("postcopy", "Postcopy")];

/// `vm.send-migration`.
pub fn send_migration(arg: &str) -> Result<String, OptionError> {
    let all = [
        "destination_url",
        "local",
        "preserve_source",
        "downtime_ms",
        "timeout_s",
        "timeout_strategy",
        "connections",
        "tls_dir",
        "memory_mode",
    ];
    let o = Options::parse(arg, &all)?;
    let url = o.required("destination_url")?;
    let tls_dir = o.string("tls_dir");
    migration_url("destination_url", url, tls_dir.is_some())?;
    let nonzero = |k: &str, max: u64, default: u64| -> Result<u64, OptionError> {
        match o.uint(k, max, "a non-zero integer")? {
            Some(0) => Err(OptionError::InvalidValue {
                key: k.into(),
                value: "0".into(),
                expected: "a non-zero integer",
            }),
            v => Ok(v.unwrap_or(default)),
        }
    };
    let strategy = o.choice(
        "timeout_strategy",
        &[("cancel", "Cancel"), ("ignore", "Ignore")],
        "cancel or ignore",
    )?;
    let mode = o.choice("memory_mode", &MEMORY_MODES, "precopy or postcopy")?;
    Ok(Object::new()
        .field("destination_url", url)
        .field("local", o.toggle("local")?.unwrap_or(false))
        .field(
            "preserve_source",
            o.toggle("preserve_source")?.unwrap_or(false),
        )
        .field("downtime_ms", nonzero("downtime_ms", u64::MAX, 300)?)
        .field("timeout_s", nonzero("timeout_s", u64::MAX, 3600)?)
        .field("timeout_strategy", strategy.unwrap_or("Cancel"))
        .field("connections", nonzero("connections", u32::MAX.into(), 1)?)
        .nullable("tls_dir", tls_dir)
        .field("memory_mode", mode.unwrap_or("Precopy"))
        .to_string())
}

/// `vm.receive-migration`.
pub fn receive_migration(arg: &str) -> Result<String, OptionError> {
    let all = [
        "receiver_url",
        "tls_dir",
        "memory_mode",
        "vfio_fds",
        "iommufd_fd",
        "zone_updates",
    ];
    let o = Options::parse(arg, &all)?;
    refuse_fds(&o, &["vfio_fds", "iommufd_fd"])?;
    let url = o.required("receiver_url")?;
    let tls_dir = o.string("tls_dir");
    migration_url("receiver_url", url, tls_dir.is_some())?;
    let updates = zone_updates(&o)?;
    Ok(Object::new()
        .field("receiver_url", url)
        .nullable("tls_dir", tls_dir)
        .field(
            "memory_mode",
            o.choice("memory_mode", &MEMORY_MODES, "precopy or postcopy")?
                .unwrap_or("Precopy"),
        )
        .field("vfio_fds", Json::Null)
        .field("iommufd_fd", Json::Null)
        .field("zone_updates", updates)
        .to_string())
}

/// A single positional value (`remove-device ID`, `snapshot URL`): not
/// empty, no control characters.
fn single(what: &'static str, value: &str) -> Result<(), OptionError> {
    if value.is_empty() {
        return Err(OptionError::EmptyArgument { what });
    }
    check_printable(what, value)
}

/// `vm.remove-device`: `{"id"}`.
pub fn remove_device(id: &str) -> Result<String, OptionError> {
    single("device id", id)?;
    Ok(Object::new().field("id", id).to_string())
}

/// `vm.snapshot` and `vm.coredump`: `{"destination_url"}`.
pub fn destination_url(url: &str) -> Result<String, OptionError> {
    single("destination url", url)?;
    Ok(Object::new().field("destination_url", url).to_string())
}

/// A size given to a `resize*` flag.
fn flag_size(flag: &str, v: &str) -> Result<u64, OptionError> {
    parse_size(v).ok_or_else(|| OptionError::InvalidValue {
        key: flag.into(),
        value: v.into(),
        expected: SIZE_EXPECTED,
    })
}

/// `vm.resize`: every field, `null` when not given (as upstream).
pub fn resize(
    cpus: Option<&str>,
    memory: Option<&str>,
    balloon: Option<&str>,
) -> Result<String, OptionError> {
    let cpus = cpus
        .map(|v| {
            v.parse::<u32>()
                .ok()
                .filter(|_| v.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| OptionError::InvalidValue {
                    key: "--cpus".into(),
                    value: v.into(),
                    expected: U32,
                })
        })
        .transpose()?;
    Ok(Object::new()
        .nullable("desired_vcpus", cpus.map(u64::from))
        .nullable(
            "desired_ram",
            memory.map(|m| flag_size("--memory", m)).transpose()?,
        )
        .nullable(
            "desired_balloon",
            balloon.map(|b| flag_size("--balloon", b)).transpose()?,
        )
        .to_string())
}

/// `vm.resize-disk`: `{"id", "desired_size"}`.
pub fn resize_disk(disk: &str, size: &str) -> Result<String, OptionError> {
    single("--disk", disk)?;
    Ok(Object::new()
        .field("id", disk)
        .field("desired_size", flag_size("--size", size)?)
        .to_string())
}

/// `vm.resize-zone`: `{"id", "desired_ram"}`.
pub fn resize_zone(id: &str, size: &str) -> Result<String, OptionError> {
    single("--id", id)?;
    Ok(Object::new()
        .field("id", id)
        .field("desired_ram", flag_size("--size", size)?)
        .to_string())
}

/// `vm.pmem-snapshot`: `{"id", "tag"}`.
pub fn pmem_snapshot(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &["id", "tag"])?;
    Ok(Object::new()
        .field("id", o.required("id")?)
        .field("tag", o.required("tag")?)
        .to_string())
}

/// `vm.pmem-overlay`: `{"id", "file"}`.
pub fn pmem_overlay(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &["id", "file"])?;
    Ok(Object::new()
        .field("id", o.required("id")?)
        .field("file", o.required("file")?)
        .to_string())
}

/// `vm.pmem-rollback`: `{"id", "snapshot", "reset"}`.
pub fn pmem_rollback(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &["id", "snapshot", "reset"])?;
    Ok(Object::new()
        .field("id", o.required("id")?)
        .field("snapshot", o.required("snapshot")?)
        .field("reset", o.toggle("reset")?.unwrap_or(false))
        .to_string())
}

/// `vm.pmem-snapshot-delete`: `{"id", "snapshot"}`.
pub fn pmem_snapshot_delete(arg: &str) -> Result<String, OptionError> {
    let o = Options::parse(arg, &["id", "snapshot"])?;
    Ok(Object::new()
        .field("id", o.required("id")?)
        .field("snapshot", o.required("snapshot")?)
        .to_string())
}

/// `vm.pmem-flush`: `{"id"}`, from `ID` or `id=ID`.
pub fn pmem_flush(arg: &str) -> Result<String, OptionError> {
    let id = match arg.strip_prefix("id=") {
        Some(_) => Options::parse(arg, &["id"])?.required("id")?.to_owned(),
        None => {
            single("device id", arg)?;
            arg.to_owned()
        }
    };
    Ok(Object::new().field("id", id).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    type Builder = fn(&str) -> Result<String, OptionError>;

    /// Bodies upstream's ch-remote v54 sent for the same arguments,
    /// captured byte for byte (docs/api.md has the table).
    #[test]
    fn upstream_bodies() {
        let cases: &[(Builder, &str, &str)] = &[
            (add_pmem, "file=F,size=4M,id=p1", r#"{"id":"p1","pci_segment":0,"file":"F","size":4194304,"discard_writes":false}"#),
            (add_pmem, "file=/img/a.pcow", r#"{"pci_segment":0,"file":"/img/a.pcow","discard_writes":false}"#),
            (add_pmem, "file=/img/a.pcow,size=1G,iommu=on,discard_writes=on,id=p2,pci_segment=1,pci_device_id=5", r#"{"id":"p2","iommu":true,"pci_segment":1,"pci_device_id":5,"file":"/img/a.pcow","size":1073741824,"discard_writes":true}"#),
            (remove_device, "p1", r#"{"id":"p1"}"#),
            (destination_url, "file:///tmp/snap", r#"{"destination_url":"file:///tmp/snap"}"#),
            (restore, "source_url=file:///tmp/snap", r#"{"source_url":"file:///tmp/snap","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[]}"#),
            (restore, "source_url=file:///tmp/snap,prefault=on,memory_restore_mode=ondemand,resume=true", r#"{"source_url":"file:///tmp/snap","prefault":true,"memory_restore_mode":"OnDemand","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":true,"zone_updates":[]}"#),
            (add_disk, "path=/img/d.raw", r#"{"pci_segment":0,"path":"/img/d.raw","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"disable_io_uring":false,"disable_aio":false,"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#),
            (add_disk, "path=/img/d.raw,readonly=on,direct=on,iommu=on,num_queues=2,queue_size=256,id=d0,pci_segment=0,serial=abc,image_type=raw", r#"{"id":"d0","iommu":true,"pci_segment":0,"path":"/img/d.raw","readonly":true,"direct":true,"num_queues":2,"queue_size":256,"vhost_user":false,"disable_io_uring":false,"disable_aio":false,"serial":"abc","backing_files":false,"sparse":true,"image_type":"Raw","lock_granularity":"ByteRange"}"#),
            (add_disk, "vhost_user=on,socket=/tmp/vu.sock", r#"{"pci_segment":0,"readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":true,"vhost_socket":"/tmp/vu.sock","disable_io_uring":false,"disable_aio":false,"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#),
            (add_net, "tap=tap0", r#"{"pci_segment":0,"tap":"tap0","num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}"#),
            (add_net, "tap=tap0,mac=12:34:56:78:9a:bc,ip=192.168.1.1,mask=255.255.255.0,num_queues=2,queue_size=256,id=n0", r#"{"id":"n0","pci_segment":0,"tap":"tap0","ip":"192.168.1.1","mask":"255.255.255.0","mac":"12:34:56:78:9a:bc","num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}"#),
            (add_fs, "tag=fs0,socket=/tmp/fs.sock", r#"{"pci_segment":0,"tag":"fs0","socket":"/tmp/fs.sock","num_queues":1,"queue_size":1024}"#),
            (add_fs, "tag=fs0,socket=/tmp/fs.sock,num_queues=1,queue_size=512,id=fs0,pci_segment=0", r#"{"id":"fs0","pci_segment":0,"tag":"fs0","socket":"/tmp/fs.sock","num_queues":1,"queue_size":512}"#),
            (add_vsock, "cid=3,socket=/tmp/vsock", r#"{"pci_segment":0,"cid":3,"socket":"/tmp/vsock"}"#),
            (add_vsock, "cid=3,socket=/tmp/vsock,iommu=on,id=v0,pci_segment=0", r#"{"id":"v0","iommu":true,"pci_segment":0,"cid":3,"socket":"/tmp/vsock"}"#),
            (add_device, "path=/sys/bus/pci/devices/0000:01:00.0/", r#"{"pci_segment":0,"path":"/sys/bus/pci/devices/0000:01:00.0/","x_exclude_mmap_bars":[]}"#),
            (add_device, "path=/sys/bus/pci/devices/0000:01:00.0/,iommu=on,id=vfio0,pci_segment=0", r#"{"id":"vfio0","iommu":true,"pci_segment":0,"path":"/sys/bus/pci/devices/0000:01:00.0/","x_exclude_mmap_bars":[]}"#),
            (add_vdpa, "path=/dev/vhost-vdpa-0", r#"{"pci_segment":0,"path":"/dev/vhost-vdpa-0","num_queues":1}"#),
            (add_vdpa, "path=/dev/vhost-vdpa-0,num_queues=2,iommu=on,id=vd0,pci_segment=0", r#"{"id":"vd0","iommu":true,"pci_segment":0,"path":"/dev/vhost-vdpa-0","num_queues":2}"#),
            (add_user_device, "socket=/tmp/ud.sock", r#"{"pci_segment":0,"socket":"/tmp/ud.sock"}"#),
            (add_user_device, "socket=/tmp/ud.sock,id=u0,pci_segment=0", r#"{"id":"u0","pci_segment":0,"socket":"/tmp/ud.sock"}"#),
            (add_generic_vhost_user, "device_type=fs,socket=/tmp/gv.sock,queue_sizes=[256,256]", r#"{"pci_segment":0,"socket":"/tmp/gv.sock","queue_sizes":[256,256],"device_type":26}"#),
            (send_migration, "destination_url=unix:/tmp/mig", r#"{"destination_url":"unix:/tmp/mig","local":false,"preserve_source":false,"downtime_ms":300,"timeout_s":3600,"timeout_strategy":"Cancel","connections":1,"tls_dir":null,"memory_mode":"Precopy"}"#),
            (send_migration, "destination_url=tcp:1.2.3.4:5555,local=off,downtime_ms=300,timeout_s=3600,timeout_strategy=ignore,connections=2", r#"{"destination_url":"tcp:1.2.3.4:5555","local":false,"preserve_source":false,"downtime_ms":300,"timeout_s":3600,"timeout_strategy":"Ignore","connections":2,"tls_dir":null,"memory_mode":"Precopy"}"#),
            (receive_migration, "receiver_url=unix:/tmp/mig", r#"{"receiver_url":"unix:/tmp/mig","tls_dir":null,"memory_mode":"Precopy","vfio_fds":null,"iommufd_fd":null,"zone_updates":[]}"#),
        ];
        for (f, arg, want) in cases {
            assert_eq!(f(arg).as_deref(), Ok(*want), "{arg}");
        }
        let more: &[(Builder, &str, &str)] = &[
            (add_disk, "path=/d,bw_size=100,bw_refill_time=10", r#"{"pci_segment":0,"path":"/d","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"rate_limiter_config":{"bandwidth":{"size":100,"one_time_burst":0,"refill_time":10},"ops":null},"disable_io_uring":false,"disable_aio":false,"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#),
            (add_disk, "path=/d,bw_size=100,bw_refill_time=10,ops_size=5,ops_one_time_burst=2,ops_refill_time=1,rate_limit_group=g", r#"{"pci_segment":0,"path":"/d","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"rate_limit_group":"g","rate_limiter_config":{"bandwidth":{"size":100,"one_time_burst":0,"refill_time":10},"ops":{"size":5,"one_time_burst":2,"refill_time":1}},"disable_io_uring":false,"disable_aio":false,"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#),
            (add_disk, "path=/d,queue_affinity=[0@[0,1],1@[2-3]]", r#"{"pci_segment":0,"path":"/d","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"disable_io_uring":false,"disable_aio":false,"queue_affinity":[{"queue_index":0,"host_cpus":[0,1]},{"queue_index":1,"host_cpus":[2,3]}],"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#),
            (add_disk, "path=/d,image_type=vmdk,lock_granularity=full,sparse=off,backing_files=on,_disable_io_uring=on", r#"{"pci_segment":0,"path":"/d","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"disable_io_uring":true,"disable_aio":false,"backing_files":true,"sparse":false,"image_type":"FlatVmdk","lock_granularity":"Full"}"#),
            (add_net, "mac=12:34:56:78:9A:BC,host_mac=02:00:00:00:00:01,mtu=1500,vhost_mode=server,ops_size=5,ops_refill_time=1", r#"{"pci_segment":0,"mac":"12:34:56:78:9a:bc","host_mac":"02:00:00:00:00:01","mtu":1500,"num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Server","rate_limiter_config":{"bandwidth":null,"ops":{"size":5,"one_time_burst":0,"refill_time":1}},"offload_tso":true,"offload_ufo":true,"offload_csum":true}"#),
            (add_net, "ip=fe80::1,mask=255.255.255.0", r#"{"pci_segment":0,"ip":"fe80::1","mask":"255.255.255.0","num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}"#),
            (add_device, "path=/p,x_exclude_mmap_bars=[0,2-3],x_nv_gpudirect_clique=1", r#"{"pci_segment":0,"path":"/p","x_nv_gpudirect_clique":1,"x_exclude_mmap_bars":[0,2,3]}"#),
            (restore, "source_url=file:///s,zone_updates=[z0@1,z1@0]", r#"{"source_url":"file:///s","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[{"id":"z0","host_numa_node":1},{"id":"z1","host_numa_node":0}]}"#),
            (add_generic_vhost_user, "virtio_id=40,socket=/s,queue_sizes=[1]", r#"{"pci_segment":0,"socket":"/s","queue_sizes":[1],"device_type":40}"#),
            (receive_migration, "receiver_url=tcp:0.0.0.0:6000,memory_mode=postcopy,zone_updates=[a@1]", r#"{"receiver_url":"tcp:0.0.0.0:6000","tls_dir":null,"memory_mode":"Postcopy","vfio_fds":null,"iommufd_fd":null,"zone_updates":[{"id":"a","host_numa_node":1}]}"#),
        ];
        for (f, arg, want) in more {
            assert_eq!(f(arg).as_deref(), Ok(*want), "{arg}");
        }
        let resizes = [
            (
                (Some("4"), None, None),
                r#"{"desired_vcpus":4,"desired_ram":null,"desired_balloon":null}"#,
            ),
            (
                (None, Some("1G"), None),
                r#"{"desired_vcpus":null,"desired_ram":1073741824,"desired_balloon":null}"#,
            ),
            (
                (None, None, Some("512M")),
                r#"{"desired_vcpus":null,"desired_ram":null,"desired_balloon":536870912}"#,
            ),
            (
                (Some("2"), Some("2G"), Some("0")),
                r#"{"desired_vcpus":2,"desired_ram":2147483648,"desired_balloon":0}"#,
            ),
            (
                (None, None, None),
                r#"{"desired_vcpus":null,"desired_ram":null,"desired_balloon":null}"#,
            ),
        ];
        for ((c, m, b), want) in resizes {
            assert_eq!(resize(c, m, b).as_deref(), Ok(want));
        }
        assert_eq!(
            resize_disk("d0", "10G").as_deref(),
            Ok(r#"{"id":"d0","desired_size":10737418240}"#)
        );
        assert_eq!(
            resize_zone("z0", "1G").as_deref(),
            Ok(r#"{"id":"z0","desired_ram":1073741824}"#)
        );
    }

    #[test]
    fn more_options() {
        assert_eq!(
            add_disk("path=/d,bw_size=100,bw_refill_time=10,ops_size=5,ops_one_time_burst=2,ops_refill_time=1,rate_limit_group=g").unwrap(),
            r#"{"pci_segment":0,"path":"/d","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"rate_limit_group":"g","rate_limiter_config":{"bandwidth":{"size":100,"one_time_burst":0,"refill_time":10},"ops":{"size":5,"one_time_burst":2,"refill_time":1}},"disable_io_uring":false,"disable_aio":false,"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#
        );
        // A bucket with a zero refill time is no bucket, as upstream.
        assert!(!add_disk("path=/d,bw_size=100")
            .unwrap()
            .contains("rate_limiter"));
        assert!(add_net(
            "mac=12:34:56:78:9A:BC,host_mac=02:00:00:00:00:01,mtu=1500,vhost_mode=server"
        )
        .unwrap()
        .contains(r#""mac":"12:34:56:78:9a:bc","host_mac":"02:00:00:00:00:01","mtu":1500"#));
        assert!(
            add_device("path=/p,x_exclude_mmap_bars=[0,2-3],x_nv_gpudirect_clique=1")
                .unwrap()
                .ends_with(r#""x_nv_gpudirect_clique":1,"x_exclude_mmap_bars":[0,2,3]}"#)
        );
        assert_eq!(
            add_generic_vhost_user("virtio_id=40,socket=/s,queue_sizes=[1]").unwrap(),
            r#"{"pci_segment":0,"socket":"/s","queue_sizes":[1],"device_type":40}"#
        );
        assert!(restore("source_url=file:///s,zone_updates=[z0@1,z1@0]")
            .unwrap()
            .ends_with(
                r#""zone_updates":[{"id":"z0","host_numa_node":1},{"id":"z1","host_numa_node":0}]}"#
            ));
        assert_eq!(
            pmem_snapshot("id=p0,tag=t1").unwrap(),
            r#"{"id":"p0","tag":"t1"}"#
        );
        assert_eq!(
            pmem_overlay("file=/o,id=p0").unwrap(),
            r#"{"id":"p0","file":"/o"}"#
        );
        assert_eq!(
            pmem_rollback("id=p0,snapshot=3,reset=on").unwrap(),
            r#"{"id":"p0","snapshot":"3","reset":true}"#
        );
        assert_eq!(
            pmem_rollback("id=p0,snapshot=t").unwrap(),
            r#"{"id":"p0","snapshot":"t","reset":false}"#
        );
        assert_eq!(
            pmem_snapshot_delete("id=p0,snapshot=t").unwrap(),
            r#"{"id":"p0","snapshot":"t"}"#
        );
        assert_eq!(pmem_flush("p0").unwrap(), r#"{"id":"p0"}"#);
        assert_eq!(pmem_flush("id=p0").unwrap(), r#"{"id":"p0"}"#);
    }

    #[test]
    fn refusals() {
        let cases: &[(Builder, &str, &str)] = &[
            (add_pmem, "size=1G", "`file` is required"),
            (add_pmem, "file=/a,size=0", "invalid value `0` for `size`: expected a size greater than 0"),
            (add_pmem, "file=/a,size=1T", "invalid value `1T` for `size`: expected a size in bytes, or with a K, M or G suffix (512M, 1G)"),
            (add_pmem, "file=/a,pci_device_id=256", "invalid value `256` for `pci_device_id`: expected an integer from 0 to 255"),
            (add_pmem, "file=/a,readonly=on", "unknown option `readonly` (accepted: file, size, discard_writes, id, iommu, pci_segment, pci_device_id)"),
            (add_fs, "tag=t,socket=/s,iommu=on", "unknown option `iommu` (accepted: tag, socket, num_queues, queue_size, id, pci_segment, pci_device_id)"),
            (add_fs, "socket=/s", "`tag` is required"),
            (add_fs, &format!("tag={},socket=/s", "t".repeat(37)), "expected at most 36 bytes"),
            (add_vsock, "socket=/s", "`cid` is required"),
            (add_vsock, "cid=-1,socket=/s", "invalid value `-1` for `cid`"),
            (add_net, "fd=[3,4]", "`fd` passes file descriptors, which this ch-remote does not send"),
            (add_net, "mac=12:34:56:78:9a", "invalid value `12:34:56:78:9a` for `mac`"),
            (add_net, "ip=1.2.3", "invalid value `1.2.3` for `ip`"),
            (add_device, "fd=3", "`fd` passes file descriptors"),
            (add_device, "path=/p,x_exclude_mmap_bars=[6]", "invalid value `[6]` for `x_exclude_mmap_bars`"),
            (add_disk, "path=/d,image_type=iso", "invalid value `iso` for `image_type`"),
            (
                add_disk,
                "path=/d,queue_affinity=[0@[1-99999]]",
                "invalid value `[0@[1-99999]]` for `queue_affinity`",
            ),
            (add_generic_vhost_user, "device_type=iommu,socket=/s,queue_sizes=[1]", "expected a device type other than iommu and watchdog"),
            (add_generic_vhost_user, "device_type=nope,socket=/s,queue_sizes=[1]", "invalid value `nope` for `device_type`"),
            (add_generic_vhost_user, "device_type=fs,socket=/s", "`queue_sizes` is required"),
            (restore, "prefault=on", "`source_url` is required"),
            (restore, "source_url=file:///s,net_fds=[n0@[3]]", "`net_fds` passes file descriptors"),
            (restore, "source_url=file:///s,memory_restore_mode=lazy", "invalid value `lazy` for `memory_restore_mode`: expected copy, ondemand or copyonwrite"),
            (send_migration, "unix:/tmp/mig", "unknown option `unix:/tmp/mig`"),
            (send_migration, "destination_url=ftp://x", "expected tcp:<host>:<port> or unix:<path>"),
            (send_migration, "destination_url=tcp:host", "expected tcp:<host>:<port>"),
            (send_migration, "destination_url=unix:/m,tls_dir=/t", "UNIX sockets and TLS encryption cannot be used at the same time"),
            (send_migration, "destination_url=unix:/m,connections=0", "invalid value `0` for `connections`: expected a non-zero integer"),
            (receive_migration, "receiver_url=unix:", "expected tcp:<host>:<port> or unix:<path>"),
            (receive_migration, "receiver_url=unix:/m,iommufd_fd=3", "`iommufd_fd` passes file descriptors"),
            (pmem_snapshot, "id=p0", "`tag` is required"),
            (pmem_snapshot, "p0", "unknown option `p0` (accepted: id, tag)"),
            (pmem_rollback, "id=p0,snapshot=t,reset=maybe", "invalid value `maybe` for `reset`"),
            (pmem_flush, "", "empty device id"),
            (pmem_flush, "p\n0", "`device id` contains a control character (byte 0x0a)"),
            (pmem_flush, "id=", "`id` needs a value"),
            (remove_device, "", "empty device id"),
            (remove_device, "a\x07", "contains a control character"),
            (destination_url, "", "empty destination url"),
        ];
        for (f, arg, want) in cases {
            let e = f(arg).unwrap_err().to_string();
            assert!(e.contains(want), "{arg:?}: {e}");
        }
        for (c, m, b, want) in [
            (Some("-1"), None, None, "invalid value `-1` for `--cpus`"),
            (Some("+1"), None, None, "invalid value `+1` for `--cpus`"),
            (
                Some("4294967296"),
                None,
                None,
                "invalid value `4294967296` for `--cpus`",
            ),
            (
                None,
                Some("1.5G"),
                None,
                "invalid value `1.5G` for `--memory`",
            ),
            (None, None, Some(""), "invalid value `` for `--balloon`"),
        ] {
            let e = resize(c, m, b).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert!(resize_disk("", "1G").is_err());
        assert!(resize_disk("d0", "x").is_err());
        assert!(resize_zone("z0", "99999999999G").is_err());
    }

    /// Hostile strings through every builder: an error or valid JSON,
    /// never a panic (a small deterministic fuzz: xorshift over pieces of
    /// option syntax, bytes that matter to the splitter, and big numbers).
    #[test]
    fn hostile_strings_never_panic() {
        let builders: [Builder; 18] = [
            add_pmem,
            add_disk,
            add_net,
            add_fs,
            add_vsock,
            add_device,
            add_vdpa,
            add_user_device,
            add_generic_vhost_user,
            restore,
            send_migration,
            receive_migration,
            remove_device,
            destination_url,
            pmem_snapshot,
            pmem_rollback,
            pmem_flush,
            pmem_overlay,
        ];
        let pieces = [
            "file",
            "size",
            "id",
            "path",
            "socket",
            "tag",
            "cid",
            "=",
            ",",
            "\"",
            "[",
            "]",
            "@",
            "-",
            "0",
            "1",
            "4M",
            "99999999999999999999",
            "18446744073709551615G",
            "on",
            "x",
            "queue_affinity",
            "@[",
            "queue_sizes",
            "x_exclude_mmap_bars",
            "zone_updates",
            "source_url",
            "device_type",
            "destination_url",
            "receiver_url",
            "tcp:",
            "unix:",
            ":",
            "\u{0}",
            "\n",
            "é",
            " ",
            "bw_size",
            "bw_refill_time",
            "snapshot",
            "reset",
            "0-18446744073709551615",
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = next() % 12;
            let input: String = (0..len)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect();
            for build in builders {
                if let Ok(body) = build(&input) {
                    assert!(
                        serde_json::from_str::<serde_json::Value>(&body).is_ok(),
                        "{input:?} -> {body}"
                    );
                }
            }
        }
    }

    /// Every id, tag, snapshot reference and path: at its limit, past it,
    /// and with a control character (C0, DEL, C1).
    #[test]
    fn strings_are_bounded_and_printable() {
        use crate::options::{max_len, MAX_STRING_LEN};
        let path = format!("/{}", "p".repeat(MAX_STRING_LEN - 1));
        let cases: &[(Builder, &str, &str)] = &[
            (pmem_snapshot, "id=p0,tag=X", "tag"),
            (pmem_snapshot, "id=X,tag=t", "id"),
            (pmem_overlay, "id=p0,file=X", "file"),
            (pmem_rollback, "id=p0,snapshot=X", "snapshot"),
            (pmem_snapshot_delete, "id=p0,snapshot=X", "snapshot"),
            (pmem_flush, "id=X", "id"),
            (pmem_flush, "X", "device id"),
            (remove_device, "X", "device id"),
            (add_pmem, "file=X", "file"),
            (add_pmem, "file=/f,id=X", "id"),
        ];
        for &(f, template, key) in cases {
            let at = &match max_len(key) {
                MAX_STRING_LEN => path.clone(),
                n => "i".repeat(n),
            };
            assert!(
                f(&template.replace('X', at)).is_ok(),
                "{template} at the limit"
            );
            let e = f(&template.replace('X', &format!("{at}x")))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{key}` is")), "{template}: {e}");
            assert!(e.contains("at most"), "{template}: {e}");
            for c in ['\n', '\u{7f}', '\u{85}'] {
                let e = f(&template.replace('X', &format!("a{c}b")))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("control character"), "{template} {c:?}: {e}");
            }
        }
    }
}
