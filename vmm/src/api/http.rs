//! The HTTP/1.1 server on the API's Unix socket: an accept thread and one
//! thread per connection (at most [`MAX_CONNECTIONS`], far more than slow
//! clients can usefully fill), requests parsed with `httparse`, answered in
//! order on the connection (keep-alive).
//!
//! Every request has deadlines ([`Limits`]): its whole head must arrive
//! within [`HEAD_TIMEOUT`] of the server starting to wait for it (an idle
//! keep-alive connection counts as a slow head), and its body within
//! [`BODY_TIMEOUT`] plus one second per [`BODY_MIN_RATE`] bytes declared.
//! A connection whose deadline passes is closed without an answer. A slow
//! client therefore only ties up its own small-stack thread, for a bounded
//! time, and never delays a fast one.
//!
//! Under `--landlock` the acceptor and the connection threads follow the
//! VMM's confinement to no filesystem access once it is published
//! ([`crate::landlock_rules::threads`]): the acceptor before it spawns a
//! connection thread, a connection thread before each request.
//!
//! The socket is created mode 0600. A lock file next to it (`PATH.lock`,
//! `flock`ed for the server's life) stops a second VMM from taking the
//! socket; a socket file left by a VMM that died is replaced.

use crate::landlock_rules::threads::{self, LateConfinement};
use crate::seccomp_filters::{self, ThreadKind};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::routes::route;
use super::{ApiError, ApiRequest, ApiResult, ApiSender};

/// Largest request body accepted (413 beyond).
pub const MAX_BODY: usize = 4 << 20;
/// Largest request head (request line and headers).
pub const MAX_HEAD: usize = 16 << 10;
/// Concurrent connections served; more are answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 4096;
/// A whole request head must arrive within this long of the server starting
/// to wait for it (after accepting, or after answering the previous one).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The time a body gets on top of its size-scaled share ([`BODY_MIN_RATE`]).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(5);
/// The slowest body accepted, in bytes per second: a body of `n` bytes must
/// arrive within `BODY_TIMEOUT + n / BODY_MIN_RATE` seconds.
pub const BODY_MIN_RATE: u64 = 64 << 10;
/// A client that reads nothing for this long is disconnected.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEADERS: usize = 64;
/// Stack of a connection thread: parsing and routing need little, and a
/// small stack keeps thousands of connections cheap.
const CONN_STACK: usize = 256 << 10;

/// The server's per-connection limits (the defaults are the constants
/// above; tests use shorter deadlines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// See [`HEAD_TIMEOUT`].
    pub head_timeout: Duration,
    /// See [`BODY_TIMEOUT`].
    pub body_timeout: Duration,
    /// See [`BODY_MIN_RATE`] (bytes per second, at least 1).
    pub body_min_rate: u64,
    /// See [`MAX_CONNECTIONS`].
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            head_timeout: HEAD_TIMEOUT,
            body_timeout: BODY_TIMEOUT,
            body_min_rate: BODY_MIN_RATE,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

impl Limits {
    /// How long a body of `len` bytes may take to arrive.
    pub fn body_time(&self, len: usize) -> Duration {
        let rate = self.body_min_rate.max(1);
        self.body_timeout + Duration::from_millis((len as u64).saturating_mul(1000) / rate)
    }
}

