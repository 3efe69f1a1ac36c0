//! Cloud Hypervisor's `key=value,key=value` option syntax.
//!
//! Behaviour follows upstream's `OptionParser`: values are split at commas
//! except inside `[...]` (and `"..."`), every key must be one the option
//! declared (an unknown key is an error naming it and the accepted keys),
//! a key declared valueless (`--serial off`) takes no `=value`. Two
//! deliberate differences: a key given twice is an error (upstream keeps
//! the last one silently), and sizes that overflow 64 bits are an error
//! (upstream's shift wraps).

use std::str::FromStr;

/// What went wrong in one option string. The message names the key and the
/// value; the caller ([`super::OptionError`]) adds the option and its
/// syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The option string is empty.
    #[error("empty value")]
    Empty,
    /// A key the option does not know.
    #[error("unknown key `{}` (accepted keys: {accepted})", esc(.key))]
    UnknownKey {
        /// The key as given.
        key: String,
        /// The accepted keys, comma-separated.
        accepted: String,
    },
    /// A key that needs `=value` was given without one.
    #[error("`{0}` needs a value ({0}=...)", esc(.key))]
    MissingValue {
        /// The key.
        key: String,
    },
    /// A valueless key (`off`, `tty`) was given a value.
    #[error("`{}` takes no value, got `{}`", esc(.key), esc(.value))]
    UnexpectedValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
    },
    /// The same key twice.
    #[error("`{}` given twice", esc(.key))]
    Duplicate {
        /// The key.
        key: String,
    },
    /// Unbalanced `[ ]` or `"`.
    #[error("unbalanced brackets or quotes in `{}`", esc(.0))]
    Unbalanced(String),
    /// A value that does not convert.
    #[error("invalid value `{}` for `{}`: expected {expected}", esc(.value), esc(.key))]
    InvalidValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What is accepted, in words.
        expected: String,
    },
    /// A required key is absent.
    #[error("`{}` is required", esc(.key))]
    Missing {
        /// The key.
        key: String,
    },
    /// Keys that exclude each other.
    #[error("`{}` and `{}` exclude each other", esc(.first), esc(.second))]
    Conflict {
        /// The first key found.
        first: String,
        /// The other key.
        second: String,
    },
}

/// `s` with control characters (and quotes) escaped, so that an error
/// naming what the user gave stays one line.
pub fn esc(s: &str) -> String {
    s.escape_debug().to_string()
}

/// Splits `s` at commas that are not inside `[...]` or `"..."`.
pub fn split_commas(s: &str) -> Result<Vec<String>, ParseError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut depth = 0usize;
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '[' if !quoted => depth += 1,
            ']' if !quoted => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| ParseError::Unbalanced(s.to_owned()))?
            }
            '"' => quoted = !quoted,
            ',' if depth == 0 && !quoted => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if depth != 0 || quoted {
        return Err(ParseError::Unbalanced(s.to_owned()));
    }
    out.push(cur);
    Ok(out)
}

#[derive(Debug)]
struct Slot {
    key: &'static str,
    requires_value: bool,
    value: Option<String>,
}

/// A parser for one option's `key=value,...` string.
#[derive(Debug, Default)]
pub struct OptionParser {
    slots: Vec<Slot>,
}

