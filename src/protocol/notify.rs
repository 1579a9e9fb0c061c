//! Notifications on the wire, with no I/O: a message whose immediate is
//! the tag and whose bytes are a small header and the payload. A transfer
//! list with a notification posts it after its last piece, so on a reliable
//! connection (ordered) the peer sees it only after every piece landed. A
//! list that fails sends a failure notification instead, carrying the
//! reason, so the peer's wait fails at once rather than at its timeout.

#![forbid(unsafe_code)]

use bytes::{Buf, BufMut};

/// The largest payload a notification carries.
pub const MAX_NOTIFY_PAYLOAD: usize = 4096;

/// Header bytes before the payload.
pub(crate) const HEADER: usize = 8;

/// The largest notification message.
pub(crate) const MAX_MESSAGE: usize = HEADER + MAX_NOTIFY_PAYLOAD;

/// "gN": marks a notification.
const MAGIC: u16 = 0x674e;
const VERSION: u8 = 1;

/// What a notification says about its transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotifyStatus {
    /// Every piece landed.
    Done,
    /// The transfer failed; the payload is the reason, in UTF-8.
    Failed,
}

/// Encodes a notification message into `out` (cleared first). The payload
/// is cut at [`MAX_NOTIFY_PAYLOAD`] bytes (on a UTF-8 boundary for a
/// failure's reason).
pub(crate) fn encode(status: NotifyStatus, payload: &[u8], out: &mut Vec<u8>) {
    let mut len = payload.len().min(MAX_NOTIFY_PAYLOAD);
    if status == NotifyStatus::Failed {
        if let Ok(text) = std::str::from_utf8(payload) {
            while !text.is_char_boundary(len) {
                len -= 1;
            }
        }
    }
    out.clear();
    out.reserve(HEADER + len);
    out.put_u16(MAGIC);
    out.put_u8(VERSION);
    out.put_u8(match status {
        NotifyStatus::Done => 0,
        NotifyStatus::Failed => 1,
    });
    out.put_u32(len as u32);
    out.extend_from_slice(&payload[..len]);
}

/// Why a message is not a notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Malformed(pub String);

/// Decodes a notification message: its status and payload.
pub(crate) fn decode(mut msg: &[u8]) -> Result<(NotifyStatus, &[u8]), Malformed> {
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
        other => return Err(Malformed(format!("unknown status {other}"))),
    };
    let len = msg.get_u32() as usize;
    if len > MAX_NOTIFY_PAYLOAD || len != msg.len() {
        return Err(Malformed(format!("payload length {len}, with {} bytes after the header", msg.len())));
    }
    Ok((status, msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_encoded_decodes_to_the_same() {
        let mut buf = Vec::new();
        for payload in [&b""[..], b"x", &[7u8; MAX_NOTIFY_PAYLOAD]] {
            for status in [NotifyStatus::Done, NotifyStatus::Failed] {
                encode(status, payload, &mut buf);
                assert_eq!(decode(&buf), Ok((status, payload)));
            }
        }
    }

    #[test]
    fn a_long_payload_is_cut_and_a_reason_on_a_character_boundary() {
        let mut buf = Vec::new();
        encode(NotifyStatus::Done, &[1u8; MAX_NOTIFY_PAYLOAD + 10], &mut buf);
        assert_eq!(decode(&buf).unwrap().1.len(), MAX_NOTIFY_PAYLOAD);
        let reason = "é".repeat(MAX_NOTIFY_PAYLOAD); // 2 bytes each
        let cut = format!("x{reason}");
        encode(NotifyStatus::Failed, cut.as_bytes(), &mut buf);
        let (_, got) = decode(&buf).unwrap();
        assert!(std::str::from_utf8(got).is_ok(), "cut inside a character");
        assert_eq!(got.len(), MAX_NOTIFY_PAYLOAD - 1);
    }

    #[test]
    fn anything_else_is_malformed_never_a_panic() {
        let mut good = Vec::new();
        encode(NotifyStatus::Done, b"payload", &mut good);
        // Every cut, every single-byte change of the header, random bytes.
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
                // Only the status byte turned to the other known value decodes.
                let ok = decode(&m).is_ok();
                assert_eq!(ok, i == 3 && b == 1, "byte {i} = {b}");
            }
        }
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 64) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
            let _ = decode(&bytes);
        }
    }
}
