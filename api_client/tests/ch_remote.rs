//! `ch-remote` end to end against a fake API server that answers as
//! upstream Cloud Hypervisor's does (`HTTP/1.1 204 \r\n\r\n`, a 200 with
//! `Content-Length`, a 500 with `["Error from API", ...]`): a thread on a
//! Unix socket in a tempdir that records every connection's bytes. It
//! checks the client's side of the contract (request bytes, output, exit
//! codes); the real server has its own tests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

struct FakeServer {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    /// Every connection's bytes, including connections that sent nothing.
    requests: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// Upstream's 200 with a JSON body.
fn ok_json(body: &str) -> Vec<u8> {
    answer(200, body)
}

/// Upstream's answer with a body: no reason phrase.
fn answer(status: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} \r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Upstream's 204: no Content-Length.
fn no_content() -> Vec<u8> {
    b"HTTP/1.1 204 \r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\r\n".to_vec()
}

impl FakeServer {
    /// `routes` maps `"PUT vm.boot"` to the raw answer; other requests get
    /// upstream's 404 `["Not Found"]`.
    fn start(routes: &[(&str, Vec<u8>)]) -> FakeServer {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("ch.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let routes: HashMap<String, Vec<u8>> = routes
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&requests);
        thread::spawn(move || {
            for conn in listener.incoming() {
                let mut conn = conn.unwrap();
                let request = read_request(&mut conn);
                let line = String::from_utf8_lossy(&request).into_owned();
                log.lock().unwrap().push(request);
                let mut words = line.split(' ');
                let method = words.next().unwrap_or_default();
                let path = words.next().unwrap_or_default();
                let key = format!("{method} {}", path.strip_prefix("/api/v1/").unwrap_or(path));
                let answer = routes
                    .get(&key)
                    .cloned()
                    .unwrap_or_else(|| answer(404, r#"["Not Found"]"#));
                let _ = conn.write_all(&answer);
            }
        });
        FakeServer {
            _dir: dir,
            socket,
            requests,
        }
    }

    fn requests(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .map(|r| String::from_utf8(r.clone()).unwrap())
            .collect()
    }

    fn run(&self, args: &[&str]) -> Output {
        run_ch_remote(&self.socket, args, None)
    }
}

/// Reads a request head and its `Content-Length` body (what there is of
/// it if the client closes early).
fn read_request(conn: &mut impl Read) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return buf,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + len {
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf
}

fn run_ch_remote(socket: &Path, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ch-remote"));
    cmd.arg("--api-socket")
        .arg(socket)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(data) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        let data = data.to_vec();
        // A writer thread: the child may stop reading (too big) and exit.
        thread::spawn(move || {
            let _ = pipe.write_all(&data);
        });
    }
    child.wait_with_output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

/// Upstream's request without a body.
fn bodiless(method: &str, endpoint: &str) -> String {
    format!("{method} /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n")
}

/// Upstream's request with a JSON body: `Content-Length`, no
/// `Content-Type`.
fn with_body(endpoint: &str, body: &str) -> String {
    format!(
        "PUT /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Every command with upstream's argument style and the bytes upstream's
/// ch-remote v54 sent for the same arguments (captured; docs/api.md),
/// plus the pcow commands.
fn command_table(config: &str) -> Vec<(Vec<String>, String)> {
    let b = |args: &[&str], req: String| (args.iter().map(|s| s.to_string()).collect(), req);
    vec![
        b(&["ping"], bodiless("GET", "vmm.ping")),
        b(&["shutdown-vmm"], bodiless("PUT", "vmm.shutdown")),
        b(&["boot"], bodiless("PUT", "vm.boot")),
        b(&["pause"], bodiless("PUT", "vm.pause")),
        b(&["resume"], bodiless("PUT", "vm.resume")),
        b(&["shutdown"], bodiless("PUT", "vm.shutdown")),
        b(&["reboot"], bodiless("PUT", "vm.reboot")),
        b(&["delete"], bodiless("PUT", "vm.delete")),
        b(&["info"], bodiless("GET", "vm.info")),
        b(&["counters"], bodiless("GET", "vm.counters")),
        b(&["power-button"], bodiless("PUT", "vm.power-button")),
        b(&["nmi"], bodiless("PUT", "vm.nmi")),
        b(&["create", config], with_body("vm.create", "{\"memory\":{\"size\":536870912}}\n")),
        b(
            &["add-pmem", "file=F,size=4M,id=p1"],
            with_body("vm.add-pmem", r#"{"id":"p1","pci_segment":0,"file":"F","size":4194304,"discard_writes":false}"#),
        ),
        b(
            &["add-pmem", "file=/img/a.pcow,size=1G,iommu=on,discard_writes=on,id=p2,pci_segment=1,pci_device_id=5"],
            with_body("vm.add-pmem", r#"{"id":"p2","iommu":true,"pci_segment":1,"pci_device_id":5,"file":"/img/a.pcow","size":1073741824,"discard_writes":true}"#),
        ),
        b(&["remove-device", "p1"], with_body("vm.remove-device", r#"{"id":"p1"}"#)),
        b(
            &["snapshot", "file:///tmp/snap"],
            with_body("vm.snapshot", r#"{"destination_url":"file:///tmp/snap"}"#),
        ),
        b(
            &["restore", "source_url=file:///tmp/snap,prefault=on,memory_restore_mode=ondemand,resume=true"],
            with_body("vm.restore", r#"{"source_url":"file:///tmp/snap","prefault":true,"memory_restore_mode":"OnDemand","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":true,"zone_updates":[]}"#),
        ),
        b(
            &["coredump", "file:///tmp/core"],
            with_body("vm.coredump", r#"{"destination_url":"file:///tmp/core"}"#),
        ),
        b(
            &["resize", "--cpus", "2", "--memory", "2G", "--balloon", "0"],
            with_body("vm.resize", r#"{"desired_vcpus":2,"desired_ram":2147483648,"desired_balloon":0}"#),
        ),
        b(
            &["resize", "--memory", "1G"],
            with_body("vm.resize", r#"{"desired_vcpus":null,"desired_ram":1073741824,"desired_balloon":null}"#),
        ),
        b(
            &["resize-disk", "--disk", "d0", "--size", "10G"],
            with_body("vm.resize-disk", r#"{"id":"d0","desired_size":10737418240}"#),
        ),
        b(
            &["resize-zone", "--id", "z0", "--size", "1G"],
            with_body("vm.resize-zone", r#"{"id":"z0","desired_ram":1073741824}"#),
        ),
        b(
            &["add-disk", "path=/img/d.raw"],
            with_body("vm.add-disk", r#"{"pci_segment":0,"path":"/img/d.raw","readonly":false,"direct":false,"num_queues":1,"queue_size":128,"vhost_user":false,"disable_io_uring":false,"disable_aio":false,"backing_files":false,"sparse":true,"image_type":"Unknown","lock_granularity":"ByteRange"}"#),
        ),
        b(
            &["add-net", "tap=tap0"],
            with_body("vm.add-net", r#"{"pci_segment":0,"tap":"tap0","num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}"#),
        ),
        b(
            &["add-fs", "tag=fs0,socket=/tmp/fs.sock"],
            with_body("vm.add-fs", r#"{"pci_segment":0,"tag":"fs0","socket":"/tmp/fs.sock","num_queues":1,"queue_size":1024}"#),
        ),
        b(
            &["add-vsock", "cid=3,socket=/tmp/vsock"],
            with_body("vm.add-vsock", r#"{"pci_segment":0,"cid":3,"socket":"/tmp/vsock"}"#),
        ),
        b(
            &["add-device", "path=/sys/bus/pci/devices/0000:01:00.0/"],
            with_body("vm.add-device", r#"{"pci_segment":0,"path":"/sys/bus/pci/devices/0000:01:00.0/","x_exclude_mmap_bars":[]}"#),
        ),
        b(
            &["add-vdpa", "path=/dev/vhost-vdpa-0"],
            with_body("vm.add-vdpa", r#"{"pci_segment":0,"path":"/dev/vhost-vdpa-0","num_queues":1}"#),
        ),
        b(
            &["add-user-device", "socket=/tmp/ud.sock"],
            with_body("vm.add-user-device", r#"{"pci_segment":0,"socket":"/tmp/ud.sock"}"#),
        ),
        b(
            &["add-generic-vhost-user", "device_type=fs,socket=/tmp/gv.sock,queue_sizes=[256,256]"],
            with_body("vm.add-generic-vhost-user", r#"{"pci_segment":0,"socket":"/tmp/gv.sock","queue_sizes":[256,256],"device_type":26}"#),
        ),
        b(
            &["send-migration", "destination_url=unix:/tmp/mig"],
            with_body("vm.send-migration", r#"{"destination_url":"unix:/tmp/mig","local":false,"preserve_source":false,"downtime_ms":300,"timeout_s":3600,"timeout_strategy":"Cancel","connections":1,"tls_dir":null,"memory_mode":"Precopy"}"#),
        ),
        b(
            &["receive-migration", "receiver_url=unix:/tmp/mig"],
            with_body("vm.receive-migration", r#"{"receiver_url":"unix:/tmp/mig","tls_dir":null,"memory_mode":"Precopy","vfio_fds":null,"iommufd_fd":null,"zone_updates":[]}"#),
        ),
        b(
            &["pmem-snapshot", "id=pmem0,tag=before"],
            with_body("vm.pmem-snapshot", r#"{"id":"pmem0","tag":"before"}"#),
        ),
        b(
            &["pmem-overlay", "id=pmem0,file=/img/o.pcow"],
            with_body("vm.pmem-overlay", r#"{"id":"pmem0","file":"/img/o.pcow"}"#),
        ),
        b(
            &["pmem-rollback", "id=pmem0,snapshot=before"],
            with_body("vm.pmem-rollback", r#"{"id":"pmem0","snapshot":"before","reset":false}"#),
        ),
        b(
            &["pmem-rollback", "id=pmem0,snapshot=1,reset=on"],
            with_body("vm.pmem-rollback", r#"{"id":"pmem0","snapshot":"1","reset":true}"#),
        ),
        b(
            &["pmem-snapshot-delete", "id=pmem0,snapshot=before"],
            with_body("vm.pmem-snapshot-delete", r#"{"id":"pmem0","snapshot":"before"}"#),
        ),
        b(&["pmem-flush", "pmem0"], with_body("vm.pmem-flush", r#"{"id":"pmem0"}"#)),
        b(&["pmem-flush", "id=pmem0"], with_body("vm.pmem-flush", r#"{"id":"pmem0"}"#)),
        b(&["pmem-info"], bodiless("GET", "vm.pmem-info")),
    ]
}

/// The `(method, endpoint)` of a request's first line.
fn route(request: &str) -> (String, String) {
    let mut words = request.split(' ');
    let method = words.next().unwrap().to_owned();
    let path = words.next().unwrap().strip_prefix("/api/v1/").unwrap();
    (method, path.to_owned())
}

fn write_config(dir: &Path) -> String {
    let config = dir.join("vm.json");
    std::fs::write(&config, "{\"memory\":{\"size\":536870912}}\n").unwrap();
    config.to_str().unwrap().to_owned()
}

#[test]
fn every_command_sends_upstreams_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let table = command_table(&write_config(dir.path()));
    let routes: Vec<String> = table
        .iter()
        .map(|(_, req)| {
            let (m, p) = route(req);
            format!("{m} {p}")
        })
        .collect();
    let routes: Vec<(&str, Vec<u8>)> = routes.iter().map(|r| (r.as_str(), no_content())).collect();
    let server = FakeServer::start(&routes);
    for (args, _) in &table {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = server.run(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), "", "{args:?}: a 204 prints nothing");
        assert_eq!(stderr(&out), "", "{args:?}");
    }
    let expected: Vec<String> = table.into_iter().map(|(_, req)| req).collect();
    assert_eq!(server.requests(), expected);
}

#[test]
fn a_200_prints_the_body_and_a_newline() {
    let ping = r#"{"build_version":"v0.1.0","version":"0.1.0","pid":42,"features":[]}"#;
    let pmem = "[]\n";
    let server = FakeServer::start(&[
        ("GET vmm.ping", ok_json(ping)),
        ("GET vm.pmem-info", ok_json(pmem)),
        (
            "PUT vm.add-pmem",
            ok_json(r#"{"id":"p1","bdf":"0000:00:03.0"}"#),
        ),
        // Upstream's vmm.shutdown: a 200 with an empty body.
        (
            "PUT vmm.shutdown",
            b"HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n".to_vec(),
        ),
        // A status line with a reason phrase is read too.
        (
            "GET vm.info",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        ),
        // No Content-Length: no body, as upstream's client reads it.
        (
            "GET vm.counters",
            b"HTTP/1.1 200 \r\n\r\n{\"x\":{}}".to_vec(),
        ),
    ]);
    let out = server.run(&["ping"]);
    assert_eq!(
        (stdout(&out), out.status.code()),
        (format!("{ping}\n"), Some(0))
    );
    // As it came: a body ending in a newline gets a second one.
    assert_eq!(stdout(&server.run(&["pmem-info"])), "[]\n\n");
    assert_eq!(
        stdout(&server.run(&["add-pmem", "file=/a,id=p1"])),
        "{\"id\":\"p1\",\"bdf\":\"0000:00:03.0\"}\n"
    );
    let out = server.run(&["shutdown-vmm"]);
    assert_eq!(
        (stdout(&out), out.status.code()),
        ("\n".to_owned(), Some(0))
    );
    assert_eq!(stdout(&server.run(&["info"])), "{}\n");
    let out = server.run(&["counters"]);
    assert_eq!((stdout(&out), out.status.code()), (String::new(), Some(0)));
}

#[test]
fn server_errors_print_upstreams_chain() {
    let server = FakeServer::start(&[
        (
            "PUT vm.boot",
            answer(
                500,
                r#"["Error from API","The VM could not boot","VM is already running"]"#,
            ),
        ),
        ("PUT vm.pause", answer(400, r#"["Bad Request"]"#)),
        ("PUT vm.resume", answer(429, r#"["slow down"]"#)),
        ("PUT vm.nmi", answer(501, r#"["Not Implemented"]"#)),
        (
            "PUT vm.reboot",
            answer(409, r#"["Error from API","conflict"]"#),
        ),
        ("PUT vm.delete", answer(500, "not json")),
        (
            "PUT vm.shutdown",
            b"HTTP/1.1 404 Not Found\r\n\r\n".to_vec(),
        ),
    ]);
    let head =
        "Error: ch-remote exited with the following chain of errors:\n  0: http client error\n";
    let cases = [
        (
            "boot",
            "  1: Server responded with InternalServerError\n  2: Error from API\n  \
             3: The VM could not boot\n  4: VM is already running\n",
        ),
        (
            "pause",
            "  1: Server responded with BadRequest\n  2: Bad Request\n",
        ),
        (
            "resume",
            "  1: Server responded with TooManyRequests\n  2: slow down\n",
        ),
        (
            "nmi",
            "  1: Server responded with NotImplemented\n  2: Not Implemented\n",
        ),
        (
            "reboot",
            "  1: Server responded with Unknown\n  2: Error from API\n  3: conflict\n",
        ),
        (
            "delete",
            "  X: Can't get remote's error messages from JSON response: \
             expected ident at line 1 column 2: body='not json'\n",
        ),
        (
            "shutdown",
            "  X: Can't get remote's error messages from JSON response: \
             EOF while parsing a value at line 1 column 0: body=''\n",
        ),
        // The fake's default: upstream's unknown path.
        (
            "power-button",
            "  1: Server responded with NotFound\n  2: Not Found\n",
        ),
    ];
    for (cmd, chain) in cases {
        let out = server.run(&[cmd]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        assert_eq!(stdout(&out), "", "{cmd}");
        assert_eq!(stderr(&out), format!("{head}{chain}"), "{cmd}");
    }
}

#[test]
fn transport_errors_name_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = run_ch_remote(&socket, &["ping"], None);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines[0],
        "Error: ch-remote exited with the following chain of errors:"
    );
    assert_eq!(lines[1], "  0: http client error");
    assert_eq!(
        lines[2],
        format!("  1: cannot connect to the API socket {}", socket.display())
    );
    assert!(
        lines[3].starts_with("  2: No such file or directory"),
        "{err}"
    );

    let server = FakeServer::start(&[(
        "GET vm.info",
        b"HTTP/1.1 200 \r\nContent-Length: 100\r\n\r\n{\"state\":".to_vec(),
    )]);
    let out = server.run(&["info"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    assert_eq!(
        stderr(&out),
        format!(
            "Error: ch-remote exited with the following chain of errors:\n  0: http client error\n  \
             1: bad response from the API socket {}\n  2: the connection closed after 9 of 100 body bytes\n",
            server.socket.display()
        )
    );
}

#[test]
fn create_reads_standard_input_by_default() {
    let server = FakeServer::start(&[("PUT vm.create", no_content())]);
    let config =
        "{\n  \"payload\": {\"kernel\": \"/k\"},\n  \"memory\": {\"size\": 536870912}\n}\n";
    for args in [&["create"][..], &["create", "-"]] {
        let out = run_ch_remote(&server.socket, args, Some(config.as_bytes()));
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), "");
    }
    assert_eq!(
        server.requests(),
        [
            with_body("vm.create", config),
            with_body("vm.create", config)
        ]
    );
}

#[test]
fn create_refuses_what_it_cannot_send() {
    let server = FakeServer::start(&[("PUT vm.create", no_content())]);
    let out = server.run(&["create", "/nonexistent/vm.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "Error: ch-remote exited with the following chain of errors:\n  \
         0: Error reading from file\n  1: /nonexistent/vm.json: No such file or directory (os error 2)\n"
    );
    let out = run_ch_remote(&server.socket, &["create"], Some(b"{\"a\":\"\xff\"}"));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "Error: ch-remote exited with the following chain of errors:\n  \
         0: Error reading from stdin\n  1: stream did not contain valid UTF-8\n"
    );
    let huge = vec![b' '; (16 << 20) + 1];
    let out = run_ch_remote(&server.socket, &["create", "-"], Some(&huge));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).ends_with("  1: the VM config is over 16777216 bytes\n"),
        "{}",
        stderr(&out)
    );
    // A directory is not a config.
    let out = server.run(&["create", "/"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("  0: Error reading from file\n"),
        "{}",
        stderr(&out)
    );
    assert!(server.requests().is_empty());
}

#[test]
fn bad_arguments_fail_before_connecting() {
    let server = FakeServer::start(&[]);
    // The longest id accepted (1024 bytes, the API's limit).
    let huge = format!("file=/a,id={}", "x".repeat(1024));
    let too_long = format!("file=/a,id={}", "x".repeat(100_000));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["add-pmem", &too_long],
            "  1: `id` is 100000 bytes long: at most 1024 are accepted\n",
        ),
        (
            vec!["add-pmem", "file=/a,readonly=on"],
            "  0: Error parsing persistent memory syntax\n  1: unknown option `readonly` \
             (accepted: file, size, discard_writes, id, iommu, pci_segment, pci_device_id)\n  \
             2: syntax: file=<backing_file_path>,size=<persistent_memory_size>,iommu=on|off,\
             discard_writes=on|off,id=<device_id>,pci_segment=<segment_id>,pci_device_id=<pci_slot>\n",
        ),
        (vec!["add-pmem", ""], "  1: empty option string\n"),
        (vec!["add-pmem", "file=/a,size=1T"], "  1: invalid value `1T` for `size`: expected a size in bytes, or with a K, M or G suffix (512M, 1G)\n"),
        (vec!["add-pmem", "file=/a,size=99999999999G"], "  1: invalid value `99999999999G` for `size`"),
        (vec!["add-pmem", "file=/a\nid=x"], "  1: `file` contains a control character (byte 0x0a)\n"),
        (vec!["add-pmem", "file=\"/a"], "  1: unbalanced quotes or brackets in `file=\"/a`\n"),
        (vec!["add-pmem", "file=/a,file=/b"], "  1: `file` given twice\n"),
        (vec!["add-net", "tap=t,fd=[3]"], "  0: Error parsing network syntax\n  1: `fd` passes file descriptors, which this ch-remote does not send\n"),
        (vec!["remove-device", ""], "  0: Error parsing device id\n  1: empty device id\n"),
        (vec!["remove-device", "p1\u{1b}[2J"], "  1: `device id` contains a control character (byte 0x1b)\n"),
        (vec!["snapshot", ""], "  0: Error parsing snapshot destination\n"),
        (vec!["restore", "prefault=on"], "  0: Error parsing restore syntax\n  1: `source_url` is required\n"),
        (vec!["resize", "--cpus=-1"], "  0: Error parsing CPU count\n  1: invalid value `-1` for `--cpus`"),
        (vec!["resize", "--memory", "lots"], "  0: Error parsing memory size\n  1: invalid value `lots` for `--memory`"),
        (vec!["resize", "--balloon", "1.5G"], "  0: Error parsing balloon size\n"),
        (vec!["resize-disk", "--disk", "d0", "--size", "x"], "  0: Invalid disk size\n"),
        (vec!["resize-zone", "--id", "z0", "--size", ""], "  0: Error parsing memory size\n"),
        (vec!["send-migration", "unix:/tmp/mig"], "  0: Error parsing send migration configuration\n  1: unknown option `unix:/tmp/mig`"),
        (vec!["receive-migration", "receiver_url=ftp://x"], "  0: Error parsing receive migration configuration\n"),
        (vec!["pmem-snapshot", "id=p0"], "  0: Error parsing pmem-snapshot syntax\n  1: `tag` is required\n"),
        (vec!["pmem-snapshot", "p0"], "  1: unknown option `p0` (accepted: id, tag)\n"),
        (vec!["pmem-rollback", "id=p0,snapshot=t,reset=maybe"], "  1: invalid value `maybe` for `reset`: expected on, off, true or false\n"),
        (vec!["pmem-flush", "p\t0"], "  1: `device id` contains a control character (byte 0x09)\n"),
    ];
    for (args, needle) in &cases {
        let out = server.run(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("Error: ch-remote exited with the following chain of errors:\n"),
            "{args:?}: {err}"
        );
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(stdout(&out), "");
    }
    assert!(server.requests().is_empty());
    // The longest valid argument is sent whole.
    let server = FakeServer::start(&[("PUT vm.add-pmem", no_content())]);
    let out = server.run(&["add-pmem", &huge]);
    assert!(out.status.success(), "{}", stderr(&out));
    let sent = server.requests();
    assert_eq!(sent.len(), 1);
    assert!(sent[0].ends_with(&format!(
        "\"id\":\"{}\",\"pci_segment\":0,\"file\":\"/a\",\"discard_writes\":false}}",
        "x".repeat(1024)
    )));
}

#[test]
fn usage_errors_exit_2() {
    let bin = env!("CARGO_BIN_EXE_ch-remote");
    let run = |args: &[&str]| {
        Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    for (args, why) in [
        (
            &["--api-socket", "/x", "pmem-snapshot", "pmem0", "t1"][..],
            "two positionals",
        ),
        (
            &[
                "--api-socket",
                "/x",
                "pmem-rollback",
                "id=p0,snapshot=t",
                "--reset",
            ],
            "old --reset flag",
        ),
        (
            &["--api-socket", "/x", "remove-device", "a", "b"],
            "two positionals",
        ),
        (&["--api-socket", "/x", "add-pmem"], "missing config"),
        (&["--api-socket", "/x", "snapshot"], "missing url"),
        (
            &["--api-socket", "/x", "resize-disk", "--disk", "d0"],
            "missing --size",
        ),
        (
            &["--api-socket", "/x", "resize-zone", "--size", "1G"],
            "missing --id",
        ),
        (&["--api-socket", "/x", "frobnicate"], "unknown command"),
        (&["--api-socket"], "no socket value"),
        (
            &["--api-socket", "/x", "--dbus-service-name", "org.x", "ping"],
            "D-Bus",
        ),
        (
            &["--api-socket", "/x", "--dbus-system-bus", "ping"],
            "D-Bus",
        ),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{why}: {}", stderr(&out));
        assert!(!out.stderr.is_empty(), "{why}");
    }
    let out = run(&["--api-socket", "/x", "--dbus-object-path", "/o", "ping"]);
    assert!(stderr(&out).contains("no D-Bus client"), "{}", stderr(&out));
    // Non-UTF-8 arguments are refused by the parser.
    use std::os::unix::ffi::OsStrExt;
    let out = Command::new(bin)
        .args(["--api-socket", "/x", "remove-device"])
        .arg(std::ffi::OsStr::from_bytes(b"p\xff"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // No socket: exit 1, as upstream, saying what is missing.
    let out = run(&["ping"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("--api-socket <path> is required"),
        "{}",
        stderr(&out)
    );
    // No arguments: the help, on stderr, exit 2.
    assert_eq!(run(&[]).status.code(), Some(2));
}

#[test]
fn help_lists_every_command() {
    let out = Command::new(env!("CARGO_BIN_EXE_ch-remote"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = stdout(&out);
    let dir = tempfile::tempdir().unwrap();
    let mut names: Vec<String> = command_table(&write_config(dir.path()))
        .into_iter()
        .map(|(args, _)| args[0].clone())
        .collect();
    names.dedup();
    assert_eq!(names.len(), 37, "{names:?}"); // upstream's 31 and the 6 pcow ones
    for cmd in names {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(&format!("{cmd} "))),
            "{cmd} missing from --help:\n{help}"
        );
    }
    assert!(help.contains("--api-socket <api-socket>"), "{help}");
}

/// The `(method, endpoint)` pairs `docs/openapi.yaml` declares.
fn openapi_routes() -> Vec<(String, String)> {
    let yaml =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.yaml"))
            .unwrap();
    let mut routes = Vec::new();
    let mut path: Option<&str> = None;
    for line in yaml.lines() {
        if let Some(p) = line.strip_prefix("  /").and_then(|l| l.strip_suffix(':')) {
            path = Some(p);
        } else if let (Some(p), Some(m)) = (
            path,
            line.strip_prefix("    ").and_then(|l| l.strip_suffix(':')),
        ) {
            if matches!(m, "get" | "put" | "post" | "patch" | "delete") {
                routes.push((m.to_uppercase(), p.to_owned()));
            }
        } else if !line.starts_with("   ") {
            path = None;
        }
    }
    routes.sort();
    routes
}

/// Every route of the OpenAPI file is reached by a `ch-remote` command
/// with the method the file gives, and `docs/api.md` shows it with curl.
#[test]
fn commands_cover_the_openapi_routes() {
    let routes = openapi_routes();
    assert!(routes.len() >= 18, "{routes:?}");
    let dir = tempfile::tempdir().unwrap();
    let reached: Vec<(String, String)> = command_table(&write_config(dir.path()))
        .iter()
        .map(|(_, req)| route(req))
        .collect();
    for r in &routes {
        assert!(reached.contains(r), "no ch-remote command for {r:?}");
    }

    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.md")).unwrap();
    // Shell commands with their `\` continuations joined.
    let mut curls = Vec::new();
    let mut cur = String::new();
    for line in doc.lines() {
        cur.push_str(line.trim_end_matches('\\').trim());
        cur.push(' ');
        if !line.ends_with('\\') {
            if cur.starts_with("curl --unix-socket /tmp/ch.sock ") {
                curls.push(std::mem::take(&mut cur));
            }
            cur.clear();
        }
    }
    for (method, path) in &routes {
        let shown = curls.iter().any(|c| {
            (method == "PUT") == c.contains(" -X PUT ")
                && c.contains(&format!(" http://localhost/api/v1/{path} "))
        });
        assert!(shown, "docs/api.md has no curl example for {method} {path}");
    }
}

/// A server that never answers: the request gives up after `--timeout`.
#[test]
fn timeout_gives_up() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("slow.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    thread::spawn(move || {
        let conns: Vec<_> = listener.incoming().take(1).collect();
        thread::sleep(Duration::from_secs(10));
        drop(conns);
    });
    let started = std::time::Instant::now();
    let out = run_ch_remote(&socket, &["--timeout", "1", "ping"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(started.elapsed() < Duration::from_secs(8));
    assert!(
        stderr(&out).contains("no complete response"),
        "{}",
        stderr(&out)
    );
}

/// With `UPSTREAM_CH_REMOTE` naming upstream's ch-remote binary: it sends
/// byte for byte what the table says for every upstream command (the
/// table our own client is checked against above). SKIPPED otherwise.
#[test]
fn upstream_ch_remote_sends_the_table_bytes() {
    let Some(theirs) = std::env::var_os("UPSTREAM_CH_REMOTE") else {
        println!("SKIPPED: UPSTREAM_CH_REMOTE (upstream's ch-remote binary) is not set");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let table: Vec<(Vec<String>, String)> = command_table(&write_config(dir.path()))
        .into_iter()
        .filter(|(args, _)| !args[0].starts_with("pmem-"))
        .collect();
    let routes: Vec<String> = table
        .iter()
        .map(|(_, req)| {
            let (m, p) = route(req);
            format!("{m} {p}")
        })
        .collect();
    let routes: Vec<(&str, Vec<u8>)> = routes.iter().map(|r| (r.as_str(), no_content())).collect();
    let server = FakeServer::start(&routes);
    for (args, _) in &table {
        let out = Command::new(&theirs)
            .arg("--api-socket")
            .arg(&server.socket)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    let expected: Vec<String> = table.into_iter().map(|(_, req)| req).collect();
    assert_eq!(server.requests(), expected);
}
