//! `--landlock` and `--landlock-rules`: once a VM's config is known
//! (`vm.create`, `--kernel`, a restore), the VMM thread restricts itself
//! (and every thread it spawns later) with Landlock to the files that VM
//! needs, plus the rules the user gave. What lies outside is refused by the
//! kernel; the actions that name a new path (`vm.pmem-overlay`,
//! `vm.snapshot`, `vm.add-pmem`) check it first, so the refusal names the
//! path and says Landlock instead of a bare "Permission denied".
//!
//! The paths a VM gets ([`vm_rules`]): its kernel, initramfs and firmware
//! (read); every pmem file (read and write) and its directory (overlays,
//! frozen snapshot files and their temporary names are created beside
//! it); every base of a pcow chain (read); serial and console files and
//! sockets (their directory, as they may be created), `/dev/ptmx` and
//! `/dev/pts` for a pty; the rng source; `/dev/kvm`, `/dev/userfaultfd`
//! when present, `/dev/urandom`, `/proc/self` and
//! `/proc/sys/vm/max_map_count`. A restore adds the snapshot directory
//! (read): its files are the VM's, and the VMM confines itself before it
//! opens the VM's files, creates clones (which must lie within the rules)
//! and starts the VM's threads.
//!
//! The threads that were running before (the API server's, the event
//! monitor's) follow on their own, to no filesystem access at all
//! ([`threads`]).
//!
//! Landlock domains only narrow: a second VM in the same process (after
//! `vm.delete`) stays within the first one's rules. Its files
//! ([`vm_needs`]) are checked against them before any is opened, and the
//! first outside is refused by name ([`Confinement::first_outside`],
//! [`Confinement::first_base_outside`]).

use std::path::{Path, PathBuf};

use landlock::{
    Access, AccessFs, BitFlags, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, ABI,
};
use serde_json::Value;

use crate::config::{ConsoleOutputMode, VmConfig};
use crate::snapshot::restore::PmemClone;

pub mod threads;

/// The Landlock ABI whose rights are handled (v5 adds `IoctlDev`, which
/// the rule on `/dev/kvm` grants).
const LANDLOCK_ABI: ABI = ABI::V5;

/// Read and/or write, as `access=` gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleAccess {
    /// Reading files and listing directories.
    pub read: bool,
    /// Writing, creating, renaming and removing.
    pub write: bool,
}

impl RuleAccess {
    /// Read only.
    pub const R: RuleAccess = RuleAccess {
        read: true,
        write: false,
    };
    /// Read and write.
    pub const RW: RuleAccess = RuleAccess {
        read: true,
        write: true,
    };

    /// Parses upstream's `access=` value: `r`, `w` or both, nothing else.
    pub fn parse(s: &str) -> Option<RuleAccess> {
        if s.is_empty() || s.len() > 2 {
            return None;
        }
        let mut a = RuleAccess {
            read: false,
            write: false,
        };
        for c in s.chars() {
            match c {
                'r' if !a.read => a.read = true,
                'w' if !a.write => a.write = true,
                _ => return None,
            }
        }
        Some(a)
    }

    fn rights(self) -> BitFlags<AccessFs> {
        let mut r = BitFlags::EMPTY;
        if self.read {
            r |= AccessFs::from_read(LANDLOCK_ABI);
        }
        if self.write {
            r |= AccessFs::from_write(LANDLOCK_ABI);
        }
        r
    }
}

/// One path and what may be done beneath it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LandlockRule {
    /// A file or a directory (its whole tree).
    pub path: PathBuf,
    /// The rights given.
    pub access: RuleAccess,
}

/// Why confinement could not be set up.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("--landlock-rules entry {index}: {what}")]
    BadRule { index: usize, what: String },
    #[error("--landlock-rules entry {index}: path {path:?} does not exist")]
    NoSuchPath {
        index: usize,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Landlock: building the rule for {path:?}")]
    Rule {
        path: PathBuf,
        #[source]
        source: landlock::RulesetError,
    },
    #[error("Landlock: creating the ruleset")]
    Ruleset(#[source] landlock::RulesetError),
    #[error("Landlock: restricting the VMM")]
    Restrict(#[source] landlock::RulesetError),
    #[error(
        "--landlock: this kernel does not enforce Landlock (no Landlock LSM); refusing to run \
         unconfined when confinement was asked for"
    )]
    NotEnforced,
}

