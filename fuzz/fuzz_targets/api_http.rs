//! Arbitrary bytes as what a client sends on the API socket: the HTTP head
//! parser (httparse, Content-Length, size limits), the router (method and
//! path) and every action's JSON body, exactly as a connection thread runs
//! them. Any input must give an action, an error a client would get (with
//! a 4xx status and a non-empty chain), or "incomplete": never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(Err(e)) = vmm::api::http::parse_and_route(data) {
        assert!(
            (400..500).contains(&e.status),
            "status {} for a bad request",
            e.status
        );
        assert!(!e.chain.is_empty());
    }
    // The body alone against every body-taking route.
    for action in [
        "vm.create",
        "vm.add-pmem",
        "vm.pmem-snapshot",
        "vm.pmem-rollback",
        "vm.resize",
        "vm.remove-device",
        "vm.add-disk",
    ] {
        let _ = vmm::api::routes::route("PUT", &format!("/api/v1/{action}"), data);
    }
});
