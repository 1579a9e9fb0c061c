//! Byte sizes as people write them: `256MiB`, `64k`, `1GB`, `4096`.

#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// Parses a byte size. Binary suffixes (`KiB`, `MiB`, `GiB`, `TiB`, and the
/// short `k`, `m`, `g`, `t`, `K`, `M`, `G`, `T`) are powers of 1024; decimal
/// ones (`kB`, `MB`, `GB`, `TB`) powers of 1000; `B` or nothing is bytes.
///
/// # Errors
/// [`Error::InvalidArgument`] for anything else, or a size that overflows.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '_').unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let num: u64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("`{text}` is not a byte size (like 4096, 64KiB, 256MiB)")))?;
    let mult: u64 = match suffix.trim() {
        "" | "B" | "b" => 1,
        "k" | "K" | "KiB" | "kiB" | "Ki" => 1 << 10,
        "m" | "M" | "MiB" | "Mi" => 1 << 20,
        "g" | "G" | "GiB" | "Gi" => 1 << 30,
        "t" | "T" | "TiB" | "Ti" => 1 << 40,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(Error::InvalidArgument(format!("`{other}` in `{text}` is not a size unit")));
        }
    };
    num.checked_mul(mult).ok_or_else(|| Error::InvalidArgument(format!("`{text}` is too large")))
}

/// Formats a byte count with a binary suffix: `256 MiB`, `4 KiB`, `100 B`.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 { format!("{} {}", v as u64, UNITS[u]) } else { format!("{v:.2} {}", UNITS[u]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("64k").unwrap(), 65536);
        assert_eq!(parse_bytes("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes(" 2 G ").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1_000").unwrap(), 1000);
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("99999999999999999999T").is_err());
        assert!(parse_bytes("16777216T").is_err());
    }

    #[test]
    fn sizes_format() {
        assert_eq!(format_bytes(256 << 20), "256 MiB");
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
    }
}
