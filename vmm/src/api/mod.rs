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
//!    action's struct (`deny_unknown_fields`). A bad request is answered
//!    right there (4xx) without bothering the VMM.
//! 3. A good request becomes an [`ApiRequest`] sent over a channel with a
//!    reply channel, and the API eventfd is written.
//! 4. The VMM thread's epoll loop wakes on that eventfd and runs every
//!    queued request through its [`RequestHandler`] (the VMM's state
//!    machine in [`crate::vmm`]), in order, sending each result back.
//! 5. The connection thread writes the response: 200 with a JSON body, 204
//!    without, or the error status with the error chain as a JSON array of
//!    strings.

pub mod http;
pub mod routes;

use std::sync::mpsc;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use vmm_sys_util::eventfd::EventFd;

use crate::config::{PmemConfig, VmConfig};

/// `PUT vm.remove-device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// `PUT vm.power-button`.
    VmPowerButton,
    /// `PUT vm.nmi`.
    VmNmi,
}

/// A failed action: the HTTP status and the error chain, outermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// 400, 404, 405, 409, 413 or 500.
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
        let mut e: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(x) = e {
            chain.push(x.to_string());
            e = x.source();
        }
        ApiError { status, chain }
    }
}

/// What a successful action answers: a JSON body (200) or nothing (204).
pub type ApiResult = Result<Option<Value>, ApiError>;

/// The VMM side of the API.
pub trait RequestHandler {
    /// Carries out one action.
    fn handle(&mut self, request: ApiRequest) -> ApiResult;
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
            let r = handler.handle(req);
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
