//! The HTTP API: Cloud Hypervisor's control plane on a Unix socket, plus
//! the pcow pmem actions.
//!
//! How a request travels (the VMM thread never waits for a client):
//!
//! 1. The HTTP thread ([`http`]) accepts a connection and hands it to a
//!    connection thread, which reads one request at a time with a timeout
//!    and a size limit (a slow or vanished client only ties up its own
//!    thread).
//! 2. The connection thread parses and routes it ([`routes`]): the method
//!    and path pick an action, the JSON body is deserialized into that
//!    action's struct (unknown fields ignored, as upstream; our own pcow
//!    actions are `deny_unknown_fields`). A bad request is answered right
//!    there (400 `["Bad Request"]`, 404 `["Not Found"]`, 400 `["Failed to
//!    deserialize JSON", why]`, as upstream) without bothering the VMM.
//! 3. A good request becomes an [`ApiRequest`] sent over a channel with a
//!    reply channel, and the API eventfd is written.
//! 4. The VMM thread's epoll loop wakes on that eventfd and runs every
//!    queued request through its [`RequestHandler`] (the VMM's state
//!    machine in [`crate::vmm`]), in order. A failed action is a
//!    [`VmmError`]; [`errors`] alone picks its status and chain. Each
//!    result is sent back.
//! 5. The connection thread writes the response in micro_http's bytes
//!    (upstream's server): 200 with a JSON body, 204 without, or the error
//!    status with the chain `["Error from API", what failed, why...]`.

pub mod errors;
pub mod http;
pub mod routes;

use std::sync::mpsc;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use vmm_sys_util::eventfd::EventFd;

use crate::config::{PmemConfig, VmConfig};
use crate::vmm_error::VmmError;

/// `PUT vm.remove-device` (upstream's `VmRemoveDeviceData`), and the
/// device of `vm.pmem-flush`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceId {
    /// The device id.
    pub id: String,
}

/// `PUT vm.pmem-snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemSnapshot {
    /// The pmem device id.
    pub id: String,
    /// The new snapshot's tag.
    pub tag: String,
}

/// `PUT vm.pmem-overlay`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemOverlay {
    /// The pmem device id.
    pub id: String,
    /// The new overlay file (must not exist).
    pub file: String,
}

/// `PUT vm.pmem-rollback`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemRollback {
    /// The pmem device id.
    pub id: String,
    /// The snapshot, by tag or numeric id.
    pub snapshot: String,
    /// On a running or paused VM: restart the guest on the rolled-back
    /// image (required there).
    #[serde(default)]
    pub reset: bool,
}

/// `PUT vm.pmem-snapshot-delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PmemSnapshotDelete {
    /// The pmem device id.
    pub id: String,
    /// The snapshot, by tag or numeric id.
    pub snapshot: String,
}

/// `PUT vm.resize`: upstream's `VmResizeData`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmResize {
    /// vCPUs wanted.
    #[serde(default)]
    pub desired_vcpus: Option<u32>,
    /// Guest RAM wanted, in bytes.
    #[serde(default)]
    pub desired_ram: Option<u64>,
    /// Balloon size wanted, in bytes.
    #[serde(default)]
    pub desired_balloon: Option<u64>,
}

/// `PUT vm.snapshot`'s body (upstream's `VmSnapshotConfig`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VmSnapshotConfig {
    /// Where to write the snapshot: `file:///DIR`.
    pub destination_url: String,
}

/// An upstream endpoint of a device or feature this VMM does not have:
/// its body was valid JSON, and the VMM answers with a clear refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsupported {
    /// The action, `vm.add-disk` for one.
    pub action: &'static str,
    /// What is missing, for the message: "virtio-block devices".
    pub missing: &'static str,
}

