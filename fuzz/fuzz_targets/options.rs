//! Arbitrary text as command-line option values (`--pmem`, `--cpus`,
//! `--memory`, `--serial`, `--console`, `--rng`, `--api-socket`) and as a whole
//! command line: a value or a one-line error naming the option, never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::config::cli::{ApiSocket, CommandLine};
use vmm::config::{ConsoleConfig, CpusConfig, MemoryConfig, PmemConfig, RngConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let one_line = |e: &dyn std::fmt::Display| {
        let m = e.to_string();
        assert!(!m.contains('\n'), "multi-line error: {m}");
    };
    if let Err(e) = PmemConfig::parse(s) {
        one_line(&e);
    }
    if let Err(e) = CpusConfig::parse(s) {
        one_line(&e);
    }
    if let Err(e) = MemoryConfig::parse(s) {
        one_line(&e);
    }
    for r in [
        ConsoleConfig::parse_serial(s),
        ConsoleConfig::parse_console(s),
    ] {
        if let Err(e) = r {
            one_line(&e);
        }
    }
    if let Err(e) = RngConfig::parse(s) {
        one_line(&e);
    }
    let _ = ApiSocket::parse(s);
    let args: Vec<&str> = s.split(' ').collect();
    if let Err(e) = CommandLine::parse(args) {
        one_line(&e);
    }
});
