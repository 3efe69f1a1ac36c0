//! `add-pmem`'s option string (`file=..,size=..,id=..`) and the PmemConfig
//! JSON it becomes.
//!
//! Same syntax as the VMM's `--pmem`, which follows upstream: values are
//! split at commas outside double quotes (a quoted value loses its quotes),
//! sizes are bytes or a number with a `K`, `M` or `G` suffix (binary
//! units), toggles are `on|off|true|false`. Stricter than upstream: an
//! unknown key, a key given twice and a bad value are errors, each naming
//! the key.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The accepted syntax, for errors and `--help`.
pub const PMEM_SYNTAX: &str = "file=<backing_file_path>,size=<persistent_memory_size>,\
                               iommu=on|off,discard_writes=on|off,id=<device_id>,\
                               pci_segment=<segment_id>";

const KEYS: [&str; 6] = [
    "file",
    "size",
    "iommu",
    "discard_writes",
    "id",
    "pci_segment",
];

/// The body of `vm.add-pmem`: upstream's `PmemConfig`.
///
/// ```
/// let cfg: api_client::PmemConfig = "file=/img/a.pcow,size=1G,id=pmem0".parse()?;
/// assert_eq!(
///     serde_json::to_string(&cfg).unwrap(),
///     r#"{"file":"/img/a.pcow","size":1073741824,"iommu":false,"discard_writes":false,"id":"pmem0","pci_segment":0}"#
/// );
/// # Ok::<(), api_client::PmemOptionError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PmemConfig {
    /// Backing file (pcow image or raw file), as the VMM will open it.
    pub file: String,
    /// Device size in bytes; absent: the file's own size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Behind a virtual IOMMU.
    #[serde(default)]
    pub iommu: bool,
    /// Guest writes are not written back to the file.
    #[serde(default)]
    pub discard_writes: bool,
    /// Device id; absent: the VMM assigns one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// PCI segment.
    #[serde(default)]
    pub pci_segment: u16,
}

/// Why an `add-pmem` option string did not parse.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PmemOptionError {
    #[error("empty option string")]
    Empty,
    #[error("unbalanced quotes in `{input}`")]
    UnbalancedQuotes { input: String },
    #[error(
        "unknown key `{key}` (accepted keys: file, size, iommu, discard_writes, id, pci_segment)"
    )]
    UnknownKey { key: String },
    #[error("`{key}` needs a value ({key}=...)")]
    MissingValue { key: String },
    #[error("`{key}` given twice")]
    Duplicate { key: String },
    #[error("`file` is required")]
    MissingFile,
    #[error("invalid value `{value}` for `{key}`: expected {expected}")]
    InvalidValue {
        key: String,
        value: String,
        expected: &'static str,
    },
}

impl FromStr for PmemConfig {
    type Err = PmemOptionError;

