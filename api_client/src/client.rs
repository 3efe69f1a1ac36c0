//! [`Client`]: one connection per request on the API's Unix socket.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::http::{encode_request, read_response, Method, Response, ResponseError};

/// How long a request may take, connect to last body byte, unless the
/// caller says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a request failed.
///
/// [`Error::Server`] is the server's own answer (any status but 100, 200
/// and 204) and keeps its body, the error chain; every other variant is a
/// local or transport failure and names the socket.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid endpoint `{endpoint}` (expected `vm.<action>` or `vmm.<action>`)")]
    InvalidEndpoint { endpoint: String },
    #[error("cannot encode the request body")]
    Encode(#[source] serde_json::Error),
    #[error("cannot connect to the API socket {}", socket.display())]
    Connect {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot send the request to the API socket {}", socket.display())]
    Send {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no complete response from the API socket {} within {timeout:?}", socket.display())]
    Timeout { socket: PathBuf, timeout: Duration },
    #[error("bad response from the API socket {}", socket.display())]
    Response {
        socket: PathBuf,
        #[source]
        source: ResponseError,
    },
    #[error("the response body is not UTF-8")]
    NotUtf8,
    #[error("Server responded with {}", status_name(*status))]
    Server {
        method: Method,
        endpoint: String,
        status: u16,
        /// The body as sent (`None` without a `Content-Length`): upstream's
        /// error chain, a JSON array of strings, outermost first.
        body: Option<String>,
    },
}

/// The name upstream's client gives a status code (its `StatusCode`
/// variants): the codes it knows, `Unknown` for the rest.
pub fn status_name(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "Ok",
        204 => "NoContent",
        400 => "BadRequest",
        404 => "NotFound",
        429 => "TooManyRequests",
        500 => "InternalServerError",
        501 => "NotImplemented",
        _ => "Unknown",
    }
}

/// Whether upstream's client takes the status as success: 100, 200, 204.
pub fn is_success(status: u16) -> bool {
    matches!(status, 100 | 200 | 204)
}

impl Error {
    /// The lines to show a user, outermost first, as upstream's `ch-remote`
    /// shows them: for [`Error::Server`], `Server responded with <status>`
    /// then the server's chain (or, when the body is not a JSON array of
    /// strings, upstream's one `X:` line saying so); otherwise this error
    /// and its sources.
    ///
    /// ```
    /// let e = api_client::Error::Server {
    ///     method: api_client::Method::Put,
    ///     endpoint: "vm.boot".into(),
    ///     status: 500,
    ///     body: Some(r#"["Error from API","The VM could not boot"]"#.into()),
    /// };
    /// assert_eq!(
    ///     e.chain(),
    ///     ["Server responded with InternalServerError", "Error from API", "The VM could not boot"]
    /// );
    /// ```
    pub fn chain(&self) -> Vec<String> {
        if let Error::Server { body, .. } = self {
            let body = body.as_deref().unwrap_or_default();
            return match serde_json::from_str::<Vec<String>>(body) {
                Ok(lines) => std::iter::once(self.to_string()).chain(lines).collect(),
                Err(e) => vec![format!(
                    "X: Can't get remote's error messages from JSON response: {e}: body='{body}'"
                )],
            };
        }
        let mut lines = vec![self.to_string()];
        let mut cur = std::error::Error::source(self);
        while let Some(e) = cur {
            lines.push(e.to_string());
            cur = e.source();
        }
        lines
    }

    /// The HTTP status for [`Error::Server`].
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Server { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A client for one API socket. Each request opens its own connection, as
/// upstream's `ch-remote` does.
///
/// ```no_run
/// let client = api_client::Client::new("/tmp/ch.sock");
/// if let Some(json) = client.get("vmm.ping")? {
///     println!("{json}");
/// }
/// client.put("vm.boot")?;
/// # Ok::<(), api_client::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
    timeout: Option<Duration>,
}

impl Client {
    /// A client for the socket at `socket`, with [`DEFAULT_TIMEOUT`].
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            socket: socket.into(),
            timeout: Some(DEFAULT_TIMEOUT),
        }
    }

    /// The same client with another time limit per request (`None`: wait
    /// as long as it takes).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET /api/v1/<endpoint>`; the body of a 2xx answer, if it has one.
    pub fn get(&self, endpoint: &str) -> Result<Option<String>, Error> {
        self.call(Method::Get, endpoint, None)
    }

    /// `PUT /api/v1/<endpoint>` without a body.
    pub fn put(&self, endpoint: &str) -> Result<Option<String>, Error> {
        self.call(Method::Put, endpoint, None)
    }

    /// `PUT /api/v1/<endpoint>` with `body` serialized as JSON.
    pub fn put_json<T: Serialize + ?Sized>(
        &self,
        endpoint: &str,
        body: &T,
    ) -> Result<Option<String>, Error> {
        let body = serde_json::to_vec(body).map_err(Error::Encode)?;
        self.call(Method::Put, endpoint, Some(&body))
    }

    /// Sends one request and checks the status as upstream's client does:
    /// 100, 200 and 204 are success and give the body (`None` for a 204 and
    /// for an answer without `Content-Length`); anything else is
    /// [`Error::Server`].
    pub fn call(
        &self,
        method: Method,
        endpoint: &str,
        body: Option<&[u8]>,
    ) -> Result<Option<String>, Error> {
        let resp = self.request(method, endpoint, body)?;
        let text = match (resp.status, resp.content_length) {
            (204, _) | (_, None) => None,
            _ => Some(String::from_utf8(resp.body).map_err(|_| Error::NotUtf8)?),
        };
        if !is_success(resp.status) {
            return Err(Error::Server {
                method,
                endpoint: endpoint.to_owned(),
                status: resp.status,
                body: text,
            });
        }
        Ok(text)
    }

    /// Sends one request and returns the response whatever its status.
    pub fn request(
        &self,
        method: Method,
        endpoint: &str,
        body: Option<&[u8]>,
    ) -> Result<Response, Error> {
        if endpoint.is_empty()
            || !endpoint
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'?' && b != b'#')
        {
            return Err(Error::InvalidEndpoint {
                endpoint: endpoint.to_owned(),
            });
        }
        let deadline = self.timeout.map(|t| Instant::now() + t);
        let mut stream = UnixStream::connect(&self.socket).map_err(|source| Error::Connect {
            socket: self.socket.clone(),
            source,
        })?;
        let request = encode_request(method, endpoint, body);
        let sent = set_write_deadline(&stream, deadline).and_then(|()| stream.write_all(&request));
        let mut reader = DeadlineReader {
            stream: &stream,
            deadline,
        };
        match sent {
            Ok(()) => read_response(&mut reader).map_err(|e| self.read_error(e)),
            Err(e) if is_timeout(&e) => Err(self.timeout_error()),
            Err(source) => {
                // A server that refuses a request (413 for a huge body)
                // may answer and close before reading it all: its answer
                // says more than the broken pipe.
                read_response(&mut reader).map_err(|_| Error::Send {
                    socket: self.socket.clone(),
                    source,
                })
            }
        }
    }

    fn read_error(&self, e: ResponseError) -> Error {
        match e {
            ResponseError::Io(ref io) if is_timeout(io) => self.timeout_error(),
            source => Error::Response {
                socket: self.socket.clone(),
                source,
            },
        }
    }

    fn timeout_error(&self) -> Error {
        Error::Timeout {
            socket: self.socket.clone(),
            timeout: self.timeout.unwrap_or_default(),
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// What is left until `deadline`; an error once it has passed (a zero
/// socket timeout would mean "no timeout").
fn remaining(deadline: Option<Instant>) -> io::Result<Option<Duration>> {
    match deadline {
        None => Ok(None),
        Some(d) => match d.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(Some(left)),
            _ => Err(io::ErrorKind::TimedOut.into()),
        },
    }
}

fn set_write_deadline(stream: &UnixStream, deadline: Option<Instant>) -> io::Result<()> {
    stream.set_write_timeout(remaining(deadline)?)
}

/// Reads from the stream with the time left until the deadline, so a
/// server that trickles bytes cannot stretch a request past it.
struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Option<Instant>,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(remaining(self.deadline)?)?;
        self.stream.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::thread;

    /// A server thread that reads one request head and answers with
    /// `answer` (or nothing, holding the connection, when `None`).
    fn serve_once(answer: Option<&'static [u8]>) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let listener = UnixListener::bind(&path).unwrap();
        thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut chunk).unwrap();
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            match answer {
                Some(a) => conn.write_all(a).unwrap(),
                None => thread::sleep(Duration::from_secs(5)),
            }
        });
        (dir, path)
    }

    #[test]
    fn success_and_no_content() {
        let (_dir, path) = serve_once(Some(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"));
        assert_eq!(
            Client::new(&path).get("vmm.ping").unwrap().as_deref(),
            Some("{}")
        );
        let (_dir, path) = serve_once(Some(b"HTTP/1.1 204 \r\n\r\n"));
        assert_eq!(Client::new(&path).put("vm.boot").unwrap(), None);
        let (_dir, path) = serve_once(Some(
            b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
        ));
        assert_eq!(Client::new(&path).put("vm.boot").unwrap(), None);
        // Upstream's vmm.shutdown answer: a 200 with an empty body.
        let (_dir, path) = serve_once(Some(b"HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n"));
        assert_eq!(
            Client::new(&path).put("vmm.shutdown").unwrap().as_deref(),
            Some("")
        );
    }

    #[test]
    fn server_error_keeps_the_chain() {
        let (_dir, path) = serve_once(Some(
            b"HTTP/1.1 500 \r\nContent-Type: application/json\r\nContent-Length: 42\r\n\r\n\
              [\"Error from API\",\"VM is already running\"]",
        ));
        let e = Client::new(&path).put("vm.boot").unwrap_err();
        assert_eq!(e.status(), Some(500));
        assert_eq!(
            e.chain(),
            [
                "Server responded with InternalServerError",
                "Error from API",
                "VM is already running"
            ]
        );
    }

    #[test]
    fn statuses_as_upstream_names_them() {
        for (code, name) in [
            (100, "Continue"),
            (200, "Ok"),
            (204, "NoContent"),
            (400, "BadRequest"),
            (404, "NotFound"),
            (429, "TooManyRequests"),
            (500, "InternalServerError"),
            (501, "NotImplemented"),
            (201, "Unknown"),
            (405, "Unknown"),
            (409, "Unknown"),
            (413, "Unknown"),
            (503, "Unknown"),
        ] {
            assert_eq!(status_name(code), name);
            assert_eq!(is_success(code), matches!(code, 100 | 200 | 204), "{code}");
        }
        // A 2xx upstream does not know is an error, as in upstream's client.
        let (_dir, path) = serve_once(Some(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n[]"));
        let e = Client::new(&path).put("vm.boot").unwrap_err();
        assert_eq!(e.chain(), ["Server responded with Unknown"]);
    }

    #[test]
    fn error_bodies_that_are_not_a_chain() {
        let server = |status, body: Option<&str>| Error::Server {
            method: Method::Get,
            endpoint: "vm.info".into(),
            status,
            body: body.map(str::to_owned),
        };
        assert_eq!(
            server(404, None).chain(),
            ["X: Can't get remote's error messages from JSON response: \
              EOF while parsing a value at line 1 column 0: body=''"]
        );
        assert_eq!(
            server(409, Some("plain")).chain(),
            ["X: Can't get remote's error messages from JSON response: \
              expected value at line 1 column 1: body='plain'"]
        );
        assert_eq!(
            server(400, Some("[]")).chain(),
            ["Server responded with BadRequest"]
        );
    }

    #[test]
    fn connect_error_names_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.sock");
        let e = Client::new(&path).get("vmm.ping").unwrap_err();
        assert!(matches!(e, Error::Connect { .. }), "{e:?}");
        let chain = e.chain();
        assert!(chain[0].contains(&*path.to_string_lossy()), "{chain:?}");
        assert_eq!(chain.len(), 2, "{chain:?}");
    }

    #[test]
    fn silent_server_times_out() {
        let (_dir, path) = serve_once(None);
        let started = Instant::now();
        let e = Client::new(&path)
            .with_timeout(Some(Duration::from_millis(200)))
            .get("vm.info")
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(4));
    }

    #[test]
    fn truncated_answer_is_an_error() {
        let (_dir, path) = serve_once(Some(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{\"a\""));
        let e = Client::new(&path).get("vm.info").unwrap_err();
        assert!(
            matches!(
                e,
                Error::Response {
                    source: ResponseError::TruncatedBody {
                        expected: 9,
                        got: 4
                    },
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn refusal_before_the_body_is_read_is_reported() {
        // The server reads only the head, answers 413 and closes while the
        // client is still writing an 8 MiB body: the client must show the
        // 413, not the broken pipe.
        let (_dir, path) = serve_once(Some(
            b"HTTP/1.1 413 \r\nContent-Length: 31\r\n\r\n[\"request body over 4194304 B\"]",
        ));
        let body = vec![b' '; 8 << 20];
        let e = Client::new(&path)
            .call(Method::Put, "vm.create", Some(&body))
            .unwrap_err();
        assert_eq!(e.status(), Some(413), "{e:?}");
        assert_eq!(
            e.chain(),
            [
                "Server responded with Unknown",
                "request body over 4194304 B"
            ]
        );
    }

    #[test]
    fn endpoints_cannot_inject() {
        let client = Client::new("/nonexistent.sock");
        for bad in [
            "",
            "vm.boot HTTP/1.1\r\nX: y",
            "../vm.boot",
            "vm.boot?x",
            "vm boot",
        ] {
            assert!(
                matches!(client.put(bad), Err(Error::InvalidEndpoint { .. })),
                "{bad:?}"
            );
        }
    }
}