/// Parses a config's `landlock_rules` (upstream's list of
/// `{"path": .., "access": "r"|"w"|"rw"}`); every path must exist.
pub fn parse_rules(v: &Option<Value>) -> Result<Vec<LandlockRule>, LandlockError> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let list = v.as_array().ok_or_else(|| LandlockError::BadRule {
        index: 0,
        what: "landlock_rules must be a list".into(),
    })?;
    let mut rules = Vec::with_capacity(list.len());
    for (index, item) in list.iter().enumerate() {
        let bad = |what: &str| LandlockError::BadRule {
            index,
            what: what.to_owned(),
        };
        let path = item
            .get("path")
            .and_then(Value::as_str)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| bad("path is missing"))?;
        let access = item
            .get("access")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("access is missing"))?;
        let access = RuleAccess::parse(access)
            .ok_or_else(|| bad(&format!("access {access:?}: must be r, w or rw")))?;
        let path = PathBuf::from(path);
        if let Err(source) = std::fs::symlink_metadata(&path) {
            return Err(LandlockError::NoSuchPath {
                index,
                path,
                source,
            });
        }
        rules.push(LandlockRule { path, access });
    }
    Ok(rules)
}

/// The directory a file is (or will be) in.
fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// The files of a pmem file's chain: itself and, for pcow, every base.
fn chain_of(file: &Path) -> Vec<PathBuf> {
    let opts = pcow::OpenOptions {
        force_share: true,
        ..Default::default()
    };
    match pcow::Image::open(file, opts) {
        Ok(img) => img.chain_paths(),
        // Raw, or an image the device will refuse with its own error.
        Err(_) => vec![file.to_owned()],
    }
}

/// The rules a VM with `config` needs (see the module's description).
pub fn vm_rules(config: &VmConfig) -> Result<Vec<LandlockRule>, LandlockError> {
    let mut rules = Vec::new();
    let mut add = |path: PathBuf, access| rules.push(LandlockRule { path, access });
    if let Some(p) = &config.payload {
        for f in [&p.kernel, &p.initramfs, &p.firmware].into_iter().flatten() {
            add(f.clone(), RuleAccess::R);
        }
    }
    for pmem in config.pmem() {
        add(pmem.file.clone(), RuleAccess::RW);
        add(parent_dir(&pmem.file), RuleAccess::RW);
        for base in chain_of(&pmem.file).into_iter().skip(1) {
            add(base, RuleAccess::R);
        }
    }
    for c in [&config.serial, &config.console] {
        for f in [&c.file, &c.socket].into_iter().flatten() {
            add(parent_dir(f), RuleAccess::RW);
        }
        if c.mode == ConsoleOutputMode::Pty {
            // A new terminal at each first boot: the multiplexer and the
            // terminals it makes.
            add("/dev/ptmx".into(), RuleAccess::RW);
            add("/dev/pts".into(), RuleAccess::RW);
        }
    }
    add(config.rng.src.clone(), RuleAccess::R);
    add("/dev/kvm".into(), RuleAccess::RW);
    add("/dev/urandom".into(), RuleAccess::R);
    add("/proc/self".into(), RuleAccess::R);
    // The device sizes its mapping budget from it.
    add("/proc/sys/vm/max_map_count".into(), RuleAccess::R);
    if Path::new("/dev/userfaultfd").exists() {
        add("/dev/userfaultfd".into(), RuleAccess::RW);
    }
    rules.extend(parse_rules(&config.landlock_rules)?);
    Ok(rules)
}

/// The paths a VM with `config` opens or creates itself, each with the
/// access it needs: what must lie within the rules a process already keeps
/// before that VM is created or restored there. Its pmem files (or, for a
/// device `clones` names, the clone's file, and read access to the
/// snapshot's image's directory, where its frozen image lies), kernel,
/// initramfs and firmware, serial and console files and sockets, rng
/// source, and its own `landlock_rules` (they would widen nothing). The
/// bases of its pcow chains are found by [`Confinement::first_base_outside`].
pub fn vm_needs(config: &VmConfig, clones: &[PmemClone]) -> Vec<LandlockRule> {
    let mut needs = Vec::new();
    let mut add = |path: PathBuf, access| needs.push(LandlockRule { path, access });
    if let Some(p) = &config.payload {
        for f in [&p.kernel, &p.initramfs, &p.firmware].into_iter().flatten() {
            add(f.clone(), RuleAccess::R);
        }
    }
    for pmem in config.pmem() {
        let clone = clones
            .iter()
            .find(|c| pmem.id.as_deref() == Some(c.id.as_str()));
        match clone {
            Some(c) => {
                add(c.file.clone(), RuleAccess::RW);
                add(parent_dir(&pmem.file), RuleAccess::R);
            }
            None => add(pmem.file.clone(), RuleAccess::RW),
        }
    }
    for c in [&config.serial, &config.console] {
        let path = match c.mode {
            ConsoleOutputMode::File => &c.file,
            ConsoleOutputMode::Socket => &c.socket,
            // A pty's `file` is the terminal a previous boot made: the next
            // one gets a new terminal (see `vm_rules`).
            _ => &None,
        };
        if let Some(f) = path {
            add(f.clone(), RuleAccess::RW);
        }
    }
    add(config.rng.src.clone(), RuleAccess::R);
    // Rules that do not parse are the config's own validation's to refuse.
    needs.extend(parse_rules(&config.landlock_rules).unwrap_or_default());
    needs
}

