//! Parsing and the path check; the kernel side is tested in a forked
//! child (a Landlock domain cannot be left) and through the binary
//! (`vmm/tests/landlock.rs`).

use super::*;
use serde_json::json;

#[test]
fn access_words_are_upstreams() {
    assert_eq!(RuleAccess::parse("r"), Some(RuleAccess::R));
    assert_eq!(RuleAccess::parse("rw"), Some(RuleAccess::RW));
    assert_eq!(RuleAccess::parse("wr"), Some(RuleAccess::RW));
    assert_eq!(
        RuleAccess::parse("w"),
        Some(RuleAccess {
            read: false,
            write: true
        })
    );
    for bad in ["", "rr", "x", "rwx", "R", "read"] {
        assert_eq!(RuleAccess::parse(bad), None, "{bad}");
    }
}

#[test]
fn rules_parse_and_bad_ones_name_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let rules = parse_rules(&Some(json!([{"path": d, "access": "rw"}]))).unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].access, RuleAccess::RW);
    assert!(parse_rules(&None).unwrap().is_empty());
    let cases = [
        (json!({"path": d}), "must be a list"),
        (json!([{"access": "r"}]), "entry 0: path is missing"),
        (
            json!([{"path": d, "access": "r"}, {"path": d}]),
            "entry 1: access is missing",
        ),
        (
            json!([{"path": d, "access": "x"}]),
            "access \"x\": must be r, w or rw",
        ),
        (
            json!([{"path": "/no/such/dir", "access": "r"}]),
            "does not exist",
        ),
    ];
    for (v, want) in cases {
        let e = parse_rules(&Some(v.clone())).unwrap_err().to_string();
        assert!(e.contains(want), "{v}: {e}");
    }
}

#[test]
fn a_path_outside_the_rules_is_refused_and_landlock_enforces_it() {
    if !kernel_supports_landlock() {
        let listed = std::fs::read_to_string("/sys/kernel/security/lsm")
            .is_ok_and(|l| l.split(',').any(|m| m.trim() == "landlock"));
        assert!(
            !(listed && std::env::var_os("CI").is_some()),
            "Landlock is listed in /sys/kernel/security/lsm but not usable"
        );
        println!(
            "SKIPPED a_path_outside_the_rules_is_refused_and_landlock_enforces_it: no Landlock"
        );
        return;
    }
    let inside = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let rules = vec![LandlockRule {
        path: inside.path().to_owned(),
        access: RuleAccess::RW,
    }];
    let (ins, outs) = (inside.path().join("f"), outside.path().join("f"));
    // Landlock is for good once applied: restrict a forked child, which
    // reports by its exit code.
    // SAFETY: the child only runs the restriction and file calls below and
    // leaves with _exit, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let code = match Confinement::restrict(rules) {
            Err(_) => 3,
            Ok(c) => {
                // A missing directory is left to the action's own error.
                let checks = c.allows(&ins, true)
                    && !c.allows(&outs, true)
                    && !c.allows(&outs, false)
                    && c.allows(Path::new("/no/such/dir/f"), true);
                let created = std::fs::write(&ins, b"x").is_ok();
                let refused = std::fs::write(&outs, b"x")
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied);
                if checks && created && refused {
                    0
                } else {
                    4
                }
            }
        };
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "status {status:#x}"
    );
    assert!(ins.exists() && !outs.exists());
}
