//! Arbitrary text as command-line option values (every option with a
//! `key=value` syntax, `--rng` included, `--log-format`, `--api-socket`), as a whole command
//! line, and as a `vm.create` body: a value or a one-line error naming the
//! option, never a panic; a JSON config that parses serializes and parses
//! back to itself, and validation never panics on it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::config::cli::{ApiSocket, CommandLine};
use vmm::config::options::{
    check_log_format, EventMonitor, RestoreConfig, DEVICE_OPTIONS,
};
use vmm::config::{
    ConsoleConfig, CpusConfig, DebugConsoleConfig, MemoryConfig, PciSegmentConfig,
    PlatformConfig, PmemConfig, RngConfig, VmConfig,
};

fuzz_target!(|data: &[u8]| {
    if let Ok((mut v, _)) = vmm::config::from_json_ignoring::<VmConfig>(data) {
        let s = serde_json::to_string(&v).expect("a parsed config serializes");
        let back: VmConfig = vmm::config::from_json(s.as_bytes()).expect("and parses back");
        assert_eq!(back, v);
        // Only files named by the input are looked at; errors are values.
        let _ = v.validate();
    }
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let one_line = |e: &dyn std::fmt::Display| {
        let m = e.to_string();
        assert!(!m.contains('\n'), "multi-line error: {m}");
    };
    macro_rules! check {
        ($e:expr) => {
            if let Err(e) = $e {
                one_line(&e);
            }
        };
    }
    check!(PmemConfig::parse(s));
    check!(CpusConfig::parse(s));
    check!(MemoryConfig::parse(s));
    check!(PlatformConfig::parse(s));
    check!(PciSegmentConfig::parse(s));
    check!(DebugConsoleConfig::parse(s));
    check!(EventMonitor::parse(s));
    check!(RestoreConfig::parse(s));
    check!(check_log_format(s));
    for d in DEVICE_OPTIONS {
        check!(d.parse(s));
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
    check!(CommandLine::parse(args));
});
