//! Benchmark: `vmm.ping` latency while 1,000 slow clients are connected.
//!
//! Starts the API server (default limits) with a stand-in VMM that answers
//! every request, opens 1,000 connections that each send one byte of a
//! request head or of a declared 4 MiB body per second, then times 1,000
//! `vmm.ping` requests (one connection each, as ch-remote) and prints p50,
//! p99 and max.
//!
//! `cargo run --release -p vmm --example api_slow_clients`

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vmm::api::http::{spawn_ping_responder, HttpServer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("api.sock");
    let (tx, rx) = vmm::api::channel()?;
    spawn_ping_responder(rx)?;
    let _srv = HttpServer::start(&sock, tx)?;

    let mut slow = Vec::new();
    for i in 0..1000 {
        let mut c = UnixStream::connect(&sock)?;
        if i % 2 == 1 {
            c.write_all(b"PUT /api/v1/vm.boot HTTP/1.1\r\nContent-Length: 4194304\r\n\r\n")?;
        }
        slow.push(c);
    }
    let dripper = std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(3) {
            for c in slow.iter_mut() {
                let _ = c.write_all(b"x");
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        slow
    });

    let mut lat = Vec::new();
    for _ in 0..1000 {
        let t = Instant::now();
        let mut c = UnixStream::connect(&sock)?;
        c.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nConnection: close\r\n\r\n")?;
        let mut out = Vec::new();
        c.read_to_end(&mut out)?;
        if !out.starts_with(b"HTTP/1.1 204 ") {
            return Err(format!("ping answered {:?}", String::from_utf8_lossy(&out)).into());
        }
        lat.push(t.elapsed());
    }
    let slow = dripper.join().map_err(|_| "dripper thread panicked")?;
    lat.sort();
    let pct = |p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    println!(
        "1000 slow connections open, 1000 pings: p50 {:?} p99 {:?} max {:?}",
        pct(50),
        pct(99),
        lat[lat.len() - 1]
    );
    drop(slow);
    Ok(())
}
