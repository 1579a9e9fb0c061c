//! The notification ring, with no I/O: where a connection's notifications
//! land at the peer without taking a receive.
//!
//! Each side of a connection exposes one ring to the other at the handshake
//! (a region under [`RING_TAG`]; the peer may only write it). A
//! notification is an RDMA write of one record into the peer's ring, posted
//! behind the data it covers on the same connection, so on a reliable
//! connection its bytes land after that data (the transport keeps posting
//! order). No receive is consumed: notes that arrive before the peer has an
//! [`Inbox`](crate::Inbox) wait in the ring, and the peer's own receives on
//! the same connection take only its messages.
//!
//! The ring is a byte ring of `cap` bytes after a [`HEADER`]. Records are
//! [`ALIGN`]-byte aligned:
//!
//! ```text
//! 0        8        12       16                     size-8   size
//! | seq    | len    | tag    | notification (len B) | seq    |
//! ```
//!
//! `seq` counts records from 1 (so zeroed memory is never a record) and
//! appears at both ends: a reader takes a record only once both ends show
//! the sequence number it expects, and zeroes it after copying it out. A
//! record that would cross the end of the ring is preceded by a pad record
//! (`len` = [`PAD`], header only) that sends the reader back to the start.
//!
//! The writer may run at most `cap` bytes ahead of what the reader has
//! taken. The reader writes how many bytes it has taken into the first
//! word of the writer's own ring header (credits); until they come back, a
//! notification waits (within its operation's timeout). So a ring holds at
//! most `cap` bytes of notes nobody has taken: the documented bound.

#![forbid(unsafe_code)]

use super::notify;

pub(crate) use crate::bootstrap::{MAX_RING, MIN_RING, RING_ALIGN as ALIGN, RING_TAG};

/// Bytes before the ring: word 0 holds how many ring bytes the peer has
/// taken of what this side wrote into its ring (written by the peer);
/// word 1 is where this side prepares the same count for the peer.
pub(crate) use crate::bootstrap::RING_HEADER as HEADER;

/// Offset of the credit word the peer writes.
pub(crate) const CREDITS_IN: usize = 0;

/// Offset of the word this side's credits go out from.
pub(crate) const CREDITS_OUT: usize = 8;

/// Header bytes of a record (sequence number, length, tag).
const RECORD_HEADER: usize = 16;

/// A record's `len` that marks a pad to the end of the ring.
const PAD: u32 = u32::MAX;

/// The largest record.
pub(crate) const MAX_RECORD: usize = record_size(notify::MAX_MESSAGE);

const _: () = assert!(MIN_RING >= 2 * MAX_RECORD && MIN_RING % ALIGN == 0);

/// The bytes a record of a `len`-byte notification takes.
pub(crate) const fn record_size(len: usize) -> usize {
    (RECORD_HEADER + len + 8).div_ceil(ALIGN) * ALIGN
}

pub(crate) use crate::bootstrap::valid_ring as valid_cap;

/// Where the next notification goes in the peer's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placed {
    /// A pad record first, at this ring offset, with this sequence number.
    pub pad: Option<(usize, u64)>,
    /// The record's ring offset.
    pub at: usize,
    /// Its sequence number.
    pub seq: u64,
    /// Its size in bytes.
    pub size: usize,
    /// Ring bytes it takes, pad included.
    taken: u64,
}

/// The writing side of one ring (the peer's).
#[derive(Clone, Debug)]
pub(crate) struct RingWriter {
    cap: u64,
    /// Ring bytes written, ever.
    head: u64,
    /// The next record's sequence number.
    seq: u64,
}

impl RingWriter {
    pub(crate) fn new(cap: usize) -> Self {
        RingWriter { cap: cap as u64, head: 0, seq: 1 }
    }

    /// Where a notification of `len` bytes goes, if the peer, having taken
    /// `taken` bytes, leaves room for it; nothing is committed.
    pub(crate) fn place(&self, len: usize, taken: u64) -> Option<Placed> {
        let size = record_size(len);
        // A peer cannot have taken more than was written.
        let used = self.head - taken.min(self.head);
        let off = (self.head % self.cap) as usize;
        let to_end = self.cap as usize - off;
        let (pad, at, seq, need) = if size <= to_end {
            (None, off, self.seq, size)
        } else {
            (Some((off, self.seq)), 0, self.seq + 1, to_end + size)
        };
        (used + need as u64 <= self.cap).then_some(Placed { pad, at, seq, size, taken: need as u64 })
    }