/// An action the VMM carries out, one per endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiRequest {
    /// `GET vmm.ping`.
    VmmPing,
    /// `PUT vmm.shutdown`.
    VmmShutdown,
    /// `PUT vm.create`.
    VmCreate(Box<VmConfig>),
    /// `PUT vm.boot`.
    VmBoot,
    /// `GET vm.info`.
    VmInfo,
    /// `PUT vm.pause`.
    VmPause,
    /// `PUT vm.resume`.
    VmResume,
    /// `PUT vm.shutdown`.
    VmShutdown,
    /// `PUT vm.reboot`.
    VmReboot,
    /// `PUT vm.delete`.
    VmDelete,
    /// `PUT vm.add-pmem`.
    VmAddPmem(Box<PmemConfig>),
    /// `PUT vm.remove-device`.
    VmRemoveDevice(DeviceId),
    /// `GET vm.counters`.
    VmCounters,
    /// `PUT vm.power-button`.
    VmPowerButton,
    /// `PUT vm.nmi`.
    VmNmi,
    /// `PUT vm.resize`.
    VmResize(VmResize),
    /// `PUT vm.snapshot`: the `destination_url`.
    VmSnapshot(VmSnapshotConfig),
    /// `PUT vm.restore`: the body, checked by the handler
    /// ([`crate::snapshot::restore::RestoreRequest::from_value`]).
    VmRestore(Box<serde_json::Value>),
    /// An upstream endpoint of something this VMM does not have.
    Unsupported(Unsupported),
    /// `PUT vm.pmem-snapshot`.
    PmemSnapshot(PmemSnapshot),
    /// `PUT vm.pmem-overlay`.
    PmemOverlay(PmemOverlay),
    /// `PUT vm.pmem-rollback`.
    PmemRollback(PmemRollback),
    /// `PUT vm.pmem-snapshot-delete`.
    PmemSnapshotDelete(PmemSnapshotDelete),
    /// `PUT vm.pmem-flush`.
    PmemFlush(DeviceId),
    /// `GET vm.pmem-info`.
    PmemInfo,
}

impl ApiRequest {
    /// What failed, as the second element of an error body: upstream's
    /// words for its actions.
    pub fn failure(&self) -> &'static str {
        match self {
            ApiRequest::VmmPing => "The VMM could not be pinged",
            ApiRequest::VmmShutdown => "The VMM could not shutdown",
            ApiRequest::VmCreate(_) => "The VM could not be created",
            ApiRequest::VmBoot => "The VM could not boot",
            ApiRequest::VmInfo | ApiRequest::VmCounters => "The VM info is not available",
            ApiRequest::VmPause => "The VM could not be paused",
            ApiRequest::VmResume => "The VM could not resume",
            ApiRequest::VmShutdown => "The VM could not shutdown",
            ApiRequest::VmReboot => "The VM could not reboot",
            ApiRequest::VmDelete => "The VM could not be deleted",
            ApiRequest::VmAddPmem(_) => "The pmem device could not be added to the VM",
            ApiRequest::VmRemoveDevice(_) => "The device could not be removed from the VM",
            ApiRequest::VmPowerButton => "Error triggering power button",
            ApiRequest::VmNmi => "Error triggering NMI",
            ApiRequest::VmResize(_) => "The VM could not be resized",
            ApiRequest::VmSnapshot(_) => "The VM could not be snapshotted",
            ApiRequest::VmRestore(_) => "The VM could not be restored",
            ApiRequest::Unsupported(u) => unsupported_failure(u.action),
            ApiRequest::PmemSnapshot(_) => "The pmem snapshot could not be taken",
            ApiRequest::PmemOverlay(_) => "The pmem overlay could not be created",
            ApiRequest::PmemRollback(_) => "The pmem device could not be rolled back",
            ApiRequest::PmemSnapshotDelete(_) => "The pmem snapshot could not be deleted",
            ApiRequest::PmemFlush(_) => "The pmem device could not be flushed",
            ApiRequest::PmemInfo => "The pmem info is not available",
        }
    }
}

/// Upstream's words for a failed action of an endpoint we refuse.
fn unsupported_failure(action: &str) -> &'static str {
    match action {
        "vm.add-disk" => "The disk could not be added to the VM",
        "vm.add-fs" => "The fs could not be added to the VM",
        "vm.add-net" => "The network device could not be added to the VM",
        "vm.add-vsock" => "The vsock device could not be added to the VM",
        "vm.add-vdpa" => "The vDPA device could not be added to the VM",
        "vm.add-device" => "The device could not be added to the VM",
        "vm.add-user-device" => "The user device could not be added to the VM",
        "vm.add-generic-vhost-user" => "The generic vhost-user device could not be added to the VM",
        "vm.resize-zone" => "The memory zone could not be resized",
        "vm.resize-disk" => "The disk could not be resized",
        "vm.snapshot" => "The VM could not be snapshotted",
        "vm.restore" => "The VM could not be restored",
        "vm.coredump" => "The VM could not be coredumped",
        "vm.send-migration" => "Error dispatching the migration worker",
        "vm.receive-migration" => "Error receiving migration",
        _ => "The request could not be carried out",
    }
}