impl OptionParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares a `key=value` key.
    pub fn add(&mut self, key: &'static str) -> &mut Self {
        self.slots.push(Slot {
            key,
            requires_value: true,
            value: None,
        });
        self
    }

    /// Declares a key without value (`off`, `tty`).
    pub fn add_valueless(&mut self, key: &'static str) -> &mut Self {
        self.slots.push(Slot {
            key,
            requires_value: false,
            value: None,
        });
        self
    }

    /// Parses `input`; every key must have been declared.
    pub fn parse(&mut self, input: &str) -> Result<(), ParseError> {
        if input.trim().is_empty() {
            return Err(ParseError::Empty);
        }
        for item in split_commas(input)? {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (item.trim(), None),
            };
            let accepted = self.accepted();
            let slot = self
                .slots
                .iter_mut()
                .find(|s| s.key == key)
                .ok_or_else(|| ParseError::UnknownKey {
                    key: key.to_owned(),
                    accepted,
                })?;
            if slot.value.is_some() {
                return Err(ParseError::Duplicate {
                    key: key.to_owned(),
                });
            }
            slot.value = Some(match (slot.requires_value, value) {
                (true, Some(v)) => v.to_owned(),
                (true, None) => {
                    return Err(ParseError::MissingValue {
                        key: key.to_owned(),
                    })
                }
                (false, None) => String::new(),
                (false, Some(v)) => {
                    return Err(ParseError::UnexpectedValue {
                        key: key.to_owned(),
                        value: v.to_owned(),
                    })
                }
            });
        }
        Ok(())
    }

    fn accepted(&self) -> String {
        let keys: Vec<&str> = self.slots.iter().map(|s| s.key).collect();
        keys.join(", ")
    }

    /// Whether `key` was given.
    pub fn is_set(&self, key: &str) -> bool {
        self.slots.iter().any(|s| s.key == key && s.value.is_some())
    }

    /// The raw value of `key`, if given.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.slots
            .iter()
            .find(|s| s.key == key)
            .and_then(|s| s.value.as_deref())
    }

    /// The value of `key`, which must be given.
    pub fn require(&self, key: &str) -> Result<&str, ParseError> {
        match self.get(key) {
            Some(v) if !v.is_empty() => Ok(v),
            Some(_) => Err(ParseError::MissingValue {
                key: key.to_owned(),
            }),
            None => Err(ParseError::Missing {
                key: key.to_owned(),
            }),
        }
    }

    /// The value of `key` converted with [`FromStr`]; `expected` describes
    /// the accepted values for the error.
    pub fn convert<T: FromStr>(&self, key: &str, expected: &str) -> Result<Option<T>, ParseError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .parse::<T>()
                .map(Some)
                .map_err(|_| ParseError::InvalidValue {
                    key: key.to_owned(),
                    value: v.to_owned(),
                    expected: expected.to_owned(),
                }),
        }
    }

    /// A size (`512M`, `1G`, bytes otherwise).
    pub fn size(&self, key: &str) -> Result<Option<u64>, ParseError> {
        Ok(self
            .convert::<ByteSized>(key, ByteSized::EXPECTED)?
            .map(|b| b.0))
    }

    /// A boolean (`on|off|true|false`).
    pub fn toggle(&self, key: &str) -> Result<Option<bool>, ParseError> {
        Ok(self.convert::<Toggle>(key, Toggle::EXPECTED)?.map(|t| t.0))
    }
}

/// A size in bytes written as upstream does: a decimal number with an
/// optional `K`, `M` or `G` suffix (binary units); bytes otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSized(pub u64);

impl ByteSized {
    /// What a size looks like, for errors and help.
    pub const EXPECTED: &'static str = "a size in bytes, or with a K, M or G suffix (512M, 1G)";
}

impl FromStr for ByteSized {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        let s = s.trim();
        let (digits, shift) = match s.as_bytes().last() {
            Some(b'K') => (&s[..s.len() - 1], 10),
            Some(b'M') => (&s[..s.len() - 1], 20),
            Some(b'G') => (&s[..s.len() - 1], 30),
            _ => (s, 0),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(());
        }
        let n: u64 = digits.parse().map_err(|_| ())?;
        n.checked_mul(1u64 << shift).map(ByteSized).ok_or(())
    }
}

/// A boolean written as upstream does: `on|off|true|false` (any case).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Toggle(pub bool);

impl Toggle {
    /// What a boolean looks like, for errors and help.
    pub const EXPECTED: &'static str = "on, off, true or false";
}

impl FromStr for Toggle {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s.to_ascii_lowercase().as_str() {
            "on" | "true" => Ok(Toggle(true)),
            "off" | "false" => Ok(Toggle(false)),
            _ => Err(()),
        }
    }
}

/// Most integers a list may expand to (`0-3` is four): a hostile range
/// such as `0-4294967295` is an error, not gigabytes of memory.
pub const MAX_LIST_LEN: u64 = 4096;

/// Upstream's string list: `a,b` or `[a,b]` (brackets optional), split at
/// commas outside quotes and brackets.
pub fn string_list(s: &str) -> Result<Vec<String>, ParseError> {
    let body = s.trim().trim_matches(|c| c == '[' || c == ']');
    if body.is_empty() {
        return Ok(Vec::new());
    }
    split_commas(body)
}

