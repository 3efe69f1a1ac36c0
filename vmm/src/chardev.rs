//! Character backends of the serial port and the virtio console: where
//! their output goes and where their input comes from.
//!
//! - [`Output`]: a bounded buffer ([`OUTPUT_BUFFER`] bytes) drained by a
//!   writer thread into a file, standard output, a pseudo-terminal or a
//!   socket client. Devices push bytes into it from the VMM or vCPU
//!   threads and never wait: when the consumer is slower than the guest
//!   and the buffer is full, the **oldest** bytes are dropped (counted,
//!   logged once per [`LOG_EVERY_DROP`] bytes), so the latest output is
//!   what a late reader sees. A socket output without a client keeps the
//!   buffer and replays it to the next client, as upstream does.
//! - [`Pty`]: a new pseudo-terminal (`posix_openpt`, `grantpt`,
//!   `unlockpt`), its terminal side in raw mode (no echo of the guest's
//!   output back as input) and kept open by the VMM, so that the main side
//!   never reads as hung up while no client has the terminal open.
//! - [`SerialSocket`]: a listening Unix socket; one client at a time gets
//!   the serial port's input and output, a new client replaces the old one
//!   (as upstream). The socket file is removed when the VM goes.
//!
//! [`Chardevs`] holds the backends of one VM: they are opened at its first
//! boot and kept across reboots (a pty keeps its path), and closed when
//! the VM is deleted or the VMM exits.

use crate::seccomp_filters::{self, ThreadKind};
use std::collections::VecDeque;
use std::ffi::CStr;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{ConsoleConfig, ConsoleOutputMode, VmConfig};

/// Bytes an [`Output`] holds for a slow or absent consumer.
pub const OUTPUT_BUFFER: usize = 64 * 1024;
/// Dropped output is logged once, then once per this many bytes.
pub const LOG_EVERY_DROP: u64 = 1 << 20;
/// How long dropping an [`Output`] waits for its buffer to drain.
const DRAIN_ON_DROP: Duration = Duration::from_secs(1);
/// How long the writer waits before retrying a target that would block.
const RETRY: Duration = Duration::from_millis(20);

