//! Output helpers shared by the commands: qemu-img's size and date
//! formats, JSON printing, error lines.

use std::io::Write;

/// The error and its cause chain on one line, joined with ": ".
pub fn error_line(e: &anyhow::Error) -> String {
    e.chain()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}

/// Human size as qemu-img prints it: three significant digits in the unit
/// that keeps the value below 1000 (`1 GiB`, `196 KiB`, `1.5 GiB`, `0 B`).
pub fn human_size(v: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut i = 0usize;
    // Switch to the next unit once the value reaches 1000 of the current.
    while i + 1 < UNITS.len() && (v as f64) >= 1000.0 * (1u64 << (10 * i)) as f64 {
        i += 1;
    }
    let x = v as f64 / (1u64 << (10 * i)) as f64;
    format!("{} {}", sig3(x), UNITS[i])
}

/// `%0.3g` for values below 1000.
fn sig3(x: f64) -> String {
    let s = if x >= 99.95 {
        format!("{x:.0}")
    } else if x >= 9.995 {
        format!("{x:.1}")
    } else if x >= 0.9995 || x == 0.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// `YYYY-MM-DD HH:MM:SS` in local time (UTC if the conversion fails).
pub fn date(sec: u64) -> String {
    let t = libc::time_t::try_from(sec).unwrap_or(libc::time_t::MAX);
    // SAFETY: an all-zero `tm` is a valid value (integers and, on glibc, a
    // null zone pointer); localtime_r only writes into it.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals of the right types;
    // localtime_r is the thread-safe variant and keeps no reference.
    let r = unsafe { libc::localtime_r(&t, &mut tm) };
    if r.is_null() {
        return civil_utc(sec);
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// UTC date from seconds since the epoch.
fn civil_utc(sec: u64) -> String {
    let (y, m, d, hh, mm, ss) = pcow::civil::utc(sec);
    format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}:{ss:02}")
}

/// `%#-16x` as C prints it: `0` for zero, `0x...` otherwise, padded to 16.
pub fn hex16(v: u64) -> String {
    let s = if v == 0 {
        "0".to_owned()
    } else {
        format!("{v:#x}")
    };
    format!("{s:<16}")
}

/// Prints a JSON value, pretty, with a final newline.
pub fn print_json(v: &serde_json::Value) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_like_qemu() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(512), "512 B");
        assert_eq!(human_size(1 << 30), "1 GiB");
        assert_eq!(human_size(3 << 29), "1.5 GiB");
        assert_eq!(human_size(200_704), "196 KiB");
        assert_eq!(human_size(1000 << 10), "0.977 MiB");
        assert_eq!(human_size(65536), "64 KiB");
        assert_eq!(human_size(10 << 20), "10 MiB");
    }

    #[test]
    fn dates() {
        assert_eq!(civil_utc(0), "1970-01-01 00:00:00");
        assert_eq!(civil_utc(1_700_000_000), "2023-11-14 22:13:20");
    }

    #[test]
    fn hex_like_c() {
        assert_eq!(hex16(0).trim_end(), "0");
        assert_eq!(hex16(65536).trim_end(), "0x10000");
        assert_eq!(hex16(1).len(), 16);
    }
}
