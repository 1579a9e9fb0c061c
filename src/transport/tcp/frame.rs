//! Frames: the header every message and control frame starts with, its
//! flags, and how a payload is cut into frames.

/// How carrying out a frame ended: done, or why the connection breaks.
pub(super) type Handled = std::result::Result<(), String>;

/// Bytes in a frame header.
pub(super) const HEADER: usize = 32;
/// Payload bytes per frame.
pub(super) const SEGMENT: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum FrameOp {
    Send = 1,
    Write = 2,
    ReadReq = 3,
    ReadResp = 4,
    Ack = 5,
    Bye = 6,
}

impl FrameOp {
    pub(super) fn from_raw(b: u8) -> Option<FrameOp> {
        Some(match b {
            1 => FrameOp::Send,
            2 => FrameOp::Write,
            3 => FrameOp::ReadReq,
            4 => FrameOp::ReadResp,
            5 => FrameOp::Ack,
            6 => FrameOp::Bye,
            _ => return None,
        })
    }
}

pub(super) const FIRST: u8 = 1;
pub(super) const LAST: u8 = 2;
pub(super) const IMM: u8 = 4;
/// Acknowledge this message: set on the final request of an operation.
/// The others of a chain are acknowledged by that one (the receiver
/// carries messages out in order), or fail it with an error
/// acknowledgement of their own, as an unsignaled request does on verbs.
/// An untracked inline send goes without it (see [`wants_ack`]).
pub(super) const ACK: u8 = 8;

/// A frame header: `op u8, flags u8, 2 reserved, seq u32, key u32, imm u32,
/// addr u64, len u32, total u32`, little-endian. `addr` is the target
/// address of a write segment or read request, the offset of a read
/// response segment; `total` the whole message's length on its first
/// segment, the status on an acknowledgement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct FrameHeader {
    pub(super) op: u8,
    pub(super) flags: u8,
    pub(super) seq: u32,
    pub(super) key: u32,
    pub(super) imm: u32,
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) total: u32,
}

impl FrameHeader {
    pub(super) fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0] = self.op;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.key.to_le_bytes());
        b[12..16].copy_from_slice(&self.imm.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..32].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    /// Decodes a header from the peer and checks what needs no context:
    /// known flag bits, a segment no longer than [`SEGMENT`].
    pub(super) fn parse(b: &[u8; HEADER]) -> std::result::Result<FrameHeader, String> {
        let h = FrameHeader::decode(b);
        if h.flags & !(FIRST | LAST | IMM | ACK) != 0 {
            return Err(format!("a garbled frame (flags {:#04x}): the stream is out of step", h.flags));
        }
        if h.len as usize > SEGMENT {
            return Err(format!(
                "a garbled frame (a segment of {} bytes, at most {SEGMENT}): the stream is out of step",
                h.len
            ));
        }
        Ok(h)
    }

    /// Checks that `self`, read inside a message, continues the message
    /// `first` started (messages are never interleaved on the stream).
    pub(super) fn continues(&self, first: &FrameHeader) -> Handled {
        if self.op != first.op || self.seq != first.seq || self.flags & FIRST != 0 {
            return Err(format!(
                "a garbled frame (operation {} of request {} inside operation {} of request {}): the stream is out of step",
                self.op, self.seq, first.op, first.seq
            ));
        }
        Ok(())
    }

    pub(super) fn decode(b: &[u8; HEADER]) -> FrameHeader {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        FrameHeader {
            op: b[0],
            flags: b[1],
            seq: u32_at(4),
            key: u32_at(8),
            imm: u32_at(12),
            addr: u64::from_le_bytes(b[16..24].try_into().unwrap_or_default()),
            len: u32_at(24),
            total: u32_at(28),
        }
    }
}

/// One frame of a message as its writer sends it: the header, then `len`
/// bytes of payload from `src`. `wire`: the message's bytes on the wire
/// before this frame (how far its writer is when it starts it).
#[derive(Clone, Copy, Debug)]
pub(super) struct OutFrame {
    pub(super) h: FrameHeader,
    pub(super) src: u64,
    pub(super) len: usize,
    pub(super) wire: u64,
}

impl OutFrame {
    pub(super) fn is_first(&self) -> bool {
        self.wire == 0
    }