/// Errors of setting up the server.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("API socket lock {}", path.display())]
    LockFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("API socket lock {}: it is a symbolic link, which is not followed; remove it", .0.display())]
    LockSymlink(PathBuf),
    #[error("API socket lock {}: it is a {kind}, not a regular file", path.display())]
    LockNotRegular { path: PathBuf, kind: &'static str },
    #[error("API socket {}: another VMM serves it (its lock {} is held)", socket.display(), lock.display())]
    InUse { socket: PathBuf, lock: PathBuf },
    #[error("API socket {}: the path exists and is not a socket", .0.display())]
    NotASocket(PathBuf),
    #[error("API socket {}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("starting the API thread")]
    Thread(#[source] io::Error),
    #[error("API socket fd {fd}")]
    Fd {
        fd: RawFd,
        #[source]
        source: io::Error,
    },
    #[error("API socket fd {fd}: {why}")]
    NotAListener { fd: RawFd, why: &'static str },
}

/// The running server. Dropping it removes the socket file it created
/// (the accept thread ends with the process).
pub struct HttpServer {
    /// The socket file and its lock, when the server created them.
    created: Option<(PathBuf, File)>,
    in_flight: Arc<AtomicUsize>,
    _accept: JoinHandle<()>,
}

impl HttpServer {
    /// Creates the socket at `path` and serves it, sending requests
    /// through `api`.
    pub fn start(path: &Path, api: ApiSender) -> Result<HttpServer, HttpError> {
        Self::start_with(path, api, Limits::default())
    }

    /// [`HttpServer::start`] with other per-connection limits (tests and
    /// benchmarks use short deadlines).
    pub fn start_with(
        path: &Path,
        api: ApiSender,
        limits: Limits,
    ) -> Result<HttpServer, HttpError> {
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock_path = PathBuf::from(lock_path);
        let lock = open_lock_file(&lock_path)?;
        if lock.try_lock().is_err() {
            return Err(HttpError::InUse {
                socket: path.to_owned(),
                lock: lock_path,
            });
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                // Ours to replace: we hold the lock, so its server is gone.
                log::info!("replacing the stale API socket {}", path.display());
                std::fs::remove_file(path).map_err(|source| HttpError::Bind {
                    path: path.to_owned(),
                    source,
                })?;
            }
            // A symlink is refused too (never followed, never replaced).
            Ok(_) => return Err(HttpError::NotASocket(path.to_owned())),
            Err(_) => {}
        }
        let bind_err = |source| HttpError::Bind {
            path: path.to_owned(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
        log::info!("API socket {}", path.display());
        Self::serve(listener, api, Some((path.to_owned(), lock)), limits)
    }

    /// Serves an inherited listening Unix socket (`--api-socket fd=N`, as
    /// a process manager that binds the socket itself passes it). The fd
    /// must be an open, listening `AF_UNIX` stream socket; it becomes the
    /// server's (close-on-exec).
    pub fn from_fd(fd: RawFd, api: ApiSender) -> Result<HttpServer, HttpError> {
        check_listener(fd)?;
        // SAFETY: `check_listener` proved `fd` is an open listening Unix
        // stream socket; the command line hands it to the server alone, so
        // nothing else owns or closes it.
        let listener = unsafe { UnixListener::from_raw_fd(fd) };
        // SAFETY: F_SETFD on an fd this process owns, with a valid flag.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
            return Err(HttpError::Fd {
                fd,
                source: io::Error::last_os_error(),
            });
        }
        log::info!("API socket: inherited fd {fd}");
        Self::serve(listener, api, None, Limits::default())
    }

    fn serve(
        listener: UnixListener,
        api: ApiSender,
        created: Option<(PathBuf, File)>,
        limits: Limits,
    ) -> Result<HttpServer, HttpError> {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let inf = in_flight.clone();
        let accept = std::thread::Builder::new()
            .name("http-api".into())
            .spawn(move || accept_loop(listener, api, inf, limits, threads::process()))
            .map_err(HttpError::Thread)?;
        Ok(HttpServer {
            created,
            in_flight,
            _accept: accept,
        })
    }

    /// Waits up to `limit` for the answers already produced to be written
    /// (before the process exits on `vmm.shutdown`).
    pub fn drain(&self, limit: Duration) {
        let t0 = Instant::now();
        while self.in_flight.load(Ordering::Acquire) > 0 && t0.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some((path, _lock)) = &self.created {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Opens (creating it mode 0600 if absent) the lock file at `path`
/// without following a symbolic link at it: `O_NOFOLLOW` makes the open
/// fail on a symlink, dangling or not, so nothing is ever created at a
/// link's target. `O_NONBLOCK` keeps a FIFO put there from blocking the
/// open; `fstat` then refuses anything but a regular file.
fn open_lock_file(path: &Path) -> Result<File, HttpError> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            Some(libc::ELOOP) => HttpError::LockSymlink(path.to_owned()),
            // A FIFO without a reader: O_WRONLY|O_NONBLOCK gives ENXIO.
            Some(libc::ENXIO) => HttpError::LockNotRegular {
                path: path.to_owned(),
                kind: "FIFO or device without a reader",
            },
            _ => HttpError::LockFile {
                path: path.to_owned(),
                source,
            },
        })?;
    let meta = lock.metadata().map_err(|source| HttpError::LockFile {
        path: path.to_owned(),
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(HttpError::LockNotRegular {
            path: path.to_owned(),
            kind: pcow::output_file::kind(meta.file_type()),
        });
    }
    Ok(lock)
}

/// Whether `fd` is an open, listening Unix stream socket.
fn check_listener(fd: RawFd) -> Result<(), HttpError> {
    let not = |why| HttpError::NotAListener { fd, why };
    let sockopt = |opt| -> Result<libc::c_int, HttpError> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, an int
        // that lives through the call; a bad fd is an error return.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r < 0 {
            let source = io::Error::last_os_error();
            return Err(match source.raw_os_error() {
                Some(libc::ENOTSOCK) => not("not a socket"),
                _ => HttpError::Fd { fd, source },
            });
        }
        Ok(v)
    };
    if sockopt(libc::SO_DOMAIN)? != libc::AF_UNIX {
        return Err(not("not a Unix socket"));
    }
    if sockopt(libc::SO_TYPE)? != libc::SOCK_STREAM {
        return Err(not("not a stream socket"));
    }
    if sockopt(libc::SO_ACCEPTCONN)? == 0 {
        return Err(not("not listening (bind and listen before passing it)"));
    }
    Ok(())
}

/// Follows the VMM's Landlock confinement (see
/// [`threads`]): false when this thread could not, and must stop serving.
fn follow_confinement(late: &LateConfinement, confined: &mut bool, who: &str) -> bool {
    match late.follow(confined) {
        Ok(now) => {
            if now {
                log::info!(
                    "API: the {who} follows the VMM's Landlock confinement (no file access)"
                );
            }
            true
        }
        Err(e) => {
            log::error!(
                "API: the {who} cannot confine itself as the VMM did (--landlock): {}; \
                 it stops serving",
                error_report::chain(&e)
            );
            false
        }
    }
}

fn accept_loop(
    listener: UnixListener,
    api: ApiSender,
    in_flight: Arc<AtomicUsize>,
    limits: Limits,
    late: &'static LateConfinement,
) {
    // The connection threads spawned below inherit this filter.
    if let Err(e) = seccomp_filters::apply(ThreadKind::HttpApi) {
        log::error!("API: {}; no request is served", error_report::chain(&e));
        return;
    }
    let active = Arc::new(AtomicUsize::new(0));
    let mut confined = false;
    for stream in listener.incoming() {
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("API: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // Before a connection thread is spawned: it inherits the domain.
        if !follow_confinement(late, &mut confined, "acceptor") {
            return;
        }
        if active.load(Ordering::Acquire) >= limits.max_connections {
            let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
            let busy = ApiError::new(503, "too many API connections");
            let _ = write_response(&mut stream, &Answer::Err(&busy), true);
            continue;
        }
        active.fetch_add(1, Ordering::AcqRel);
        let (api, act, inf) = (api.clone(), active.clone(), in_flight.clone());
        let spawned = std::thread::Builder::new()
            .name("http-conn".into())
            .stack_size(CONN_STACK)
            .spawn(move || {
                serve_connection(stream, &api, &inf, &limits, late, confined);
                act.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            log::warn!("API: no thread for a connection: {e}");
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One parsed request.
struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
    close: bool,
}

/// Why reading a request stopped.
enum ReadError {
    /// The client closed or timed out between requests: nothing to answer.
    Gone,
    /// A bad request: answer it, then close.
    Bad(ApiError),
}

fn io_gone(e: io::Error) -> ReadError {
    log::debug!("API: connection: {e}");
    ReadError::Gone
}

/// A byte source whose reads can be bounded in time.
trait DeadlineRead: Read {
    /// Makes the next reads wait at most `timeout` (never zero).
    fn set_timeout(&mut self, timeout: Duration) -> io::Result<()>;
}

impl DeadlineRead for UnixStream {
    fn set_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(timeout))
    }
}

impl DeadlineRead for io::Cursor<&[u8]> {
    fn set_timeout(&mut self, _: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// Reads more bytes into `buf` before `deadline`; a passed deadline, an
/// error or the end of the stream is [`ReadError::Gone`].
fn read_before(
    stream: &mut impl DeadlineRead,
    buf: &mut Vec<u8>,
    deadline: Instant,
    what: &str,
) -> Result<(), ReadError> {
    let mut chunk = [0u8; 8192];
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        log::debug!("API: closing a connection: its {what} deadline passed");
        return Err(ReadError::Gone);
    }
    stream.set_timeout(left).map_err(io_gone)?;
    let n = match stream.read(&mut chunk) {
        Ok(n) => n,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            log::debug!("API: closing a connection: its {what} deadline passed");
            return Err(ReadError::Gone);
        }
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
        Err(e) => return Err(io_gone(e)),
    };
    if n == 0 {
        if !buf.is_empty() {
            log::debug!("API: client closed in the middle of a request {what}");
        }
        return Err(ReadError::Gone);
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// Reads one request within `limits`' deadlines; `buf` keeps bytes of the
/// next one.
fn read_request(
    stream: &mut impl DeadlineRead,
    buf: &mut Vec<u8>,
    limits: &Limits,
) -> Result<Request, ReadError> {
    let head_deadline = Instant::now() + limits.head_timeout;
    let (head_len, method, path, content_length, close) = loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf) {
            Ok(httparse::Status::Complete(n)) => {
                let mut len = None;
                let mut close = req.version == Some(0);
                for h in req.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        let v = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .ok_or_else(|| {
                                ReadError::Bad(ApiError::new(400, "invalid Content-Length"))
                            })?;
                        if len.is_some_and(|l| l != v) {
                            return Err(ReadError::Bad(ApiError::new(
                                400,
                                "conflicting Content-Length headers",
                            )));
                        }
                        len = Some(v);
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                        return Err(ReadError::Bad(ApiError::new(
                            400,
                            "Transfer-Encoding is not supported: send Content-Length",
                        )));
                    } else if h.name.eq_ignore_ascii_case("connection") {
                        close = h.value.eq_ignore_ascii_case(b"close");
                    }
                }
                break (
                    n,
                    req.method.unwrap_or("").to_owned(),
                    req.path.unwrap_or("").to_owned(),
                    len.unwrap_or(0),
                    close,
                );
            }
            Ok(httparse::Status::Partial) => {
                if buf.len() > MAX_HEAD {
                    return Err(ReadError::Bad(ApiError::new(
                        400,
                        format!("request head larger than {MAX_HEAD} bytes"),
                    )));
                }
            }
            Err(e) => {
                return Err(ReadError::Bad(ApiError::new(
                    400,
                    format!("malformed HTTP request: {e}"),
                )))
            }
        }
        read_before(stream, buf, head_deadline, "head")?;
    };
    if content_length > MAX_BODY {
        return Err(ReadError::Bad(ApiError::new(
            413,
            format!("request body of {content_length} bytes: at most {MAX_BODY} are accepted"),
        )));
    }
    buf.drain(..head_len);
    let body_deadline = Instant::now() + limits.body_time(content_length);
    while buf.len() < content_length {
        read_before(stream, buf, body_deadline, "body")?;
    }
    let body = buf.drain(..content_length).collect();
    Ok(Request {
        method,
        path,
        body,
        close,
    })
}

/// Parses the first request in `input` and routes it, as a connection
/// does: the action, the error a client would get, or `None` when the
/// input ends before a whole request (the fuzz target's entry).
pub fn parse_and_route(input: &[u8]) -> Option<Result<super::ApiRequest, ApiError>> {
    let mut cursor = io::Cursor::new(input);
    let mut buf = Vec::new();
    match read_request(&mut cursor, &mut buf, &Limits::default()) {
        Ok(req) => Some(route(&req.method, &req.path, &req.body)),
        Err(ReadError::Bad(e)) => Some(Err(e)),
        Err(ReadError::Gone) => None,
    }
}

/// What a request is answered with.
enum Answer<'a> {
    /// 204, no body and no `Content-Length`.
    NoContent,
    /// 200 with this JSON body (empty for `vmm.shutdown`).
    Ok(Vec<u8>),
    /// The error's status, its chain as a JSON array.
    Err(&'a ApiError),
}

impl Answer<'_> {
    fn of<'a>(r: &'a ApiResult, action: Option<&ApiRequest>) -> Answer<'a> {
        match r {
            // Upstream answers vmm.shutdown 200 with an empty body.
            Ok(None) if matches!(action, Some(ApiRequest::VmmShutdown)) => Answer::Ok(Vec::new()),
            Ok(None) => Answer::NoContent,
            Ok(Some(v)) => Answer::Ok(ascii_json(serde_json::to_vec(v).unwrap_or_default())),
            Err(e) => Answer::Err(e),
        }
    }
}

