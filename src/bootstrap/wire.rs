//! The handshake's wire format: pure encoding and decoding, no I/O.
//!
//! Every message is one frame: a fixed 16-byte header, then the payload.
//!
//! ```text
//! offset size field
//!      0    4 magic        "GRDM" (0x4752444d), big-endian
//!      4    2 version      protocol version (this crate: 4)
//!      6    1 kind         1 hello, 2 ready, 3 bye, 4 reject, 5 challenge,
//!                          6 proof, 7 accept
//!      7    1 flags        0
//!      8    4 length       payload bytes, at most the receiver's limit
//!     12    4 crc32        CRC-32 (IEEE) of the payload
//! ```
//!
//! The header layout never changes between versions, so a peer of another
//! version is told apart from a garbled one. All integers are big-endian.
//! A hello's payload:
//!
//! ```text
//!  caps u64                              bit 0: a verbs endpoint follows
//!                                        bit 1: a TCP endpoint follows
//!                                        bit 2: a name follows the regions
//!                                        bit 3: cover writes with immediate
//!                                        (a record naming each one's range in
//!                                        this side's notification ring first)
//!  [verbs endpoint, 36 bytes, if caps bit 0]
//!     qp_num u32, psn u32, max_msg_sz u32, lid u16, mtu u8 (ibv_mtu),
//!     link_layer u8, responder_resources u8, 3 reserved bytes, gid [16]
//!  [TCP endpoint, 12 bytes, if caps bit 1]
//!     rnr_retry u8, min_rnr_timer u8, 2 reserved bytes, max_message u32,
//!     send_depth u32 (1..=MAX_TCP_QUEUE_DEPTH: the requests this side
//!     keeps outstanding at most; the peer buffers no more replies than that)
//!
//! An end offers what it can and may use: verbs when it has an active RDMA
//! port (and TCP was not asked for), TCP unless verbs only was asked for.
//! Both ends then choose the same way: verbs when both offer it on one
//! fabric, else TCP when both offer it, else the handshake fails.
//!  region count u32
//!  regions, 32 bytes each: tag u64, addr u64, len u64, rkey u32, access u32
//!    (exactly one under tag u64::MAX: the side's notification ring,
//!    writable, 64 bytes of header then MIN_RING..=MAX_RING bytes)
//!  [name, if caps bit 2: length u16 (1..=256), then that many bytes: who
//!   this side is, for the peer to tell its connections apart]
//!  (trailing bytes, reserved for later extensions of version 1, are ignored)
//! ```
//!
//! A reject's payload is a UTF-8 reason of at most 1 KiB.

use bytes::{Buf, BufMut, Bytes, BytesMut};

pub use crate::remote::{REGION_LEN, decode_region, encode_region};

#[cfg(test)]
use crate::access::Access;
use crate::error::BootstrapError;
use crate::remote::RemoteRegion;

/// "GRDM".
pub const MAGIC: u32 = 0x4752_444d;
/// The protocol version this crate speaks (5: each side announces its
/// notification ring among its regions, under
/// [`RING_TAG`]).
pub const VERSION: u16 = 5;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 16;
/// The default limit on a frame's payload.
pub const DEFAULT_MAX_PAYLOAD: u32 = 1 << 20;
/// The largest reject reason.
pub const MAX_REASON: usize = 1024;

/// The tag of the region each side announces as its notification ring:
/// where the peer writes its notifications (see [`Hello::regions`]). A
/// region of the user's may not use it.
pub const RING_TAG: u64 = u64::MAX;

/// Bytes of a notification ring's header, before the ring itself.
pub const RING_HEADER: usize = 64;

/// The smallest notification ring (the ring itself, after its header):
/// two of the largest notification records.
pub const MIN_RING: usize = 16 << 10;

/// The largest notification ring a side makes or accepts.
pub const MAX_RING: usize = 64 << 20;

/// The notification ring a connection makes unless told otherwise
/// ([`ConnectOptions::notify_ring`](crate::ConnectOptions::notify_ring)).
pub const DEFAULT_RING: usize = 64 << 10;

/// Records in a ring start on this alignment; a ring's size is a multiple.
pub const RING_ALIGN: usize = 64;

