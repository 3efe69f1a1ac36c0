//! Sizes and offsets on the command line: a decimal number of bytes with an
//! optional K, M, G or T suffix (either case, powers of 1024).

use std::fmt;

/// Why a size did not parse; names the value as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SizeError {
    /// Nothing given.
    Empty,
    /// No digits before the suffix, or a character that is neither.
    NotANumber(String),
    /// A suffix other than K, M, G, T.
    BadSuffix(String, String),
    /// Does not fit in 64 bits.
    Overflow(String),
    /// Not a multiple of the cluster size.
    NotAligned(String, u64),
}

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeError::Empty => write!(f, "invalid size '': empty (expected a number of bytes with an optional K, M, G or T suffix)"),
            SizeError::NotANumber(s) => write!(
                f,
                "invalid size '{s}': not a number (expected digits with an optional K, M, G or T suffix)"
            ),
            SizeError::BadSuffix(s, suf) => write!(
                f,
                "invalid size '{s}': unknown suffix '{suf}' (use K, M, G or T)"
            ),
            SizeError::Overflow(s) => write!(f, "invalid size '{s}': too large (at most 2^64 - 1 bytes)"),
            SizeError::NotAligned(s, c) => write!(
                f,
                "invalid size '{s}': not a multiple of the cluster size {c}"
            ),
        }
    }
}

impl std::error::Error for SizeError {}

/// Parses `64k`, `1G`, `4096`, ... into bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    if t.is_empty() {
        return Err(SizeError::Empty);
    }
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (num, suffix) = t.split_at(digits);
    if num.is_empty() {
        return Err(SizeError::NotANumber(s.to_owned()));
    }
    let shift = match suffix {
        "" | "b" | "B" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        _ => return Err(SizeError::BadSuffix(s.to_owned(), suffix.to_owned())),
    };
    let n: u64 = num.parse().map_err(|_| SizeError::Overflow(s.to_owned()))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow(s.to_owned()))
}

/// Parses a size that must be a multiple of `cluster_size`.
pub fn parse_aligned(s: &str, cluster_size: u64) -> Result<u64, SizeError> {
    let n = parse_size(s)?;
    if cluster_size != 0 && !n.is_multiple_of(cluster_size) {
        return Err(SizeError::NotAligned(s.to_owned(), cluster_size));
    }
    Ok(n)
}

/// Parses a byte value for `-P`: decimal or `0x` hex, 0..=255.
pub fn parse_byte(s: &str) -> Result<u8, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => s.parse::<u8>(),
    };
    r.map_err(|_| format!("invalid pattern '{s}': expected a byte, 0..255 or 0x00..0xff"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes() {
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn errors_name_the_value() {
        assert_eq!(
            parse_size("12x"),
            Err(SizeError::BadSuffix("12x".into(), "x".into()))
        );
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert_eq!(parse_size("k"), Err(SizeError::NotANumber("k".into())));
        assert_eq!(parse_size("-1"), Err(SizeError::NotANumber("-1".into())));
        assert_eq!(
            parse_size("99999999999999999999"),
            Err(SizeError::Overflow("99999999999999999999".into()))
        );
        assert_eq!(
            parse_size("16777216T"),
            Err(SizeError::Overflow("16777216T".into()))
        );
        assert!(parse_size("12x").unwrap_err().to_string().contains("'12x'"));
        assert_eq!(
            parse_aligned("1000", 4096),
            Err(SizeError::NotAligned("1000".into(), 4096))
        );
        assert_eq!(parse_aligned("8k", 4096), Ok(8192));
    }

    #[test]
    fn bytes() {
        assert_eq!(parse_byte("0xcd"), Ok(0xcd));
        assert_eq!(parse_byte("7"), Ok(7));
        assert!(parse_byte("256").is_err());
        assert!(parse_byte("zz").is_err());
    }
}