/// The bytes of one answer, as micro_http (upstream's server) writes them:
/// the status line has no reason phrase (upstream's client parses all of
/// the rest of the line as the code), a 204 has neither `Content-Type`
/// nor `Content-Length`. `close`: the connection closes after this answer
/// (the client asked, or its request could not be read), and says so
/// instead of `keep-alive`.
fn response_bytes(answer: &Answer, close: bool) -> Vec<u8> {
    let (status, body) = match answer {
        Answer::NoContent => (204, None),
        Answer::Ok(b) => (200, Some(b.clone())),
        Answer::Err(e) => (
            e.status,
            Some(ascii_json(serde_json::to_vec(&e.chain).unwrap_or_default())),
        ),
    };
    let connection = if close { "close" } else { "keep-alive" };
    let mut out = format!(
        "HTTP/1.1 {status} \r\nServer: Cloud Hypervisor API\r\nConnection: {connection}\r\n"
    )
    .into_bytes();
    if let Some(body) = &body {
        out.extend_from_slice(
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            )
            .as_bytes(),
        );
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.as_deref().unwrap_or_default());
    out
}

/// `json` with every non-ASCII character as a `\\u` escape. Upstream's
/// client decodes each 256-byte read as UTF-8 on its own and panics on a
/// character split between two reads; ASCII cannot be split.
fn ascii_json(json: Vec<u8>) -> Vec<u8> {
    if json.is_ascii() {
        return json;
    }
    let text = String::from_utf8_lossy(&json);
    let mut out = String::with_capacity(json.len() + 16);
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out.into_bytes()
}