/// Whether `cap` is a ring size this side makes or accepts.
pub fn valid_ring(cap: usize) -> bool {
    (MIN_RING..=MAX_RING).contains(&cap) && cap % RING_ALIGN == 0
}

/// Takes the peer's notification ring out of the regions its hello
/// announced, checked: exactly one, writable, of a size this side accepts.
///
/// # Errors
/// [`BootstrapError::Incompatible`] for none, several or one not writable;
/// [`BootstrapError::OutOfRange`] for its length.
pub fn take_ring(regions: &mut Vec<RemoteRegion>) -> Result<RemoteRegion, BootstrapError> {
    let n = regions.iter().filter(|r| r.tag == RING_TAG).count();
    let Some(ring) = regions.iter().find(|r| r.tag == RING_TAG).copied().filter(|_| n == 1) else {
        return Err(BootstrapError::Incompatible(format!(
            "the peer announced {n} notification rings (region tag {RING_TAG:#x}); one is needed"
        )));
    };
    regions.retain(|r| r.tag != RING_TAG);
    let cap = ring.len.checked_sub(RING_HEADER as u64);
    if !cap.is_some_and(|c| usize::try_from(c).is_ok_and(valid_ring)) {
        return Err(BootstrapError::OutOfRange {
            field: "notification ring length",
            value: ring.len,
            min: (RING_HEADER + MIN_RING) as u64,
            max: (RING_HEADER + MAX_RING) as u64,
        });
    }
    if !ring.access.contains(crate::access::Access::REMOTE_WRITE) {
        return Err(BootstrapError::Incompatible("the peer's notification ring is not writable".into()));
    }
    Ok(ring)
}

/// Capability bit: the hello carries a verbs endpoint.
pub const CAP_VERBS: u64 = 1;
/// Capability bit: the hello carries a TCP endpoint.
pub const CAP_TCP: u64 = 2;
/// Hello capability bit: a name follows the regions.
pub const CAP_NAME: u64 = 4;
/// Hello capability bit: over verbs, put a cover record (the range it
/// writes) in this side's notification ring ahead of each write with
/// immediate. Set by a side that may hold GPU memory on the staged path,
/// where an immediate alone names nothing to copy in.
pub const CAP_IMM_COVERS: u64 = 8;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// The endpoint and the exposed regions.
    Hello = 1,
    /// "My queue pair is ready to receive and send."
    Ready = 2,
    /// "I am closing; no more operations from me."
    Bye = 3,
    /// "I refuse this connection", with a reason.
    Reject = 4,
    /// A nonce the peer must prove knowledge of the shared secret against.
    Challenge = 5,
    /// The proof: an HMAC of the nonces under the shared secret.
    Proof = 6,
    /// "Your proof is good."
    Accept = 7,
}

impl FrameKind {
    fn from_raw(raw: u8) -> Option<Self> {
        Some(match raw {
            1 => FrameKind::Hello,
            2 => FrameKind::Ready,
            3 => FrameKind::Bye,
            4 => FrameKind::Reject,
            5 => FrameKind::Challenge,
            6 => FrameKind::Proof,
            7 => FrameKind::Accept,
            _ => return None,
        })
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Hello => "hello",
            FrameKind::Ready => "ready",
            FrameKind::Bye => "bye",
            FrameKind::Reject => "reject",
            FrameKind::Challenge => "challenge",
            FrameKind::Proof => "proof",
            FrameKind::Accept => "accept",
        }
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Payload length.
    pub len: u32,
    /// CRC-32 of the payload.
    pub crc: u32,
}