    /// Records that `p` was posted.
    pub(crate) fn commit(&mut self, p: &Placed) {
        self.head += p.taken;
        self.seq = p.seq + 1;
    }

    /// Ring bytes written, ever.
    #[cfg(test)]
    pub(crate) fn head(&self) -> u64 {
        self.head
    }
}

/// Encodes a record of `msg` with `seq` and `tag` into `out`, which holds
/// at least [`record_size`]`(msg.len())` bytes; what it writes.
pub(crate) fn encode(seq: u64, tag: u32, msg: &[u8], out: &mut [u8]) -> usize {
    let size = record_size(msg.len());
    let out = &mut out[..size];
    out.fill(0);
    out[..8].copy_from_slice(&seq.to_le_bytes());
    out[8..12].copy_from_slice(&(msg.len() as u32).to_le_bytes());
    out[12..16].copy_from_slice(&tag.to_le_bytes());
    out[RECORD_HEADER..RECORD_HEADER + msg.len()].copy_from_slice(msg);
    out[size - 8..].copy_from_slice(&seq.to_le_bytes());
    size
}

/// Encodes a pad record with `seq` into `out`; what it writes.
pub(crate) fn encode_pad(seq: u64, out: &mut [u8]) -> usize {
    out[..8].copy_from_slice(&seq.to_le_bytes());
    out[8..12].copy_from_slice(&PAD.to_le_bytes());
    out[12..16].fill(0);
    RECORD_HEADER
}

/// The reading side's view of its ring's memory, which the peer writes at
/// any time: offsets are within the ring (after [`HEADER`]).
pub(crate) trait RingMemory {
    /// The little-endian word at `off` (8-aligned), loaded with acquire
    /// ordering.
    fn load(&self, off: usize) -> u64;
    /// Copies `out.len()` bytes from `off`.
    fn copy_out(&self, off: usize, out: &mut [u8]);
    /// Zeroes `len` bytes at `off`.
    fn zero(&self, off: usize, len: usize);
}

/// Why the ring can no longer be read: the peer broke its format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Broken(pub String);

/// The reading side of this side's ring.
#[derive(Debug)]
pub(crate) struct RingReader {
    cap: u64,
    /// Ring bytes taken, ever: the credits owed to the writer.
    tail: u64,
    /// The next record's sequence number.
    seq: u64,
}

impl RingReader {
    pub(crate) fn new(cap: usize) -> Self {
        RingReader { cap: cap as u64, tail: 0, seq: 1 }
    }

    /// Ring bytes taken, ever.
    pub(crate) fn taken(&self) -> u64 {
        self.tail
    }

