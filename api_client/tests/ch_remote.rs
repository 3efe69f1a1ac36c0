//! `ch-remote` end to end against a fake API server: a thread on a Unix
//! socket in a tempdir that records each request and answers from a table.
//! It checks the client's side of the contract only (request bytes, output,
//! exit codes); the real server has its own tests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;

struct FakeServer {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    requests: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// A response with a JSON body.
fn json(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nServer: fake\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn no_content() -> Vec<u8> {
    b"HTTP/1.1 204 No Content\r\nServer: fake\r\n\r\n".to_vec()
}

impl FakeServer {
    /// `routes` maps `"PUT vm.boot"` to the raw bytes of the answer; other
    /// requests get a 404 with a one-line chain.
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
                let Some(request) = read_request(&mut conn) else {
                    continue;
                };
                let line = String::from_utf8_lossy(&request);
                let mut words = line.split(' ');
                let method = words.next().unwrap_or_default();
                let path = words.next().unwrap_or_default();
                let key = format!("{method} {}", path.strip_prefix("/api/v1/").unwrap_or(path));
                log.lock().unwrap().push(request);
                let answer = routes
                    .get(&key)
                    .cloned()
                    .unwrap_or_else(|| json("404 Not Found", r#"["unknown path"]"#));
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

/// Reads a request head and its `Content-Length` body.
fn read_request(conn: &mut impl Read) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + len {
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(buf)
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
        child.stdin.take().unwrap().write_all(data).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

/// The request a bodiless command must send.
fn bodiless(method: &str, endpoint: &str) -> String {
    format!(
        "{method} /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
         Content-Length: 0\r\n\r\n"
    )
}

/// The request a command with a JSON body must send.
fn with_body(endpoint: &str, body: &str) -> String {
    format!(
        "PUT /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn ping_prints_the_body() {
    let body = r#"{"build_version":"v0.1.0","version":"0.1.0","pid":42,"features":["pcow"]}"#;
    let server = FakeServer::start(&[("GET vmm.ping", json("200 OK", body))]);
    let out = server.run(&["ping"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{body}\n"));
    assert_eq!(stderr(&out), "");
    assert_eq!(server.requests(), [bodiless("GET", "vmm.ping")]);
}

#[test]
fn bodiless_commands() {
    let cases = [
        ("shutdown-vmm", "PUT", "vmm.shutdown"),
        ("boot", "PUT", "vm.boot"),
        ("pause", "PUT", "vm.pause"),
        ("resume", "PUT", "vm.resume"),
        ("shutdown", "PUT", "vm.shutdown"),
        ("reboot", "PUT", "vm.reboot"),
        ("delete", "PUT", "vm.delete"),
    ];
    let routes: Vec<(String, Vec<u8>)> = cases
        .iter()
        .map(|(_, m, e)| (format!("{m} {e}"), no_content()))
        .collect();
    let routes: Vec<(&str, Vec<u8>)> = routes
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let server = FakeServer::start(&routes);
    for (cmd, _, _) in cases {
        let out = server.run(&[cmd]);
        assert!(out.status.success(), "{cmd}: {}", stderr(&out));
        assert_eq!(stdout(&out), "", "{cmd}");
        assert_eq!(stderr(&out), "", "{cmd}");
    }
    let expected: Vec<String> = cases.iter().map(|(_, m, e)| bodiless(m, e)).collect();
    assert_eq!(server.requests(), expected);
}

#[test]
fn queries_print_json() {
    let info = r#"{"config":{},"state":"Created","memory_actual_size":536870912,"device_tree":{}}"#;
    let pmem = "[]\n";
    let server = FakeServer::start(&[
        ("GET vm.info", json("200 OK", info)),
        ("GET vm.pmem-info", json("200 OK", pmem)),
    ]);
    let out = server.run(&["info"]);
    assert_eq!(stdout(&out), format!("{info}\n"));
    let out = server.run(&["pmem-info"]);
    // A body that already ends in a newline gets no second one.
    assert_eq!(stdout(&out), pmem);
    assert_eq!(
        server.requests(),
        [bodiless("GET", "vm.info"), bodiless("GET", "vm.pmem-info")]
    );
}

#[test]
fn create_sends_the_file_as_is() {
    let server = FakeServer::start(&[("PUT vm.create", no_content())]);
    let config =
        "{\n  \"payload\": {\"kernel\": \"/k\"},\n  \"memory\": {\"size\": 536870912}\n}\n";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.json");
    std::fs::write(&file, config).unwrap();
    let out = server.run(&["create", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "");
    let out = run_ch_remote(&server.socket, &["create", "-"], Some(config.as_bytes()));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        server.requests(),
        [
            with_body("vm.create", config),
            with_body("vm.create", config)
        ]
    );
}

#[test]
fn create_with_a_missing_file_fails_locally() {
    let server = FakeServer::start(&[]);
    let out = server.run(&["create", "/nonexistent/vm.json"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.starts_with("ch-remote: cannot read the VM config /nonexistent/vm.json\n"),
        "{err}"
    );
    assert!(server.requests().is_empty());
}

#[test]
fn add_pmem_and_remove_device() {
    let server = FakeServer::start(&[
        ("PUT vm.add-pmem", no_content()),
        ("PUT vm.remove-device", no_content()),
    ]);
    let out = server.run(&[
        "add-pmem",
        "file=/img/a.pcow,size=1G,discard_writes=on,id=pmem1,iommu=off,pci_segment=0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = server.run(&["add-pmem", "file=/img/b.raw"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = server.run(&["remove-device", "pmem1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        server.requests(),
        [
            with_body(
                "vm.add-pmem",
                r#"{"file":"/img/a.pcow","size":1073741824,"iommu":false,"discard_writes":true,"id":"pmem1","pci_segment":0}"#
            ),
            with_body(
                "vm.add-pmem",
                r#"{"file":"/img/b.raw","iommu":false,"discard_writes":false,"pci_segment":0}"#
            ),
            with_body("vm.remove-device", r#"{"id":"pmem1"}"#),
        ]
    );
}

#[test]
fn add_pmem_bad_options_fail_before_connecting() {
    let server = FakeServer::start(&[("PUT vm.add-pmem", no_content())]);
    for (opt, msg) in [
        (
            "file=/a,readonly=on",
            "ch-remote: add-pmem: unknown key `readonly` (accepted keys: file, size, iommu, discard_writes, id, pci_segment)",
        ),
        (
            "file=/a,size=1T",
            "ch-remote: add-pmem: invalid value `1T` for `size`: expected a size in bytes, or with a K, M or G suffix (512M, 1G)",
        ),
        (
            "file=/a,discard_writes=yes",
            "ch-remote: add-pmem: invalid value `yes` for `discard_writes`: expected on, off, true or false",
        ),
        ("id=x", "ch-remote: add-pmem: `file` is required"),
    ] {
        let out = server.run(&["add-pmem", opt]);
        assert_eq!(out.status.code(), Some(1), "{opt}");
        assert_eq!(
            stderr(&out),
            format!("{msg}\nsyntax: {}\n", api_client::PMEM_SYNTAX),
            "{opt}"
        );
        assert_eq!(stdout(&out), "");
    }
    assert!(server.requests().is_empty());
}

#[test]
fn pmem_actions() {
    let snap = r#"{"id":"pmem0","snapshot":{"id":1,"tag":"before","time":"2026-05-01T12:00:00Z"}}"#;
    let overlay = r#"{"id":"pmem0","file":"/img/o.pcow","base":"/img/a.pcow"}"#;
    let flush = r#"{"id":"pmem0","private_pages":3,"pages_copied":3,"held_us":120}"#;
    let server = FakeServer::start(&[
        ("PUT vm.pmem-snapshot", json("200 OK", snap)),
        ("PUT vm.pmem-overlay", json("200 OK", overlay)),
        ("PUT vm.pmem-rollback", json("200 OK", snap)),
        ("PUT vm.pmem-snapshot-delete", json("200 OK", snap)),
        ("PUT vm.pmem-flush", json("200 OK", flush)),
    ]);
    let cases: [(&[&str], &str); 6] = [
        (&["pmem-snapshot", "pmem0", "before"], snap),
        (&["pmem-overlay", "pmem0", "/img/o.pcow"], overlay),
        (&["pmem-rollback", "pmem0", "before"], snap),
        (&["pmem-rollback", "pmem0", "1", "--reset"], snap),
        (&["pmem-snapshot-delete", "pmem0", "before"], snap),
        (&["pmem-flush", "pmem0"], flush),
    ];
    for (args, answer) in cases {
        let out = server.run(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), format!("{answer}\n"), "{args:?}");
    }
    assert_eq!(
        server.requests(),
        [
            with_body("vm.pmem-snapshot", r#"{"id":"pmem0","tag":"before"}"#),
            with_body("vm.pmem-overlay", r#"{"id":"pmem0","file":"/img/o.pcow"}"#),
            with_body(
                "vm.pmem-rollback",
                r#"{"id":"pmem0","snapshot":"before","reset":false}"#
            ),
            with_body(
                "vm.pmem-rollback",
                r#"{"id":"pmem0","snapshot":"1","reset":true}"#
            ),
            with_body(
                "vm.pmem-snapshot-delete",
                r#"{"id":"pmem0","snapshot":"before"}"#
            ),
            with_body("vm.pmem-flush", r#"{"id":"pmem0"}"#),
        ]
    );
}

#[test]
fn server_errors_print_the_chain() {
    let server = FakeServer::start(&[
        (
            "PUT vm.pmem-rollback",
            json(
                "409 Conflict",
                r#"["cannot roll back pmem0 to `before`","the VM is Running: pause is not enough, use reset=true"]"#,
            ),
        ),
        (
            "PUT vm.pmem-flush",
            json("400 Bad Request", r#"["pmem1: not a pcow device"]"#),
        ),
        (
            "PUT vm.boot",
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ),
    ]);
    let out = server.run(&["pmem-rollback", "pmem0", "before"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    assert_eq!(
        stderr(&out),
        "cannot roll back pmem0 to `before`\n\
         the VM is Running: pause is not enough, use reset=true\n"
    );
    let out = server.run(&["pmem-flush", "pmem1"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr(&out), "pmem1: not a pcow device\n");
    // No chain in the body: the status line stands in for it.
    let out = server.run(&["boot"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "ch-remote: PUT vm.boot: the server answered 404 Not Found\n"
    );
    // Unknown paths get the fake's 404 chain.
    let out = server.run(&["pause"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr(&out), "unknown path\n");
}

#[test]
fn truncated_answer_fails() {
    let server = FakeServer::start(&[(
        "GET vm.info",
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"state\":".to_vec(),
    )]);
    let out = server.run(&["info"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    let socket = server.socket.display().to_string();
    assert_eq!(
        stderr(&out),
        format!(
            "ch-remote: bad response from the API socket {socket}\n\
             the connection closed after 9 of 100 body bytes\n"
        )
    );
}

#[test]
fn connection_errors_name_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = run_ch_remote(&socket, &["ping"], None);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let first = err.lines().next().unwrap();
    assert_eq!(
        first,
        format!(
            "ch-remote: cannot connect to the API socket {}",
            socket.display()
        )
    );
    assert_eq!(err.lines().count(), 2, "{err}");
}

#[test]
fn usage_errors() {
    let bin = env!("CARGO_BIN_EXE_ch-remote");
    let out = Command::new(bin).arg("ping").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "missing --api-socket");
    let out = Command::new(bin)
        .args(["--api-socket", "/x", "pmem-snapshot", "pmem0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "missing tag");
    let out = Command::new(bin)
        .args(["--api-socket", "/x", "frobnicate"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "unknown command");
    let out = Command::new(bin).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = stdout(&out);
    for cmd in [
        "ping",
        "shutdown-vmm",
        "create",
        "boot",
        "info",
        "pause",
        "resume",
        "shutdown",
        "reboot",
        "delete",
        "add-pmem",
        "remove-device",
        "pmem-snapshot",
        "pmem-overlay",
        "pmem-rollback",
        "pmem-snapshot-delete",
        "pmem-flush",
        "pmem-info",
    ] {
        assert!(
            help.lines()
                .any(|l| l.trim_start().starts_with(&format!("{cmd} "))),
            "{cmd} missing from --help:\n{help}"
        );
    }
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

/// Every route of the OpenAPI file is reached by exactly one `ch-remote`
/// command with the method the file gives, and `docs/api.md` shows it with
/// curl.
#[test]
fn commands_cover_the_openapi_routes() {
    let routes = openapi_routes();
    assert_eq!(routes.len(), 20, "{routes:?}");
    let table: Vec<(String, Vec<u8>)> = routes
        .iter()
        .map(|(m, p)| (format!("{m} {p}"), no_content()))
        .collect();
    let table: Vec<(&str, Vec<u8>)> = table.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let server = FakeServer::start(&table);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vm.json");
    std::fs::write(&config, "{}").unwrap();
    let commands: [&[&str]; 20] = [
        &["ping"],
        &["shutdown-vmm"],
        &["create", config.to_str().unwrap()],
        &["boot"],
        &["info"],
        &["pause"],
        &["resume"],
        &["shutdown"],
        &["reboot"],
        &["delete"],
        &["add-pmem", "file=/a"],
        &["remove-device", "a"],
        &["pmem-snapshot", "a", "t"],
        &["pmem-overlay", "a", "/o"],
        &["pmem-rollback", "a", "t"],
        &["pmem-snapshot-delete", "a", "t"],
        &["pmem-flush", "a"],
        &["pmem-info"],
        &["power-button"],
        &["nmi"],
    ];
    for args in commands {
        let out = server.run(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    let mut sent: Vec<(String, String)> = server
        .requests()
        .iter()
        .map(|r| {
            let mut words = r.split(' ');
            let method = words.next().unwrap().to_owned();
            let path = words
                .next()
                .unwrap()
                .strip_prefix("/api/v1/")
                .unwrap()
                .to_owned();
            (method, path)
        })
        .collect();
    sent.sort();
    assert_eq!(sent, routes);

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
