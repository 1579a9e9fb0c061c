//! Notifications on the wire, with no I/O: a message whose immediate is
//! the tag and whose bytes are a small header, the ranges the transfer
//! wrote (the region's key and up to [`MAX_COVER`] address ranges) and the
//! payload. A transfer list with a notification posts it after its last
//! piece, so on a reliable connection (ordered) the peer sees it only after
//! every piece landed, and makes the ranges visible to CUDA work where they
//! are GPU memory before handing the note out. A list that fails sends a
//! failure notification instead, carrying the reason, so the peer's wait
//! fails at once rather than at its timeout.

#![forbid(unsafe_code)]

use bytes::{Buf, BufMut};

/// The largest payload a notification carries.
pub const MAX_NOTIFY_PAYLOAD: usize = 4096;

/// The most ranges a notification names as written by its transfer (more
/// are merged across their smallest gaps).
pub(crate) const MAX_COVER: usize = 16;

/// Header bytes before the ranges.
pub(crate) const HEADER: usize = 16;

/// Bytes per range.
const RANGE: usize = 16;

/// The largest notification message.
pub(crate) const MAX_MESSAGE: usize = HEADER + MAX_COVER * RANGE + MAX_NOTIFY_PAYLOAD;

/// "gN": marks a notification.
const MAGIC: u16 = 0x674e;
const VERSION: u8 = 2;

/// What a notification says about its transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotifyStatus {
    /// Every piece landed.
    Done,
    /// The transfer failed; the payload is the reason, in UTF-8.
    Failed,
    /// Not a notification: the cover of one write with immediate (see
    /// [`CAP_IMM_COVERS`](crate::bootstrap::CAP_IMM_COVERS)), posted just
    /// before it; the payload is its ordinal among the connection's writes
    /// with immediate, from 1 ([`COVER_PAYLOAD`] bytes, big-endian).
    Cover,
}

/// The payload of a [`NotifyStatus::Cover`] record: the write's ordinal.
pub(crate) const COVER_PAYLOAD: usize = 8;

/// The message of the cover record for the `ordinal`-th write with
/// immediate, into `len` bytes at `addr` of the region with `key`.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) fn encode_cover(ordinal: u64, key: u32, addr: u64, len: u64, out: &mut Vec<u8>) {
    let cover = Cover { key, ranges: vec![(addr, len)] };
    encode(NotifyStatus::Cover, &cover, &ordinal.to_be_bytes(), out);
}

/// The ordinal a decoded cover record carries, if it is one.
pub(crate) fn cover_ordinal(d: &Decoded<'_>) -> Option<u64> {
    match (d.status, d.payload) {
        (NotifyStatus::Cover, &[a, b, c, e, f, g, h, i]) => Some(u64::from_be_bytes([a, b, c, e, f, g, h, i])),
        _ => None,
    }
}

/// What a transfer wrote, as its notification names it: the region's
/// remote key and up to [`MAX_COVER`] address ranges (`addr`, `len`) of it.
/// The receiving side makes them visible before it hands the notification
/// out (GPU memory on the staged path, or behind a flush).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cover {
    pub key: u32,
    pub ranges: Vec<(u64, u64)>,
}

impl Cover {
    /// The cover of writes at `ranges` (address, length; any order, any
    /// overlap) of the region with `key`: merged where they touch, then
    /// across the smallest gaps down to [`MAX_COVER`] ranges (a range may
    /// then take in bytes between two writes: making those visible too is
    /// harmless, they hold what the region held).
    pub(crate) fn of(key: u32, ranges: impl IntoIterator<Item = (u64, u64)>) -> Cover {
        let mut r: Vec<(u64, u64)> = ranges.into_iter().filter(|&(_, len)| len > 0).collect();
        r.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(r.len().min(MAX_COVER * 4));
        for (addr, len) in r {
            let end = addr.saturating_add(len);
            match merged.last_mut() {
                Some((a, l)) if addr <= a.saturating_add(*l) => *l = end.max(a.saturating_add(*l)) - *a,
                _ => merged.push((addr, end - addr)),
            }
        }
        if merged.len() > MAX_COVER {
            // Keep the MAX_COVER - 1 widest gaps; merge across the others.
            let mut gaps: Vec<(u64, usize)> =
                merged.windows(2).enumerate().map(|(i, w)| (w[1].0 - (w[0].0 + w[0].1), i)).collect();
            gaps.sort_unstable_by(|a, b| b.cmp(a));
            let mut cut: Vec<usize> = gaps[..MAX_COVER - 1].iter().map(|&(_, i)| i).collect();
            cut.sort_unstable();
            let mut out = Vec::with_capacity(MAX_COVER);
            let mut start = 0;
            for &i in cut.iter().chain(std::iter::once(&(merged.len() - 1))) {
                let (a, _) = merged[start];
                let (b, bl) = merged[i];
                out.push((a, b + bl - a));
                start = i + 1;
            }
            merged = out;
        }
        Cover { key, ranges: merged }
    }
}

