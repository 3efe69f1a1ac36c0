//! The header and its two slots: reading them (the current slot is the
//! valid one with the higher generation), and the header as an open image
//! keeps it: staged for the next barrier, next to the committed slot and
//! generation.

use std::fs::File;

use crate::format::{FormatError, Geometry, Header, MAGIC, MAX_CLUSTER_BITS, MIN_CLUSTER_BITS};
use crate::io::Storage;

/// An open image's header.
#[derive(Debug)]
pub(crate) struct HeaderState {
    /// Counters and fields as the next barrier will write them.
    pub(crate) staged: Header,
    /// Slot (0 = A, 1 = B) holding the committed header.
    pub(crate) slot: u8,
    /// Generation of the last committed barrier.
    pub(crate) committed_gen: u64,
}

impl HeaderState {
    /// The header read from `slot`, committed.
    pub(crate) fn new(header: Header, slot: u8) -> Self {
        HeaderState {
            committed_gen: header.generation,
            staged: header,
            slot,
        }
    }

    /// File offset of the committed header slot.
    pub(crate) fn offset(&self) -> u64 {
        u64::from(self.slot) * self.staged.geometry.slot_size() as u64
    }
}

/// Whether the file starts with the pcow magic.
pub fn is_pcow(file: &File) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut m = [0u8; 8];
    match file.read_exact_at(&mut m, 0) {
        Ok(()) => Ok(m == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Why the header could not be read.
#[derive(Debug)]
pub(crate) enum HeaderError {
    Io(std::io::Error),
    Format(FormatError),
}

fn read_slot(
    storage: &dyn Storage,
    at: u64,
    len: usize,
    file_len: u64,
) -> std::result::Result<Option<Vec<u8>>, std::io::Error> {
    if at + len as u64 > file_len {
        return Ok(None);
    }
    let mut buf = vec![0u8; len];
    storage.read_at(&mut buf, at)?;
    Ok(Some(buf))
}

/// Reads both header slots and returns the current one (the valid slot with
/// the higher generation), its index, and where each valid slot's non-zero
/// bytes end.
pub(crate) fn read_header(
    storage: &dyn Storage,
    file_len: u64,
) -> std::result::Result<(Header, u8, [Option<usize>; 2]), HeaderError> {
    let mut magic = [0u8; 8];
    if file_len < 8 {
        return Err(HeaderError::Format(FormatError::NotPcow));
    }
    storage.read_at(&mut magic, 0).map_err(HeaderError::Io)?;
    if magic != MAGIC {
        return Err(HeaderError::Format(FormatError::NotPcow));
    }
    let min_slot = 1u64 << (MIN_CLUSTER_BITS - 1);
    if file_len < min_slot {
        return Err(HeaderError::Format(FormatError::Truncated {
            len: file_len,
        }));
    }
    // Slot A's cluster_bits tells where slot B is; if slot A is torn, try
    // every geometry for B (its own cluster_bits must agree).
    let mut bits = [0u8; 4];
    if file_len >= 20 {
        storage.read_at(&mut bits, 16).map_err(HeaderError::Io)?;
    }
    let a_bits = u32::from_le_bytes(bits);
    let decode_at = |g: Geometry,
                     at: u64|
     -> std::result::Result<Option<(Header, Vec<u8>)>, HeaderError> {
        let Some(buf) = read_slot(storage, at, g.slot_size(), file_len).map_err(HeaderError::Io)?
        else {
            return Ok(None);
        };
        match Header::decode(&buf, at) {
            Ok(h) if h.geometry == g => Ok(Some((h, buf))),
            Ok(_) => Ok(None),
            Err(e) => Err(HeaderError::Format(e)),
        }
    };
    let a = match Geometry::new(a_bits) {
        Some(g) => decode_at(g, 0),
        None => Err(HeaderError::Format(FormatError::ClusterBits {
            value: a_bits,
            offset: 16,
        })),
    };
    let b = match &a {
        Ok(Some((h, _))) => decode_at(h.geometry, h.geometry.slot_size() as u64),
        _ => {
            // Without slot A's geometry, slot B may be at any of the slot
            // sizes. A candidate that has the magic but fails a rule is
            // remembered, so the error names what is wrong with slot B.
            let mut found = Ok(None);
            for bits in MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS {
                if let Some(g) = Geometry::new(bits) {
                    match decode_at(g, g.slot_size() as u64) {
                        Ok(Some(x)) => {
                            found = Ok(Some(x));
                            break;
                        }
                        Err(HeaderError::Io(e)) => return Err(HeaderError::Io(e)),
                        Err(HeaderError::Format(FormatError::HeaderMagic { .. })) | Ok(None) => {}
                        Err(e) => {
                            if matches!(found, Ok(None)) {
                                found = Err(e);
                            }
                        }
                    }
                }
            }
            found
        }
    };
    // A slot whose CRC is right is a real header even when a rule fails
    // (unknown feature, future version): its error must not be hidden by
    // falling back to the older slot.
    let end = |r: &std::result::Result<Option<(Header, Vec<u8>)>, HeaderError>| match r {
        Ok(Some((_, buf))) => Some(crate::slot_ends::content_end(buf)),
        _ => None,
    };
    let ends = [end(&a), end(&b)];
    match (a, b) {
        (Ok(Some((ha, _))), Ok(Some((hb, _)))) => {
            if hb.generation > ha.generation {
                Ok((hb, 1, ends))
            } else {
                Ok((ha, 0, ends))
            }
        }
        (
            Ok(Some((ha, _))),
            Ok(None)
            | Err(HeaderError::Format(FormatError::Crc { .. } | FormatError::HeaderMagic { .. })),
        ) => Ok((ha, 0, ends)),
        (
            Ok(None)
            | Err(HeaderError::Format(
                FormatError::Crc { .. }
                | FormatError::HeaderMagic { .. }
                | FormatError::ClusterBits { .. },
            )),
            Ok(Some((hb, _))),
        ) => Ok((hb, 1, ends)),
        (Err(HeaderError::Io(e)), _) | (_, Err(HeaderError::Io(e))) => Err(HeaderError::Io(e)),
        (Err(HeaderError::Format(e)), _)
            if !matches!(e, FormatError::Crc { .. } | FormatError::HeaderMagic { .. }) =>
        {
            Err(HeaderError::Format(e))
        }
        (_, Err(HeaderError::Format(e)))
            if !matches!(e, FormatError::Crc { .. } | FormatError::HeaderMagic { .. }) =>
        {
            Err(HeaderError::Format(e))
        }
        (a, b) => Err(HeaderError::Format(FormatError::NoValidHeader {
            a: describe(&a),
            b: describe(&b),
        })),
    }
}

fn describe(r: &std::result::Result<Option<(Header, Vec<u8>)>, HeaderError>) -> String {
    match r {
        Ok(Some(_)) => "valid".into(),
        Ok(None) => "absent".into(),
        Err(HeaderError::Format(e)) => e.to_string(),
        Err(HeaderError::Io(e)) => e.to_string(),
    }
}