/// Decodes and checks a header: magic, then version, then kind, then the
/// length against `max_payload` (before anything is allocated for it).
///
/// # Errors
/// [`BootstrapError::BadMagic`], [`BootstrapError::VersionMismatch`],
/// [`BootstrapError::Malformed`] (unknown kind or flags),
/// [`BootstrapError::Oversized`].
pub fn decode_header(bytes: &[u8; HEADER_LEN], max_payload: u32) -> Result<Header, BootstrapError> {
    let mut b = &bytes[..];
    let magic = b.get_u32();
    if magic != MAGIC {
        return Err(BootstrapError::BadMagic { found: magic, expected: MAGIC });
    }
    let version = b.get_u16();
    if version != VERSION {
        return Err(BootstrapError::VersionMismatch { ours: VERSION, theirs: version });
    }
    let kind_raw = b.get_u8();
    let flags = b.get_u8();
    let len = b.get_u32();
    let crc = b.get_u32();
    let kind = FrameKind::from_raw(kind_raw).ok_or_else(|| BootstrapError::Malformed {
        what: "frame header",
        detail: format!("unknown message kind {kind_raw}"),
    })?;
    if flags != 0 {
        return Err(BootstrapError::Malformed { what: "frame header", detail: format!("unknown flags {flags:#04x}") });
    }
    if len > max_payload {
        return Err(BootstrapError::Oversized { len: u64::from(len), max: u64::from(max_payload) });
    }
    Ok(Header { kind, len, crc })
}

/// Encodes a whole frame.
pub fn encode_frame(kind: FrameKind, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + payload.len());
    out.put_u32(MAGIC);
    out.put_u16(VERSION);
    out.put_u8(kind as u8);
    out.put_u8(0);
    out.put_u32(payload.len() as u32);
    out.put_u32(crc32fast::hash(payload));
    out.put_slice(payload);
    out.freeze()
}

/// Checks a payload against its header's CRC.
///
/// # Errors
/// [`BootstrapError::Checksum`].
pub fn check_payload(header: &Header, payload: &[u8]) -> Result<(), BootstrapError> {
    let computed = crc32fast::hash(payload);
    if computed != header.crc {
        return Err(BootstrapError::Checksum { found: header.crc, computed });
    }
    Ok(())
}

/// Decodes one complete frame from the front of `bytes`, returning it and
/// the bytes it used. For in-memory decoding (tests, fuzzing); the socket
/// path reads header and payload separately with the same checks.
///
/// # Errors
/// Every [`BootstrapError`] a frame can cause, [`BootstrapError::Truncated`]
/// when `bytes` ends inside the frame.
pub fn decode_frame(bytes: &[u8], max_payload: u32) -> Result<(FrameKind, Bytes, usize), BootstrapError> {
    let Some(head) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(BootstrapError::Truncated { expected: HEADER_LEN, got: bytes.len() });
    };
    let header = decode_header(head, max_payload)?;
    let total = HEADER_LEN + header.len as usize;
    if bytes.len() < total {
        return Err(BootstrapError::Truncated { expected: total, got: bytes.len() });
    }
    let payload = &bytes[HEADER_LEN..total];
    check_payload(&header, payload)?;
    Ok((header.kind, Bytes::copy_from_slice(payload), total))
}

/// The verbs part of a hello: how to reach this side's queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerbsEndpoint {
    /// Queue pair number (24 bits, non-zero).
    pub qp_num: u32,
    /// First packet sequence number this side sends (24 bits).
    pub psn: u32,
    /// Largest message the port carries.
    pub max_msg_sz: u32,
    /// LID (InfiniBand).
    pub lid: u16,
    /// Active MTU (`ibv_mtu` number, 1..=5).
    pub mtu: u8,
    /// Link layer (`IBV_LINK_LAYER_*`).
    pub link_layer: u8,
    /// RDMA reads this side accepts outstanding as target.
    pub responder_resources: u8,
    /// GID.
    pub gid: [u8; 16],
}

/// The TCP part of a hello: how this side runs the TCP transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// Receiver-not-ready retries this side's sends allow (7: forever).
    pub rnr_retry: u8,
    /// This side's receiver-not-ready timer code (how long a peer's send
    /// waits per retry for a receive to be posted here).
    pub min_rnr_timer: u8,
    /// The largest message this side accepts.
    pub max_message: u32,
    /// The requests (sends, writes, reads) this side keeps outstanding at
    /// most: its send-queue depth, 1..=[`MAX_TCP_QUEUE_DEPTH`]. The peer
    /// queues at most this many replies for it, and breaks the connection
    /// if it is sent more.
    pub send_depth: u32,
}

