//! Parsing and the path check; the kernel side is tested in a forked
//! child (a Landlock domain cannot be left) and through the binary
//! (`vmm/tests/landlock.rs`).

use super::*;
use serde_json::json;

use crate::config::ConsoleOutputMode;

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

/// Whether Landlock is here; otherwise says SKIPPED (and fails under CI
/// where the kernel lists Landlock among its LSMs).
fn landlock_or_skip(test: &str) -> bool {
    if kernel_supports_landlock() {
        return true;
    }
    let listed = std::fs::read_to_string("/sys/kernel/security/lsm")
        .is_ok_and(|l| l.split(',').any(|m| m.trim() == "landlock"));
    assert!(
        !(listed && std::env::var_os("CI").is_some()),
        "Landlock is listed in /sys/kernel/security/lsm but not usable"
    );
    println!("SKIPPED {test}: no Landlock (landlock_create_ruleset failed)");
    false
}

#[test]
fn a_path_outside_the_rules_is_refused_and_landlock_enforces_it() {
    if !landlock_or_skip("a_path_outside_the_rules_is_refused_and_landlock_enforces_it") {
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
        let code = match Confinement::resolve(rules).restrict() {
            Err(_) => 3,
            Ok(c) => {
                // A missing directory is left to the action's own error.
                let checks = c.allows(&ins, RuleAccess::RW)
                    && !c.allows(&outs, RuleAccess::RW)
                    && !c.allows(&outs, RuleAccess::R)
                    && c.allows(Path::new("/no/such/dir/f"), RuleAccess::RW);
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

#[test]
fn rights_of_rules_above_a_path_add_up_and_the_first_missing_need_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (ro, rw) = (dir.path().join("ro"), dir.path().join("ro/rw"));
    std::fs::create_dir_all(&rw).unwrap();
    let w_only = RuleAccess {
        read: false,
        write: true,
    };
    let c = Confinement::resolve(vec![
        LandlockRule {
            path: ro.clone(),
            access: RuleAccess::R,
        },
        LandlockRule {
            path: rw.clone(),
            access: w_only,
        },
        // Left out: Landlock cannot name it.
        LandlockRule {
            path: dir.path().join("gone"),
            access: RuleAccess::RW,
        },
    ]);
    assert!(c.allows(&ro.join("f"), RuleAccess::R));
    assert!(!c.allows(&ro.join("f"), RuleAccess::RW));
    // Read from the rule above, write from its own: both.
    assert!(c.allows(&rw.join("new"), RuleAccess::RW));
    assert!(!c.allows(dir.path(), RuleAccess::R));
    // Through a symbolic link: the target decides.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&rw, &link).unwrap();
    assert!(c.allows(&link.join("x"), RuleAccess::RW));
    let needs = [
        LandlockRule {
            path: ro.join("a"),
            access: RuleAccess::R,
        },
        LandlockRule {
            path: ro.join("b"),
            access: RuleAccess::RW,
        },
        LandlockRule {
            path: dir.path().join("c"),
            access: RuleAccess::R,
        },
    ];
    assert_eq!(
        c.first_outside(&needs).map(|n| &n.path),
        Some(&ro.join("b"))
    );
    assert_eq!(c.first_outside(&needs[..1]), None);
}

#[test]
fn the_first_base_outside_is_found_without_opening_it() {
    let dir = tempfile::tempdir().unwrap();
    let (inside, outside) = (dir.path().join("in"), dir.path().join("out"));
    std::fs::create_dir_all(&inside).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let opts = pcow::CreateOptions {
        virtual_size: Some(2 << 20),
        ..Default::default()
    };
    let base = outside.join("base.pcow");
    pcow::Image::create(&base, &opts).unwrap().close().unwrap();
    let mid = inside.join("mid.pcow");
    let top = inside.join("top.pcow");
    let on = |b: &Path| pcow::CreateOptions {
        base: Some(pcow::BaseRef {
            name: b.to_str().unwrap().to_owned(),
            format: pcow::BaseFormat::Pcow,
        }),
        ..Default::default()
    };
    pcow::Image::create(&mid, &on(&base))
        .unwrap()
        .close()
        .unwrap();
    pcow::Image::create(&top, &on(&mid))
        .unwrap()
        .close()
        .unwrap();
    let rule = |path: &Path| LandlockRule {
        path: path.to_owned(),
        access: RuleAccess::RW,
    };
    let c = Confinement::resolve(vec![rule(&inside)]);
    assert_eq!(c.first_base_outside(&top), Some(base.clone()));
    let c = Confinement::resolve(vec![rule(&inside), rule(&outside)]);
    assert_eq!(c.first_base_outside(&top), None);
    // Not a file, or not pcow: nothing to walk (the config's checks speak).
    assert_eq!(c.first_base_outside(&inside), None);
    std::fs::write(inside.join("raw"), b"raw").unwrap();
    assert_eq!(c.first_base_outside(&inside.join("raw")), None);
}

#[test]
fn a_vms_needs_name_its_files_and_a_clone_instead_of_its_image() {
    let mut cfg = VmConfig::default();
    cfg.payload_mut().kernel = Some("/k/vmlinux".into());
    let pmem: crate::config::PmemConfig =
        serde_json::from_value(json!({"file": "/img/disk.pcow", "id": "p0"})).unwrap();
    cfg.pmem = Some(vec![pmem]);
    cfg.serial.mode = ConsoleOutputMode::File;
    cfg.serial.file = Some("/logs/serial.log".into());
    // A pty's path is the terminal of a previous boot, not a need.
    cfg.console.mode = ConsoleOutputMode::Pty;
    cfg.console.file = Some("/dev/pts/77".into());
    let needs = vm_needs(&cfg, &[]);
    let has = |p: &str, a: RuleAccess| {
        needs
            .iter()
            .any(|n| n.path == Path::new(p) && n.access == a)
    };
    assert!(has("/k/vmlinux", RuleAccess::R), "{needs:?}");
    assert!(has("/img/disk.pcow", RuleAccess::RW), "{needs:?}");
    assert!(has("/logs/serial.log", RuleAccess::RW), "{needs:?}");
    assert!(has("/dev/urandom", RuleAccess::R), "{needs:?}");
    assert!(
        !needs.iter().any(|n| n.path.starts_with("/dev/pts")),
        "{needs:?}"
    );
    let clone = PmemClone {
        id: "p0".into(),
        file: "/clones/c.pcow".into(),
    };
    let needs = vm_needs(&cfg, std::slice::from_ref(&clone));
    let has = |p: &str, a: RuleAccess| {
        needs
            .iter()
            .any(|n| n.path == Path::new(p) && n.access == a)
    };
    assert!(has("/clones/c.pcow", RuleAccess::RW), "{needs:?}");
    // The frozen image lies beside the snapshot's image: read only.
    assert!(has("/img", RuleAccess::R), "{needs:?}");
    assert!(!needs.iter().any(|n| n.path == Path::new("/img/disk.pcow")));
    // The VM's own rules, for the pty: the multiplexer and its terminals.
    let rules = vm_rules(&cfg).unwrap();
    assert!(rules.iter().any(|r| r.path == Path::new("/dev/ptmx")));
}

#[test]
fn a_thread_that_follows_the_published_confinement_opens_nothing() {
    let test = "a_thread_that_follows_the_published_confinement_opens_nothing";
    if !landlock_or_skip(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    // Landlock is per thread: a thread's domain ends with it, so the test
    // process itself stays unconfined.
    let late: &'static threads::LateConfinement =
        Box::leak(Box::new(threads::LateConfinement::new()));
    let (f, f2) = (file.clone(), file.clone());
    let worker = std::thread::spawn(move || {
        let mut confined = false;
        // Not published: the thread works as before.
        let before = late.follow(&mut confined).unwrap();
        let opened_before = std::fs::read(&f).is_ok();
        late.publish();
        let after = late.follow(&mut confined).unwrap();
        let again = late.follow(&mut confined).unwrap();
        let refused =
            std::fs::read(&f).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied);
        // A thread it spawns now inherits the domain (the acceptor's
        // connection threads).
        let child_refused = std::thread::spawn(move || {
            std::fs::read(&f2).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
        })
        .join()
        .unwrap();
        (before, opened_before, after, again, refused, child_refused)
    });
    let (before, opened_before, after, again, refused, child_refused) = worker.join().unwrap();
    assert!(
        !before && opened_before,
        "confined before the VMM published"
    );
    assert!(after && refused, "the following thread still opens files");
    assert!(!again, "confined twice");
    assert!(child_refused, "a thread it spawned is not confined");
    // The rest of the process is not.
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}
