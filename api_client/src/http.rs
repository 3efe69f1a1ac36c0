//! The HTTP/1.1 subset the API speaks: one request out, one response in.
//!
//! Requests are written byte for byte as upstream's `ch-remote` writes
//! them: `Host: localhost`, `Accept: */*`, and `Content-Length` only when
//! there is a body (no `Content-Type`). Responses are read as upstream's
//! client reads them where it matters to a script: a body exists only when
//! the answer has a `Content-Length`, so `ch-remote` prints the body of a
//! 200, even an empty one, and nothing for a 204 (which never has a body). The status line may carry a reason phrase (`200 OK`) or not
//! (upstream's `200 `). Chunked transfer coding is refused.

use std::fmt;
use std::io::{self, Read};

/// Longest response head (status line and headers) accepted.
pub const MAX_HEAD_LEN: usize = 64 << 10;
/// Largest response body accepted.
pub const MAX_BODY_LEN: u64 = 16 << 20;

/// The two methods the API uses: GET for queries, PUT for actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// A query (`vmm.ping`, `vm.info`, `vm.counters`, `vm.pmem-info`).
    Get,
    /// An action.
    Put,
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Method::Get => "GET",
            Method::Put => "PUT",
        })
    }
}

/// The bytes of one request for `/api/v1/<endpoint>`.
///
/// ```
/// use api_client::{encode_request, Method};
/// let req = encode_request(Method::Put, "vm.boot", None);
/// assert_eq!(req, b"PUT /api/v1/vm.boot HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
/// let req = encode_request(Method::Put, "vm.remove-device", Some(br#"{"id":"p1"}"#));
/// assert_eq!(
///     req,
///     &b"PUT /api/v1/vm.remove-device HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
///        Content-Length: 11\r\n\r\n{\"id\":\"p1\"}"[..]
/// );
/// ```
pub fn encode_request(method: Method, endpoint: &str, body: Option<&[u8]>) -> Vec<u8> {
    let mut out =
        format!("{method} /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n")
            .into_bytes();
    if let Some(body) = body {
        out.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.unwrap_or_default());
    out
}

/// One response as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code (`200`, `204`, `409`, ...).
    pub status: u16,
    /// The reason phrase of the status line (may be empty).
    pub reason: String,
    /// The headers in order, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body: what the `Content-Length` framed (empty without one).
    pub body: Vec<u8>,
    /// The `Content-Length` the answer carried, if any: whether a 200 has
    /// a body at all, which is what upstream's client goes by.
    pub content_length: Option<u64>,
}

impl Response {
    /// The value of the first header called `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether upstream's client takes the status as success: 100, 200
    /// or 204 ([`crate::is_success`]).
    pub fn is_success(&self) -> bool {
        crate::is_success(self.status)
    }
}

/// Why a response could not be read.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum ResponseError {
    #[error("reading from the socket failed")]
    Io(#[source] io::Error),
    #[error("the server closed the connection without answering")]
    NoResponse,
    #[error("the connection closed inside the response headers ({got} bytes received)")]
    TruncatedHead { got: usize },
    #[error("the connection closed after {got} of {expected} body bytes")]
    TruncatedBody { expected: u64, got: u64 },
    #[error("the response headers exceed {limit} bytes")]
    HeadTooLong { limit: usize },
    #[error("the response body exceeds {limit} bytes")]
    BodyTooLong { limit: u64 },
    #[error("bad status line `{line}`")]
    BadStatusLine { line: String },
    #[error("bad header line `{line}`")]
    BadHeader { line: String },
    #[error("bad Content-Length `{value}`")]
    BadContentLength { value: String },
    #[error("Transfer-Encoding `{value}` is not supported")]
    UnsupportedTransferEncoding { value: String },
}