/// Encodes a notification message into `out` (cleared first): its status,
/// the writes it covers, and its payload, cut at [`MAX_NOTIFY_PAYLOAD`]
/// bytes (on a UTF-8 boundary for a failure's reason; the caller refuses a
/// longer payload of its own).
pub(crate) fn encode(status: NotifyStatus, cover: &Cover, payload: &[u8], out: &mut Vec<u8>) {
    let mut len = payload.len().min(MAX_NOTIFY_PAYLOAD);
    if status == NotifyStatus::Failed {
        if let Ok(text) = std::str::from_utf8(payload) {
            while !text.is_char_boundary(len) {
                len -= 1;
            }
        }
    }
    let ranges = &cover.ranges[..cover.ranges.len().min(MAX_COVER)];
    out.clear();
    out.reserve(HEADER + ranges.len() * RANGE + len);
    out.put_u16(MAGIC);
    out.put_u8(VERSION);
    out.put_u8(match status {
        NotifyStatus::Done => 0,
        NotifyStatus::Failed => 1,
        NotifyStatus::Cover => 2,
    });
    out.put_u32(len as u32);
    out.put_u32(cover.key);
    out.put_u8(ranges.len() as u8);
    out.put_slice(&[0; 3]);
    for &(addr, l) in ranges {
        out.put_u64(addr);
        out.put_u64(l);
    }
    out.extend_from_slice(&payload[..len]);
}

/// Why a message is not a notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Malformed(pub String);

/// A decoded notification.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Decoded<'a> {
    pub status: NotifyStatus,
    pub cover: Cover,
    pub payload: &'a [u8],
}