fn write_response(stream: &mut UnixStream, answer: &Answer, close: bool) -> io::Result<()> {
    stream.write_all(&response_bytes(answer, close))?;
    stream.flush()
}

fn serve_connection(
    mut stream: UnixStream,
    api: &ApiSender,
    in_flight: &AtomicUsize,
    limits: &Limits,
    late: &LateConfinement,
    mut confined: bool,
) {
    if stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
        return;
    }
    let mut buf = Vec::new();
    loop {
        // A keep-alive connection may outlive the moment the VMM confines
        // itself (the `vm.create` that does it may come through it).
        if !follow_confinement(late, &mut confined, "connection thread") {
            return;
        }
        match read_request(&mut stream, &mut buf, limits) {
            Ok(req) => {
                let result = match route(&req.method, &req.path, &req.body) {
                    Ok(action) => {
                        in_flight.fetch_add(1, Ordering::AcqRel);
                        let shutdown = matches!(action, ApiRequest::VmmShutdown);
                        let r = api.call(action);
                        let kind = shutdown.then_some(&ApiRequest::VmmShutdown);
                        let w = write_response(&mut stream, &Answer::of(&r, kind), req.close);
                        in_flight.fetch_sub(1, Ordering::AcqRel);
                        w
                    }
                    Err(e) => {
                        log::debug!("API: {} {}: {}", req.method, req.path, e.chain.join(": "));
                        write_response(&mut stream, &Answer::Err(&e), req.close)
                    }
                };
                if result.is_err() || req.close {
                    return;
                }
            }
            Err(ReadError::Gone) => return,
            Err(ReadError::Bad(e)) => {
                log::debug!("API: bad request: {}", e.chain.join(": "));
                let _ = write_response(&mut stream, &Answer::Err(&e), true);
                return;
            }
        }
    }
}

