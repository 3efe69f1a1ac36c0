//! Calendar dates of Unix times, in UTC, without a date crate (snapshot
//! times in `pcow-img` listings and in the VMM's API).

/// `(year, month, day, hour, minute, second)` in UTC of `sec` seconds
/// since the epoch (Howard Hinnant's `civil_from_days`).
pub fn utc(sec: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (sec / 86400) as i64;
    let rem = sec % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        m as u32,
        d as u32,
        (rem / 3600) as u32,
        (rem % 3600 / 60) as u32,
        (rem % 60) as u32,
    )
}

/// RFC 3339 in UTC: `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339(sec: u64) -> String {
    let (y, mo, d, h, mi, s) = utc(sec);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_324_597), "2026-11-22T05:16:37Z");
    }
}