/// Decodes a notification message: its status, cover and payload.
pub(crate) fn decode(mut msg: &[u8]) -> Result<Decoded<'_>, Malformed> {
    if msg.len() < HEADER {
        return Err(Malformed(format!("{} bytes, shorter than the {HEADER}-byte header", msg.len())));
    }
    let magic = msg.get_u16();
    if magic != MAGIC {
        return Err(Malformed(format!("magic {magic:#06x}, expected {MAGIC:#06x}")));
    }
    let version = msg.get_u8();
    if version != VERSION {
        return Err(Malformed(format!("version {version}, this side speaks {VERSION}")));
    }
    let status = match msg.get_u8() {
        0 => NotifyStatus::Done,
        1 => NotifyStatus::Failed,
        2 => NotifyStatus::Cover,
        other => return Err(Malformed(format!("unknown status {other}"))),
    };
    let len = msg.get_u32() as usize;
    let key = msg.get_u32();
    let count = usize::from(msg.get_u8());
    msg.advance(3);
    if count > MAX_COVER {
        return Err(Malformed(format!("{count} ranges, at most {MAX_COVER}")));
    }
    if len > MAX_NOTIFY_PAYLOAD || count * RANGE + len != msg.len() {
        return Err(Malformed(format!(
            "{count} ranges and a payload of {len}, with {} bytes after the header",
            msg.len()
        )));
    }
    let ranges = (0..count).map(|_| (msg.get_u64(), msg.get_u64())).collect();
    Ok(Decoded { status, cover: Cover { key, ranges }, payload: msg })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cover() -> Cover {
        Cover { key: 0x1234_5678, ranges: vec![(0x1000, 64), (0x9000, 4096)] }
    }

    #[test]
    fn what_is_encoded_decodes_to_the_same() {
        let mut buf = Vec::new();
        for payload in [&b""[..], b"x", &[7u8; MAX_NOTIFY_PAYLOAD]] {
            for status in [NotifyStatus::Done, NotifyStatus::Failed, NotifyStatus::Cover] {
                for c in [Cover::default(), cover()] {
                    encode(status, &c, payload, &mut buf);
                    assert!(buf.len() <= MAX_MESSAGE);
                    assert_eq!(decode(&buf), Ok(Decoded { status, cover: c, payload }));
                }
            }
        }
    }

    #[test]
    fn a_cover_carries_its_ordinal_and_names_one_range() {
        let mut buf = Vec::new();
        encode_cover(u64::MAX - 1, 9, 0x7000, 4096, &mut buf);
        let d = decode(&buf).unwrap();
        assert_eq!((d.status, cover_ordinal(&d)), (NotifyStatus::Cover, Some(u64::MAX - 1)));
        assert_eq!(d.cover, Cover { key: 9, ranges: vec![(0x7000, 4096)] });
        // Its record fits one ring slot of ALIGN bytes.
        assert!(crate::protocol::mailbox::record_size(buf.len()) <= crate::protocol::mailbox::ALIGN);
        encode(NotifyStatus::Done, &Cover::default(), &7u64.to_be_bytes(), &mut buf);
        assert_eq!(cover_ordinal(&decode(&buf).unwrap()), None, "a note is no cover");
    }

    #[test]
    fn a_long_payload_is_cut_and_a_reason_on_a_character_boundary() {
        let mut buf = Vec::new();
        encode(NotifyStatus::Done, &Cover::default(), &[1u8; MAX_NOTIFY_PAYLOAD + 10], &mut buf);
        assert_eq!(decode(&buf).unwrap().payload.len(), MAX_NOTIFY_PAYLOAD);
        let reason = "é".repeat(MAX_NOTIFY_PAYLOAD); // 2 bytes each
        let cut = format!("x{reason}");
        encode(NotifyStatus::Failed, &Cover::default(), cut.as_bytes(), &mut buf);
        let got = decode(&buf).unwrap().payload;
        assert!(std::str::from_utf8(got).is_ok(), "cut inside a character");
        assert_eq!(got.len(), MAX_NOTIFY_PAYLOAD - 1);
    }

    #[test]
    fn anything_else_is_malformed_never_a_panic() {
        let mut good = Vec::new();
        encode(NotifyStatus::Done, &cover(), b"payload", &mut good);
        // Every cut, every single-byte change of the fixed header, random bytes.
        for n in 0..good.len() {
            assert!(decode(&good[..n]).is_err(), "cut at {n}");
        }
        for i in 0..HEADER {
            for b in 0..=255u8 {
                let mut m = good.clone();
                if m[i] == b {
                    continue;
                }
                m[i] = b;
                // Only the status byte turned to the other known value, a
                // key, or reserved bytes decode.
                let ok = decode(&m).is_ok();
                let harmless = (i == 3 && (b == 1 || b == 2)) || (8..12).contains(&i) || (13..16).contains(&i);
                assert_eq!(ok, harmless, "byte {i} = {b}");
            }
        }
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 96) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn a_cover_merges_touching_writes_and_stays_within_its_bound() {
        // Overlapping and adjacent writes merge; empty ones vanish.
        let c = Cover::of(7, [(100, 10), (0, 50), (50, 10), (105, 20), (300, 0)]);
        assert_eq!(c.ranges, vec![(0, 60), (100, 25)]);
        // 1,000 pages with gaps of 4 KiB, and 15 wider gaps: 16 ranges, split at the wide gaps.
        let mut pages = Vec::new();
        let mut at = 0u64;
        for i in 0..1000u64 {
            pages.push((at, 4096));
            at += 8192 + if i % 64 == 63 { 1 << 20 } else { 0 };
        }
        let c = Cover::of(7, pages.iter().rev().copied());
        assert_eq!(c.ranges.len(), MAX_COVER);
        for &(a, l) in &pages {
            assert!(c.ranges.iter().any(|&(s, n)| s <= a && a + l <= s + n), "page at {a} is covered");
        }
        let covered: u64 = c.ranges.iter().map(|r| r.1).sum();
        assert!(covered < 1000 * 8192, "no wide gap was merged: {covered}");
        assert!(Cover::of(7, [(u64::MAX - 1, 10)]).ranges.len() == 1, "an overflowing write, clamped");
    }
}