/// Bytes in an encoded TCP endpoint.
pub const TCP_LEN: usize = 12;

/// The deepest send queue a TCP endpoint may announce (and the TCP
/// transport's limit on [`ConnectOptions::send_queue_depth`](crate::ConnectOptions)).
pub const MAX_TCP_QUEUE_DEPTH: u32 = 1 << 16;

/// The smallest largest-message size a peer may announce (verbs
/// `max_msg_sz`, TCP `max_message`): every RDMA device carries far more
/// (InfiniBand 2 GiB, soft-RoCE 8 MiB), and work planned against the
/// peer's limit (a list split into pieces of at most that size) stays
/// proportional to what the caller asked for.
pub const MIN_MAX_MESSAGE: u32 = 64 * 1024;

/// Checks an announced number against what this side accepts.
fn in_range(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), BootstrapError> {
    if (min..=max).contains(&value) { Ok(()) } else { Err(BootstrapError::OutOfRange { field, value, min, max }) }
}

/// The first message each side sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Capability bits (the endpoint bits are set from the fields below).
    pub caps: u64,
    /// The verbs endpoint, when this side offers verbs.
    pub verbs: Option<VerbsEndpoint>,
    /// The TCP endpoint, when this side offers TCP.
    pub tcp: Option<TcpEndpoint>,
    /// The regions this side exposes to the peer.
    pub regions: Vec<RemoteRegion>,
    /// Who this side is (empty: unnamed), at most [`MAX_NAME`] bytes.
    pub name: Vec<u8>,
}

/// The longest name a hello carries.
pub const MAX_NAME: usize = 256;

/// Bytes in an encoded verbs endpoint.
pub const VERBS_LEN: usize = 36;

/// The most region descriptors one hello may carry.
pub const MAX_REGIONS: u32 = 4096;

