//! A small synchronous client for the `cloud-hypervisor` REST API, and the
//! `ch-remote` command built on it, which takes upstream Cloud Hypervisor's
//! `ch-remote` arguments and sends the same bytes.
//!
//! The API is HTTP/1.1 on a Unix socket (`--api-socket path=PATH`), one
//! request per connection, paths `/api/v1/<vm|vmm>.<action>`: GET for
//! queries, PUT for actions. A 200 answer carries a JSON body, a 204 none;
//! an error answer's body is the error chain as a JSON array of strings,
//! outermost first (upstream's starts with `"Error from API"`).
//! `docs/api.md` and `docs/openapi.yaml` describe every endpoint.
//!
//! How a request goes:
//! 1. [`commands`] turns a command's arguments into its JSON body, as
//!    upstream's `ch-remote` would (same keys, defaults and field order).
//! 2. [`Client::call`] checks the endpoint name and connects to the socket.
//! 3. [`encode_request`] writes upstream's request bytes.
//! 4. [`read_response`] reads the status line (with or without a reason
//!    phrase), the headers and a body framed by `Content-Length`, all
//!    before one deadline ([`DEFAULT_TIMEOUT`] unless set otherwise).
//! 5. A 100, 200 or 204 status gives the body; any other gives
//!    [`Error::Server`], whose [`Error::chain`] is the lines upstream's
//!    `ch-remote` prints.
//!
//! ```no_run
//! use api_client::{commands, Client, Method};
//! let client = Client::new("/tmp/ch.sock");
//! let body = commands::pmem_snapshot("id=pmem0,tag=t1")?;
//! let snap = client.call(Method::Put, "vm.pmem-snapshot", Some(body.as_bytes()))?;
//! println!("{}", snap.unwrap_or_default());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

mod client;
pub mod commands;
mod http;
pub mod json;
mod options;

pub use client::{is_success, status_name, Client, Error, DEFAULT_TIMEOUT};
pub use commands::PMEM_SYNTAX;
pub use http::{
    encode_request, read_response, Method, Response, ResponseError, MAX_BODY_LEN, MAX_HEAD_LEN,
};
pub use options::{OptionError, Options};
