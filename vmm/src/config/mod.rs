//! Cloud Hypervisor's command line and the [`VmConfig`] it builds.
//!
//! Validation comes in layers, each with its own error type:
//!
//! 1. **Option syntax** ([`option_parser`], [`cli`]): each option's
//!    `key=value,...` string is parsed against a `SYNTAX` string that
//!    `--help` prints too; a bad value is one [`OptionError`] line naming
//!    the option, the key and the value.
//! 2. **API bodies**: the same structs deserialize from upstream's JSON
//!    (`vm.create`, `vm.add-pmem`) with [`from_json`]: as upstream, fields
//!    it does not know are ignored (each is logged as a warning).
//! 3. **The whole config** ([`VmConfig::validate`]): unsupported fields at
//!    non-default values, vCPU and RAM sizes, unique device ids (assigning
//!    `_pmem0`, `_pmem1`, ... as upstream does), the kernel and the pmem
//!    files on disk and their sizes.
//! 4. The device constructors' own checks (opening the pcow chain for
//!    writing, locks, mappings) come later, in the devices.
//!
//! ```
//! use vmm::config::{cli::CommandLine, ConsoleOutputMode};
//!
//! let cl = CommandLine::parse([
//!     "--kernel", "/boot/vmlinuz", "--cpus", "boot=2", "--memory", "size=1G",
//!     "--pmem", "file=/img.pcow,id=root", "--serial", "tty", "--console", "off",
//! ])
//! .unwrap();
//! let vm = cl.vm.unwrap();
//! assert_eq!(vm.cpus.boot_vcpus, 2);
//! assert_eq!(vm.memory.size, 1 << 30);
//! assert_eq!(vm.pmem()[0].id.as_deref(), Some("root"));
//! assert_eq!(vm.serial.mode, ConsoleOutputMode::Tty);
//! assert!(serde_json::to_string(&vm).unwrap().contains(r#""boot_vcpus":2"#));
//! ```

pub mod cli;
pub mod option_parser;
pub mod options;
mod validate;
mod vm_config;

use serde::de::DeserializeOwned;

pub use option_parser::{ByteSized, OptionParser, ParseError, Toggle};
pub use validate::{PmemFormat, ValidatedPmem, ValidationError};
pub use vm_config::{
    ConsoleConfig, ConsoleOutputMode, CoreScheduling, CpuAffinity, CpuFeatures, CpuProfile,
    CpuTopology, CpusConfig, DebugConsoleConfig, HotplugMethod, MemoryConfig, PayloadConfig,
    PciSegmentConfig, PlatformConfig, PmemConfig, RngConfig, VmConfig, DEFAULT_DEBUG_CONSOLE_PORT,
    DEFAULT_MAX_PHYS_BITS, DEFAULT_MEMORY_SIZE, DEFAULT_VCPUS, MAX_VCPUS,
};

/// Deserializes an API body (`vm.create`, `vm.add-pmem`, ...) as upstream
/// does: fields it does not know are ignored. Returns the value and the
/// paths of the ignored fields (`cpus.bogus`, `pmem.0.x`).
pub fn from_json_ignoring<T: DeserializeOwned>(
    body: &[u8],
) -> Result<(T, Vec<String>), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut ignored = Vec::new();
    let value = serde_ignored::deserialize(&mut de, |path| {
        // `?` marks a step through an `Option`: not part of the JSON path.
        let p = path.to_string().replace(".?", "");
        ignored.push(p.strip_prefix("?.").unwrap_or(&p).to_owned());
    })?;
    de.end()?;
    Ok((value, ignored))
}

/// [`from_json_ignoring`], logging a warning for each ignored field.
pub fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    let (value, ignored) = from_json_ignoring(body)?;
    for path in ignored {
        log::warn!(
            "ignoring unknown field `{}` in the request body",
            option_parser::esc(&path)
        );
    }
    Ok(value)
}

/// A bad command-line option value: one line naming the option, the value
/// as given, what is wrong (key and value) and the option's syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{option} {value:?}: {kind} (syntax: --{option} {syntax})")]
pub struct OptionError {
    /// The option, without `--`.
    pub option: &'static str,
    /// The option's value as given.
    pub value: String,
    /// The option's syntax, as `--help` prints it.
    pub syntax: &'static str,
    /// What is wrong (part of the message, not a separate source, so the
    /// error stays one line).
    pub kind: Box<ParseError>,
}

impl OptionError {
    /// An error in `value` of `--option`.
    pub fn new(option: &'static str, value: &str, syntax: &'static str, kind: ParseError) -> Self {
        OptionError {
            option,
            value: value.to_owned(),
            syntax,
            kind: Box::new(kind),
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod compat_tests;