    fn from_str(s: &str) -> Result<Self, PmemOptionError> {
        if s.trim().is_empty() {
            return Err(PmemOptionError::Empty);
        }
        let mut values: [Option<String>; KEYS.len()] = Default::default();
        for item in split_commas(s)? {
            let (key, value) = item.split_once('=').unwrap_or((item.as_str(), ""));
            let key = key.trim();
            let slot =
                KEYS.iter()
                    .position(|k| *k == key)
                    .ok_or_else(|| PmemOptionError::UnknownKey {
                        key: key.to_owned(),
                    })?;
            let value = unquote(value.trim());
            if value.is_empty() {
                return Err(PmemOptionError::MissingValue {
                    key: key.to_owned(),
                });
            }
            if values[slot].replace(value.to_owned()).is_some() {
                return Err(PmemOptionError::Duplicate {
                    key: key.to_owned(),
                });
            }
        }
        let [file, size, iommu, discard_writes, id, pci_segment] = values;
        let invalid = |key: &str, value: &str, expected| PmemOptionError::InvalidValue {
            key: key.to_owned(),
            value: value.to_owned(),
            expected,
        };
        let size = match size {
            None => None,
            Some(v) => match parse_size(&v) {
                Some(0) => return Err(invalid("size", &v, "a size greater than 0")),
                Some(n) => Some(n),
                None => return Err(invalid("size", &v, SIZE_EXPECTED)),
            },
        };
        let toggle = |key: &str, v: Option<String>| match v {
            None => Ok(false),
            Some(v) => parse_toggle(&v).ok_or_else(|| invalid(key, &v, TOGGLE_EXPECTED)),
        };
        let pci_segment = match pci_segment {
            None => 0,
            Some(v) if v.bytes().all(|b| b.is_ascii_digit()) => v
                .parse()
                .map_err(|_| invalid("pci_segment", &v, SEGMENT_EXPECTED))?,
            Some(v) => return Err(invalid("pci_segment", &v, SEGMENT_EXPECTED)),
        };
        Ok(PmemConfig {
            file: file.ok_or(PmemOptionError::MissingFile)?,
            size,
            iommu: toggle("iommu", iommu)?,
            discard_writes: toggle("discard_writes", discard_writes)?,
            id,
            pci_segment,
        })
    }
}

const SIZE_EXPECTED: &str = "a size in bytes, or with a K, M or G suffix (512M, 1G)";
const TOGGLE_EXPECTED: &str = "on, off, true or false";
const SEGMENT_EXPECTED: &str = "an integer from 0 to 65535";

/// Splits at commas outside double quotes.
fn split_commas(s: &str) -> Result<Vec<String>, PmemOptionError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if quoted {
        return Err(PmemOptionError::UnbalancedQuotes {
            input: s.to_owned(),
        });
    }
    out.push(cur);
    Ok(out)
}

fn unquote(v: &str) -> &str {
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(v)
}

