//! A small synchronous client for the `cloud-hypervisor` REST API, and the
//! `ch-remote` command built on it.
//!
//! The API is HTTP/1.1 on a Unix socket (`--api-socket path=PATH`), one
//! request per connection, paths `/api/v1/<vm|vmm>.<action>`: GET for
//! queries, PUT for actions. A 2xx answer carries a JSON body (200) or none
//! (204); an error answer is a 4xx or 5xx status whose body is the error
//! chain as a JSON array of strings, outermost first. `docs/api.md` and
//! `docs/openapi.yaml` describe every endpoint.
//!
//! How a request goes:
//! 1. [`Client::call`] checks the endpoint name and connects to the socket.
//! 2. [`encode_request`] writes the request as upstream's `ch-remote` does:
//!    `Host: localhost`, `Accept: */*`, `Content-Type: application/json`
//!    with a body, `Content-Length` always.
//! 3. [`read_response`] reads the status line, the headers and a body
//!    framed by `Content-Length` (or running to the end of the connection),
//!    all before one deadline ([`DEFAULT_TIMEOUT`] unless set otherwise).
//! 4. A 2xx status gives the body; any other gives [`Error::Server`] with
//!    the server's chain, which [`Error::chain`] returns line by line.
//!
//! ```no_run
//! use api_client::{body, Client};
//! let client = Client::new("/tmp/ch.sock");
//! let snap = client.put_json("vm.pmem-snapshot", &body::PmemSnapshot { id: "pmem0", tag: "t1" })?;
//! println!("{}", snap.unwrap_or_default());
//! # Ok::<(), api_client::Error>(())
//! ```
//!
//! The crate has no dependency on the VMM: `add-pmem`'s option string is
//! parsed here ([`PmemConfig`]) into the JSON the server takes.
#![warn(missing_docs)]

pub mod body;
mod client;
mod http;
mod pmem;

pub use client::{Client, Error, DEFAULT_TIMEOUT};
pub use http::{
    encode_request, read_response, Method, Response, ResponseError, MAX_BODY_LEN, MAX_HEAD_LEN,
};
pub use pmem::{PmemConfig, PmemOptionError, PMEM_SYNTAX};