impl Hello {
    /// Encodes the payload.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(8 + VERBS_LEN + 4 + self.regions.len() * REGION_LEN);
        let mut caps = self.caps & !(CAP_VERBS | CAP_TCP | CAP_NAME);
        if self.verbs.is_some() {
            caps |= CAP_VERBS;
        }
        if self.tcp.is_some() {
            caps |= CAP_TCP;
        }
        if !self.name.is_empty() {
            caps |= CAP_NAME;
        }
        out.put_u64(caps);
        if let Some(v) = &self.verbs {
            out.put_u32(v.qp_num);
            out.put_u32(v.psn);
            out.put_u32(v.max_msg_sz);
            out.put_u16(v.lid);
            out.put_u8(v.mtu);
            out.put_u8(v.link_layer);
            out.put_u8(v.responder_resources);
            out.put_slice(&[0; 3]);
            out.put_slice(&v.gid);
        }
        if let Some(t) = &self.tcp {
            out.put_u8(t.rnr_retry);
            out.put_u8(t.min_rnr_timer);
            out.put_u16(0);
            out.put_u32(t.max_message);
            out.put_u32(t.send_depth);
        }
        out.put_u32(self.regions.len() as u32);
        for r in &self.regions {
            out.put_slice(&encode_region(r));
        }
        if !self.name.is_empty() {
            // Cut to the limit (the caller checks it; the wire never exceeds it).
            let name = &self.name[..self.name.len().min(MAX_NAME)];
            out.put_u16(name.len() as u16);
            out.put_slice(name);
        }
        out.freeze()
    }

    /// Decodes and validates a payload.
    ///
    /// # Errors
    /// [`BootstrapError::Malformed`] naming the field.
    pub fn decode(mut p: &[u8]) -> Result<Self, BootstrapError> {
        let bad = |detail: String| BootstrapError::Malformed { what: "hello", detail };
        let short = |field: &str| bad(format!("ends before the {field} field"));
        let caps = p.try_get_u64().map_err(|_| short("caps"))?;
        let verbs = if caps & CAP_VERBS != 0 {
            if p.remaining() < VERBS_LEN {
                return Err(short("verbs endpoint"));
            }
            let qp_num = p.get_u32();
            let psn = p.get_u32();
            let max_msg_sz = p.get_u32();
            let lid = p.get_u16();
            let mtu = p.get_u8();
            let link_layer = p.get_u8();
            let responder_resources = p.get_u8();
            p.advance(3);
            let mut gid = [0u8; 16];
            p.copy_to_slice(&mut gid);
            if qp_num == 0 || qp_num > 0x00ff_ffff {
                return Err(bad(format!("queue pair number {qp_num:#x} is not a 24-bit non-zero value")));
            }
            if psn > 0x00ff_ffff {
                return Err(bad(format!("PSN {psn:#x} does not fit in 24 bits")));
            }
            if !(1..=5).contains(&mtu) {
                return Err(bad(format!("MTU code {mtu} is not 1..=5")));
            }
            in_range("verbs max_msg_sz", max_msg_sz.into(), MIN_MAX_MESSAGE.into(), u32::MAX.into())?;
            in_range("verbs responder_resources", responder_resources.into(), 1, u8::MAX.into())?;
            if link_layer > 2 {
                return Err(bad(format!("link layer {link_layer} is unknown")));
            }
            Some(VerbsEndpoint { qp_num, psn, max_msg_sz, lid, mtu, link_layer, responder_resources, gid })
        } else {
            None
        };
        let tcp = if caps & CAP_TCP != 0 {
            if p.remaining() < TCP_LEN {
                return Err(short("TCP endpoint"));
            }
            let rnr_retry = p.get_u8();
            let min_rnr_timer = p.get_u8();
            p.advance(2);
            let max_message = p.get_u32();
            let send_depth = p.get_u32();
            in_range("TCP send_depth", send_depth.into(), 1, MAX_TCP_QUEUE_DEPTH.into())?;
            in_range("TCP rnr_retry", rnr_retry.into(), 0, 7)?;
            in_range("TCP min_rnr_timer", min_rnr_timer.into(), 0, 31)?;
            in_range("TCP max_message", max_message.into(), MIN_MAX_MESSAGE.into(), u32::MAX.into())?;
            Some(TcpEndpoint { rnr_retry, min_rnr_timer, max_message, send_depth })
        } else {
            None
        };
        let count = p.try_get_u32().map_err(|_| short("region count"))?;
        if count > MAX_REGIONS {
            return Err(bad(format!("{count} regions, the limit is {MAX_REGIONS}")));
        }
        if (count as usize).saturating_mul(REGION_LEN) > p.remaining() {
            return Err(bad(format!("{count} regions announced, only {} bytes follow", p.remaining())));
        }
        let mut regions = Vec::with_capacity(count as usize);
        for _ in 0..count {
            regions.push(decode_region(&p[..REGION_LEN])?);
            p.advance(REGION_LEN);
        }
        let name = if caps & CAP_NAME != 0 {
            let len = usize::from(p.try_get_u16().map_err(|_| short("name length"))?);
            if len == 0 || len > MAX_NAME {
                return Err(bad(format!("a name of {len} bytes (1..={MAX_NAME})")));
            }
            if p.remaining() < len {
                return Err(short("name"));
            }
            p[..len].to_vec()
        } else {
            Vec::new()
        };
        Ok(Hello { caps, verbs, tcp, regions, name })
    }
}

/// Encodes a reject reason (cut to [`MAX_REASON`] bytes at a character boundary).
pub fn encode_reason(reason: &str) -> Bytes {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    Bytes::copy_from_slice(&reason.as_bytes()[..end])
}