/// Reads exactly one response from `r`.
///
/// ```
/// let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
/// let resp = api_client::read_response(&mut &raw[..]).unwrap();
/// assert_eq!((resp.status, resp.body.as_slice()), (200, &b"{}"[..]));
/// ```
pub fn read_response<R: Read>(r: &mut R) -> Result<Response, ResponseError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    // Read until the empty line that ends the head.
    let head_end = loop {
        if let Some(end) = find_head_end(&buf) {
            break end;
        }
        if buf.len() > MAX_HEAD_LEN {
            return Err(ResponseError::HeadTooLong {
                limit: MAX_HEAD_LEN,
            });
        }
        let n = read_some(r, &mut chunk)?;
        if n == 0 {
            return Err(if buf.is_empty() {
                ResponseError::NoResponse
            } else {
                ResponseError::TruncatedHead { got: buf.len() }
            });
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let (head_len, body_start) = head_end;
    if head_len > MAX_HEAD_LEN {
        return Err(ResponseError::HeadTooLong {
            limit: MAX_HEAD_LEN,
        });
    }
    let head = String::from_utf8_lossy(&buf[..head_len]).into_owned();
    let mut lines = head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let (status, reason) = parse_status_line(lines.next().unwrap_or_default())?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .filter(|(n, _)| !n.is_empty() && !n.contains(char::is_whitespace))
            .ok_or_else(|| ResponseError::BadHeader {
                line: line.to_owned(),
            })?;
        headers.push((name.to_owned(), value.trim().to_owned()));
    }
    let mut resp = Response {
        status,
        reason,
        headers,
        body: Vec::new(),
        content_length: None,
    };
    let length = content_length(&resp.headers)?;
    if matches!(status, 100..=199 | 204 | 304) {
        // No body, whatever the headers say.
        resp.content_length = length;
        return Ok(resp);
    }
    if let Some(te) = resp.header("Transfer-Encoding") {
        if !te.eq_ignore_ascii_case("identity") {
            return Err(ResponseError::UnsupportedTransferEncoding {
                value: te.to_owned(),
            });
        }
    }
    let mut body = buf.split_off(body_start);
    match length {
        Some(len) => {
            if len > MAX_BODY_LEN {
                return Err(ResponseError::BodyTooLong {
                    limit: MAX_BODY_LEN,
                });
            }
            while (body.len() as u64) < len {
                let n = read_some(r, &mut chunk)?;
                if n == 0 {
                    return Err(ResponseError::TruncatedBody {
                        expected: len,
                        got: body.len() as u64,
                    });
                }
                body.extend_from_slice(&chunk[..n]);
            }
            // Anything after the announced length is not ours.
            body.truncate(len as usize);
        }
        // No length: no body, as upstream's client reads it (it stops at
        // the end of the head).
        None => body.clear(),
    }
    resp.content_length = length;
    resp.body = body;
    Ok(resp)
}

/// One `read`, retried on `Interrupted`.
fn read_some<R: Read>(r: &mut R, chunk: &mut [u8]) -> Result<usize, ResponseError> {
    loop {
        match r.read(chunk) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other.map_err(ResponseError::Io),
        }
    }
}

/// The length of the head (without the empty line) and where the body
/// starts, once the empty line is in `buf`. Bare `\n` line ends are
/// accepted as well as `\r\n`.
fn find_head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = buf.iter().position(|&b| b == b'\n')?;
    loop {
        let rest = &buf[i + 1..];
        if rest.starts_with(b"\r\n") {
            return Some((trim_cr(buf, i), i + 3));
        }
        if rest.starts_with(b"\n") {
            return Some((trim_cr(buf, i), i + 2));
        }
        i += 1 + rest.iter().position(|&b| b == b'\n')?;
    }
}

/// `i` is the index of a `\n`; the line content ends before it (and before
/// a `\r` in front of it).
fn trim_cr(buf: &[u8], i: usize) -> usize {
    if i > 0 && buf[i - 1] == b'\r' {
        i - 1
    } else {
        i
    }
}