/// The first element of the body of every failed action, as upstream.
pub const API_ERROR: &str = "Error from API";

/// A failed request: the HTTP status and the error chain, outermost first.
/// The VMM's handlers fail with a [`VmmError`], which [`errors`] turns into
/// this; [`ApiReceiver::serve`] puts [`API_ERROR`] and the action's
/// [`ApiRequest::failure`] in front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// 400, 404, 409, 413, 500 or 503.
    pub status: u16,
    /// The error chain, outermost first.
    pub chain: Vec<String>,
}

impl ApiError {
    /// An error with one message.
    pub fn new(status: u16, msg: impl Into<String>) -> ApiError {
        ApiError {
            status,
            chain: vec![msg.into()],
        }
    }

    /// `what`, caused by `err` and its sources.
    pub fn with_source(
        status: u16,
        what: impl Into<String>,
        err: &(dyn std::error::Error + 'static),
    ) -> ApiError {
        let mut chain = vec![what.into()];
        chain.extend(error_report::messages(err));
        ApiError { status, chain }
    }
}

/// What an action answers on the wire: a JSON body (200), nothing (204),
/// or an error.
pub type ApiResult = Result<Option<Value>, ApiError>;

/// What the VMM's handler returns for an action.
pub type HandlerResult = Result<Option<Value>, VmmError>;

/// The VMM side of the API.
pub trait RequestHandler {
    /// Carries out one action.
    fn handle(&mut self, request: ApiRequest) -> HandlerResult;
}

/// A request with the channel its answer goes back on.
pub type ApiMessage = (ApiRequest, mpsc::Sender<ApiResult>);

/// The VMM thread's end of the API: the eventfd its epoll loop watches and
/// the queue of requests.
pub struct ApiReceiver {
    /// Written once per queued request.
    pub evt: Arc<EventFd>,
    rx: mpsc::Receiver<ApiMessage>,
}

impl ApiReceiver {
    /// Runs every queued request through `handler`, answering each. Returns
    /// how many were handled.
    pub fn serve(&self, handler: &mut dyn RequestHandler) -> usize {
        let _ = self.evt.read();
        let mut n = 0;
        while let Ok((req, reply)) = self.rx.try_recv() {
            let failure = req.failure();
            let r = handler.handle(req).map_err(|e| {
                let mut e = errors::api_error(&e);
                e.chain
                    .splice(0..0, [API_ERROR.to_owned(), failure.to_owned()]);
                e
            });
            // A client that went away does not care about its answer.
            let _ = reply.send(r);
            n += 1;
        }
        n
    }
}

/// The HTTP side's end: sends requests to the VMM thread and waits for
/// the answers.
#[derive(Clone)]
pub struct ApiSender {
    evt: Arc<EventFd>,
    tx: mpsc::Sender<ApiMessage>,
}

impl ApiSender {
    /// Sends `req` and waits for the VMM's answer. A VMM that is gone
    /// answers 500.
    pub fn call(&self, req: ApiRequest) -> ApiResult {
        let (reply_tx, reply_rx) = mpsc::channel();
        if self.tx.send((req, reply_tx)).is_err() {
            return Err(ApiError::new(500, "the VMM is shutting down"));
        }
        if let Err(e) = self.evt.write(1) {
            return Err(ApiError::new(500, format!("waking the VMM: {e}")));
        }
        reply_rx
            .recv()
            .unwrap_or_else(|_| Err(ApiError::new(500, "the VMM is shutting down")))
    }
}

/// A connected pair.
pub fn channel() -> std::io::Result<(ApiSender, ApiReceiver)> {
    let evt = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
    let (tx, rx) = mpsc::channel();
    Ok((
        ApiSender {
            evt: evt.clone(),
            tx,
        },
        ApiReceiver { evt, rx },
    ))
}