/// A stand-in VMM for tests and benchmarks: a thread that answers every
/// request on `rx` with `vmm.ping`'s empty success, woken by its eventfd.
#[doc(hidden)]
pub fn spawn_ping_responder(rx: super::ApiReceiver) -> io::Result<JoinHandle<()>> {
    use std::os::fd::AsRawFd;
    struct Pong;
    impl super::RequestHandler for Pong {
        fn handle(&mut self, _: ApiRequest) -> super::HandlerResult {
            Ok(None)
        }
    }
    std::thread::Builder::new()
        .name("api-responder".into())
        .spawn(move || loop {
            let mut pfd = libc::pollfd {
                fd: rx.evt.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd that lives through the call.
            unsafe { libc::poll(&mut pfd, 1, 100) };
            rx.serve(&mut Pong);
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(limits: Limits) -> (tempfile::TempDir, PathBuf, HttpServer) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let (tx, rx) = super::super::channel().unwrap();
        spawn_ping_responder(rx).unwrap();
        let srv = HttpServer::start_with(&sock, tx, limits).unwrap();
        (dir, sock, srv)
    }

    fn ping(sock: &Path) -> String {
        let mut c = UnixStream::connect(sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    }

    /// Reads until the server closes; Err if it does not within 10 s.
    fn closed_by_server(c: &mut UnixStream) -> io::Result<Vec<u8>> {
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut out = Vec::new();
        c.read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn idle_and_slow_connections_are_closed_by_their_deadline() {
        let limits = Limits {
            head_timeout: Duration::from_millis(300),
            body_timeout: Duration::from_millis(300),
            body_min_rate: 1 << 20,
            max_connections: MAX_CONNECTIONS,
        };
        let (_dir, sock, _srv) = server(limits);
        let t0 = Instant::now();
        let mut conns: Vec<UnixStream> = (0..1000)
            .map(|_| UnixStream::connect(&sock).unwrap())
            .collect();
        // Some send part of a head, some part of a declared 4 MiB body.
        for (i, c) in conns.iter_mut().enumerate() {
            match i % 4 {
                1 => c.write_all(b"GET /api/v1/vm").unwrap(),
                2 => c
                    .write_all(b"PUT /api/v1/vm.boot HTTP/1.1\r\nContent-Length: 4194304\r\n\r\n{")
                    .unwrap(),
                _ => {}
            }
        }
        for (i, c) in conns.iter_mut().enumerate() {
            let out = closed_by_server(c).unwrap_or_else(|e| panic!("connection {i}: {e}"));
            assert!(out.is_empty(), "connection {i} got an answer");
        }
        // 300 ms deadlines (a 4 MiB body at 1 MiB/s: 4.3 s): all gone well
        // before the 10 s the client would wait for each.
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        assert!(ping(&sock).starts_with("HTTP/1.1 204 \r\n"));
    }

    #[test]
    fn ping_answers_while_hundreds_of_slow_connections_are_open() {
        let (_dir, sock, _srv) = server(Limits::default());
        let mut slow: Vec<UnixStream> = (0..500)
            .map(|_| UnixStream::connect(&sock).unwrap())
            .collect();
        for (i, c) in slow.iter_mut().enumerate() {
            if i % 2 == 0 {
                c.write_all(b"GET /api/v1/vmm.pi").unwrap();
            } else {
                c.write_all(b"PUT /api/v1/vm.boot HTTP/1.1\r\nContent-Length: 4194304\r\n\r\n{")
                    .unwrap();
            }
        }
        for _ in 0..20 {
            let out = ping(&sock);
            assert!(out.starts_with("HTTP/1.1 204 \r\n"), "{out}");
        }
        // The slow ones are still open (served, not refused with a 503).
        for c in slow.iter_mut() {
            c.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            let e = c.read(&mut b).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        }
    }

    #[test]
    fn a_body_gets_time_by_its_length() {
        let l = Limits::default();
        assert_eq!(l.body_time(0), BODY_TIMEOUT);
        assert_eq!(
            l.body_time(MAX_BODY),
            BODY_TIMEOUT + Duration::from_secs(MAX_BODY as u64 / BODY_MIN_RATE)
        );
    }

    #[test]
    fn requests_from_bytes() {
        let ok = parse_and_route(b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(ok, Some(Ok(ApiRequest::VmmPing)));
        let body =
            b"PUT /api/v1/vm.pmem-flush HTTP/1.1\r\nContent-Length: 11\r\n\r\n{\"id\":\"p\"}";
        // One byte of the body missing: not a whole request.
        assert_eq!(parse_and_route(body), None);
        let mut whole = body.to_vec();
        whole.push(b' ');
        assert!(matches!(
            parse_and_route(&whole),
            Some(Ok(ApiRequest::PmemFlush(_)))
        ));
        let status = |b: &[u8]| parse_and_route(b).unwrap().unwrap_err().status;
        assert_eq!(
            status(b"PUT /api/v1/vm.boot HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n"),
            413
        );
        assert_eq!(status(b"\x00\x01 nonsense\r\n\r\n"), 400);
        assert_eq!(
            status(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"),
            400
        );
    }

    #[test]
    fn answers_are_ascii() {
        let v = serde_json::json!(["é", "𝄞", "a\"b"]);
        let out = ascii_json(serde_json::to_vec(&v).unwrap());
        assert!(out.is_ascii());
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&out).unwrap(),
            v
        );
    }

    /// micro_http's bytes, exactly: what upstream's client parses.
    #[test]
    fn responses_are_micro_http_bytes() {
        let text = |a: &Answer, close| String::from_utf8(response_bytes(a, close)).unwrap();
        assert_eq!(
            text(&Answer::NoContent, false),
            "HTTP/1.1 204 \r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\r\n"
        );
        assert_eq!(
            text(&Answer::Ok(b"{}".to_vec()), false),
            "HTTP/1.1 200 \r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        );
        let shutdown = Answer::of(&Ok(None), Some(&ApiRequest::VmmShutdown));
        assert!(text(&shutdown, false).ends_with("Content-Length: 0\r\n\r\n"));
        let e = ApiError {
            status: 500,
            chain: vec!["Error from API".into(), "The VM could not boot".into()],
        };
        assert_eq!(
            text(&Answer::Err(&e), true),
            "HTTP/1.1 500 \r\nServer: Cloud Hypervisor API\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: 42\r\n\r\n\
             [\"Error from API\",\"The VM could not boot\"]"
        );
    }

    fn mkfifo(path: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that lives through the call;
        // mkfifo only reads it.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    /// A dangling symlink at `<socket>.lock` is refused through the whole
    /// start path, and nothing is created at its target.
    #[test]
    fn lock_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let target = dir.path().join("victim");
        std::os::unix::fs::symlink(&target, dir.path().join("api.sock.lock")).unwrap();
        let (tx, _rx) = super::super::channel().unwrap();
        let e = match HttpServer::start(&sock, tx) {
            Err(e) => e,
            Ok(_) => panic!("a symlinked lock file was accepted"),
        };
        assert!(matches!(e, HttpError::LockSymlink(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("api.sock.lock") && msg.contains("symbolic link"),
            "{msg}"
        );
        assert!(!target.exists(), "a file was created at the link's target");
        assert!(!sock.exists(), "the socket was bound despite the refusal");

        // A symlink to an existing file: refused too, the file untouched.
        std::fs::write(&target, b"keep").unwrap();
        let link2 = dir.path().join("b.lock");
        std::os::unix::fs::symlink(&target, &link2).unwrap();
        assert!(matches!(
            open_lock_file(&link2),
            Err(HttpError::LockSymlink(_))
        ));
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    /// A lock path that is a FIFO, a directory or a device is refused at
    /// once (no hang on the FIFO); a regular file is created and reused.
    #[test]
    fn lock_must_be_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.lock");
        mkfifo(&fifo);
        let t0 = Instant::now();
        let e = open_lock_file(&fifo).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(matches!(e, HttpError::LockNotRegular { .. }), "{e:?}");
        assert!(e.to_string().contains("fifo.lock"), "{e}");

        // A FIFO with a reader opens; fstat still refuses it.
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let e = open_lock_file(&fifo).unwrap_err();
        assert!(
            matches!(e, HttpError::LockNotRegular { kind: "FIFO", .. }),
            "{e:?}"
        );
        drop(reader);

        let d = dir.path().join("d.lock");
        std::fs::create_dir(&d).unwrap();
        let e = open_lock_file(&d).unwrap_err();
        assert!(e.to_string().contains("d.lock"), "{e}");

        let e = open_lock_file(Path::new("/dev/null")).unwrap_err();
        assert!(
            matches!(
                e,
                HttpError::LockNotRegular {
                    kind: "character device",
                    ..
                }
            ),
            "{e:?}"
        );

        let reg = dir.path().join("r.lock");
        drop(open_lock_file(&reg).unwrap());
        assert!(std::fs::symlink_metadata(&reg)
            .unwrap()
            .file_type()
            .is_file());
        let mode = std::fs::metadata(&reg).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "lock file mode {mode:o}");
        drop(open_lock_file(&reg).unwrap());
    }
}