/// Decodes a reject reason.
pub fn decode_reason(payload: &[u8]) -> String {
    String::from_utf8_lossy(&payload[..payload.len().min(MAX_REASON)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            caps: CAP_VERBS | CAP_TCP | CAP_NAME,
            verbs: Some(VerbsEndpoint {
                qp_num: 0x11,
                psn: 0xabcdef,
                max_msg_sz: 1 << 23,
                lid: 0,
                mtu: 3,
                link_layer: 2,
                responder_resources: 16,
                gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            }),
            tcp: Some(TcpEndpoint { rnr_retry: 7, min_rnr_timer: 12, max_message: 1 << 30, send_depth: 128 }),
            regions: vec![
                RemoteRegion {
                    tag: 1,
                    addr: 0x7f00_0000_0000,
                    len: 1 << 28,
                    rkey: 0x1234,
                    access: Access::REMOTE_WRITE,
                },
                RemoteRegion { tag: 2, addr: 0x1000, len: 4096, rkey: 0x99, access: Access::REMOTE_READ },
            ],
            name: b"job-7/rank/3".to_vec(),
        }
    }

    #[test]
    fn a_name_rides_after_the_regions_and_is_checked() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap().name, b"job-7/rank/3");
        let unnamed = Hello { name: vec![], caps: CAP_VERBS | CAP_TCP, ..hello() };
        let bytes = unnamed.encode();
        assert_eq!(u64::from_be_bytes(bytes[..8].try_into().unwrap()) & CAP_NAME, 0, "no name: no bit");
        // A peer of before names reads the same regions and ignores the name.
        let named = h.encode();
        let before_name = named.len() - 2 - h.name.len();
        assert_eq!(&named[8..before_name], &bytes[8..], "the same fields before the name");
        // A name announced but cut short, empty or too long is refused.
        let full = h.encode().to_vec();
        for cut in [full.len() - 1, full.len() - h.name.len() - 1] {
            assert!(matches!(Hello::decode(&full[..cut]), Err(BootstrapError::Malformed { .. })), "cut at {cut}");
        }
        let mut empty = bytes.to_vec();
        empty[7] |= CAP_NAME as u8;
        empty.extend_from_slice(&0u16.to_be_bytes());
        assert!(Hello::decode(&empty).is_err());
        let mut long = bytes.to_vec();
        long[7] |= CAP_NAME as u8;
        long.extend_from_slice(&(MAX_NAME as u16 + 1).to_be_bytes());
        long.extend(std::iter::repeat_n(b'x', MAX_NAME + 1));
        assert!(Hello::decode(&long).is_err());
    }

    #[test]
    fn hello_round_trips() {
        let h = hello();
        let frame = encode_frame(FrameKind::Hello, &h.encode());
        let (kind, payload, used) = decode_frame(&frame, DEFAULT_MAX_PAYLOAD).unwrap();
        assert_eq!((kind, used), (FrameKind::Hello, frame.len()));
        assert_eq!(Hello::decode(&payload).unwrap(), h);
        let no_verbs = Hello { caps: 0, verbs: None, tcp: None, regions: vec![], name: vec![] };
        assert_eq!(Hello::decode(&no_verbs.encode()).unwrap(), no_verbs);
    }

    #[test]
    fn header_checks_magic_version_kind_and_size() {
        let frame = encode_frame(FrameKind::Ready, b"");
        let mut f = frame.to_vec();
        f[0] ^= 0xff;
        assert!(matches!(decode_frame(&f, 64), Err(BootstrapError::BadMagic { .. })));
        let mut f = frame.to_vec();
        f[5] = 9;
        assert!(matches!(decode_frame(&f, 64), Err(BootstrapError::VersionMismatch { ours: VERSION, theirs: 9 })));
        let mut f = frame.to_vec();
        f[6] = 77;
        assert!(matches!(decode_frame(&f, 64), Err(BootstrapError::Malformed { .. })));
        let big = encode_frame(FrameKind::Hello, &[0u8; 100]);
        assert!(matches!(decode_frame(&big, 64), Err(BootstrapError::Oversized { len: 100, max: 64 })));
    }

    #[test]
    fn truncation_and_corruption_are_told_apart() {
        let frame = encode_frame(FrameKind::Hello, &hello().encode());
        for cut in 0..frame.len() {
            assert!(
                matches!(decode_frame(&frame[..cut], DEFAULT_MAX_PAYLOAD), Err(BootstrapError::Truncated { .. })),
                "cut at {cut}"
            );
        }
        let mut f = frame.to_vec();
        let last = f.len() - 1;
        f[last] ^= 1;
        assert!(matches!(decode_frame(&f, DEFAULT_MAX_PAYLOAD), Err(BootstrapError::Checksum { .. })));
    }

    #[test]
    fn hello_fields_are_validated() {
        let mut h = hello();
        h.verbs.as_mut().unwrap().mtu = 9;
        assert!(matches!(Hello::decode(&h.encode()), Err(BootstrapError::Malformed { .. })));
        let mut h = hello();
        h.verbs.as_mut().unwrap().qp_num = 0;
        assert!(Hello::decode(&h.encode()).is_err());
        for depth in [0, MAX_TCP_QUEUE_DEPTH + 1, u32::MAX] {
            let mut h = hello();
            h.tcp.as_mut().unwrap().send_depth = depth;
            let e = Hello::decode(&h.encode());
            assert!(matches!(e, Err(BootstrapError::OutOfRange { field: "TCP send_depth", .. })), "depth {depth}");
        }
        // Every announced limit, just outside and just inside what is accepted.
        type Set = fn(&mut Hello, u64);
        let limits: [(&str, Set, &[u64], &[u64]); 5] = [
            (
                "verbs max_msg_sz",
                |h, v| h.verbs.as_mut().unwrap().max_msg_sz = v as u32,
                &[0, 1, 65_535],
                &[65_536, u64::from(u32::MAX)],
            ),
            (
                "verbs responder_resources",
                |h, v| h.verbs.as_mut().unwrap().responder_resources = v as u8,
                &[0],
                &[1, 255],
            ),
            (
                "TCP max_message",
                |h, v| h.tcp.as_mut().unwrap().max_message = v as u32,
                &[0, 1, 4096, 65_535],
                &[65_536],
            ),
            ("TCP rnr_retry", |h, v| h.tcp.as_mut().unwrap().rnr_retry = v as u8, &[8, 255], &[0, 7]),
            ("TCP min_rnr_timer", |h, v| h.tcp.as_mut().unwrap().min_rnr_timer = v as u8, &[32, 255], &[0, 31]),
        ];
        for (name, set, refused, accepted) in limits {
            for &v in refused {
                let mut h = hello();
                set(&mut h, v);
                match Hello::decode(&h.encode()) {
                    Err(e @ BootstrapError::OutOfRange { field, value, .. }) => {
                        assert_eq!((field, value), (name, v));
                        assert!(e.to_string().contains(name), "{e}");
                    }
                    other => panic!("{name} {v}: {other:?}"),
                }
            }
            for &v in accepted {
                let mut h = hello();
                set(&mut h, v);
                assert!(Hello::decode(&h.encode()).is_ok(), "{name} {v}");
            }
        }
        let mut payload = hello().encode().to_vec();
        // Announce more regions than follow.
        let at = 8 + VERBS_LEN + TCP_LEN;
        payload[at..at + 4].copy_from_slice(&1000u32.to_be_bytes());
        assert!(Hello::decode(&payload).is_err());
        payload[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(Hello::decode(&payload).is_err());
        // A region that wraps the address space.
        let r = RemoteRegion { tag: 0, addr: u64::MAX - 1, len: 4, rkey: 0, access: Access::empty() };
        assert!(decode_region(&encode_region(&r)).is_err());
    }

    /// Deterministic mutations of a valid frame: every decode either
    /// succeeds or returns an error; none panics.
    #[test]
    fn mutated_frames_never_panic() {
        let frame = encode_frame(FrameKind::Hello, &hello().encode()).to_vec();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut decoded_ok = 0;
        for _ in 0..20_000 {
            let mut f = frame.clone();
            for _ in 0..(next() % 4 + 1) {
                let i = (next() as usize) % f.len();
                f[i] = next() as u8;
            }
            let cut = (next() as usize) % (f.len() + 1);
            // Recompute the CRC half of the time so the payload decoder is reached.
            if next() % 2 == 0 && cut >= HEADER_LEN {
                let crc = crc32fast::hash(&f[HEADER_LEN..]);
                f[12..16].copy_from_slice(&crc.to_be_bytes());
            }
            if let Ok((FrameKind::Hello, payload, _)) = decode_frame(&f[..cut], DEFAULT_MAX_PAYLOAD) {
                if Hello::decode(&payload).is_ok() {
                    decoded_ok += 1;
                }
            }
        }
        // Some mutations only touch padding or values that stay valid.
        assert!(decoded_ok > 0);
    }
}