    pub(super) fn is_last(&self) -> bool {
        self.h.flags & LAST != 0
    }
}

/// The frames of the response to the peer's read `seq` of `len` bytes at
/// `addr`: `h.addr` is each segment's offset in the read.
pub(super) fn read_response_frames(seq: u32, addr: u64, len: u64) -> impl Iterator<Item = OutFrame> {
    segments(len).map(move |(off, n, flags, wire)| {
        let h =
            FrameHeader { op: FrameOp::ReadResp as u8, flags, seq, addr: off, len: n as u32, ..FrameHeader::default() };
        OutFrame { h, src: addr + off, len: n, wire }
    })
}

/// The bytes on the wire of a message or response of `len` bytes of
/// payload: its frames' headers and the payload.
pub(super) fn wire_len(len: u64) -> u64 {
    len + HEADER as u64 * frames_of(len)
}

/// How many frames carry `len` bytes of payload: one per segment of at
/// most [`SEGMENT`] bytes, one for none.
pub(super) fn frames_of(len: u64) -> u64 {
    len.div_ceil(SEGMENT as u64).max(1)
}

/// The segments `len` bytes of payload travel in: each one's offset and
/// length, its `FIRST`/`LAST` flags, and the payload's bytes on the wire
/// before its frame.
pub(super) fn segments(len: u64) -> impl Iterator<Item = (u64, usize, u8, u64)> {
    let frames = frames_of(len);
    (0..frames).map(move |i| {
        let off = i * SEGMENT as u64;
        let n = (len - off).min(SEGMENT as u64);
        let flags = if i == 0 { FIRST } else { 0 } | if i + 1 == frames { LAST } else { 0 };
        (off, n as usize, flags, off + i * HEADER as u64)
    })
}

/// The header of an acknowledgement of the peer's request `seq` (`status`
/// 0: done), or of this side's goodbye.
pub(super) fn ack_header(seq: u32, status: u32) -> FrameHeader {
    FrameHeader { op: FrameOp::Ack as u8, seq, total: status, ..FrameHeader::default() }
}

pub(super) fn bye_header() -> FrameHeader {
    FrameHeader { op: FrameOp::Bye as u8, ..FrameHeader::default() }
}

#[cfg(test)]
mod tests {
    //! The codec under random input: what this side encodes the peer
    //! decodes unchanged, and whatever bytes arrive, parsing never panics
    //! and accepts only what the rules allow.

    use proptest::prelude::*;

    use super::*;

    fn header() -> impl Strategy<Value = FrameHeader> {
        (1u8..=6, 0u8..16, any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>(), 0..=SEGMENT as u32, any::<u32>())
            .prop_map(|(op, flags, seq, key, imm, addr, len, total)| FrameHeader {
                op,
                flags,
                seq,
                key,
                imm,
                addr,
                len,
                total,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn what_is_encoded_parses_to_the_same(h in header()) {
            prop_assert_eq!(FrameHeader::parse(&h.encode()), Ok(h));
            prop_assert!(FrameOp::from_raw(h.op).is_some());
        }

        #[test]
        fn any_bytes_parse_or_are_refused_never_a_panic(b in any::<[u8; HEADER]>()) {
            match FrameHeader::parse(&b) {
                Ok(h) => {
                    prop_assert_eq!(h.flags & !(FIRST | LAST | IMM | ACK), 0);
                    prop_assert!(h.len as usize <= SEGMENT);
                    prop_assert_eq!(&h.encode()[..4], &[b[0], b[1], 0, 0][..]);
                    prop_assert_eq!(&h.encode()[4..], &b[4..]);
                }
                Err(why) => prop_assert!(why.contains("garbled"), "{}", why),
            }
        }

        #[test]
        fn a_segment_continues_only_its_own_message(first in header(), next in header()) {
            let first = FrameHeader { flags: first.flags | FIRST, ..first };
            let same = FrameHeader { op: first.op, seq: first.seq, flags: next.flags & !FIRST, ..next };
            prop_assert!(same.continues(&first).is_ok());
            let other = next.op != first.op || next.seq != first.seq || next.flags & FIRST != 0;
            prop_assert_eq!(next.continues(&first).is_err(), other);
        }
    }
}