/// Upstream's integer list: `[1,3,5-7]` (brackets optional, `a-b` an
/// inclusive range with `a < b`), at most [`MAX_LIST_LEN`] integers. The
/// error is the offending item.
pub fn integer_list(s: &str) -> Result<Vec<u64>, String> {
    let body = s.trim().trim_matches(|c| c == '[' || c == ']');
    let mut out = Vec::new();
    for item in body.split(',') {
        let num = |t: &str| t.trim().parse::<u64>().map_err(|_| item.to_owned());
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(item)?, num(item)?),
        };
        if a > b || (item.contains('-') && a == b) {
            return Err(item.to_owned());
        }
        if (out.len() as u64).saturating_add(b - a + 1) > MAX_LIST_LEN {
            return Err(format!("{item} (more than {MAX_LIST_LEN} integers)"));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// Upstream's tuple list: `[k1@v1,k2@v2]` (brackets required), each value
/// as given (may be a bracketed list). The error is the offending item.
pub fn tuple_list(s: &str) -> Result<Vec<(String, String)>, String> {
    let body = s
        .trim()
        .strip_prefix('[')
        .and_then(|b| b.strip_suffix(']'))
        .ok_or_else(|| s.to_owned())?;
    if body.trim().is_empty() {
        return Ok(Vec::new());
    }
    let items = split_commas(body).map_err(|_| s.to_owned())?;
    items
        .iter()
        .map(|item| match item.trim().split_once('@') {
            Some((k, v)) if !k.is_empty() && !v.contains('@') => Ok((k.to_owned(), v.to_owned())),
            _ => Err(item.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_respects_brackets_and_quotes() {
        assert_eq!(
            split_commas("a=1,b=[1,2],c").unwrap(),
            ["a=1", "b=[1,2]", "c"]
        );
        assert_eq!(split_commas("a=\"x,y\",b=2").unwrap(), ["a=\"x,y\"", "b=2"]);
        assert_eq!(
            split_commas("a=[1,2"),
            Err(ParseError::Unbalanced("a=[1,2".into()))
        );
        assert!(split_commas("a=]").is_err());
        assert!(split_commas("a=\"x").is_err());
    }

    #[test]
    fn unknown_key_names_key_and_accepted() {
        let mut p = OptionParser::new();
        p.add("boot").add("max");
        let e = p.parse("boot=1,maxx=2").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown key `maxx` (accepted keys: boot, max)"
        );
    }

    #[test]
    fn values_and_valueless() {
        let mut p = OptionParser::new();
        p.add("file").add_valueless("off").add("list");
        p.parse("file=/a b,list=[1,2,3]").unwrap();
        assert_eq!(p.get("file"), Some("/a b"));
        assert_eq!(p.get("list"), Some("[1,2,3]"));
        assert!(!p.is_set("off"));
        let mut p = OptionParser::new();
        p.add("file").add_valueless("off");
        assert_eq!(
            p.parse("off=1").unwrap_err().to_string(),
            "`off` takes no value, got `1`"
        );
        let mut p = OptionParser::new();
        p.add("file");
        assert_eq!(
            p.parse("file").unwrap_err().to_string(),
            "`file` needs a value (file=...)"
        );
        let mut p = OptionParser::new();
        p.add("file");
        assert_eq!(
            p.parse("file=a,file=b").unwrap_err().to_string(),
            "`file` given twice"
        );
        assert_eq!(OptionParser::new().parse(""), Err(ParseError::Empty));
    }

    #[test]
    fn sizes() {
        let ok = [
            ("0", 0),
            ("4096", 4096),
            ("2K", 2048),
            ("512M", 512 << 20),
            ("1G", 1 << 30),
            (" 3G ", 3 << 30),
        ];
        for (s, v) in ok {
            assert_eq!(s.parse::<ByteSized>(), Ok(ByteSized(v)), "{s}");
        }
        for s in [
            "",
            "M",
            "1.5G",
            "-1",
            "1T",
            "1m",
            "12X",
            "99999999999G",
            "0x10",
        ] {
            assert!(s.parse::<ByteSized>().is_err(), "{s}");
        }
        let mut p = OptionParser::new();
        p.add("size");
        p.parse("size=12X").unwrap();
        assert_eq!(
            p.size("size").unwrap_err().to_string(),
            format!(
                "invalid value `12X` for `size`: expected {}",
                ByteSized::EXPECTED
            )
        );
    }

    #[test]
    fn toggles() {
        for (s, v) in [
            ("on", true),
            ("ON", true),
            ("true", true),
            ("off", false),
            ("false", false),
        ] {
            assert_eq!(s.parse::<Toggle>(), Ok(Toggle(v)));
        }
        for s in ["", "yes", "1", "0", "enabled"] {
            assert!(s.parse::<Toggle>().is_err(), "{s}");
        }
    }
}
