//! A hostile peer's tools: the TCP transport's frames and the notification
//! ring's records written by hand, as an attacker would, after a handshake
//! played with the crate's own codec.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use gpu_rdma::bootstrap::{self, CAP_TCP, Deadline, Hello, TcpEndpoint};
use gpu_rdma::{Access, RemoteRegion};

pub const SEND: u8 = 1;
pub const WRITE: u8 = 2;
pub const READ_REQ: u8 = 3;
pub const READ_RESP: u8 = 4;
pub const ACK: u8 = 5;
pub const FIRST: u8 = 1;
pub const LAST: u8 = 2;
pub const IMM: u8 = 4;
/// The flag by which a frame asks for an acknowledgement.
pub const WANTS_ACK: u8 = 8;
pub const HEADER: usize = 32;

/// The transport's frame header, as documented in `transport/tcp.rs`:
/// `op u8, flags u8, 2 reserved, seq u32, key u32, imm u32, addr u64,
/// len u32, total u32`, little-endian; then `len` payload bytes.
#[allow(clippy::too_many_arguments)]
pub fn frame(op: u8, flags: u8, seq: u32, key: u32, addr: u64, len: u32, total: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&[op, flags, 0, 0]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&7u32.to_le_bytes());
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&total.to_le_bytes());
}

/// The little-endian `u32` at byte `at` of a frame header (seq at 4, len
/// at 24, total at 28; see [`frame`]).
pub fn u32_at(h: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]])
}

pub fn endpoint(rnr_retry: u8, send_depth: u32) -> TcpEndpoint {
    TcpEndpoint { rnr_retry, min_rnr_timer: 1, max_message: 1 << 30, send_depth }
}

/// Connects to `addr` and plays the handshake as a TCP-only client that
/// advertises `regions`. Returns the socket and the victim's hello.
pub fn hostile_client(addr: SocketAddr, tcp: TcpEndpoint, mut regions: Vec<RemoteRegion>) -> (TcpStream, Hello) {
    if !regions.iter().any(|r| r.tag == gpu_rdma::RING_TAG) {
        regions.push(fake_ring());
    }
    let s = TcpStream::connect(addr).expect("connect to the victim");
    let deadline = Deadline::after(Duration::from_secs(10), "the victim");
    let mine = Hello { caps: CAP_TCP, verbs: None, tcp: Some(tcp), regions, name: vec![] };
    let theirs = bootstrap::exchange_hello(&s, &mine, deadline, 1 << 20).expect("the victim's hello");
    bootstrap::exchange_ready(&s, deadline).expect("the victim's ready");
    (s, theirs)
}

/// The key of the notification ring the hostile client announces: it holds
/// no memory; the victim's writes to it (its credits) are read off the
/// socket.
pub const FAKE_RING_KEY: u32 = 0x5151;

pub fn fake_ring() -> RemoteRegion {
    RemoteRegion {
        tag: gpu_rdma::RING_TAG,
        addr: 0x7000_0000,
        len: 64 + gpu_rdma::DEFAULT_RING as u64,
        rkey: FAKE_RING_KEY,
        access: Access::REMOTE_WRITE,
    }
}

pub fn ack_frame(seq: u32, status: u32) -> Vec<u8> {
    let mut out = Vec::new();
    frame(ACK, 0, seq, 0, 0, 0, status, &mut out);
    out
}

/// A notification message as the crate encodes it (`magic "gN", version 2,
/// status, payload length, key, range count, 3 reserved`, big-endian; then
/// the ranges and the payload), naming no ranges.
pub fn note_msg(failed: bool, payload: &[u8], msg: &mut Vec<u8>) {
    note_covering(failed, 0, &[], payload, msg);
}

/// As [`note_msg`], the note naming `ranges` (address, length) of the
/// region with key `key` as written by its transfer.
pub fn note_covering(failed: bool, key: u32, ranges: &[(u64, u64)], payload: &[u8], msg: &mut Vec<u8>) {
    msg.clear();
    msg.extend_from_slice(&[0x67, 0x4e, 2, u8::from(failed)]);
    msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    msg.extend_from_slice(&key.to_be_bytes());
    msg.extend_from_slice(&[ranges.len() as u8, 0, 0, 0]);
    for &(addr, len) in ranges {
        msg.extend_from_slice(&addr.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
    }
    msg.extend_from_slice(payload);
}

/// A notification ring's record of `msg` under `tag` with sequence number
/// `seq`, as `protocol/mailbox.rs` lays it out: `seq u64, len u32, tag
/// u32, message, seq u64` (little-endian), 64-byte aligned.
pub fn ring_record(seq: u64, tag: u32, msg: &[u8]) -> Vec<u8> {
    let size = (16 + msg.len() + 8).div_ceil(64) * 64;
    let mut rec = vec![0u8; size];
    rec[..8].copy_from_slice(&seq.to_le_bytes());
    rec[8..12].copy_from_slice(&(msg.len() as u32).to_le_bytes());
    rec[12..16].copy_from_slice(&tag.to_le_bytes());
    rec[16..16 + msg.len()].copy_from_slice(msg);
    rec[size - 8..].copy_from_slice(&seq.to_le_bytes());
    rec
}

/// A write of `bytes` at ring offset `at` of the peer's notification
/// `ring` (after its 64-byte header), as frame `seq`.
pub fn ring_write(ring: &RemoteRegion, seq: u32, at: u64, bytes: &[u8], out: &mut Vec<u8>) {
    let len = bytes.len() as u32;
    frame(WRITE, FIRST | LAST, seq, ring.rkey, ring.addr + 64 + at, len, len, out);
    out.extend_from_slice(bytes);
}

/// The victim's notification ring, as its hello announced it.
pub fn ring_of(theirs: &Hello) -> RemoteRegion {
    theirs.regions.iter().find(|r| r.tag == gpu_rdma::RING_TAG).copied().expect("the victim announced its ring")
}