/// `4096`, `2K`, `512M`, `1G` (binary units); `None` for anything else,
/// including values that overflow 64 bits.
fn parse_size(s: &str) -> Option<u64> {
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 10),
        b'M' => (&s[..s.len() - 1], 20),
        b'G' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn parse_toggle(s: &str) -> Option<bool> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" => Some(true),
        "off" | "false" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<PmemConfig, PmemOptionError> {
        s.parse()
    }

    #[test]
    fn full_option_string() {
        let cfg = parse(
            "file=/var/img/root.pcow,size=2G,iommu=off,discard_writes=on,id=pmem0,pci_segment=0",
        )
        .unwrap();
        assert_eq!(
            cfg,
            PmemConfig {
                file: "/var/img/root.pcow".into(),
                size: Some(2 << 30),
                iommu: false,
                discard_writes: true,
                id: Some("pmem0".into()),
                pci_segment: 0,
            }
        );
        assert_eq!(
            serde_json::to_value(&cfg).unwrap(),
            serde_json::json!({
                "file": "/var/img/root.pcow",
                "size": 2u64 << 30,
                "iommu": false,
                "discard_writes": true,
                "id": "pmem0",
                "pci_segment": 0,
            })
        );
    }

    #[test]
    fn defaults_and_absent_fields() {
        let cfg = parse("file=a.img").unwrap();
        assert_eq!(
            cfg,
            PmemConfig {
                file: "a.img".into(),
                size: None,
                iommu: false,
                discard_writes: false,
                id: None,
                pci_segment: 0,
            }
        );
        // Absent optional fields are left out, not sent as null.
        assert_eq!(
            serde_json::to_string(&cfg).unwrap(),
            r#"{"file":"a.img","iommu":false,"discard_writes":false,"pci_segment":0}"#
        );
    }

    #[test]
    fn sizes() {
        for (s, v) in [
            ("1", 1),
            ("4096", 4096),
            ("2K", 2 << 10),
            ("512M", 512 << 20),
            ("1G", 1 << 30),
            ("17179869183G", 17_179_869_183 << 30),
        ] {
            assert_eq!(
                parse(&format!("file=f,size={s}")).unwrap().size,
                Some(v),
                "{s}"
            );
        }
        for s in [
            "0",
            "0G",
            "M",
            "1.5G",
            "-1",
            "1T",
            "1m",
            "1k",
            "12X",
            "0x10",
            "17179869184G",
            "99999999999999999999",
        ] {
            let e = parse(&format!("file=f,size={s}")).unwrap_err();
            assert!(
                matches!(&e, PmemOptionError::InvalidValue { key, value, .. } if key == "size" && value == s),
                "{s}: {e:?}"
            );
        }
        assert_eq!(
            parse("file=f,size=12X").unwrap_err().to_string(),
            "invalid value `12X` for `size`: expected a size in bytes, or with a K, M or G suffix (512M, 1G)"
        );
        assert_eq!(
            parse("file=f,size=0").unwrap_err().to_string(),
            "invalid value `0` for `size`: expected a size greater than 0"
        );
    }

    #[test]
    fn toggles() {
        for (s, v) in [
            ("on", true),
            ("ON", true),
            ("true", true),
            ("off", false),
            ("False", false),
        ] {
            let cfg = parse(&format!("file=f,iommu={s},discard_writes={s}")).unwrap();
            assert_eq!((cfg.iommu, cfg.discard_writes), (v, v), "{s}");
        }
        for s in ["yes", "1", "0", "enabled"] {
            assert_eq!(
                parse(&format!("file=f,discard_writes={s}")).unwrap_err(),
                PmemOptionError::InvalidValue {
                    key: "discard_writes".into(),
                    value: s.into(),
                    expected: TOGGLE_EXPECTED,
                }
            );
        }
    }

    #[test]
    fn pci_segment() {
        assert_eq!(
            parse("file=f,pci_segment=65535").unwrap().pci_segment,
            65535
        );
        for s in ["65536", "-1", "+1", "x"] {
            assert!(
                matches!(
                    parse(&format!("file=f,pci_segment={s}")),
                    Err(PmemOptionError::InvalidValue { .. })
                ),
                "{s}"
            );
        }
    }

    #[test]
    fn quoted_values_keep_their_commas() {
        let cfg = parse(r#"file="/img/a,b.pcow",id=x"#).unwrap();
        assert_eq!(cfg.file, "/img/a,b.pcow");
        assert_eq!(
            parse(r#"file="/img/a,id=x"#).unwrap_err(),
            PmemOptionError::UnbalancedQuotes {
                input: r#"file="/img/a,id=x"#.into()
            }
        );
    }

    #[test]
    fn structural_errors() {
        let cases: &[(&str, PmemOptionError)] = &[
            ("", PmemOptionError::Empty),
            ("  ", PmemOptionError::Empty),
            ("size=1G", PmemOptionError::MissingFile),
            (
                "file=f,bogus=1",
                PmemOptionError::UnknownKey {
                    key: "bogus".into(),
                },
            ),
            (
                "file=f,readonly",
                PmemOptionError::UnknownKey {
                    key: "readonly".into(),
                },
            ),
            ("file", PmemOptionError::MissingValue { key: "file".into() }),
            (
                "file=",
                PmemOptionError::MissingValue { key: "file".into() },
            ),
            (
                "file=f,id=",
                PmemOptionError::MissingValue { key: "id".into() },
            ),
            (
                "file=f,,id=x",
                PmemOptionError::UnknownKey { key: "".into() },
            ),
            (
                "file=a,file=b",
                PmemOptionError::Duplicate { key: "file".into() },
            ),
        ];
        for (s, want) in cases {
            assert_eq!(&parse(s).unwrap_err(), want, "{s:?}");
        }
        assert_eq!(
            parse("file=f,bogus=1").unwrap_err().to_string(),
            "unknown key `bogus` (accepted keys: file, size, iommu, discard_writes, id, pci_segment)"
        );
    }
}
