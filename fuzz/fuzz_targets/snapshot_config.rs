//! Arbitrary bytes as a snapshot's `config.json`: parsing and validation
//! give a config or a one-line error, never a panic; an accepted config
//! serializes (as the snapshot writer writes it) and is accepted again,
//! unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::dir::parse_config;

fuzz_target!(|data: &[u8]| {
    // No file is looked at: a snapshot's config is checked without them.
    match parse_config(data) {
        Ok(config) => {
            let bytes = serde_json::to_vec(&config).expect("an accepted config serializes");
            let back = parse_config(&bytes).expect("and is accepted again");
            assert_eq!(back, config);
        }
        Err(e) => {
            let m = e.to_string();
            assert!(!m.contains('\n'), "multi-line error: {m}");
        }
    }
});
