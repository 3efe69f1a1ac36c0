//! Arbitrary bytes as a snapshot's `state.json`: the envelope reader gives
//! a value or a one-line error, never a panic; an accepted envelope has a
//! valid RAM layout, and serializes and parses back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::dir::parse_state;

fuzz_target!(|data: &[u8]| {
    match parse_state(data) {
        Ok(state) => {
            let total = state
                .memory
                .check()
                .expect("an accepted envelope has a valid layout");
            let offsets: Vec<u64> = state.memory.with_file_offsets().map(|(_, o)| o).collect();
            assert!(offsets.iter().all(|&o| o < total), "offset past the RAM");
            let bytes = serde_json::to_vec(&state).expect("an accepted envelope serializes");
            let back = parse_state(&bytes).expect("and parses back");
            assert_eq!(back, state);
        }
        Err(e) => {
            let m = e.to_string();
            assert!(!m.contains('\n'), "multi-line error: {m}");
        }
    }
});