    /// Takes the next record if it has landed whole: copies its
    /// notification into `msg` and returns its tag.
    ///
    /// # Errors
    /// [`Broken`] when the peer wrote what no writer of this format writes
    /// (a length past the largest notification, a record across the
    /// ring's end): nothing after it can be found.
    pub(crate) fn next(&mut self, mem: &impl RingMemory, msg: &mut Vec<u8>) -> Result<Option<u32>, Broken> {
        loop {
            let off = (self.tail % self.cap) as usize;
            if mem.load(off) != self.seq {
                return Ok(None);
            }
            let meta = mem.load(off + 8);
            let (len, tag) = (meta as u32, (meta >> 32) as u32);
            if len == PAD {
                mem.zero(off, RECORD_HEADER);
                self.tail += self.cap - off as u64;
                self.seq += 1;
                continue;
            }
            if len as usize > notify::MAX_MESSAGE {
                return Err(Broken(format!(
                    "notification record {} of {len} bytes, at most {}",
                    self.seq,
                    notify::MAX_MESSAGE
                )));
            }
            let size = record_size(len as usize);
            if off + size > self.cap as usize {
                return Err(Broken(format!(
                    "notification record {} of {size} bytes at ring offset {off} runs past the ring's {} bytes",
                    self.seq, self.cap
                )));
            }
            // Both ends show this record's number, and its length did not
            // change meanwhile: it landed whole.
            if mem.load(off + size - 8) != self.seq || mem.load(off + 8) != meta {
                return Ok(None);
            }
            msg.clear();
            msg.resize(len as usize, 0);
            mem.copy_out(off + RECORD_HEADER, msg);
            mem.zero(off, size);
            self.tail += size as u64;
            self.seq += 1;
            return Ok(Some(tag));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A ring in a vector.
    struct Mem(RefCell<Vec<u8>>);

    impl Mem {
        fn new(cap: usize) -> Self {
            Mem(RefCell::new(vec![0; cap]))
        }
        fn put(&self, off: usize, bytes: &[u8]) {
            self.0.borrow_mut()[off..off + bytes.len()].copy_from_slice(bytes);
        }
    }

    impl RingMemory for Mem {
        fn load(&self, off: usize) -> u64 {
            u64::from_le_bytes(self.0.borrow()[off..off + 8].try_into().unwrap())
        }
        fn copy_out(&self, off: usize, out: &mut [u8]) {
            out.copy_from_slice(&self.0.borrow()[off..off + out.len()]);
        }
        fn zero(&self, off: usize, len: usize) {
            self.0.borrow_mut()[off..off + len].fill(0);
        }
    }

    /// Writes a note as a writer would, if there is room; the bytes of the
    /// record and the pad, each as one write.
    fn write(w: &mut RingWriter, mem: &Mem, taken: u64, tag: u32, msg: &[u8]) -> bool {
        let Some(p) = w.place(msg.len(), taken) else { return false };
        let mut buf = vec![0; MAX_RECORD];
        if let Some((at, seq)) = p.pad {
            let n = encode_pad(seq, &mut buf);
            mem.put(at, &buf[..n]);
        }
        let n = encode(p.seq, tag, msg, &mut buf);
        assert_eq!(n, p.size);
        mem.put(p.at, &buf[..n]);
        w.commit(&p);
        true
    }

    #[test]
    fn records_are_read_in_order_across_wraps_and_the_writer_waits_for_credits() {
        let cap = MIN_RING;
        let mem = Mem::new(cap);
        let (mut w, mut r) = (RingWriter::new(cap), RingReader::new(cap));
        let mut msg = Vec::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let (mut sent, mut got) = (0u32, 0u32);
        for _ in 0..5_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = (rng % notify::MAX_MESSAGE as u64) as usize;
            if rng % 3 != 0 {
                let body: Vec<u8> = (0..len).map(|i| (i as u32 ^ sent) as u8).collect();
                if write(&mut w, &mem, r.taken(), sent, &body) {
                    sent += 1;
                } else {
                    // No room means the writer is a whole ring ahead, near enough.
                    assert!(w.head() - r.taken() + record_size(len) as u64 > cap as u64 - MAX_RECORD as u64);
                }
            } else {
                while let Some(tag) = r.next(&mem, &mut msg).unwrap() {
                    assert_eq!(tag, got, "in order");
                    assert!(msg.iter().enumerate().all(|(i, &b)| b == (i as u32 ^ got) as u8));
                    got += 1;
                }
                assert_eq!(got, sent, "everything written is read");
            }
        }
        assert!(sent > 1_000, "the ring wrapped many times: {sent} notes");
    }

    #[test]
    fn a_record_is_taken_only_once_both_ends_landed() {
        let mem = Mem::new(MIN_RING);
        let mut r = RingReader::new(MIN_RING);
        let mut buf = vec![0; MAX_RECORD];
        let n = encode(1, 7, b"hello", &mut buf);
        let mut msg = Vec::new();
        mem.put(0, &buf[..n - 8]);
        assert_eq!(r.next(&mem, &mut msg), Ok(None), "the tail has not landed");
        mem.put(n - 8, &buf[n - 8..n]);
        assert_eq!(r.next(&mem, &mut msg), Ok(Some(7)));
        assert_eq!(msg, b"hello");
        assert!(mem.0.borrow()[..n].iter().all(|&b| b == 0), "a taken record is zeroed");
        assert_eq!(r.next(&mem, &mut msg), Ok(None));
    }

    #[test]
    fn a_record_the_format_forbids_breaks_the_ring() {
        let mut msg = Vec::new();
        let mem = Mem::new(MIN_RING);
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&1u64.to_le_bytes());
        head[8..12].copy_from_slice(&(notify::MAX_MESSAGE as u32 + 1).to_le_bytes());
        mem.put(0, &head);
        assert!(RingReader::new(MIN_RING).next(&mem, &mut msg).is_err(), "too long");

        // A record that would cross the end of the ring.
        let mem = Mem::new(MIN_RING);
        let mut r = RingReader::new(MIN_RING);
        r.tail = (MIN_RING - ALIGN) as u64;
        head[8..12].copy_from_slice(&100u32.to_le_bytes());
        mem.put(MIN_RING - ALIGN, &head);
        assert!(r.next(&mem, &mut msg).unwrap_err().0.contains("runs past"));
    }
}