/// The rules in force in this process (or about to be): canonical paths
/// and their rights.
#[derive(Debug, Clone)]
pub struct Confinement {
    rules: Vec<LandlockRule>,
}

impl Confinement {
    /// The rules as Landlock will see them, restricting nothing yet: each
    /// path resolved (symbolic links followed), those that do not exist
    /// left out (Landlock can only name existing files).
    pub fn resolve(rules: Vec<LandlockRule>) -> Confinement {
        let rules = rules
            .into_iter()
            .filter_map(|r| {
                std::fs::canonicalize(&r.path)
                    .ok()
                    .map(|path| LandlockRule {
                        path,
                        access: r.access,
                    })
            })
            .collect();
        Confinement { rules }
    }

    /// Restricts the calling thread (and the threads it spawns later) to
    /// these rules. A path that vanished since [`Confinement::resolve`] is
    /// left out here too, so [`Confinement::allows`] never claims more
    /// than the kernel grants.
    pub fn restrict(self) -> Result<Confinement, LandlockError> {
        let handled = AccessFs::from_all(LANDLOCK_ABI);
        let mut ruleset = Ruleset::default()
            .handle_access(handled)
            .map_err(LandlockError::Ruleset)?
            .create()
            .map_err(LandlockError::Ruleset)?;
        let mut kept = Vec::new();
        for rule in self.rules {
            let Ok(fd) = PathFd::new(&rule.path) else {
                continue;
            };
            let mut rights = rule.access.rights();
            if !rule.path.is_dir() {
                rights &= AccessFs::from_file(LANDLOCK_ABI);
            }
            ruleset = ruleset
                .add_rule(PathBeneath::new(fd, rights))
                .map_err(|source| LandlockError::Rule {
                    path: rule.path.clone(),
                    source,
                })?;
            kept.push(rule);
        }
        let status = ruleset.restrict_self().map_err(LandlockError::Restrict)?;
        if status.ruleset == RulesetStatus::NotEnforced {
            return Err(LandlockError::NotEnforced);
        }
        Ok(Confinement { rules: kept })
    }

    /// Whether `path` (existing or to be created) lies beneath rules that
    /// together give `need` (writing: creating it in its directory
    /// counts). A path whose directory does not exist is let through: the
    /// action then fails with its own error naming what is missing.
    pub fn allows(&self, path: &Path, need: RuleAccess) -> bool {
        let resolved = std::fs::canonicalize(path).or_else(|_| {
            let name = path.file_name().ok_or(std::io::ErrorKind::InvalidInput)?;
            std::fs::canonicalize(parent_dir(path)).map(|d| d.join(name))
        });
        let Ok(resolved) = resolved else {
            return true;
        };
        // Landlock grants the union of the rights of every rule above a
        // file.
        let (read, write) = self
            .rules
            .iter()
            .filter(|r| resolved.starts_with(&r.path))
            .fold((false, false), |(r, w), rule| {
                (r || rule.access.read, w || rule.access.write)
            });
        (read || !need.read) && (write || !need.write)
    }

    /// The first of `needs` these rules do not allow.
    pub fn first_outside<'a>(&self, needs: &'a [LandlockRule]) -> Option<&'a LandlockRule> {
        needs.iter().find(|n| !self.allows(&n.path, n.access))
    }

    /// The first base of `file`'s pcow chain these rules do not let the
    /// VMM read, found before that base is opened: each image is opened
    /// without its base (`skip_base`) to learn the next name. A raw file,
    /// an image that does not open, or the end of the chain ends the walk
    /// (the device's own checks then give their errors).
    pub fn first_base_outside(&self, file: &Path) -> Option<PathBuf> {
        let mut current = file.to_owned();
        for _ in 0..=pcow::format::MAX_CHAIN_DEPTH {
            // A FIFO or a device is refused by the config's own checks;
            // never open one here.
            if !std::fs::metadata(&current).is_ok_and(|m| m.is_file()) {
                return None;
            }
            let opts = pcow::OpenOptions {
                force_share: true,
                skip_base: true,
                ..Default::default()
            };
            let img = pcow::Image::open(&current, opts).ok()?;
            let base = img.base_ref()?;
            let next = pcow::resolve_base(&current, &base.name);
            if !self.allows(&next, RuleAccess::R) {
                return Some(next);
            }
            current = next;
        }
        None
    }
}

/// Whether this kernel enforces Landlock (for tests that need it).
pub fn kernel_supports_landlock() -> bool {
    // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    // only returns the ABI version (or an error); it creates nothing.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    v >= 1
}

#[cfg(test)]
mod tests;