/// Why an output file (`--serial file=`, `--console file=`) was refused:
/// its type. The `source` of the open's `io::Error` (kind `InvalidInput`).
#[derive(Debug, thiserror::Error)]
#[error("it is a {0}; output goes only to a regular file or a character device")]
pub struct OutputFileType(pub &'static str);

/// Opens `path` for output, created if missing (then truncated, or
/// appended to when `append`). Opened with `O_NONBLOCK` so that a FIFO
/// (which may never be read) cannot block the open; `fstat` then accepts
/// only a regular file or a character device (`/dev/null`, a tty), and
/// `O_NONBLOCK` is cleared again for the writes. A FIFO, socket, directory
/// or block device is refused at once, naming its type.
pub fn open_output_file(path: &Path, append: bool) -> io::Result<File> {
    let refused = |t| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            OutputFileType(pcow::output_file::kind(t)),
        )
    };
    let mut o = OpenOptions::new();
    o.create(true).custom_flags(libc::O_NONBLOCK);
    if append {
        o.append(true);
    } else {
        o.write(true).truncate(true);
    }
    let file = match o.open(path) {
        Ok(f) => f,
        // A FIFO without a reader, or a socket: name the type.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(match std::fs::metadata(path) {
                Ok(m) => refused(m.file_type()),
                Err(_) => e,
            })
        }
        Err(e) => return Err(e),
    };
    let t = file.metadata()?.file_type();
    if !(t.is_file() || t.is_char_device()) {
        return Err(refused(t));
    }
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL/F_SETFL take and return plain integers on `fd`,
    // which `file` owns and keeps open through both calls.
    let r = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK)
        }
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Errors of opening a backend.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum ChardevError {
    #[error("{what}: cannot create the output file {}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{what}: mode File without a file path")]
    MissingFile { what: &'static str },
    #[error("{what}: cannot open a pseudo-terminal")]
    Pty {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{what}: cannot duplicate standard output")]
    Stdout {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("serial: socket mode without a socket path")]
    MissingSocket,
    #[error("serial: {} exists (a stale socket? remove it)", .0.display())]
    SocketExists(PathBuf),
    #[error("serial: cannot listen on {}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("console: socket mode is not supported for the virtio console (as upstream)")]
    ConsoleSocket,
    #[error("starting the output writer thread")]
    Thread(#[source] io::Error),
}

/// Counters of an [`Output`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputStats {
    /// Bytes the devices pushed.
    pub pushed: u64,
    /// Bytes the target took.
    pub written: u64,
    /// Bytes dropped (buffer full, or the target failed).
    pub dropped: u64,
}

struct OutState {
    buf: VecDeque<u8>,
    stats: OutputStats,
    stop: bool,
}

/// Where the writer thread writes; `None` (a socket without client)
/// keeps the bytes buffered.
type Target = Option<Box<dyn Write + Send>>;

struct OutShared {
    state: Mutex<OutState>,
    /// Signalled when bytes arrive, a target is attached, or on stop.
    more: Condvar,
    /// Signalled when the writer emptied the buffer.
    drained: Condvar,
    target: Mutex<Target>,
    name: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A bounded output buffer with a writer thread (see the module docs).
pub struct Output {
    shared: Arc<OutShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Output")
            .field("name", &self.shared.name)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Output {
    /// An output named `name` (for messages) writing to `target`, or
    /// buffering until [`Output::attach`] when `None`.
    pub fn new(name: &str, target: Target) -> Result<Output, ChardevError> {
        let shared = Arc::new(OutShared {
            state: Mutex::new(OutState {
                buf: VecDeque::new(),
                stats: OutputStats::default(),
                stop: false,
            }),
            more: Condvar::new(),
            drained: Condvar::new(),
            target: Mutex::new(target),
            name: name.to_owned(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-out"))
            .spawn(move || writer(&s))
            .map_err(ChardevError::Thread)?;
        Ok(Output {
            shared,
            thread: Some(thread),
        })
    }

    /// Queues `bytes` for the target; never blocks on the target. When the
    /// buffer is full the oldest bytes make room.
    pub fn push(&self, bytes: &[u8]) {
        self.shared.push(bytes);
    }

    /// Sets a new target (a socket client); what is buffered goes to it
    /// first.
    pub fn attach(&self, target: Box<dyn Write + Send>) {
        *lock(&self.shared.target) = Some(target);
        self.shared.more.notify_one();
    }

    /// Removes the target: output is buffered again.
    pub fn detach(&self) {
        *lock(&self.shared.target) = None;
    }

    /// Counters so far.
    pub fn stats(&self) -> OutputStats {
        lock(&self.shared.state).stats
    }

    /// Waits until the buffer is empty (or `timeout`); whether it is.
    /// Returns at once when there is no target to drain into.
    pub fn drain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            // Never wait for the target's lock: the writer holds it while
            // a write blocks (a full pipe).
            let detached = matches!(self.shared.target.try_lock().as_deref(), Ok(None));
            let st = lock(&self.shared.state);
            if st.buf.is_empty() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if detached || left.is_zero() {
                return false;
            }
            let _ = self.shared.drained.wait_timeout(st, left.min(RETRY));
        }
    }

    /// A [`Write`] handle that pushes into this output (never fails).
    pub fn writer(&self) -> OutputWriter {
        OutputWriter(self.shared.clone())
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        let t0 = Instant::now();
        self.drain(DRAIN_ON_DROP);
        lock(&self.shared.state).stop = true;
        self.shared.more.notify_all();
        if let Some(t) = self.thread.take() {
            // Let the chunk in flight reach the target; a writer stuck in a
            // blocking write (a full pipe) is left behind rather than
            // blocking the VMM, and ends with the process.
            while !t.is_finished() && t0.elapsed() < DRAIN_ON_DROP + RETRY * 5 {
                std::thread::sleep(RETRY / 4);
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// A [`Write`] into an [`Output`]'s buffer, for vm-superio's serial.
pub struct OutputWriter(Arc<OutShared>);

impl Write for OutputWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.push(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl OutShared {
    fn push(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let mut st = lock(&self.state);
        st.stats.pushed += bytes.len() as u64;
        // Only the newest OUTPUT_BUFFER bytes of this call can stay.
        let keep = &bytes[bytes.len().saturating_sub(OUTPUT_BUFFER)..];
        let over = (st.buf.len() + keep.len()).saturating_sub(OUTPUT_BUFFER);
        st.buf.drain(..over);
        st.buf.extend(keep);
        let dropped = (bytes.len() - keep.len() + over) as u64;
        if dropped > 0 {
            count_dropped(
                &self.name,
                &mut st.stats,
                dropped,
                "the output consumer is slower than the guest",
            );
        }
        drop(st);
        self.more.notify_one();
    }
}

/// Counts `n` dropped bytes, logging the first and then one line per
/// [`LOG_EVERY_DROP`].
fn count_dropped(name: &str, stats: &mut OutputStats, n: u64, why: &str) {
    let before = stats.dropped;
    stats.dropped += n;
    if before == 0 || before / LOG_EVERY_DROP != stats.dropped / LOG_EVERY_DROP {
        log::warn!("{name}: {why}: {} byte(s) dropped so far", stats.dropped);
    }
}

fn writer(s: &OutShared) {
    if let Err(e) = seccomp_filters::apply(ThreadKind::Chardev) {
        log::error!(
            "{}: {}; no output is written",
            s.name,
            error_report::chain(&e)
        );
        return;
    }
    let mut chunk = Vec::with_capacity(16 * 1024);
    loop {
        {
            let mut st = lock(&s.state);
            loop {
                if !st.buf.is_empty() && lock(&s.target).is_some() {
                    break;
                }
                if st.buf.is_empty() {
                    s.drained.notify_all();
                }
                if st.stop {
                    return;
                }
                st = s
                    .more
                    .wait_timeout(st, Duration::from_millis(200))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let n = st.buf.len().min(16 * 1024);
            chunk.clear();
            chunk.extend(st.buf.drain(..n));
        }
        let mut off = 0;
        while off < chunk.len() {
            // The target lock is never held while taking the state lock
            // (the order elsewhere is state, then target).
            let r = lock(&s.target).as_mut().map(|t| t.write(&chunk[off..]));
            match r {
                None => {
                    // Detached meanwhile: keep the rest for the next client.
                    let mut st = lock(&s.state);
                    for &b in chunk[off..].iter().rev() {
                        st.buf.push_front(b);
                    }
                    let over = st.buf.len().saturating_sub(OUTPUT_BUFFER);
                    st.buf.drain(..over);
                    st.stats.dropped += over as u64;
                    break;
                }
                Some(Ok(0)) => {
                    log::warn!("{}: the output target is closed", s.name);
                    *lock(&s.target) = None;
                }
                Some(Ok(n)) => {
                    off += n;
                    lock(&s.state).stats.written += n as u64;
                }
                Some(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                    if lock(&s.state).stop {
                        return;
                    }
                    std::thread::sleep(RETRY);
                }
                Some(Err(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                    ) =>
                {
                    // A socket client left: buffer for the next one.
                    log::info!("{}: the client went away ({e})", s.name);
                    *lock(&s.target) = None;
                }
                Some(Err(e)) => {
                    let lost = (chunk.len() - off) as u64;
                    count_dropped(
                        &s.name,
                        &mut lock(&s.state).stats,
                        lost,
                        &format!("writing the output failed ({e})"),
                    );
                    break;
                }
            }
        }
    }
}

/// A pseudo-terminal (see the module docs).
#[derive(Debug)]
pub struct Pty {
    main: File,
    /// Kept open so the main side never reads as hung up.
    _sub: File,
    path: PathBuf,
}

impl Pty {
    /// Opens a new pseudo-terminal.
    pub fn open() -> io::Result<Pty> {
        // SAFETY: posix_openpt takes flags only; the result is checked.
        let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let main = unsafe { File::from_raw_fd(fd) };
        // SAFETY: grantpt/unlockpt on a valid pty main descriptor.
        if unsafe { libc::grantpt(fd) } != 0 || unsafe { libc::unlockpt(fd) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut name = [0 as libc::c_char; 128];
        // SAFETY: `name` is valid for writes of its length for the call.
        let r = unsafe { libc::ptsname_r(fd, name.as_mut_ptr(), name.len()) };
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
        // SAFETY: ptsname_r succeeded, so `name` holds a NUL-terminated string.
        let path = PathBuf::from(
            unsafe { CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned(),
        );
        let sub = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY | libc::O_CLOEXEC)
            .open(&path)?;
        set_raw(sub.as_raw_fd())?;
        set_nonblocking(fd)?;
        Ok(Pty {
            main,
            _sub: sub,
            path,
        })
    }

    /// The terminal's path (`/dev/pts/N`), for clients.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The main side, read for input and written for output.
    pub fn main_fd(&self) -> RawFd {
        self.main.as_raw_fd()
    }

    fn writer(&self) -> io::Result<Box<dyn Write + Send>> {
        Ok(Box::new(self.main.try_clone()?))
    }
}

/// Puts the terminal `fd` in raw mode (cfmakeraw).
fn set_raw(fd: RawFd) -> io::Result<()> {
    // SAFETY: termios is plain data; tcgetattr fills it before use.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `t` is valid for the call; the result is checked.
    if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `t` is a valid termios.
    unsafe { libc::cfmakeraw(&mut t) };
    // SAFETY: `t` is valid for the call; the result is checked.
    if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets O_NONBLOCK on `fd`.
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns, valid flags.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads what `fd` has (non-blocking): `Ok(0)` is end of file.
pub fn read_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length for the call.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The serial port's listening socket and its current client.
#[derive(Debug)]
pub struct SerialSocket {
    listener: UnixListener,
    path: PathBuf,
    client: Mutex<Option<UnixStream>>,
}

impl SerialSocket {
    fn bind(path: &Path) -> Result<SerialSocket, ChardevError> {
        if std::fs::symlink_metadata(path).is_ok() {
            return Err(ChardevError::SocketExists(path.to_owned()));
        }
        let bind = |source| ChardevError::Bind {
            path: path.to_owned(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(bind)?;
        listener.set_nonblocking(true).map_err(bind)?;
        Ok(SerialSocket {
            listener,
            path: path.to_owned(),
            client: Mutex::new(None),
        })
    }

    /// The listening socket's fd.
    pub fn listen_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// The current client's fd.
    pub fn client_fd(&self) -> Option<RawFd> {
        lock(&self.client).as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Accepts a pending client: it replaces the current one, gets the
    /// buffered output, then everything the guest writes. Returns its fd.
    pub fn accept(&self, out: &Output) -> Option<RawFd> {
        let stream = match self.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            Err(e) => {
                log::warn!("serial socket {}: accept: {e}", self.path.display());
                return None;
            }
        };
        let writer = match stream
            .set_nonblocking(true)
            .and_then(|_| stream.try_clone())
        {
            Ok(w) => w,
            Err(e) => {
                log::warn!("serial socket {}: new client: {e}", self.path.display());
                return None;
            }
        };
        let fd = stream.as_raw_fd();
        if let Some(old) = lock(&self.client).replace(stream) {
            let _ = old.shutdown(std::net::Shutdown::Both);
            log::info!("serial socket: a new client replaces the previous one");
        }
        out.attach(Box::new(writer));
        Some(fd)
    }

    /// Reads the client's input; on end of file or error the client is
    /// dropped (and output buffered again) and `None` returned.
    pub fn read_client(&self, out: &Output, buf: &mut [u8]) -> Option<usize> {
        let mut c = lock(&self.client);
        let stream = c.as_mut()?;
        match stream.read(buf) {
            Ok(0) => {}
            Ok(n) => return Some(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Some(0),
            Err(e) => log::info!("serial socket: client read: {e}"),
        }
        log::info!("serial socket: the client closed the connection");
        *c = None;
        out.detach();
        None
    }
}

impl Drop for SerialSocket {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            log::warn!("serial socket {}: removing it: {e}", self.path.display());
        }
    }
}

/// One console's backend.
#[derive(Debug)]
pub enum Backend {
    /// No device.
    Off,
    /// Device present, output discarded, no input.
    Null,
    /// Output to standard output; input from standard input when this
    /// console owns it.
    Tty(Option<Output>),
    /// Output to a file.
    File(Output),
    /// A pseudo-terminal: output and input.
    Pty(Pty, Output),
    /// A Unix socket (serial only): one client at a time.
    Socket(SerialSocket, Output),
}

impl Backend {
    /// The buffered output, if the backend has one.
    pub fn output(&self) -> Option<&Output> {
        match self {
            Backend::Tty(o) => o.as_ref(),
            Backend::File(o) | Backend::Pty(_, o) | Backend::Socket(_, o) => Some(o),
            Backend::Off | Backend::Null => None,
        }
    }

    /// The pty's path, with mode Pty.
    pub fn pty_path(&self) -> Option<&Path> {
        match self {
            Backend::Pty(p, _) => Some(p.path()),
            _ => None,
        }
    }
}

/// A duplicate of standard output, so that closing it never closes fd 1.
fn dup_stdout(what: &'static str) -> Result<File, ChardevError> {
    // SAFETY: dup of fd 1; the result is checked.
    let fd = unsafe { libc::dup(libc::STDOUT_FILENO) };
    if fd < 0 {
        return Err(ChardevError::Stdout {
            what,
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn open_pty(what: &'static str) -> Result<Backend, ChardevError> {
    let pty = Pty::open().map_err(|source| ChardevError::Pty { what, source })?;
    let out = Output::new(
        what,
        Some(
            pty.writer()
                .map_err(|source| ChardevError::Pty { what, source })?,
        ),
    )?;
    // Upstream logs nothing but puts the path in the config; say it where
    // a user looks.
    log::warn!("{what}: pseudo-terminal {}", pty.path().display());
    Ok(Backend::Pty(pty, out))
}

/// The backends of one VM's serial port and virtio console.
#[derive(Debug)]
pub struct Chardevs {
    /// The 8250's (`Tty` and `File` output are written by the device
    /// itself; see [`crate::legacy::serial`]).
    pub serial: Backend,
    /// The virtio console's.
    pub console: Backend,
}

impl Chardevs {
    /// Opens what `config` asks for and writes each pty's path into its
    /// `file` (upstream reports it there in `vm.info`).
    pub fn open(config: &mut VmConfig) -> Result<Chardevs, ChardevError> {
        let serial = Self::open_serial(&config.serial)?;
        let console = Self::open_console(&config.console)?;
        if let Some(p) = serial.pty_path() {
            config.serial.file = Some(p.to_owned());
        }
        if let Some(p) = console.pty_path() {
            config.console.file = Some(p.to_owned());
        }
        Ok(Chardevs { serial, console })
    }

    fn open_serial(c: &ConsoleConfig) -> Result<Backend, ChardevError> {
        Ok(match c.mode {
            ConsoleOutputMode::Off => Backend::Off,
            ConsoleOutputMode::Null => Backend::Null,
            // The UART writes these itself (legacy::serial).
            ConsoleOutputMode::Tty => Backend::Tty(None),
            ConsoleOutputMode::File => Backend::Null,
            ConsoleOutputMode::Pty => open_pty("serial")?,
            ConsoleOutputMode::Socket => {
                let path = c.socket.as_deref().ok_or(ChardevError::MissingSocket)?;
                let sock = SerialSocket::bind(path)?;
                log::info!("serial: listening on {}", path.display());
                Backend::Socket(sock, Output::new("serial", None)?)
            }
        })
    }

    fn open_console(c: &ConsoleConfig) -> Result<Backend, ChardevError> {
        const WHAT: &str = "console";
        Ok(match c.mode {
            ConsoleOutputMode::Off => Backend::Off,
            ConsoleOutputMode::Null => Backend::Null,
            ConsoleOutputMode::Tty => {
                let out = dup_stdout(WHAT)?;
                Backend::Tty(Some(Output::new(WHAT, Some(Box::new(out)))?))
            }
            ConsoleOutputMode::File => {
                let path = c
                    .file
                    .as_deref()
                    .ok_or(ChardevError::MissingFile { what: WHAT })?;
                // As upstream: created, or truncated.
                let f = open_output_file(path, false).map_err(|source| ChardevError::File {
                    what: WHAT,
                    path: path.to_owned(),
                    source,
                })?;
                Backend::File(Output::new(WHAT, Some(Box::new(f)))?)
            }
            ConsoleOutputMode::Pty => open_pty(WHAT)?,
            ConsoleOutputMode::Socket => return Err(ChardevError::ConsoleSocket),
        })
    }

    /// Which device reads standard input: the serial port when it is on
    /// `tty`, else the console when it is (upstream lets both read it when
    /// both are `tty`; here the serial port, the one a user asked for with
    /// a non-default option, gets it alone).
    pub fn stdin_owner(&self) -> Option<StdinOwner> {
        match (&self.serial, &self.console) {
            (Backend::Tty(_), _) => Some(StdinOwner::Serial),
            (_, Backend::Tty(_)) => Some(StdinOwner::Console),
            _ => None,
        }
    }
}

/// The device standard input feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinOwner {
    /// The 8250.
    Serial,
    /// The virtio console.
    Console,
}

/// Whether `path` can serve as an entropy source: not a directory, FIFO or
/// socket (a read from those could block the VMM thread forever).
pub fn check_entropy_source(file: &File) -> io::Result<Option<&'static str>> {
    let ft = file.metadata()?.file_type();
    Ok(if ft.is_dir() {
        Some("a directory")
    } else if ft.is_fifo() {
        Some("a FIFO")
    } else if ft.is_socket() {
        Some("a socket")
    } else {
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A target that blocks until released.
    struct Gate(Arc<(Mutex<bool>, Condvar)>, Buf);

    impl Write for Gate {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let (m, c) = &*self.0;
            let mut open = m.lock().unwrap();
            while !*open {
                open = c.wait(open).unwrap();
            }
            self.1.write(b)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn output_reaches_the_target_in_order() {
        let buf = Buf::default();
        let out = Output::new("t", Some(Box::new(buf.clone()))).unwrap();
        for i in 0..100u8 {
            out.push(&[i; 10]);
        }
        assert!(out.drain(Duration::from_secs(5)));
        let got = buf.0.lock().unwrap().clone();
        assert_eq!(got.len(), 1000);
        assert!(got.chunks(10).enumerate().all(|(i, c)| c == [i as u8; 10]));
        assert_eq!(out.stats().dropped, 0);
    }

    #[test]
    fn a_stuck_consumer_never_blocks_the_pusher_and_the_oldest_bytes_go() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let buf = Buf::default();
        let out = Output::new("t", Some(Box::new(Gate(gate.clone(), buf.clone())))).unwrap();
        let t = Instant::now();
        // 4x the buffer while the target blocks: push returns at once.
        for i in 0..(4 * OUTPUT_BUFFER / 1024) {
            out.push(&[(i % 251) as u8; 1024]);
        }
        out.push(b"LAST");
        assert!(t.elapsed() < Duration::from_secs(2));
        let s = out.stats();
        assert_eq!(s.pushed, 4 * OUTPUT_BUFFER as u64 + 4);
        assert!(s.dropped > 0);
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert!(out.drain(Duration::from_secs(5)));
        let got = buf.0.lock().unwrap().clone();
        assert!(got.ends_with(b"LAST"));
        // What was kept plus what the writer had taken before it blocked.
        assert!(got.len() <= OUTPUT_BUFFER + 16 * 1024 + 4);
        assert_eq!(out.stats().written + out.stats().dropped, s.pushed);
    }

    #[test]
    fn without_a_target_output_is_kept_and_replayed_to_the_next() {
        let out = Output::new("t", None).unwrap();
        out.push(b"early ");
        let buf = Buf::default();
        out.attach(Box::new(buf.clone()));
        out.push(b"late");
        assert!(out.drain(Duration::from_secs(5)));
        assert_eq!(&*buf.0.lock().unwrap(), b"early late");
    }

    #[test]
    fn a_pty_carries_output_and_input_and_is_raw() {
        let pty = Pty::open().unwrap();
        assert!(pty.path().starts_with("/dev/pts"));
        let mut client = OpenOptions::new()
            .read(true)
            .write(true)
            .open(pty.path())
            .unwrap();
        let out = Output::new("t", Some(pty.writer().unwrap())).unwrap();
        out.push(b"guest says hi\n");
        let mut got = vec![0u8; 14];
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"guest says hi\n");
        client.write_all(b"typed\n").unwrap();
        let mut buf = [0u8; 64];
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut input = Vec::new();
        while input.len() < 6 && Instant::now() < deadline {
            match read_fd(pty.main_fd(), &mut buf) {
                Ok(n) => input.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("{e}"),
            }
        }
        // Raw: no CR added, and the output was not echoed back as input.
        assert_eq!(input, b"typed\n");
    }

    #[test]
    fn serial_socket_serves_one_client_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.sock");
        let sock = SerialSocket::bind(&path).unwrap();
        assert!(matches!(
            SerialSocket::bind(&path),
            Err(ChardevError::SocketExists(_))
        ));
        let out = Output::new("t", None).unwrap();
        out.push(b"boot log ");
        let mut c1 = UnixStream::connect(&path).unwrap();
        let mut fd = None;
        for _ in 0..100 {
            fd = sock.accept(&out);
            if fd.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(fd, sock.client_fd());
        let mut b = [0u8; 9];
        c1.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"boot log ");
        c1.write_all(b"in").unwrap();
        let mut buf = [0u8; 8];
        let mut n = Some(0);
        for _ in 0..100 {
            n = sock.read_client(&out, &mut buf);
            if n != Some(0) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(n, Some(2));
        let mut c2 = UnixStream::connect(&path).unwrap();
        for _ in 0..100 {
            if sock.accept(&out).is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The first client was shut down.
        let mut rest = Vec::new();
        c1.read_to_end(&mut rest).unwrap();
        out.push(b"x");
        let mut one = [0u8; 1];
        c2.read_exact(&mut one).unwrap();
        assert_eq!(&one, b"x");
        drop(c2);
        let mut gone = false;
        for _ in 0..100 {
            if sock.read_client(&out, &mut buf).is_none() {
                gone = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(gone);
        drop(sock);
        assert!(!path.exists(), "the socket file is removed");
    }

    #[test]
    fn entropy_sources_that_could_block_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let d = File::open(dir.path()).unwrap();
        assert_eq!(check_entropy_source(&d).unwrap(), Some("a directory"));
        let f = tempfile::NamedTempFile::new().unwrap();
        assert_eq!(check_entropy_source(f.as_file()).unwrap(), None);
    }
}
