//! The `key=value,...` option strings `ch-remote` takes (`add-pmem
//! file=F,size=4M`, `restore source_url=...`), with upstream's syntax.
//!
//! Upstream's rules: the string is split at commas outside double quotes
//! and outside `[...]` (so `queue_sizes=[256,256]` is one option), each
//! piece is `key=value`, a value loses its surrounding quotes. Stricter
//! than upstream, so that a typo is never sent on: a key given twice, an
//! empty value (`id=`) and an ASCII control character are errors, and every
//! conversion names the key and the value it refused.

use std::collections::HashMap;

/// Why an option string or one of its values was refused.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("empty option string")]
    Empty,
    #[error("empty {what}")]
    EmptyArgument { what: &'static str },
    #[error("unbalanced quotes or brackets in `{input}`")]
    Unbalanced { input: String },
    #[error("unknown option `{key}` (accepted: {accepted})")]
    UnknownKey { key: String, accepted: String },
    #[error("`{key}` needs a value ({key}=...)")]
    MissingValue { key: String },
    #[error("`{key}` given twice")]
    Duplicate { key: String },
    #[error("`{key}` is required")]
    Required { key: &'static str },
    #[error("`{key}` contains a control character (byte {byte:#04x})")]
    ControlCharacter { key: String, byte: u8 },
    #[error("`{key}` is {len} bytes long: at most {max} are accepted")]
    TooLong { key: String, len: usize, max: usize },
    #[error("invalid value `{value}` for `{key}`: expected {expected}")]
    InvalidValue {
        key: String,
        value: String,
        expected: &'static str,
    },
    #[error("`{key}` passes file descriptors, which this ch-remote does not send")]
    FileDescriptors { key: &'static str },
    #[error("{what}")]
    Conflict { what: &'static str },
}

/// What a size value must look like.
pub const SIZE_EXPECTED: &str = "a size in bytes, or with a K, M or G suffix (512M, 1G)";
const TOGGLE_EXPECTED: &str = "on, off, true or false";

/// Queue indices, each with its host CPUs.
pub type Affinity = Vec<(u64, Vec<u64>)>;

/// One parsed option string: the values by key, each key at most once.
#[derive(Debug)]
pub struct Options {
    values: HashMap<String, String>,
}

impl Options {
    /// Parses `input`, accepting only the keys in `accepted`.
    ///
    /// ```
    /// let o = api_client::Options::parse("file=\"/a,b\",size=1G", &["file", "size", "id"])?;
    /// assert_eq!(o.string("file"), Some("/a,b"));
    /// assert_eq!(o.size("size")?, Some(1 << 30));
    /// assert_eq!(o.string("id"), None);
    /// # Ok::<(), api_client::OptionError>(())
    /// ```
    pub fn parse(input: &str, accepted: &[&str]) -> Result<Options, OptionError> {
        let input = input.trim();
        if input.is_empty() {
            return Err(OptionError::Empty);
        }
        // Before splitting: an escape sequence's `[` must not pass for a
        // list bracket.
        if let Some(item) = input.split(',').find(|i| i.chars().any(char::is_control)) {
            let (key, value) = item.split_once('=').unwrap_or(("", item));
            check_printable(key.trim(), value)?;
        }
        let mut values = HashMap::new();
        for item in split(input)? {
            let (key, value) = item.split_once('=').unwrap_or((&item, ""));
            let key = key.trim();
            if !accepted.contains(&key) {
                return Err(OptionError::UnknownKey {
                    key: key.to_owned(),
                    accepted: accepted.join(", "),
                });
            }
            let value = unquote(value.trim());
            if value.is_empty() {
                return Err(OptionError::MissingValue {
                    key: key.to_owned(),
                });
            }
            check_printable(key, value)?;
            if values.insert(key.to_owned(), value.to_owned()).is_some() {
                return Err(OptionError::Duplicate {
                    key: key.to_owned(),
                });
            }
        }
        Ok(Options { values })
    }

    /// The raw value of `key`, if given.
    pub fn string(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    /// The value of `key`, which must be given.
    pub fn required(&self, key: &'static str) -> Result<&str, OptionError> {
        self.values
            .get(key)
            .map(String::as_str)
            .ok_or(OptionError::Required { key })
    }

    /// Whether `key` was given.
    pub fn has(&self, key: &str) -> bool {
        self.values.contains_key(key)
    }

    /// `on|off|true|false` (any case).
    pub fn toggle(&self, key: &str) -> Result<Option<bool>, OptionError> {
        self.convert(key, TOGGLE_EXPECTED, |v| {
            match v.to_ascii_lowercase().as_str() {
                "on" | "true" => Some(true),
                "off" | "false" => Some(false),
                _ => None,
            }
        })
    }

    /// A byte size: digits with an optional `K`, `M` or `G` suffix.
    pub fn size(&self, key: &str) -> Result<Option<u64>, OptionError> {
        self.convert(key, SIZE_EXPECTED, parse_size)
    }

    /// An unsigned integer no larger than `max`.
    pub fn uint(
        &self,
        key: &str,
        max: u64,
        expected: &'static str,
    ) -> Result<Option<u64>, OptionError> {
        self.convert(key, expected, |v| parse_uint(v).filter(|n| *n <= max))
    }

    /// One of `choices` (matched without case), as the JSON name paired
    /// with it.
    pub fn choice(
        &self,
        key: &str,
        choices: &[(&str, &'static str)],
        expected: &'static str,
    ) -> Result<Option<&'static str>, OptionError> {
        self.convert(key, expected, |v| {
            choices
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(v))
                .map(|(_, json)| *json)
        })
    }

    /// `[1,2-4,6]`: integers and ascending ranges, each at most `max`.
    pub fn uint_list(
        &self,
        key: &str,
        max: u64,
        expected: &'static str,
    ) -> Result<Option<Vec<u64>>, OptionError> {
        self.convert(key, expected, |v| parse_uint_list(v, max))
    }

    /// `[a@1,b@2]`: pairs of a non-empty name and an integer at most `max`.
    pub fn pair_list(
        &self,
        key: &str,
        max: u64,
        expected: &'static str,
    ) -> Result<Option<Vec<(String, u64)>>, OptionError> {
        self.convert(key, expected, |v| {
            let inner = v.strip_prefix('[')?.strip_suffix(']')?;
            if inner.trim().is_empty() {
                return Some(Vec::new());
            }
            inner
                .split(',')
                .map(|pair| {
                    let (name, n) = pair.trim().rsplit_once('@')?;
                    let n = parse_uint(n).filter(|n| *n <= max)?;
                    (!name.is_empty() && !name.contains(['[', ']']))
                        .then(|| (unquote(name).to_owned(), n))
                })
                .collect()
        })
    }

    /// `[a@/path/one,b@/path/two]`: names each with a path (the path may
    /// hold `@`; the name is what comes before the first one).
    pub fn path_pair_list(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Option<Vec<(String, String)>>, OptionError> {
        self.convert(key, expected, |v| {
            let inner = v.strip_prefix('[')?.strip_suffix(']')?;
            if inner.trim().is_empty() {
                return Some(Vec::new());
            }
            inner
                .split(',')
                .map(|pair| {
                    let (name, path) = pair.trim().split_once('@')?;
                    (!name.is_empty() && !path.is_empty() && !name.contains(['[', ']']))
                        .then(|| (unquote(name).to_owned(), unquote(path).to_owned()))
                })
                .collect()
        })
    }

    /// `[0@[0,1],1@[2-3]]`: queue indices (at most `max_index`) each with
    /// a list of host CPUs (at most `max_cpu`, ranges allowed).
    pub fn affinity_list(
        &self,
        key: &str,
        max_index: u64,
        max_cpu: u64,
        expected: &'static str,
    ) -> Result<Option<Affinity>, OptionError> {
        self.convert(key, expected, |v| {
            let inner = v.strip_prefix('[')?.strip_suffix(']')?;
            split(inner)
                .ok()?
                .iter()
                .map(|item| {
                    let (index, cpus) = item.trim().split_once('@')?;
                    let index = parse_uint(index).filter(|i| *i <= max_index)?;
                    Some((index, parse_uint_list(cpus, max_cpu)?))
                })
                .collect()
        })
    }

    fn convert<T>(
        &self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>, OptionError> {
        match self.values.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| OptionError::InvalidValue {
                key: key.to_owned(),
                value: v.clone(),
                expected,
            }),
        }
    }
}

/// Longest device id, in bytes (the API's limit).
pub const MAX_ID_LEN: usize = 1024;
/// Longest snapshot tag or reference, in bytes (the API's limit, pcow's).
pub const MAX_TAG_LEN: usize = 255;
/// Longest other value (a path...), in bytes: Linux's `PATH_MAX`, the API's
/// limit.
pub const MAX_STRING_LEN: usize = 4096;

/// The longest value `key` accepts: [`MAX_ID_LEN`] for ids,
/// [`MAX_TAG_LEN`] for tags and snapshot references, [`MAX_STRING_LEN`]
/// for the rest.
pub fn max_len(key: &str) -> usize {
    match key {
        "id" | "device id" => MAX_ID_LEN,
        "tag" | "snapshot" => MAX_TAG_LEN,
        _ => MAX_STRING_LEN,
    }
}

/// Refuses control characters in a value (C0, DEL and C1: never meant,
/// and a newline or escape in an id or a path only hides what was sent),
/// and a value longer than [`max_len`] (the API would refuse it).
pub fn check_printable(key: &str, value: &str) -> Result<(), OptionError> {
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(OptionError::ControlCharacter {
            key: key.to_owned(),
            // Control characters are all below U+00A0: one byte's worth.
            byte: u8::try_from(u32::from(c)).unwrap_or(u8::MAX),
        });
    }
    let max = max_len(key);
    if value.len() > max {
        return Err(OptionError::TooLong {
            key: key.to_owned(),
            len: value.len(),
            max,
        });
    }
    Ok(())
}

/// Splits at commas outside quotes and brackets.
fn split(s: &str) -> Result<Vec<String>, OptionError> {
    let unbalanced = || OptionError::Unbalanced {
        input: s.to_owned(),
    };
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut depth = 0u32;
    for c in s.chars() {
        match c {
            '"' => quoted = !quoted,
            _ if quoted => {}
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(unbalanced)?,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if quoted || depth != 0 {
        return Err(unbalanced());
    }
    out.push(cur);
    Ok(out)
}

fn unquote(v: &str) -> &str {
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(v)
}

/// Digits only (no sign, no spaces), within 64 bits.
fn parse_uint(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `4096`, `2K`, `512M`, `1G` (binary units); `None` for anything else,
/// including values that overflow 64 bits.
pub fn parse_size(s: &str) -> Option<u64> {
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 10),
        b'M' => (&s[..s.len() - 1], 20),
        b'G' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    parse_uint(digits)?.checked_mul(1 << shift)
}

fn parse_uint_list(s: &str, max: u64) -> Option<Vec<u64>> {
    let inner = s.strip_prefix('[').unwrap_or(s);
    let inner = inner.strip_suffix(']').unwrap_or(inner);
    let mut out = Vec::new();
    for item in inner.split(',') {
        let (lo, hi) = match item.split_once('-') {
            Some((lo, hi)) => (parse_uint(lo)?, parse_uint(hi)?),
            None => {
                let n = parse_uint(item)?;
                (n, n)
            }
        };
        // Ranges are bounded by `max`, which keeps a hostile `0-99999999999`
        // from allocating without end.
        if lo > hi || hi > max {
            return None;
        }
        out.extend(lo..=hi);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYS: &[&str] = &["file", "size", "id", "on", "list", "pairs"];

    fn parse(s: &str) -> Result<Options, OptionError> {
        Options::parse(s, KEYS)
    }

    #[test]
    fn splitting_and_quotes() {
        let o = parse(r#" file="/a,b=c" , id = x ,list=[1,2-3]"#).unwrap();
        assert_eq!(o.string("file"), Some("/a,b=c"));
        assert_eq!(o.string("id"), Some("x"));
        assert_eq!(o.uint_list("list", 10, "l").unwrap(), Some(vec![1, 2, 3]));
        assert!(o.has("list") && !o.has("size"));
    }

    #[test]
    fn structural_errors() {
        let cases: &[(&str, OptionError)] = &[
            ("", OptionError::Empty),
            (" ", OptionError::Empty),
            (
                "file=\"a",
                OptionError::Unbalanced {
                    input: "file=\"a".into(),
                },
            ),
            (
                "list=[1,2",
                OptionError::Unbalanced {
                    input: "list=[1,2".into(),
                },
            ),
            (
                "list=1]",
                OptionError::Unbalanced {
                    input: "list=1]".into(),
                },
            ),
            ("file", OptionError::MissingValue { key: "file".into() }),
            ("file=", OptionError::MissingValue { key: "file".into() }),
            (
                "file=\"\"",
                OptionError::MissingValue { key: "file".into() },
            ),
            (
                "file=a,file=b",
                OptionError::Duplicate { key: "file".into() },
            ),
            (
                "file=a\nb",
                OptionError::ControlCharacter {
                    key: "file".into(),
                    byte: b'\n',
                },
            ),
            (
                "file=a\x1b[0m",
                OptionError::ControlCharacter {
                    key: "file".into(),
                    byte: 0x1b,
                },
            ),
        ];
        for (s, want) in cases {
            assert_eq!(&parse(s).unwrap_err(), want, "{s:?}");
        }
        let e = parse("file=a,,id=b").unwrap_err();
        assert!(
            matches!(e, OptionError::UnknownKey { ref key, .. } if key.is_empty()),
            "{e:?}"
        );
        assert_eq!(
            parse("bogus=1").unwrap_err().to_string(),
            "unknown option `bogus` (accepted: file, size, id, on, list, pairs)"
        );
    }

    #[test]
    fn sizes() {
        for (s, v) in [
            ("1", 1),
            ("0", 0),
            ("2K", 2 << 10),
            ("512M", 512 << 20),
            ("1G", 1 << 30),
            ("17179869183G", 17_179_869_183 << 30),
        ] {
            let o = parse(&format!("size={s}")).unwrap();
            assert_eq!(o.size("size").unwrap(), Some(v), "{s}");
        }
        for s in [
            "M",
            "1.5G",
            "-1",
            "+1",
            "1T",
            "1m",
            "1KM",
            "12X",
            "0x10",
            "17179869184G",
            "99999999999999999999",
            " 1",
        ] {
            let o = Options {
                values: [("size".to_owned(), s.to_owned())].into(),
            };
            let e = o.size("size").unwrap_err();
            assert_eq!(
                e,
                OptionError::InvalidValue {
                    key: "size".into(),
                    value: s.into(),
                    expected: SIZE_EXPECTED
                }
            );
        }
    }

    #[test]
    fn toggles_uints_choices() {
        for (s, v) in [
            ("on", true),
            ("TRUE", true),
            ("off", false),
            ("False", false),
        ] {
            assert_eq!(
                parse(&format!("on={s}")).unwrap().toggle("on").unwrap(),
                Some(v)
            );
        }
        for s in ["yes", "1", "enabled"] {
            assert!(
                parse(&format!("on={s}")).unwrap().toggle("on").is_err(),
                "{s}"
            );
        }
        let o = parse("id=65535").unwrap();
        assert_eq!(o.uint("id", 65535, "u16").unwrap(), Some(65535));
        assert!(o.uint("id", 255, "u8").is_err());
        for s in ["-1", "+1", "x", "1 2", "99999999999999999999"] {
            let o = Options {
                values: [("id".to_owned(), s.to_owned())].into(),
            };
            assert!(o.uint("id", u64::MAX, "u64").is_err(), "{s}");
        }
        let o = parse("id=OnDemand").unwrap();
        let modes = [("copy", "Copy"), ("ondemand", "OnDemand")];
        assert_eq!(o.choice("id", &modes, "m").unwrap(), Some("OnDemand"));
        assert!(parse("id=lazy").unwrap().choice("id", &modes, "m").is_err());
    }

    #[test]
    fn lists() {
        let o = parse("list=[0,2-4,6]").unwrap();
        assert_eq!(
            o.uint_list("list", 6, "l").unwrap(),
            Some(vec![0, 2, 3, 4, 6])
        );
        for s in ["[4-2]", "[1,,2]", "[a]", "[0-99999999999]", "[7]"] {
            let o = parse(&format!("list={s}")).unwrap();
            assert!(o.uint_list("list", 6, "l").is_err(), "{s}");
        }
        let o = parse("list=[0@[0,1],1@[2-3],2@4]").unwrap();
        assert_eq!(
            o.affinity_list("list", 65535, 65535, "a").unwrap(),
            Some(vec![(0, vec![0, 1]), (1, vec![2, 3]), (2, vec![4])])
        );
        for s in [
            "[0@[0-99999999]]",
            "[70000@[1]]",
            "[0]",
            "0@[1]",
            "[x@[1]]",
            "[0@[]]",
        ] {
            let o = parse(&format!("list={s}")).unwrap();
            assert!(o.affinity_list("list", 65535, 65535, "a").is_err(), "{s}");
        }
        let o = parse("pairs=[z0@1,z1@0]").unwrap();
        assert_eq!(
            o.pair_list("pairs", u32::MAX.into(), "p").unwrap(),
            Some(vec![("z0".to_owned(), 1), ("z1".to_owned(), 0)])
        );
        assert_eq!(
            parse("pairs=[]")
                .unwrap()
                .pair_list("pairs", 9, "p")
                .unwrap(),
            Some(vec![])
        );
        for s in ["[@1]", "[z0]", "[z0@x]", "z0@1", "[z0@10]"] {
            let o = parse(&format!("pairs={s}")).unwrap();
            assert!(o.pair_list("pairs", 9, "p").is_err(), "{s}");
        }
    }
}
