//! Byte blobs of the snapshot state (a local APIC's register page, an
//! XSAVE area, FPU registers) written as lowercase hex strings: readable
//! in `state.json`, and two characters a byte instead of a JSON array's
//! four or more.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// Bytes that serialize as a hex string (`"00ff..."`). Deserializing
/// rejects odd lengths and characters that are not hex digits; the length
/// each field needs is checked by the state that holds it.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct HexBytes(pub Vec<u8>);

impl fmt::Debug for HexBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HexBytes({} bytes)", self.0.len())
    }
}

impl HexBytes {
    /// The bytes as a lowercase hex string.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(self.0.len() * 2);
        for b in &self.0 {
            s.push(DIGITS[usize::from(b >> 4)] as char);
            s.push(DIGITS[usize::from(b & 0xf)] as char);
        }
        s
    }

    /// Parses a hex string (either case), or says what is wrong with it.
    pub fn from_hex(s: &str) -> Result<HexBytes, String> {
        if !s.len().is_multiple_of(2) {
            return Err(format!(
                "{} hex digits: not a whole number of bytes",
                s.len()
            ));
        }
        let digit = |c: u8, at: usize| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("character {at} is not a hex digit")),
        };
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len() / 2);
        for i in (0..b.len()).step_by(2) {
            out.push(digit(b[i], i)? << 4 | digit(b[i + 1], i + 1)?);
        }
        Ok(HexBytes(out))
    }
}

impl Serialize for HexBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for HexBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HexBytes, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HexBytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string of hex digits")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HexBytes, E> {
                HexBytes::from_hex(v).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

/// `#[serde(with = "crate::snapshot::hex_bytes")]` for a `Vec<u8>` field
/// (config space, FIFOs): the same hex string as [`HexBytes`].
pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&HexBytes(bytes.to_vec()).to_hex())
}

/// The reading half of [`serialize`].
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    HexBytes::deserialize(d).map(|h| h.0)
}

/// Decodes a hex string, or says what is wrong with it.
pub fn decode(s: &str) -> Result<Vec<u8>, String> {
    HexBytes::from_hex(s).map(|h| h.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_bad_strings() {
        let b = HexBytes(vec![0, 0x7f, 0xff, 0x10]);
        let j = serde_json::to_string(&b).unwrap();
        assert_eq!(j, "\"007fff10\"");
        assert_eq!(serde_json::from_str::<HexBytes>(&j).unwrap(), b);
        assert_eq!(HexBytes::from_hex("AbCd").unwrap().0, [0xab, 0xcd]);
        assert!(HexBytes::from_hex("abc")
            .unwrap_err()
            .contains("3 hex digits"));
        assert!(HexBytes::from_hex("0g")
            .unwrap_err()
            .contains("character 1"));
        assert!(serde_json::from_str::<HexBytes>("[1,2]").is_err());
        assert!(serde_json::from_str::<HexBytes>("\"zz\"").is_err());
    }
}