fn parse_status_line(line: &str) -> Result<(u16, String), ResponseError> {
    let bad = || ResponseError::BadStatusLine {
        line: line.to_owned(),
    };
    let (version, rest) = line.split_once(' ').ok_or_else(bad)?;
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(bad());
    }
    let (code, reason) = rest.split_once(' ').unwrap_or((rest, ""));
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let status: u16 = code.parse().map_err(|_| bad())?;
    if !(100..=599).contains(&status) {
        return Err(bad());
    }
    Ok((status, reason.trim().to_owned()))
}

/// The `Content-Length`, if any; several headers must agree.
fn content_length(headers: &[(String, String)]) -> Result<Option<u64>, ResponseError> {
    let mut found: Option<u64> = None;
    for (_, value) in headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("Content-Length"))
    {
        let bad = || ResponseError::BadContentLength {
            value: value.clone(),
        };
        if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let len: u64 = value.parse().map_err(|_| bad())?;
        if found.is_some_and(|f| f != len) {
            return Err(bad());
        }
        found = Some(len);
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out at most `step` bytes per call, to exercise
    /// responses split across reads.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = self.step.min(out.len()).min(self.data.len());
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn parse(raw: &[u8]) -> Result<Response, ResponseError> {
        read_response(&mut &raw[..])
    }

    fn parse_trickle(raw: &[u8], step: usize) -> Result<Response, ResponseError> {
        read_response(&mut Trickle { data: raw, step })
    }

    #[test]
    fn requests_are_upstreams_bytes() {
        // Captured from upstream's ch-remote v54 (docs/api.md).
        assert_eq!(
            encode_request(Method::Get, "vmm.ping", None),
            b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
        );
        assert_eq!(
            encode_request(Method::Put, "vm.shutdown", None),
            b"PUT /api/v1/vm.shutdown HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
        );
        let body =
            br#"{"id":"p1","pci_segment":0,"file":"F","size":4194304,"discard_writes":false}"#;
        let mut expected = b"PUT /api/v1/vm.add-pmem HTTP/1.1\r\nHost: localhost\r\n\
              Accept: */*\r\nContent-Length: 76\r\n\r\n"
            .to_vec();
        expected.extend_from_slice(body);
        assert_eq!(
            encode_request(Method::Put, "vm.add-pmem", Some(body)),
            expected
        );
    }

    #[test]
    fn ok_with_body() {
        let raw = b"HTTP/1.1 200 OK\r\n\
                    Server: Cloud Hypervisor API\r\n\
                    Content-Type: application/json\r\n\
                    Content-Length: 17\r\n\
                    \r\n\
                    {\"version\":\"v1\"}\n";
        for step in [1, 3, 7, 4096] {
            let r = parse_trickle(raw, step).unwrap();
            assert_eq!(r.status, 200);
            assert_eq!(r.reason, "OK");
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.header("Server"), Some("Cloud Hypervisor API"));
            assert_eq!(r.body, b"{\"version\":\"v1\"}\n");
            assert!(r.is_success());
        }
    }

    #[test]
    fn no_content_has_no_body() {
        let r = parse(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap();
        assert_eq!((r.status, r.reason.as_str()), (204, "No Content"));
        assert!(r.body.is_empty());
        assert_eq!(r.content_length, None);
        // Upstream's status line: no reason phrase, a space before the end.
        let r = parse(b"HTTP/1.1 204 \r\n\r\n").unwrap();
        assert_eq!(
            (r.status, r.reason.as_str(), r.content_length),
            (204, "", None)
        );
        // A 204 never has a body, whatever the headers say.
        let r = parse(b"HTTP/1.1 204\r\nContent-Length: 5\r\n\r\n").unwrap();
        assert_eq!((r.status, r.reason.as_str()), (204, ""));
        assert!(r.body.is_empty());
        assert_eq!(r.content_length, Some(5));
    }

    #[test]
    fn upstream_status_lines() {
        let r = parse(
            b"HTTP/1.1 200 \r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        )
        .unwrap();
        assert_eq!(
            (r.status, r.reason.as_str(), r.body.as_slice()),
            (200, "", &b"{}"[..])
        );
        assert_eq!(r.content_length, Some(2));
        let r = parse(b"HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n").unwrap();
        assert_eq!((r.status, r.content_length), (200, Some(0)));
        let r = parse(b"HTTP/1.1 500 \r\nContent-Length: 18\r\n\r\n[\"Error from API\"]").unwrap();
        assert_eq!(
            (r.status, r.body.as_slice()),
            (500, &br#"["Error from API"]"#[..])
        );
    }

    #[test]
    fn error_statuses_keep_their_body() {
        let body = br#"["Error booting the VM","VM is already running"]"#;
        for (code, reason) in [
            (400, "Bad Request"),
            (404, "Not Found"),
            (405, "Method Not Allowed"),
            (409, "Conflict"),
            (413, "Payload Too Large"),
            (500, "Internal Server Error"),
        ] {
            let mut raw = format!(
                "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            raw.extend_from_slice(body);
            let r = parse_trickle(&raw, 5).unwrap();
            assert_eq!(r.status, code);
            assert_eq!(r.reason, reason);
            assert_eq!(r.body, body);
            assert!(!r.is_success());
        }
    }

    #[test]
    fn no_length_means_no_body() {
        // As upstream's client: without Content-Length the head is all.
        let r = parse_trickle(b"HTTP/1.0 200 OK\r\n\r\n[1,2,3]", 2).unwrap();
        assert!(r.body.is_empty());
        assert_eq!(r.content_length, None);
    }

    #[test]
    fn bare_newlines_are_accepted() {
        let r = parse(b"HTTP/1.1 200 OK\nContent-Length: 2\n\n{}").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
    }

    #[test]
    fn bytes_after_the_body_are_ignored() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}garbage").unwrap();
        assert_eq!(r.body, b"{}");
    }

    #[test]
    fn truncated_responses_are_errors() {
        assert!(matches!(parse(b""), Err(ResponseError::NoResponse)));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Len"),
            Err(ResponseError::TruncatedHead { got: 28 })
        ));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"a\":"),
            Err(ResponseError::TruncatedBody {
                expected: 10,
                got: 5
            })
        ));
        assert!(matches!(
            parse_trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", 1),
            Err(ResponseError::TruncatedBody {
                expected: 10,
                got: 0
            })
        ));
    }

    #[test]
    fn malformed_responses_are_errors() {
        for raw in [
            &b"HTTP/2 200 OK\r\n\r\n"[..],
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 099 Low\r\n\r\n",
            b"garbage\r\n\r\n",
            b"HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                matches!(parse(raw), Err(ResponseError::BadStatusLine { .. })),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"),
            Err(ResponseError::BadHeader { .. })
        ));
        for cl in ["-1", "abc", "", "1 2", "99999999999999999999999"] {
            let raw = format!("HTTP/1.1 200 OK\r\nContent-Length: {cl}\r\n\r\n");
            assert!(
                matches!(
                    parse(raw.as_bytes()),
                    Err(ResponseError::BadContentLength { .. })
                ),
                "{cl}"
            );
        }
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"),
            Err(ResponseError::BadContentLength { .. })
        ));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"),
            Err(ResponseError::UnsupportedTransferEncoding { .. })
        ));
    }

    #[test]
    fn limits() {
        let raw = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_LEN + 1
        );
        assert!(matches!(
            parse(raw.as_bytes()),
            Err(ResponseError::BodyTooLong { .. })
        ));
        let mut raw = b"HTTP/1.1 200 OK\r\nX-Long: ".to_vec();
        raw.resize(MAX_HEAD_LEN + 10, b'a');
        raw.extend_from_slice(b"\r\n\r\n");
        assert!(matches!(
            parse(&raw),
            Err(ResponseError::HeadTooLong { .. })
        ));
    }

    #[test]
    fn io_errors_are_kept() {
        struct Broken;
        impl Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::from(io::ErrorKind::ConnectionReset))
            }
        }
        match read_response(&mut Broken) {
            Err(ResponseError::Io(e)) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
            other => panic!("{other:?}"),
        }
    }
}
