//! The out-of-band handshake over TCP: versioned hello, ready, bye and
//! reject frames (see [`wire`] for the format), read and written with
//! deadlines so a silent or dead peer is an error, never a hang.
//!
//! Plain safe code: no `unsafe` here.

#![forbid(unsafe_code)]

pub mod auth;
mod io;
pub mod wire;

pub use auth::{Secret, authenticate};
pub use wire::{
    CAP_IMM_COVERS, CAP_TCP, CAP_VERBS, DEFAULT_MAX_PAYLOAD, FrameKind, HEADER_LEN, Hello, MAGIC, MAX_NAME,
    MAX_TCP_QUEUE_DEPTH, MIN_MAX_MESSAGE, REGION_LEN, TcpEndpoint, VERSION, VerbsEndpoint, decode_frame, decode_region,
    encode_frame, encode_region,
};
pub use wire::{DEFAULT_RING, MAX_RING, MIN_RING, RING_ALIGN, RING_HEADER, RING_TAG};
pub(crate) use wire::{take_ring, valid_ring};

pub use io::{Deadline, exchange_hello, exchange_ready, read_frame, send_bye, send_reject, write_frame};
