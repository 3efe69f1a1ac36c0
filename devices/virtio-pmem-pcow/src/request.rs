//! Parsing one virtio-pmem request from a descriptor chain: pure, no I/O,
//! so it is testable without a VMM and is the fuzz target's entry.
//!
//! A request is `struct virtio_pmem_req { le32 type; }` in device-readable
//! buffers, followed by `struct virtio_pmem_resp { le32 ret; }` in a
//! device-writable buffer (virtio 1.2, section 5.19.6).

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

/// `VIRTIO_PMEM_REQ_TYPE_FLUSH`.
pub const REQ_TYPE_FLUSH: u32 = 0;
/// Response: success.
pub const RESP_OK: u32 = 0;
/// Response: failure (the Linux driver maps any non-zero value to EIO).
pub const RESP_EIO: u32 = 1;
/// Size of both the request and the response.
const WORD: u32 = 4;

/// What a well-formed chain asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestType {
    /// Make every write issued before this request durable.
    Flush,
    /// A type this device does not know: answered with [`RESP_EIO`].
    Unknown(u32),
}

/// A parsed request: what to do and where to put the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The request type.
    pub kind: RequestType,
    /// Guest address of the 4-byte response.
    pub response: GuestAddress,
}

/// Why a chain is not a request. Such a chain is returned to the driver
/// unanswered (used length 0): the device never writes into a buffer it
/// cannot trust to be the response.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("chain has no device-readable descriptor for the request")]
    NoRequest,
    #[error("request descriptor holds {len} bytes, needs 4")]
    RequestTooShort { len: u32 },
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    #[error("chain has no device-writable descriptor for the response")]
    NoResponse,
    #[error("response descriptor holds {len} bytes, needs 4")]
    ResponseTooShort { len: u32 },
    #[error("descriptor [{addr:#x}, +{len}) is outside guest memory")]
    OutOfRange { addr: u64, len: u32 },
}

/// Parses `chain`. The chain iterator of `virtio-queue` stops on loops and
/// on next indices beyond the queue, so a malicious chain ends; whatever
/// it yields is checked here.
pub fn parse<M>(chain: DescriptorChain<M>) -> Result<Request, RequestError>
where
    M: Deref + Clone,
    M::Target: GuestMemory + Sized,
{
    let mem = chain.memory();
    let mut request: Option<(GuestAddress, u32)> = None;
    let mut response: Option<(GuestAddress, u32)> = None;
    for desc in chain.clone() {
        let (addr, len) = (desc.addr(), desc.len());
        let access = if desc.is_write_only() {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if len > 0 && !mem.check_range(addr, len as usize, access) {
            return Err(RequestError::OutOfRange { addr: addr.0, len });
        }
        if desc.is_write_only() {
            response.get_or_insert((addr, len));
        } else if response.is_some() {
            return Err(RequestError::ReadableAfterWritable);
        } else {
            request.get_or_insert((addr, len));
        }
    }
    let (req_addr, req_len) = request.ok_or(RequestError::NoRequest)?;
    if req_len < WORD {
        return Err(RequestError::RequestTooShort { len: req_len });
    }
    let (resp_addr, resp_len) = response.ok_or(RequestError::NoResponse)?;
    if resp_len < WORD {
        return Err(RequestError::ResponseTooShort { len: resp_len });
    }
    let ty = mem
        .read_obj::<u32>(req_addr)
        .map(u32::from_le)
        .map_err(|_| RequestError::OutOfRange {
            addr: req_addr.0,
            len: req_len,
        })?;
    let kind = match ty {
        REQ_TYPE_FLUSH => RequestType::Flush,
        other => RequestType::Unknown(other),
    };
    Ok(Request {
        kind,
        response: resp_addr,
    })
}
